"""Incremental detokenization and stop-string matching for one request at a time."""


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decoding only the ids since `prefix_offset` keeps the work per token small;
    decoding them with a few tokens of left context keeps word boundaries (leading
    spaces) right; holding back text that ends in U+FFFD waits for the rest of a
    multi-byte character split across tokens.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.prefix_offset = 0
        self.read_offset = 0

    def delta(self, token_ids: list[int]) -> str:
        decode = self.tokenizer.decode
        prefix = decode(token_ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = decode(token_ids[self.prefix_offset:], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(token_ids)
            return full[len(prefix):]
        return ""

    def flush(self, token_ids: list[int]) -> str:
        """Whatever is still held back, once no more tokens will come."""
        prefix = self.tokenizer.decode(token_ids[self.prefix_offset:self.read_offset],
                                       skip_special_tokens=True)
        full = self.tokenizer.decode(token_ids[self.prefix_offset:], skip_special_tokens=True)
        self.read_offset = len(token_ids)
        return full[len(prefix):]


def find_stop(text: str, stops: list[str], new_chars: int) -> tuple[int, str] | None:
    """The earliest stop string that ends in the last `new_chars` characters of text."""
    best = None
    for stop in stops:
        start = max(0, len(text) - new_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best
