"""SamplingParams: how one request turns logits into tokens, and when it stops."""
import math
from dataclasses import dataclass, field

from mempath.constants import SEED_RANGE, as_kind, check_seed
from mempath.structured.params import StructuredOutputsParams

# Below this temperature a request is greedy, as in vLLM (_SAMPLING_EPS): dividing the logits
# by a tiny temperature overflows to inf - inf = nan, and its limit is the argmax anyway.
GREEDY_BELOW_TEMPERATURE = 1e-5
# The sampler works in float32: a double above its largest value becomes inf there (a -inf logit
# divided by an infinite temperature is nan), and a divisor below its smallest normal value
# underflows to 0 (or to a subnormal a GPU may flush to 0).
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38
MAX_LOGIT_BIAS = 100  # OpenAI's range for a logit_bias value: -100..100


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs for each generated token
    n: int = 1
    # vLLM's penalties: presence and frequency over the generated tokens (OpenAI's formula),
    # repetition over prompt + generated tokens (divides positive logits, multiplies negative).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    min_tokens: int = 0  # EOS, stop_token_ids and stop strings do not end it before this many
    prompt_logprobs: int | None = None  # top-n logprobs (plus the actual token) at each prompt token
    skip_special_tokens: bool = True
    # Words never generated: each is tokenized (with and without a leading space) into a token
    # sequence; its last token is banned whenever the generated tokens end with the rest of it.
    bad_words: list[str] = field(default_factory=list)
    best_of: int | None = None  # refused but for 1: vLLM dropped it
    # Set by the engine from bad_words and the tokenizer (InputProcessor), never by callers.
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    # Structured output (vLLM's name): the output must match this JSON schema, regex, choice or
    # grammar (mempath.structured); None: unconstrained.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        # Another type is left as given, for validate() to name: the constructor does not raise.
        self.stop = _listed(self.stop, str)
        ids = _listed(self.stop_token_ids)
        self.stop_token_ids = [_python(t, int) for t in ids] if isinstance(ids, list) else ids
        for kind, names in ((int, ("max_tokens", "n", "top_k", "seed", "logprobs", "min_tokens", "prompt_logprobs",
                                   "best_of")),
                            (float, ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                     "repetition_penalty")),
                            (bool, ("ignore_eos", "skip_special_tokens"))):
            for name in names:
                setattr(self, name, _python(getattr(self, name), kind))
        if self.top_k == -1:
            self.top_k = 0
        self.bad_words = _listed(self.bad_words, str)
        try:
            # A list of (id, bias) pairs too; numpy's ids and biases as Python's.
            pairs = dict(self.logit_bias).items() if self.logit_bias else None
            self.logit_bias = {_python(k, int): _python(v, float) for k, v in pairs} if pairs else None
        except (TypeError, ValueError):
            pass

    def check_sample_seeds(self) -> None:
        """Sample i of n draws with seed + i: the last must still be a seed (before any sample is added)."""
        if type(self.seed) is int and type(self.n) is int and self.n > 1 and self.seed + self.n - 1 > SEED_RANGE[1]:
            raise ValueError(f"seed {self.seed} with n {self.n}: the samples' seeds (seed + 0 .. seed + n - 1) "
                             f"must stay at most 2**64 - 1; give a smaller seed")

    def validate(self, max_logprobs: int) -> None:
        """Raise ValueError naming the bad field and the allowed range."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        for name in ("n", "top_k"):  # before any comparison: None < 0 is a TypeError
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
                raise ValueError(f"{name} must be a whole number, got {getattr(self, name)!r}")
        for name in ("ignore_eos", "skip_special_tokens"):  # a truthy string would switch it on
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if not _finite_number(value):
                raise ValueError(f"{name} must be a finite number, got {_shown(value)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature > FLOAT32_MAX:
            raise ValueError(f"temperature must be in [0, {FLOAT32_MAX:.7g}] (float32's range, which the sampler "
                             f"computes in), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 or -1 turns it off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_p < FLOAT32_TINY:
            raise ValueError(f"top_p must be in [{FLOAT32_TINY:.7g}, 1] (float32's range, which the sampler "
                             f"computes in), got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= max_logprobs):
            raise ValueError(f"logprobs must be in [0, {max_logprobs}] (a whole number), got {self.logprobs!r}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be a whole number or None, got {self.seed!r}")
        if self.seed is not None:
            check_seed(self.seed)
            self.check_sample_seeds()
        if not isinstance(self.stop, list) or any(not isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if not isinstance(self.stop_token_ids, list) or any(
                isinstance(t, bool) or not isinstance(t, int) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids (whole numbers), got {self.stop_token_ids!r}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError("structured_outputs must be a mempath.structured.StructuredOutputsParams")
            self.structured_outputs.validate()
        self._validate_extensions(max_logprobs)

    def _validate_extensions(self, max_logprobs: int) -> None:
        """vLLM's ranges for the penalties, logit_bias, min_tokens, prompt_logprobs, bad_words."""
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if not _finite_number(value):
                raise ValueError(f"{name} must be a finite number, got {_shown(value)}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0 (1: off), got {self.repetition_penalty}")
        if not FLOAT32_TINY <= self.repetition_penalty <= FLOAT32_MAX:  # logits are divided by it
            raise ValueError(f"repetition_penalty must be in [{FLOAT32_TINY:.7g}, {FLOAT32_MAX:.7g}] (float32's "
                             f"range, which the sampler computes in; 1: off), got {self.repetition_penalty}")
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
        for token_id, bias in (self.logit_bias or {}).items():
            if isinstance(token_id, bool) or not isinstance(token_id, int):
                raise ValueError(f"logit_bias keys must be token ids (integers), got {token_id!r}")
            if not _finite_number(bias):
                raise ValueError(f"logit_bias[{token_id}] must be a finite number, got {_shown(bias)}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # OpenAI's range; beyond float32's it is garbage
                raise ValueError(f"logit_bias[{token_id}] must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], "
                                 f"got {bias!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) \
                or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        if self.prompt_logprobs is not None and (
                isinstance(self.prompt_logprobs, bool) or not isinstance(self.prompt_logprobs, int)
                or not 0 <= self.prompt_logprobs <= max_logprobs):
            raise ValueError(f"prompt_logprobs must be in [0, {max_logprobs}], got {self.prompt_logprobs!r}")
        if not isinstance(self.bad_words, list) or any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise ValueError("bad_words must be non-empty strings")
        if self.best_of is not None and self.best_of != 1:
            raise ValueError(f"best_of is not supported (vLLM removed it too); leave it out and use n "
                             f"(got best_of={self.best_of!r})")

    def check_vocabulary(self, vocab_size: int) -> None:
        """Token ids in logit_bias and bad_words must exist in the model's vocabulary."""
        bad = [t for t in (self.logit_bias or {}) if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"logit_bias token id(s) {bad[:5]} are outside the vocabulary [0, {vocab_size})")
        bad = [t for word in self.bad_words_token_ids for t in word if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"bad_words tokenize to id(s) {bad[:5]} outside the vocabulary [0, {vocab_size})")

    def set_bad_words_token_ids(self, encode) -> None:
        """Tokenize bad_words as vLLM does: each word alone and after a space.

        The spaced form is kept only when it is a different token sequence of the same
        length (a word-initial token of its own), so the word is banned at the start of
        the text and in its middle.
        """
        sequences: list[list[int]] = []
        for word in self.bad_words:
            plain = encode(word.lstrip())
            if plain:
                sequences.append(plain)
            spaced = encode(" " + word.lstrip())
            if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
                sequences.append(spaced)
        self.bad_words_token_ids = sequences

    @property
    def needs_history(self) -> bool:
        """Whether sampling reads the request's tokens (penalties or multi-token bad words)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0 or bool(self.bad_words_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


def _listed(value, one: type | None = None):
    """A list of ``value``'s items: a single ``one`` is a list of it, None or empty an empty list, a tuple or
    set its items; any other type is returned as it is, for SamplingParams.validate to refuse by name."""
    if one is not None and isinstance(value, one):
        return [value]
    if isinstance(value, (list, tuple, set, frozenset)):
        return list(value)
    return [] if value is None else value


def _finite_number(value) -> bool:
    """An int or float, not a bool, that a double holds (10**400 is an int math.isfinite cannot take)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:24]}... ({len(text)} characters)"


def _python(value, kind: type):
    """numpy's scalars as Python's ``kind`` (constants.as_kind); anything else as given, for validate to name."""
    converted = as_kind(value, kind)
    return value if converted is None else converted
