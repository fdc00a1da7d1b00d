"""JSON schemas the grammar engine would not enforce are refused in one line; the rest keep their meaning,
their property order included (mempath/structured/schema_check.py)."""
import decimal
import importlib.metadata
import json
import re

import jsonschema
import pytest

from mempath import LLM, SamplingParams
from mempath.assets import ASSETS, DEFAULT_MODEL
from mempath.structured import StructuredOutputsParams as Structured
from mempath.structured.schema_check import MAX_OPTIONAL_PROPERTIES, schema_text


@pytest.fixture(scope="module")
def llm():
    return LLM(str(ASSETS / DEFAULT_MODEL), show_progress=False, max_num_seqs=16, device="cpu")


def generate(llm, schema, seed=0, max_tokens=40):
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed,
                            structured_outputs=Structured(json=schema))
    return llm.generate("x = ", params, use_tqdm=False)[0]


CAT = {"type": "object", "properties": {"pet_type": {"const": "cat"}, "lives": {"type": "integer", "maximum": 9}},
       "required": ["pet_type", "lives"]}
DOG = {"type": "object", "properties": {"pet_type": {"const": "dog"}, "good": {"type": "boolean"}},
       "required": ["pet_type", "good"]}
INTEGERS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 3}}
# (name, schema, what the refusal names, where, an output xgrammar 0.2.9 accepts although it breaks the schema)
REFUSED = [
    ("uniqueItems", {**INTEGERS, "uniqueItems": True}, "'uniqueItems'", "#", "[1, 1]"),
    ("contains", {**INTEGERS, "contains": {"const": 2}}, "'contains'", "#", "[1]"),
    ("not", {"enum": ["a", "b"], "not": {"const": "a"}}, "'not'", "#", '"a"'),
    ("if/then", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                 "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "'if'", "#", '{"a": 1}'),
    ("dependentRequired", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}, "'dependentRequired'", "#", '{"a": 1}'),
    ("allOf of two", {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                                {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
     "'allOf' of more than one", "#", "false"),
    ("overlapping oneOf", {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 5},
                                     {"type": "integer", "minimum": 3, "maximum": 9}]}, "'oneOf'", "#", "4"),
    ("beside anyOf", {"anyOf": [{"type": "integer"}, {"type": "string"}], "minimum": 5},
     "'minimum' beside 'anyOf'", "#", "1"),
    ("beside $ref", {"$defs": {"I": {"type": "integer"}}, "$ref": "#/$defs/I", "minimum": 5},
     "'minimum' beside '$ref'", "#", "1"),
    ("pattern and maxLength", {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]+$",
                                                                         "maxLength": 4}}, "required": ["code"]},
     "'maxLength' beside 'pattern'", "#/properties/code", '{"code": "ABCDEF"}'),
    ("format and minLength", {"type": "string", "format": "email", "minLength": 40}, "'minLength' beside format",
     "#", '"a@b.co"'),
    ("required, undefined", {"type": "object", "required": ["a"]}, "'required' names 'a'", "#", "{}"),
    ("enum against type", {"type": "string", "enum": ["a", 1]}, "the value 1 is not of type \"string\"", "#", "1"),
    ("const against type", {"type": "object", "properties": {"n": {"type": "integer", "const": "x"}},
                            "required": ["n"]}, "the value \"x\"", "#/properties/n", '{"n": "x"}'),
]


@pytest.mark.parametrize("name, schema, says, where, _", REFUSED, ids=[case[0] for case in REFUSED])
def test_a_keyword_the_grammar_engine_drops_is_refused_in_one_line(llm, name, schema, says, where, _):
    """Each of these compiled into a grammar that let an output break the schema, which then finished with
    "stop" as if it were valid."""
    with pytest.raises(ValueError) as error:
        generate(llm, schema)
    message = str(error.value)
    assert message.startswith(f"structured_outputs.json at {where}: ") and says in message
    assert "\n" not in message and ": " in message.split(says, 1)[1]  # a fix follows
    with pytest.raises(ValueError, match=re.escape(says)):  # the text form too
        generate(llm, json.dumps(schema))
    assert llm.engine.kv.pool.num_used == 0


@pytest.mark.skipif(importlib.metadata.version("xgrammar") != "0.2.9", reason="measured on xgrammar 0.2.9")
@pytest.mark.parametrize("name, schema, says, where, breaking", REFUSED, ids=[case[0] for case in REFUSED])
def test_the_refused_keywords_are_those_xgrammar_lets_an_output_break(name, schema, says, where, breaking):
    """Why each is refused: the grammar xgrammar compiles from the schema accepts an output that breaks it."""
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(breaking), schema)
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    assert _is_grammar_accept_string(grammar, breaking)


