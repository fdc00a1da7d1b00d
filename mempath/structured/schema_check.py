"""What a JSON schema asks that the grammar engine would not enforce, refused before it is compiled.

xgrammar compiles some JSON Schema keywords into nothing: an output can then break the schema and
still finish with "stop". Checked against xgrammar 0.2.9 by compiling each keyword and feeding
the grammar a string that breaks it (tests/test_structured_schemas.py keeps each case): the
keywords in UNENFORCED, allOf of more than one schema, oneOf whose branches may overlap (it is
compiled as anyOf), any constraint beside $ref, allOf, anyOf or oneOf (the engine applies the
composition and drops its siblings), minLength or maxLength beside pattern or a format the engine
generates, a required property that properties does not define, and enum or const values that
contradict the type. Each is refused in one line naming the keyword, where it is and the fix.

The schema's text for the compile keeps the order of every properties mapping (the order the
keys are generated in) and sorts every other keyword, so schemas that differ only in keyword
order share one compiled grammar.
"""
import json

UNENFORCED = {
    "not": "the grammar engine cannot exclude a schema",
    "uniqueItems": "the grammar engine cannot compare the items it generates",
    "contains": "the grammar engine does not require an item to match it",
    "minContains": "the grammar engine does not count the items that match contains",
    "maxContains": "the grammar engine does not count the items that match contains",
    "if": "the grammar engine does not apply conditional schemas",
    "then": "the grammar engine does not apply conditional schemas",
    "else": "the grammar engine does not apply conditional schemas",
    "dependentRequired": "the grammar engine does not apply property dependencies",
    "dependentSchemas": "the grammar engine does not apply property dependencies",
    "dependencies": "the grammar engine does not apply property dependencies",
}
BREAKS = "so an output could break it and still finish"
# Keywords that constrain nothing (JSON Schema's annotations and containers of definitions).
ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "$schema", "$id", "$anchor", "deprecated",
               "readOnly", "writeOnly", "contentMediaType", "contentEncoding", "$defs", "definitions", "discriminator",
               "example"}
COMPOSITIONS = ("$ref", "allOf", "anyOf", "oneOf")
# The string formats the engine generates (its JSON schema converter); any other format is an
# annotation it leaves alone, as JSON Schema allows, and lengths beside those are enforced.
GENERATED_FORMATS = {"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
                     "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"}
# Formats whose every value has a character: a minLength of 1 beside them binds nothing (pydantic's AnyUrl).
NONEMPTY_FORMATS = GENERATED_FORMATS - {"uri-reference", "uri-template", "json-pointer"}
# An object's optional properties make the compile grow about with their cube: on the CPU of
# this project's CI machine 400 took 0.16 s, 700 1.3 s and 1,000 5.8 s, while a compile holds one
# of the server's few compile threads.
MAX_OPTIONAL_PROPERTIES = 512
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
SCHEMA_VALUES = ("items", "additionalProperties", "additionalItems", "unevaluatedProperties", "unevaluatedItems",
                 "propertyNames", "not", "if", "then", "else", "contains")


def schema_text(schema: dict) -> str:
    """The schema's JSON text to compile: properties in their order, every other keyword sorted, and the tag of
    a discriminated union required in each branch (pydantic leaves a tag with a default optional; without it
    the branches may overlap, and always writing it keeps every output valid)."""
    return json.dumps(_ordered(_tags_required(schema)))


def _tags_required(schema: dict) -> dict:
    tagged = [sub for _, sub in _subschemas(schema, "#") if _tag_of(sub)]
    if not tagged:
        return schema
    schema = json.loads(json.dumps(schema))  # a copy to edit
    for union in [sub for _, sub in _subschemas(schema, "#") if _tag_of(sub)]:
        tag = _tag_of(union)
        for branch in union["oneOf"]:
            branch = _resolve(branch, schema)
            if isinstance(branch, dict) and tag not in branch.setdefault("required", []):
                branch["required"].append(tag)
    return schema


def _tag_of(schema: dict) -> str | None:
    """The property a oneOf's discriminator names (OpenAPI's, as pydantic writes it), if any."""
    discriminator = schema.get("discriminator")
    tag = discriminator.get("propertyName") if isinstance(discriminator, dict) else None
    return tag if isinstance(tag, str) and isinstance(schema.get("oneOf"), list) else None


def _ordered(schema):
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key in sorted(schema):
        value = schema[key]
        if key in SCHEMA_MAPS and isinstance(value, dict):
            mapping = value if key == "properties" else dict(sorted(value.items()))
            out[key] = {name: _ordered(sub) for name, sub in mapping.items()}
        elif key in SCHEMA_LISTS and isinstance(value, list) or key == "items" and isinstance(value, list):
            out[key] = [_ordered(sub) for sub in value]
        elif key in SCHEMA_VALUES:
            out[key] = _ordered(value)
        else:
            out[key] = value  # enum, const, default, required...: values, kept as given
    return out


def check_enforceable(schema: dict) -> None:
    """Raise ValueError naming the first keyword of ``schema`` the grammar engine would not enforce."""
    try:
        for where, sub in _subschemas(schema, "#"):
            problem = _problem(sub, schema)
            if problem:
                raise ValueError(f"structured_outputs.json at {where}: {problem}")
    except RecursionError:
        raise ValueError("structured_outputs.json is nested too deeply to check; flatten it with $defs") from None


def _subschemas(schema, where: str):
    """(JSON pointer, schema) of ``schema`` and every schema inside it."""
    if not isinstance(schema, dict):
        return
    yield where, schema
    for key, value in schema.items():
        if key in SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                yield from _subschemas(sub, f"{where}/{key}/{_escape(name)}")
        elif (key in SCHEMA_LISTS or key == "items") and isinstance(value, list):
            for i, sub in enumerate(value):
                yield from _subschemas(sub, f"{where}/{key}/{i}")
        elif key in SCHEMA_VALUES:
            yield from _subschemas(value, f"{where}/{key}")


