"""StructuredOutputsParams: the constraint a request's output must satisfy (vLLM's names).

Exactly one of ``json`` (a JSON schema, as a dict or a string), ``json_object`` (any
JSON object), ``regex``, ``choice`` (one of these strings) or ``grammar`` (EBNF, in
xgrammar's dialect of GBNF) is set. ``whitespace_flexible`` off (the default) writes
JSON compactly: with any whitespace allowed, a weak model can loop on spaces and
newlines until max_tokens (vLLM's ``disable_any_whitespace`` is the same choice).
"""
import json
from dataclasses import dataclass

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    whitespace_flexible: bool = False

    def validate(self) -> None:
        """Raise ValueError naming the field when the request is not exactly one constraint."""
        for name in ("json_object", "whitespace_flexible"):  # a truthy string would switch it on
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be true or false, got {getattr(self, name)!r}")
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}; "
                             f"got {', '.join(given) or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object or its JSON text)")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("structured_outputs.regex must be a string")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError("structured_outputs.grammar must be a string (EBNF)")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    def cache_key(self) -> tuple[str, str, bool]:
        """What the compiled grammar depends on: equal keys share one compilation."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            value = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        elif kind == "choice":
            value = json.dumps(list(value))
        elif kind == "json_object":
            value = ""
        return kind, value, self.whitespace_flexible
