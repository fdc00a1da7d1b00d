"""Structured output under async scheduling: a grammar step is scheduled ahead like any decode
step (its forward launched before the previous step's tokens reach the host; the masks are
filled once they have, before the sampling), and its output is token for token the output of
synchronous steps."""
import json
import re

import jsonschema
import pytest
import torch

from mempath import LLM, SamplingParams
from mempath.assets import ASSETS, DEFAULT_MODEL
from mempath.structured import StructuredOutputsParams as Structured
from tests.structured_schemas import max_output_chars, schemas

PROMPTS = ["def parse(data):", "config = ", "# settings\n", "import json\n", "x"]


@pytest.fixture(scope="module")
def engines():
    def make(async_scheduling: bool) -> LLM:
        return LLM(str(ASSETS / DEFAULT_MODEL), show_progress=False, max_num_seqs=16, device="cpu",
                   async_scheduling=async_scheduling)
    return make(True), make(False)


def run(llm: LLM, prompts, params):
    """The outputs and how many steps were launched ahead of the previous one's tokens."""
    before = llm.engine.num_steps_ahead
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.kv.pool.num_used == 0  # every block came back
    return outputs, llm.engine.num_steps_ahead - before


def test_a_grammar_step_is_scheduled_ahead(engines):
    fast, _ = engines
    out, ahead = run(fast, ["x"], [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                  structured_outputs=Structured(regex="[a-z ]+"))])
    assert re.fullmatch("[a-z ]+", out[0].text) and out[0].finish_reason == "length"
    assert len(out[0].token_ids) == 8
    assert ahead >= 5  # prefill, one ordinary decode step, then every step ahead but the last


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_async_grammar_output_equals_sync_for_random_schemas(engines, batch):
    fast, slow = engines
    cases = schemas(seed=11 + batch, count=batch)
    params = [SamplingParams(max_tokens=max_output_chars(s) + 2, structured_outputs=Structured(json=s),
                             **(dict(temperature=0.8, seed=i) if i % 3 == 2 else dict(temperature=0)))
              for i, s in enumerate(cases)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    got, ahead = run(fast, prompts, params)
    want, none_ahead = run(slow, prompts, params)
    assert ahead > 0 and none_ahead == 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for schema, out in zip(cases, got):
        assert out.finish_reason == "stop", (out.text, out.error)
        jsonschema.validate(json.loads(out.text), schema)


def test_grammar_rows_beside_free_and_penalised_rows_equal_sync(engines):
    """Penalties and logit_bias read each row's newest token: from the host once the grammar
    step has handed the previous tokens over, from the device otherwise."""
    fast, slow = engines
    base = dict(max_tokens=24, temperature=0, ignore_eos=True)
    params = [SamplingParams(**base),
              SamplingParams(**base, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2),
              SamplingParams(max_tokens=24, temperature=0, structured_outputs=Structured(regex=r"[a-z_]{2,12}\(\)")),
              SamplingParams(**base, logit_bias={5: 4.0}, min_tokens=4, structured_outputs=Structured(
                  json={"type": "array", "items": {"type": "integer"}, "maxItems": 3})),
              SamplingParams(**{**base, "temperature": 0.9}, seed=7, repetition_penalty=1.2,
                             structured_outputs=Structured(choice=["alpha", "beta", "gamma delta"]))]
    got, ahead = run(fast, PROMPTS, params)
    want, _ = run(slow, PROMPTS, params)
    assert ahead > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]


def test_a_grammar_ending_while_its_next_step_is_scheduled_drops_that_row(engines):
    """The grammar takes its stop token in step t while step t+1 is already launched with the
    row: t+1's token is surplus (as for EOS and stop strings), its mask all ones."""
    fast, slow = engines
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, structured_outputs=Structured(
        choice=["done"])), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)]
    got, ahead = run(fast, ["x", "y"], params)
    want, _ = run(slow, ["x", "y"], params)
    assert ahead > 0
    assert got[0].text == "done" and got[0].finish_reason == "stop"
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_a_token_the_grammar_rejects_fails_that_request_alone(engines, monkeypatch):
    """Cannot happen with the mask applied; with the mask broken (all ones) the output
    processor's check fails the request with one line, and the batch goes on."""
    from mempath.structured.bitmask import GrammarBitmask

    def allow_everything(self, grammars):
        self.host_np[:len(grammars)] = -1

    fast, _ = engines
    monkeypatch.setattr(GrammarBitmask, "fill", allow_everything)
    free = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    alone, _ = run(fast, ["y"], [free])
    outs, ahead = run(fast, ["x", "y"], [SamplingParams(max_tokens=30, temperature=0, structured_outputs=Structured(
        regex="Q{20}")), free])
    assert outs[0].finish_reason == "error" and "not allowed by the request's grammar" in outs[0].error
    assert outs[1].token_ids == alone[0].token_ids and outs[1].finish_reason == "length"


def test_grammar_rows_stay_ahead_beside_speculative_decoding(engines):
    """Speculation never proposes for a grammar row, so a step of grammar rows alone is not
    read back for it: it stays in flight as without speculative_config, with the same output."""
    _, slow = engines
    llm = LLM(str(ASSETS / DEFAULT_MODEL), show_progress=False, device="cpu",
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                             structured_outputs=Structured(regex="[a-z ]+")) for _ in range(2)]
    got, ahead = run(llm, ["x", "def f"], params)
    want, _ = run(slow, ["x", "def f"], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert ahead >= 12


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_grammar_steps_run_ahead_on_cuda_graphs_and_allocate_nothing_per_step():
    """Grammar rows alone, decode steps replayed from CUDA graphs: every step after the first
    decode runs ahead, the masks land through the side stream before the sampling, every
    output validates, and device memory stays flat once warm."""
    llm = LLM(str(ASSETS / DEFAULT_MODEL), show_progress=False, max_num_seqs=32)
    cases = schemas(seed=3, count=32)
    params = [SamplingParams(max_tokens=max_output_chars(s) + 2, temperature=0, structured_outputs=Structured(json=s))
              for s in cases]
    llm.generate(["x"] * len(params), params, use_tqdm=False)  # warm: compiles, allocator
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["num_alloc_retries"], torch.cuda.memory_reserved()
    outs, ahead = run(llm, ["x"] * len(params), params)
    torch.cuda.synchronize()
    assert (torch.cuda.memory_stats()["num_alloc_retries"], torch.cuda.memory_reserved()) == before
    assert ahead >= max(len(o.token_ids) for o in outs) - 3
    for schema, out in zip(cases, outs):
        assert out.finish_reason == "stop", out.error
        jsonschema.validate(json.loads(out.text), schema)
