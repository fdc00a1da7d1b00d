"""Structured output in the engine: every output matches its JSON schema, regex or choice.

The shipped mempath-tiny model is not trained for JSON; the grammar makes its greedy or
seeded output valid anyway, and every schema bounds its longest document
(tests/structured_schemas.py) so max_tokens always leaves room to finish.
"""
import json
import random
import re

import jsonschema
import pytest
import torch

from mempath import LLM, SamplingParams
from mempath.assets import ASSETS, DEFAULT_MODEL
from mempath.structured import StructuredOutputsParams as Structured
from tests.structured_schemas import max_output_chars, schemas


@pytest.fixture(scope="module")
def llm():
    return LLM(str(ASSETS / DEFAULT_MODEL), show_progress=False, max_num_seqs=128, device="cpu")


PROMPTS = ["def parse(data):", "config = ", "# settings\n", "import json\n", "x"]


def test_100_random_schemas_give_valid_json(llm):
    cases = schemas(seed=0, count=100)
    rng = random.Random(1)
    params = []
    for i, schema in enumerate(cases):
        budget = max_output_chars(schema) + 2  # a token is at least one character; +EOS
        seeded = dict(temperature=0.8, seed=i) if i % 2 else dict(temperature=0)
        params.append(SamplingParams(max_tokens=budget, structured_outputs=Structured(json=schema), **seeded))
    prompts = [rng.choice(PROMPTS) for _ in cases]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for schema, out in zip(cases, outputs):
        assert out.finish_reason == "stop", (schema, out.text, out.error)
        jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.parametrize("pattern", [r"[0-9]{3}-[a-z]{2,4}", r"(yes|no)!", r"[A-Z][a-z]{1,8} [0-9]{1,4}",
                                     r"\d{1,5}\.\d\d"])
def test_regex_outputs_match(llm, pattern):
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=s, structured_outputs=Structured(regex=pattern))
              for s in range(8)]
    for out in llm.generate(["x = "] * 8, params, use_tqdm=False):
        assert out.finish_reason == "stop" and re.fullmatch(pattern, out.text), out.text


def test_choice_outputs_are_one_of_the_choices(llm):
    choices = ["red", "green", "blue sky", 'say "hi"']
    params = [SamplingParams(max_tokens=20, temperature=1.5, seed=s, structured_outputs=Structured(choice=choices))
              for s in range(12)]
    for out in llm.generate(["colour: "] * 12, params, use_tqdm=False):
        assert out.text in choices and out.finish_reason == "stop"


def test_json_object_and_ebnf_grammar(llm):
    out = llm.generate("data = ", SamplingParams(max_tokens=200, temperature=0,
                                                 structured_outputs=Structured(json_object=True)))[0]
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:
        assert out.text.startswith("{")
    grammar = 'root ::= "(" [a-c]+ ")" | "none"'
    out = llm.generate("s = ", SamplingParams(max_tokens=30, temperature=0.9, seed=3,
                                              structured_outputs=Structured(grammar=grammar)))[0]
    assert re.fullmatch(r"\([a-c]+\)|none", out.text), out.text


def test_a_grammar_request_beside_free_ones_leaves_them_unchanged(llm):
    free = SamplingParams(max_tokens=12, temperature=0)
    alone = llm.generate(PROMPTS[:2], free, use_tqdm=False)
    mixed = llm.generate(PROMPTS[:2] + ["x"], [free, free, SamplingParams(
        max_tokens=10, temperature=0, structured_outputs=Structured(choice=["a", "b"]))], use_tqdm=False)
    assert [o.token_ids for o in alone] == [o.token_ids for o in mixed[:2]]
    assert mixed[2].text in ("a", "b")


