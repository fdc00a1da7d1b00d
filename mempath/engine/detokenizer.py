"""Incremental detokenization and stop-string matching for one request at a time."""
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


def incremental_detokenizer(tokenizer, skip_special_tokens: bool = True):
    """The fast detokenizer where the tokenizer is Rust-backed, else the slow one.

    The fast one decodes with the backend alone, so it is only taken where
    transformers' decode adds nothing to the backend's (no space clean-up).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer) and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return FastIncrementalDetokenizer(backend, skip_special_tokens)
    return SlowIncrementalDetokenizer(tokenizer, skip_special_tokens)


class SlowIncrementalDetokenizer:
    """Text deltas by decoding a short window of ids twice per token (any tokenizer).

    The window holds the ids since the start of the last text returned: decoding
    them as left context keeps word boundaries (leading spaces) right, and the text
    is the window's decode less that of the ids already returned, so a token costs
    the same however long the output. Text that ends in U+FFFD is held back until
    the rest of a multi-byte character split across tokens comes.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.decode = tokenizer.decode
        self.skip_special_tokens = skip_special_tokens
        self.window: list[int] = []
        self.read = 0  # how many of the window's ids the text already returned covers

    def delta(self, token_id: int) -> str:
        self.window.append(token_id)
        return self._step()

    def flush(self) -> str:
        """Whatever is still held back, once no more tokens will come."""
        prefix, full = self._decode_window()
        self.read = len(self.window)
        return full[len(prefix):]

    def _step(self) -> str:
        prefix, full = self._decode_window()
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._advance()
            return full[len(prefix):]
        return ""

    def _advance(self) -> None:
        del self.window[:self.read]
        self.read = len(self.window)

    def _decode_window(self) -> tuple[str, str]:
        skip = self.skip_special_tokens
        return (self.decode(self.window[:self.read], skip_special_tokens=skip),
                self.decode(self.window, skip_special_tokens=skip))


class FastIncrementalDetokenizer(SlowIncrementalDetokenizer):
    """Text deltas from a `tokenizers.decoders.DecodeStream`: one Rust step per token.

    The stream runs the slow detokenizer's rule (the same window, the same held-back
    U+FFFD) inside the Rust tokenizer, so both give the same text. Like the slow one
    it starts at the first output token, the prompt not replayed into it: a Metaspace
    tokenizer's first output word loses its leading space in both. The window is
    mirrored here (mostly a token or two) for `flush` and for the rare token the stream refuses.
    """

    def __init__(self, backend: Tokenizer, skip_special_tokens: bool = True):
        super().__init__(backend, skip_special_tokens)
        self.backend = backend
        self.stream: DecodeStream | None = DecodeStream(skip_special_tokens=skip_special_tokens)

    def delta(self, token_id: int) -> str:
        self.window.append(token_id)
        if self.stream is not None:
            try:
                text = self.stream.step(self.backend, token_id)
            except Exception:
                # The text returned no longer prefixes the window's decode (byte-fallback
                # bytes that became one invalid sequence): the slow rule cuts by length.
                self.stream = None
            else:
                if text is None:
                    return ""
                self._advance()
                return text
        text = self._step()
        if self.read == len(self.window):  # nothing held back: a stream can start from the window
            self.stream = DecodeStream(self.window, skip_special_tokens=self.skip_special_tokens)
        return text


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
