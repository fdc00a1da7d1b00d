"""The request fields that ask for structured output, turned into one StructuredOutputsParams.

OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema`` with ``strict``),
vLLM's ``structured_outputs`` object (``json``, ``regex``, ``choice``, ``grammar``,
``json_object``) and its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``. At most one of them may ask for something; every refusal is a 400
naming the field. The grammar itself is compiled by the engine when the request is
added, and its error is renamed here to the field the client sent (``field_error``).

Unlike an unknown top-level field (ignored with a warning, server/protocol.py), an unknown
key inside ``response_format`` or ``structured_outputs`` is a 400 naming it and listing the
known ones: every key of these objects shapes the output, so a misspelt one (``regx``, a
``schema`` beside ``json_object``) dropped quietly would be an answer the client did not ask for.
An empty schema (``{}``) is JSON Schema's any value, enforced as such, not made an object.
"""
import difflib
from dataclasses import dataclass

from mempath.server.protocol import APIError, refuse_not_honoured
from mempath.structured import StructuredOutputsParams
from mempath.structured.params import KINDS

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# vLLM's structured_outputs fields beyond the constraint itself, at the values that ask for nothing.
NOT_HONOURED_STRUCTURED = {"disable_fallback": (False,), "disable_additional_properties": (False,),
                           "whitespace_pattern": (), "structural_tag": ()}
STRUCTURED_KEYS = (*KINDS, "disable_any_whitespace", *NOT_HONOURED_STRUCTURED)
JSON_SCHEMA_KEYS = ("name", "description", "schema", "strict")  # OpenAI's response_format.json_schema


@dataclass
class StructuredRequest:
    params: StructuredOutputsParams
    field: str  # where the client asked for it: the param an error names

    def field_error(self, error: APIError) -> APIError:
        """The engine's compile error, naming the client's field instead of structured_outputs."""
        if not error.message.startswith("structured_outputs"):
            return error
        kind = self.params.kind
        message = error.message.replace(f"structured_outputs.{kind}", self.field, 1)
        return APIError(400, message, self.field, "invalid_value")


def structured_request(req) -> StructuredRequest | None:
    """The one structured-output constraint a request asks for, or None."""
    found = []
    if req.response_format is not None:
        found += _from_response_format(req.response_format)
    if req.structured_outputs is not None:
        found.append(_from_structured_outputs(req.structured_outputs))
    for name, kind in GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            found.append(StructuredRequest(StructuredOutputsParams(**{kind: value}), name))
    if len(found) > 1:
        raise APIError(400, f"{found[0].field} and {found[1].field} both constrain the output; give one",
                       found[1].field)
    if not found:
        return None
    request = found[0]
    try:
        request.params.validate()
    except ValueError as error:
        raise APIError(400, _renamed(str(error), request.field), request.field) from None
    return request


def _renamed(message: str, field: str) -> str:
    """A StructuredOutputsParams message, which names structured_outputs[.kind], naming ``field`` instead."""
    # Longest first: structured_outputs.json is a prefix of structured_outputs.json_object.
    for name in sorted((*(f"structured_outputs.{kind}" for kind in KINDS), "structured_outputs"), key=len,
                       reverse=True):
        if message.startswith(name):
            return field + message[len(name):]
    return message


def refuse_unknown_keys(value: dict, known: tuple[str, ...], where: str) -> None:
    """APIError(400) naming the first key of ``value`` that is not in ``known`` (null ones ask for nothing)."""
    for key, item in value.items():
        if key in known or item is None:
            continue
        close = difflib.get_close_matches(key, known, n=1)
        guess = f"did you mean {close[0]!r}? " if close else ""
        shown = key if len(key) <= 40 else key[:40] + "..."
        raise APIError(400, f"{where}.{shown} is not a field of {where}; {guess}its fields are "
                            f"{', '.join(known)}", f"{where}.{key}")


def _from_response_format(value: dict) -> list[StructuredRequest]:
    kind = value.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise APIError(400, f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                       "response_format.type")
    if kind != "json_schema":
        for key in ("schema", "json_schema"):
            if value.get(key) is not None:
                raise APIError(400, f"response_format.{key}: type {kind} takes no schema; to enforce one send "
                                    f"type json_schema with the schema in json_schema.schema",
                               f"response_format.{key}")
        refuse_unknown_keys(value, ("type",), "response_format")
        if kind == "text":
            return []
        return [StructuredRequest(StructuredOutputsParams(json_object=True), "response_format")]
    schema = _json_schema(value)
    return [StructuredRequest(StructuredOutputsParams(json=schema), "response_format.json_schema.schema")]


def _json_schema(value: dict) -> dict:
    """The schema of a ``response_format`` of type json_schema; 400 naming what is missing or misplaced."""
    misplaced = next((key for key in JSON_SCHEMA_KEYS if value.get(key) is not None), None)
    if misplaced is not None:
        raise APIError(400, f"response_format.{misplaced} belongs inside json_schema: send it as "
                            f"response_format.json_schema.{misplaced}", f"response_format.{misplaced}")
    refuse_unknown_keys(value, ("type", "json_schema"), "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise APIError(400, "response_format.json_schema must be an object with the schema in 'schema'",
                       "response_format.json_schema")
    refuse_unknown_keys(spec, JSON_SCHEMA_KEYS, "response_format.json_schema")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        got = "it is missing" if schema is None else f"got {type(schema).__name__}"
        raise APIError(400, f"response_format.json_schema.schema must be the JSON schema the output follows, "
                            f"an object ({{}} for any JSON value); {got}", "response_format.json_schema.schema")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise APIError(400, "response_format.json_schema.strict must be a boolean",
                       "response_format.json_schema.strict")
    return schema  # strict or not, it is enforced: a grammar gives no weaker mode to fall back to


def _from_structured_outputs(value: dict) -> StructuredRequest:
    refuse_not_honoured(value, NOT_HONOURED_STRUCTURED, "structured_outputs.")
    refuse_unknown_keys(value, STRUCTURED_KEYS, "structured_outputs")
    for name in ("json_object", "disable_any_whitespace"):
        if not isinstance(value.get(name), (bool, type(None))):  # "no" is truthy: never read a flag by truthiness
            raise APIError(400, f"structured_outputs.{name} must be a boolean (true or false), got "
                                f"{type(value[name]).__name__}", f"structured_outputs.{name}")
    fields = {k: value[k] for k in KINDS if value.get(k) is not None and value.get(k) is not False}
    flexible = value.get("disable_any_whitespace") is False
    field = f"structured_outputs.{next(iter(fields))}" if len(fields) == 1 else "structured_outputs"
    return StructuredRequest(StructuredOutputsParams(**fields, whitespace_flexible=flexible), field)
