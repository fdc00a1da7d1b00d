"""StructuredOutputsParams: the constraint a request's output must satisfy (vLLM's names).

Exactly one of ``json`` (a JSON schema, as a dict or a string), ``json_object`` (any
JSON object), ``regex``, ``choice`` (one of these strings) or ``grammar`` (EBNF, in
xgrammar's dialect of GBNF) is set. ``whitespace_flexible`` off (the default) writes
JSON compactly: with any whitespace allowed, a weak model can loop on spaces and
newlines until max_tokens (vLLM's ``disable_any_whitespace`` is the same choice).
"""
import json
from dataclasses import dataclass, field

from mempath.safe_io import loads_json
from mempath.structured.schema_check import check_enforceable, schema_text

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    whitespace_flexible: bool = False
    _text: str | None = field(default=None, init=False, repr=False, compare=False)  # _checked_text's, of:
    _text_of: object = field(default=None, init=False, repr=False, compare=False)

    def validate(self) -> None:
        """Raise ValueError naming the field when the request is not exactly one constraint."""
        for name in ("json_object", "whitespace_flexible"):  # a truthy string would switch it on
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be true or false, got {getattr(self, name)!r}")
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}; "
                             f"got {', '.join(given) or 'none'}")
        if self.json is not None:
            self._checked_text()
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("structured_outputs.regex must be a string")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError("structured_outputs.grammar must be a string (EBNF)")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")

    def schema(self) -> dict:
        """``json`` as a dict (parsed when given as text); ValueError naming the field when it is no schema."""
        schema = self.json
        if isinstance(schema, str):
            try:
                schema = loads_json(schema)
            except json.JSONDecodeError as error:
                raise ValueError(f"structured_outputs.json is not valid JSON: {error}") from None
        if not isinstance(schema, dict):
            raise ValueError("structured_outputs.json must be a JSON schema (an object or its JSON text)")
        try:
            json.dumps(schema)
        except (TypeError, ValueError) as error:
            raise ValueError(f"structured_outputs.json is not JSON: {error}") from None
        except RecursionError:
            raise ValueError("structured_outputs.json is nested too deeply; flatten it with $defs") from None
        return schema

    def _checked_text(self) -> str:
        """``json`` checked (check_enforceable) and as the text to compile, made once per value: the server checks
        a request, the engine thread again, and a large schema's walk is not paid there twice."""
        if self._text_of is not self.json:
            schema = self.schema()
            check_enforceable(schema)
            self._text, self._text_of = schema_text(schema), self.json
        return self._text

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    def cache_key(self) -> tuple[str, str, bool]:
        """What the compiled grammar depends on: equal keys share one compilation."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            value = self._checked_text()
        elif kind == "choice":
            value = json.dumps(list(value))
        elif kind == "json_object":
            value = ""
        return kind, value, self.whitespace_flexible
