"""Incremental detokenization and stop-string matching for one request at a time."""


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decoding only the ids since `prefix_offset` keeps the work per token small;
    decoding them with a few tokens of left context keeps word boundaries (leading
    spaces) right; holding back text that ends in U+FFFD waits for the rest of a
    multi-byte character split across tokens.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.prefix_offset = 0
        self.read_offset = 0

    def delta(self, token_ids: list[int]) -> str:
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix = decode(token_ids[self.prefix_offset:self.read_offset], skip_special_tokens=skip)
        full = decode(token_ids[self.prefix_offset:], skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(token_ids)
            return full[len(prefix):]
        return ""

    def flush(self, token_ids: list[int]) -> str:
        """Whatever is still held back, once no more tokens will come."""
        skip = self.skip_special_tokens
        prefix = self.tokenizer.decode(token_ids[self.prefix_offset:self.read_offset],
                                       skip_special_tokens=skip)
        full = self.tokenizer.decode(token_ids[self.prefix_offset:], skip_special_tokens=skip)
        self.read_offset = len(token_ids)
        return full[len(prefix):]


def find_stop(text: str, stops: list[str], new_chars: int) -> tuple[int, str] | None:
    """The earliest stop string that ends in the last `new_chars` characters of text.

    Only the places where a stop string could end are compared (one comparison per
    new character and stop string), so the work per token is bounded by the stop
    strings and the token's text, however long the text before them.
    """
    best = None
    for stop in stops:
        first_end = max(len(stop), len(text) - new_chars + 1)
        for end in range(first_end, len(text) + 1):
            start = end - len(stop)
            if best is not None and start >= best[0]:
                break
            if text.startswith(stop, start):
                best = (start, stop)
                break
    return best


class StopPrefixes:
    """How much of a growing text's tail could be the start of a stop string.

    One Knuth-Morris-Pratt state per stop string: the length of the longest tail
    of the text so far that is a prefix of that stop. Each new character moves
    every state in amortised constant time, so a token costs work in proportion
    to its characters and the number of stop strings, never to the text's length
    or to a stop string's length squared.
    """

    def __init__(self, stops: list[str]):
        self.stops = list(stops)
        self.fallbacks = [_prefix_function(stop) for stop in self.stops]
        self.states = [0] * len(self.stops)

    def feed(self, chars: str) -> int:
        """Take the text's next characters; the length of the tail that must be held back."""
        for i, stop in enumerate(self.stops):
            fallback, k = self.fallbacks[i], self.states[i]
            for char in chars:
                if k == len(stop):  # a whole stop string: keep matching past it
                    k = fallback[k - 1]
                while k and stop[k] != char:
                    k = fallback[k - 1]
                if stop[k] == char:
                    k += 1
            self.states[i] = k
        # A whole stop string is the engine's to cut; only a proper prefix can still grow into one.
        return max((fallback[k - 1] if k == len(stop) else k
                    for stop, fallback, k in zip(self.stops, self.fallbacks, self.states)), default=0)


def _prefix_function(pattern: str) -> list[int]:
    """pi[i]: the longest proper prefix of pattern[:i + 1] that is also its suffix."""
    pi = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = pi[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        pi[i] = k
    return pi
