"""Grammars compiled by xgrammar, cached by what they were compiled from, and one matcher per request.

xgrammar was chosen over llguidance by measurement (BENCHMARKS.md, "Structured output:
grammar backends"): on a 128k-token byte-level BPE its per-token mask took a median of
12 µs against 97 µs, which is the cost paid at every step; its compile is slower
(3 ms against 1.4 ms median per schema) but paid once per schema and cached here.
xgrammar is imported on the first grammar request, so an engine that never sees one
never loads it.
"""
from __future__ import annotations

import json
import re
from collections import OrderedDict

from mempath.structured.params import StructuredOutputsParams

CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped first
_XGRAMMAR_LOCATION = re.compile(r"^\[[^\]]*\] \S+:\d+: (Check failed: .*? is false: )?")


def library_message(error: Exception) -> str:
    """xgrammar's message without its C++ source location."""
    return _XGRAMMAR_LOCATION.sub("", str(error).strip()).splitlines()[0]


def choice_grammar(choices: list[str]) -> str:
    """EBNF for exactly one of the strings (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class RequestGrammar:
    """One request's position in its grammar: what it may emit next, whether it is done."""

    def __init__(self, matcher):
        self.matcher = matcher
        self.error: str | None = None  # set when no token is allowed: the request fails with it

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
    """Compiles StructuredOutputsParams for one tokenizer and vocabulary; ValueError when invalid."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int]):
        if tokenizer is None:
            raise ValueError("structured outputs need a tokenizer; this model has none")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler = None
        self.cache: OrderedDict[tuple, object] = OrderedDict()
        self.num_compiled = 0

    def _xgrammar(self):
        import xgrammar
        if self._compiler is None:
            info = xgrammar.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return xgrammar

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar, from the cache when the same constraint was compiled before."""
        params.validate()
        key = params.cache_key()
        compiled = self.cache.get(key)
        if compiled is not None:
            self.cache.move_to_end(key)
            return compiled
        self._xgrammar()
        kind, value, flexible = key
        try:
            compiled = self._compile(kind, value, flexible)
        except RuntimeError as error:
            what = {"json": "is not a JSON schema this server can enforce", "regex": "is not a valid regex",
                    "grammar": "is not a valid EBNF grammar", "choice": "cannot be compiled",
                    "json_object": "cannot be compiled"}[kind]
            raise ValueError(f"structured_outputs.{kind} {what}: {library_message(error)}") from None
        self.num_compiled += 1
        self.cache[key] = compiled
        if len(self.cache) > CACHE_SIZE:
            self.cache.popitem(last=False)
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
            return compiler.compile_grammar(choice_grammar(json.loads(value)))
        return compiler.compile_grammar(value)

    def matcher(self, params: StructuredOutputsParams) -> RequestGrammar:
        xgrammar = self._xgrammar()
        return RequestGrammar(xgrammar.GrammarMatcher(self.compile(params)))