@pytest.mark.parametrize("structured, says", [
    (Structured(json={"type": "objekt"}), "structured_outputs.json is not a JSON schema"),
    (Structured(json="{not json"), "structured_outputs.json"),
    (Structured(regex="(ab"), "structured_outputs.regex is not a valid regex"),
    (Structured(grammar="root ::= missing"), "structured_outputs.grammar is not a valid EBNF grammar"),
    (Structured(choice=[]), "structured_outputs.choice must be a non-empty list"),
    (Structured(), "structured_outputs needs exactly one of"),
    (Structured(regex="a", choice=["a"]), "got regex, choice"),
])
def test_invalid_constraints_are_value_errors_naming_the_field(llm, structured, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        llm.generate("x", SamplingParams(max_tokens=4, structured_outputs=structured))
    assert llm.engine.kv.pool.num_used == 0  # nothing was admitted


def test_compiled_grammars_are_cached_by_schema(llm):
    compiler = llm.engine.inputs.grammars
    schema = {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]}
    before = compiler.num_compiled
    for _ in range(3):
        llm.generate("x", SamplingParams(max_tokens=20, temperature=0, structured_outputs=Structured(json=schema)))
    reordered = json.loads(json.dumps({"required": ["k"], **schema}))
    llm.generate("x", SamplingParams(max_tokens=20, temperature=0, structured_outputs=Structured(json=reordered)))
    assert compiler.num_compiled == before + 1


def test_a_grammar_with_no_allowed_token_fails_that_request_alone(llm, monkeypatch):
    from mempath.structured.bitmask import GrammarBitmask
    real_fill = GrammarBitmask.fill
    fills = []

    def dead_end(self, grammars):
        real_fill(self, grammars)
        if len(fills) >= 2:
            self.host_np[0] = 0  # row 0 is the grammar request's while both run
        fills.append(len(grammars))

    monkeypatch.setattr(GrammarBitmask, "fill", dead_end)
    outs = llm.generate(["x", "y"], [SamplingParams(max_tokens=30, temperature=0, structured_outputs=Structured(
        regex="[a-z]{10}")), SamplingParams(max_tokens=5, temperature=0)], use_tqdm=False)
    assert outs[0].finish_reason == "error" and "allows no next token" in outs[0].error
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 5
    assert llm.engine.kv.pool.num_used == 0


def test_a_finished_grammar_stops_even_with_ignore_eos(llm):
    out = llm.generate("x", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                           structured_outputs=Structured(choice=["done"])))[0]
    assert out.text == "done" and out.finish_reason == "stop"


def test_the_bitmask_is_counted_with_the_step_buffers(llm):
    from mempath.memory.formulas import grammar_bitmask_bytes
    runner = llm.engine.runner
    assert runner.grammar_bitmask.nbytes() == grammar_bitmask_bytes(runner.spec.vocab_size, runner.max_num_seqs)
    assert runner.workspace_bytes() >= runner.grammar_bitmask.nbytes() + runner.buffers.nbytes()
    pointer = runner.grammar_bitmask.host.data_ptr()
    llm.generate("x", SamplingParams(max_tokens=3, structured_outputs=Structured(regex="[a-z]+")))
    assert runner.grammar_bitmask.host.data_ptr() == pointer  # allocated once, reused


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_batches_with_grammar_rows_validate_and_allocate_nothing_per_step():
    """On the GPU: decode graphs replay with the mask applied in place on their logits, a mixed
    batch of grammar and free rows, and device memory stays flat once warm."""
    llm = LLM(str(ASSETS / DEFAULT_MODEL), show_progress=False, max_num_seqs=64)
    cases = schemas(seed=2, count=48)
    params = [SamplingParams(max_tokens=max_output_chars(s) + 2, temperature=0, structured_outputs=Structured(json=s))
              for s in cases] + [SamplingParams(max_tokens=64, temperature=0.7, seed=i) for i in range(16)]
    llm.generate(["x"] * len(params), params, use_tqdm=False)  # warm: compiles, allocator
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["num_alloc_retries"], torch.cuda.memory_reserved()
    outs = llm.generate(["x"] * len(params), params, use_tqdm=False)
    torch.cuda.synchronize()
    assert (torch.cuda.memory_stats()["num_alloc_retries"], torch.cuda.memory_reserved()) == before
    for schema, out in zip(cases, outs):
        assert out.finish_reason == "stop", out.error
        jsonschema.validate(json.loads(out.text), schema)