ENFORCED = [
    ("discriminated oneOf", {"$defs": {"Cat": CAT, "Dog": DOG},
                             "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
                             "discriminator": {"propertyName": "pet_type"}}),
    ("oneOf of types", {"oneOf": [{"type": "integer", "maximum": 99}, {"type": "boolean"}]}),
    ("annotations beside $ref", {"$defs": {"I": {"type": "integer", "minimum": 5, "maximum": 50}},
                                 "$ref": "#/$defs/I", "description": "a count", "default": 5, "title": "N"}),
    ("allOf of one", {"allOf": [{"type": "boolean"}], "description": "pydantic wraps a $ref so"}),
    ("length beside an annotation format", {"type": "string", "format": "password", "minLength": 2, "maxLength": 4}),
    ("uniqueItems false", {**INTEGERS, "uniqueItems": False, "maxItems": 3}),
    ("minLength 1 beside a format (AnyUrl's)", {"type": "string", "format": "date", "minLength": 1}),
    ("an extension beside $ref", {"$defs": {"B": {"type": "boolean"}}, "$ref": "#/$defs/B", "x-order": 1}),
    ("enum of the types", {"type": ["integer", "null"], "enum": [1, 2.0, None]}),
]


@pytest.mark.parametrize("name, schema", ENFORCED, ids=[case[0] for case in ENFORCED])
def test_schemas_the_grammar_engine_enforces_are_kept_and_their_outputs_valid(llm, name, schema):
    for seed in range(3):
        out = generate(llm, schema, seed=seed)
        assert out.finish_reason == "stop", (out.text, out.error)
        jsonschema.validate(json.loads(out.text), schema)


def test_properties_are_generated_in_the_schemas_order(llm):
    """The schema was compiled from its text with every key sorted: "answer" came before "reasoning", so a
    schema that asks for the reasoning first got the answer first."""
    schema = {"type": "object", "properties": {"reasoning": {"type": "string", "maxLength": 5},
                                               "answer": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["reasoning", "answer"], "additionalProperties": False}
    for given in (schema, json.dumps(schema)):
        out = generate(llm, given)
        assert list(json.loads(out.text)) == ["reasoning", "answer"], out.text
    assert schema_text(schema) != schema_text({**schema, "properties": dict(reversed(schema["properties"].items()))})
    reordered = {key: schema[key] for key in reversed(schema)}  # keyword order means nothing: one compile
    assert schema_text(reordered) == schema_text(schema)


def test_too_many_optional_properties_are_refused_before_a_long_compile(llm):
    many = {"type": "object", "properties": {f"p{i}": {"type": "boolean"} for i in range(MAX_OPTIONAL_PROPERTIES + 1)}}
    with pytest.raises(ValueError, match=f"{MAX_OPTIONAL_PROPERTIES + 1} optional properties take too long"):
        generate(llm, many)
    many["required"] = ["p0"]
    generate(llm, many, max_tokens=2)  # one fewer optional: compiled


def test_a_schema_that_is_not_json_fails_its_request_alone(llm):
    """A Decimal in a schema raised a bare TypeError from the batch's compile, which ended the whole batch."""
    bad = SamplingParams(max_tokens=5, structured_outputs=Structured(json={"type": "number",
                                                                           "maximum": decimal.Decimal("1.5")}))
    good = SamplingParams(max_tokens=5, structured_outputs=Structured(choice=["yes", "no"]))
    answered, refused = llm.generate(["x", "y"], [good, bad], use_tqdm=False)
    assert answered.text in ("yes", "no") and answered.finish_reason == "stop"
    assert refused.finish_reason == "error" and refused.error.startswith("structured_outputs.json is not JSON: ")
    with pytest.raises(ValueError, match="structured_outputs.json is not valid JSON"):
        generate(llm, '{"type": "object",')
    assert llm.engine.kv.pool.num_used == 0


@pytest.mark.parametrize("structured", [Structured(grammar="root ::= root"), Structured(regex="[^\\s\\S]")])
def test_a_grammar_that_admits_no_output_is_refused_when_compiled(llm, structured):
    """It compiled, and its request failed at the first step as the engine's own error (a 500 on the server)."""
    with pytest.raises(ValueError, match=f"structured_outputs.{structured.kind} admits no output"):
        llm.generate("x", SamplingParams(max_tokens=5, structured_outputs=structured), use_tqdm=False)
    assert llm.engine.kv.pool.num_used == 0


def test_pydantic_schemas_are_kept_and_a_defaulted_union_tag_always_written(llm):
    """pydantic writes a discriminated union's Literal tag with a default as an optional property: refused as a
    oneOf that may overlap, though the discriminator tells the branches apart. The compiled schema requires the
    tag, so every output says its branch."""
    from typing import Annotated, Literal, Optional, Union

    from pydantic import BaseModel, Field, conint

    class Cat(BaseModel):
        pet_type: Literal["cat"] = "cat"
        lives: conint(ge=0, le=9)

    class Dog(BaseModel):
        pet_type: Literal["dog"] = "dog"
        good: bool

    class Owner(BaseModel):
        name: str = Field(max_length=6, description="a short name")
        pet: Annotated[Union[Cat, Dog], Field(discriminator="pet_type")]
        nickname: Optional[str] = Field(None, max_length=4)

    schema = Owner.model_json_schema()
    for seed in range(4):
        out = generate(llm, schema, seed=seed, max_tokens=80)
        assert out.finish_reason == "stop", (out.text, out.error)
        answer = json.loads(out.text)
        jsonschema.validate(answer, schema)
        assert answer["pet"]["pet_type"] in ("cat", "dog")
        Owner.model_validate(answer)
