"""Grammars compiled by xgrammar, cached by what they were compiled from, and one matcher per request.

xgrammar was chosen over llguidance by measurement (BENCHMARKS.md, "Structured output:
grammar backends"): on a 128k-token byte-level BPE its per-token mask took a median of
12 µs against 97 µs, which is the cost paid at every step; its compile is slower
(3 ms against 1.4 ms median per schema) but paid once per schema and cached here.
xgrammar is imported on the first grammar request (or, in the server, set up in the
background at start-up), so an engine that never sees one never loads it. Compiles run
off the engine thread (docs/structured.md, "Compiling off the engine thread").
"""
from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from mempath.safe_io import loads_json
from mempath.structured.params import StructuredOutputsParams

CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped first
COMPILE_THREADS = 4  # grammars compiled at once (xgrammar releases the GIL while it compiles)
log = logging.getLogger(__name__)
_XGRAMMAR_LOCATION = re.compile(r"^\[[^\]]*\] \S+:\d+: (Check failed: .*? is false: )?")


def library_message(error: Exception) -> str:
    """xgrammar's message without its C++ source location."""
    return _XGRAMMAR_LOCATION.sub("", str(error).strip()).splitlines()[0]


def choice_grammar(choices: list[str]) -> str:
    """EBNF for exactly one of the strings (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class RequestGrammar:
    """One request's position in its grammar: what it may emit next, whether it is done."""

    def __init__(self, matcher, vocab_size: int | None = None):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.error: str | None = None  # set when no token is allowed: the request fails with it

    def allowed_tokens(self) -> set[int]:
        """The tokens the grammar allows next, read on the host for one request (a failure's
        diagnosis, not the per-step mask: that is GrammarBitmask's)."""
        import numpy as np
        import xgrammar
        mask = xgrammar.allocate_token_bitmask(1, self.vocab_size)
        self.matcher.fill_next_token_bitmask(mask)
        bits = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")[:self.vocab_size]
        return set(np.flatnonzero(bits).tolist())

    def accept(self, token_id: int) -> bool:
        """Advance by the request's newest token; ValueError if the grammar does not allow it.

        The token was sampled under this grammar's mask, so a refusal means the mask was not
        applied to its row: the request fails with this line rather than go on off-grammar.
        """
        if not self.matcher.accept_token(token_id):
            raise ValueError(f"token {token_id} is not allowed by the request's grammar, yet it was "
                             f"sampled: the mask was not applied to its row (a bug in mempath)")
        return True

    @property
    def finished(self) -> bool:
        """The grammar has taken its end (a stop token): nothing may follow."""
        return self.matcher.is_terminated()


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer and vocabulary; ValueError when invalid.

    Thread-safe: the server compiles in AsyncEngine's pool while the engine thread makes
    matchers. A lock guards the cache and the one-time xgrammar setup; the compile itself
    runs outside it, so two schemas compile at once, and a schema already being compiled
    is waited for rather than compiled again.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int]):
        if tokenizer is None:
            raise ValueError("structured outputs need a tokenizer; this model has none")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler = None
        self._setup_lock = threading.Lock()  # the tokenizer preprocessing, once
        self._lock = threading.Lock()  # the cache and the compiles under way
        self.cache: OrderedDict[tuple, object] = OrderedDict()
        self._compiling: dict[tuple, Future] = {}
        self.num_compiled = 0
        self.setup_seconds: float | None = None  # how long xgrammar's tokenizer preprocessing took

    @property
    def ready(self) -> bool:
        """xgrammar is set up: a compile no longer pays the tokenizer preprocessing."""
        return self._compiler is not None

    def prepare(self) -> float:
        """Set xgrammar up for this tokenizer (its vocabulary preprocessing); the seconds it took."""
        with self._setup_lock:
            if self._compiler is None:
                import xgrammar
                began = time.perf_counter()
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
                self.setup_seconds = time.perf_counter() - began
                log.info("structured outputs: xgrammar set up for the tokenizer in %.2f s", self.setup_seconds)
        return self.setup_seconds

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar, from the cache when the same constraint was compiled before."""
        params.validate()
        key = params.cache_key()
        with self._lock:
            compiled = self.cache.get(key)
            if compiled is not None:
                self.cache.move_to_end(key)
                return compiled
            pending = self._compiling.get(key)
            mine = pending is None
            if mine:
                pending = self._compiling[key] = Future()
        if not mine:
            return pending.result()  # its ValueError too
        try:
            compiled = self._compile_new(key)
        except BaseException as error:
            with self._lock:
                del self._compiling[key]
            pending.set_exception(error)
            raise
        with self._lock:
            del self._compiling[key]
            self.num_compiled += 1
            self.cache[key] = compiled
            if len(self.cache) > CACHE_SIZE:
                self.cache.popitem(last=False)
        pending.set_result(compiled)
        return compiled

    def compile_all(self, params: list[StructuredOutputsParams]) -> None:
        """Compile these constraints in parallel into the cache (LLM.generate's batch, before adding it).

        An invalid one is skipped here: adding its request raises its ValueError as before.
        """
        todo = list({p.cache_key(): p for p in params if _valid(p)}.values())
        if len(todo) < 2:
            return
        self.prepare()
        with ThreadPoolExecutor(min(len(todo), COMPILE_THREADS), thread_name_prefix="mempath-grammar") as pool:
            for future in [pool.submit(self.compile, p) for p in todo]:
                try:
                    future.result()
                except ValueError:
                    pass

    def _compile_new(self, key: tuple[str, str, bool]):
        self.prepare()
        kind, value, flexible = key
        try:
            compiled = self._compile(kind, value, flexible)
        except RuntimeError as error:
            what = {"json": "is not a JSON schema the grammar engine can enforce", "regex": "is not a valid regex",
                    "grammar": "is not a valid EBNF grammar", "choice": "cannot be compiled",
                    "json_object": "cannot be compiled"}[kind]
            raise ValueError(f"structured_outputs.{kind} {what}: {library_message(error)}") from None
        if not RequestGrammar(_matcher(compiled), self.vocab_size).allowed_tokens():
            # Else the request fails at its first step, as if the engine had failed (a server error).
            raise ValueError(f"structured_outputs.{kind} admits no output: no token of this model's vocabulary "
                             "can start it (a rule that never ends, or a set that matches nothing); fix the "
                             f"{kind}")
        return compiled

    def _compile(self, kind: str, value: str, flexible: bool):
        compiler = self._compiler
        if kind == "json":
            return compiler.compile_json_schema(value, any_whitespace=flexible)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=flexible)
        if kind == "regex":
            return compiler.compile_regex(value)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(loads_json(value)))
        return compiler.compile_grammar(value)

    def matcher(self, params: StructuredOutputsParams) -> RequestGrammar:
        return RequestGrammar(_matcher(self.compile(params)), self.vocab_size)


def _matcher(compiled):
    import xgrammar
    return xgrammar.GrammarMatcher(compiled)


def _valid(params) -> bool:
    if not isinstance(params, StructuredOutputsParams):
        return False  # SamplingParams.validate refuses it when the request is added
    try:
        params.validate()
    except ValueError:
        return False
    return True