def _escape(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")


def _problem(schema: dict, root: dict) -> str | None:
    for key, why in UNENFORCED.items():
        if key in schema and not (key == "uniqueItems" and schema[key] is False):
            return f"'{key}' is not enforced ({why}), {BREAKS}: remove it and check it after generation"
    composition = next((key for key in COMPOSITIONS if key in schema), None)
    if composition is not None:
        dropped = sorted(key for key in set(schema) - ANNOTATIONS - set(COMPOSITIONS) if not key.startswith("x-"))
        if dropped:
            where = "the schema it points to" if composition == "$ref" else f"each schema of the {composition}"
            return (f"'{dropped[0]}' beside '{composition}' is not enforced (the grammar engine applies the "
                    f"{composition} and drops what is beside it), {BREAKS}: move it into {where}")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"'allOf' of more than one schema is not enforced, {BREAKS}: merge them into one schema"
    if isinstance(schema.get("oneOf"), list) and not _disjoint(schema["oneOf"], root, _tag_of(schema)):
        return (f"'oneOf' whose schemas may overlap is enforced as 'anyOf', {BREAKS}: use 'anyOf', or tell the "
                "schemas apart by their type or by a required property with a different 'const' in each")
    return _string_problem(schema) or _object_problem(schema) or _value_problem(schema)


def _string_problem(schema: dict) -> str | None:
    lengths = [key for key in ("minLength", "maxLength") if key in schema]
    if not lengths:
        return None
    if "pattern" in schema:
        return (f"'{lengths[0]}' beside 'pattern' is not enforced, {BREAKS}: put the length in the pattern "
                "(e.g. {1,8})")
    binding = [key for key in lengths if not (key == "minLength" and schema["minLength"] in (0, 1)
                                              and schema.get("format") in NONEMPTY_FORMATS)]
    if schema.get("format") in GENERATED_FORMATS and binding:
        return (f"'{binding[0]}' beside format '{schema['format']}' is not enforced, {BREAKS}: remove one of them "
                "(pydantic's HttpUrl writes maxLength 2083 beside format uri; AnyUrl does not)")
    return None


def _object_problem(schema: dict) -> str | None:
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    missing = [name for name in required if name not in properties]
    if missing:
        return (f"'required' names '{missing[0]}', which 'properties' does not define: that is not enforced, {BREAKS}: "
                "define it in 'properties'")
    optional = len(set(properties) - set(required))
    if optional > MAX_OPTIONAL_PROPERTIES:
        return (f"{optional} optional properties take too long to compile (the compile grows with their cube); "
                f"make some required or split the object, at most {MAX_OPTIONAL_PROPERTIES} optional")
    return None


def _value_problem(schema: dict) -> str | None:
    declared = schema.get("type")
    types = {declared} if isinstance(declared, str) else set(declared) if isinstance(declared, list) else set()
    if not types:
        return None
    values = list(schema["enum"]) if isinstance(schema.get("enum"), list) else []
    if "const" in schema:
        values.append(schema["const"])
    for value in values:
        if not _json_types(value) & types:
            return (f"the value {json.dumps(value)} is not of type {json.dumps(declared)} and the grammar engine "
                    f"generates it anyway, {BREAKS}: make the values and the type agree")
    return None


def _json_types(value) -> set[str]:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int) or isinstance(value, float) and value.is_integer():
        return {"integer", "number"}
    return {float: {"number"}, str: {"string"}, list: {"array"}, dict: {"object"}}.get(type(value), set())


def _disjoint(branches: list, root: dict, tag: str | None) -> bool:
    """Whether no value can match two of ``branches``: told apart by their types, or by a property
    each requires with a different const (a discriminated union, as pydantic writes one; ``tag``, the one its
    discriminator names, is made required when compiled: schema_text)."""
    schemas = [_resolve(branch, root) for branch in branches]
    if not all(isinstance(s, dict) for s in schemas):
        return False
    kinds = [_kind(s.get("type")) for s in schemas]
    if None not in kinds and len(set(kinds)) == len(kinds):
        return True
    for name in (schemas[0].get("properties") or {}) if isinstance(schemas[0].get("properties"), dict) else {}:
        consts = [_const_of(s, name, required=name != tag) for s in schemas]
        if all(c is not _NONE for c in consts) and len({json.dumps(c) for c in consts}) == len(consts):
            return True
    return False


_NONE = object()


def _const_of(schema: dict, name: str, required: bool = True):
    """The one value ``schema`` requires property ``name`` to have (if present, where not ``required``), or _NONE."""
    properties = schema.get("properties")
    if not isinstance(properties, dict) or required and name not in schema.get("required", ()):
        return _NONE
    prop = properties.get(name)
    if not isinstance(prop, dict):
        return _NONE
    if "const" in prop:
        return prop["const"]
    enum = prop.get("enum")
    return enum[0] if isinstance(enum, list) and len(enum) == 1 else _NONE


def _kind(declared) -> str | None:
    """A branch's one type, integer and number as one (an integer is a number)."""
    if not isinstance(declared, str):
        return None
    return "number" if declared == "integer" else declared


def _resolve(schema, root: dict):
    """``schema``, or what its local $ref ("#/..." in this document) points to."""
    ref = schema.get("$ref") if isinstance(schema, dict) else None
    if not isinstance(ref, str) or not ref.startswith("#"):
        return schema
    target = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(target, dict) or part not in target:
            return None
        target = target[part]
    return target
