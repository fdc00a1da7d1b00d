"""Seeded random JSON schemas for the structured-output tests and benchmarks.

Every schema bounds what an output can hold (string and array lengths, integer
ranges, nesting depth), and ``max_output_chars`` gives the longest compact JSON
document it admits, so a test can give max_tokens room for the longest one and a
truncated output cannot happen.
"""
import json
import random

WORDS = ["alpha", "beta", "gamma", "delta", "red", "green", "blue", "x", "y", "on", "off"]
MAX_STRING = 6
MAX_ITEMS = 3
BYTES_PER_CHAR = 4  # a weak model may spell any character in UTF-8 bytes, one token each


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["string", "integer", "boolean", "enum", "null"]
    if depth < 2:
        kinds += ["object", "array", "object"]
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, MAX_STRING)}
    if kind == "integer":
        low = rng.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 1000)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "null":
        return {"type": "null"}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(1, 4))}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1),
                "minItems": rng.randint(0, 1), "maxItems": MAX_ITEMS}
    names = rng.sample(WORDS, rng.randint(1, 4))
    props = {name: random_schema(rng, depth + 1) for name in names}
    required = [n for n in names if rng.random() < 0.6]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def max_output_chars(schema: dict) -> int:
    """The longest compact JSON document the schema admits, in characters, a character
    of a string counted as the escape it may need (\\uXXXX, 6)."""
    if "enum" in schema:
        return max(len(json.dumps(v)) for v in schema["enum"])
    kind = schema["type"]
    if kind == "string":
        return 2 + 6 * schema["maxLength"]
    if kind == "integer":
        return max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    if kind == "boolean":
        return 5
    if kind == "null":
        return 4
    if kind == "array":
        return 2 + schema["maxItems"] * (max_output_chars(schema["items"]) + 1)
    return 2 + sum(len(json.dumps(name)) + 2 + max_output_chars(sub) for name, sub in schema["properties"].items())


def schemas(seed: int, count: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        schema = random_schema(rng)
        if schema.get("type") == "object":  # response_format json_schema wants an object at the top
            out.append(schema)
    return out
