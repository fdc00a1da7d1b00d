"""n-gram drafting (prompt lookup): propose the tokens that followed the last occurrence of
the sequence's final n tokens, n from ``prompt_lookup_max`` down to ``prompt_lookup_min``.
No second model, no draft KV; repetitive text (code, quoting the prompt) is where it hits."""
import numpy as np


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k proposed tokens (none when no earlier match is found)."""
    length = len(token_ids)
    if k <= 0 or length < min_n + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = tokens[length - n:]
        # Windows of n tokens that end before the tail starts: the latest match wins.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []
