"""Speculative steps beside rows that cannot speculate: grammar rows, rows whose logits are
edited (penalties, logit_bias, min_tokens, bad_words) and rows recording prompt logprobs are
sampled in the same step exactly as a plain step samples them."""
import math

from mempath import LLM, SamplingParams
from mempath.assets import ASSETS
from mempath.structured import StructuredOutputsParams

TARGET, DRAFT = str(ASSETS / "mempath-tiny"), str(ASSETS / "mempath-tiny-draft")
PROMPTS = ["def read_config(path):", "import os\nimport sys\n", "class Engine:\n    def step(self):",
           "for i in range(10):", "x = [1, 2, 3]\ny ="]


def mixed_params() -> list[SamplingParams]:
    base = dict(max_tokens=20, temperature=0, ignore_eos=True)
    return [SamplingParams(**base),  # speculates
            SamplingParams(**base, repetition_penalty=1.3, presence_penalty=0.5),
            SamplingParams(**{**base, "ignore_eos": False},
                           structured_outputs=StructuredOutputsParams(regex=r"[a-z_]{2,12}\(\)")),
            SamplingParams(**base, prompt_logprobs=2),
            SamplingParams(**base, logit_bias={5: 4.0}, min_tokens=4)]


def test_rows_that_cannot_speculate_match_plain_decoding_in_a_speculative_step():
    plain = LLM(TARGET, show_progress=False).generate(PROMPTS, mixed_params(), use_tqdm=False)
    llm = LLM(TARGET, show_progress=False,
              speculative_config={"model": DRAFT, "num_speculative_tokens": 3, "adaptive": False})
    fast = llm.generate(PROMPTS, mixed_params(), use_tqdm=False)
    assert llm.stats()["spec_decode"]["num_drafts"] > 0  # the first row did speculate
    assert [o.token_ids for o in fast] == [o.token_ids for o in plain]
    assert fast[2].finish_reason == "stop"  # the grammar ended it, as in the plain run
    got, want = fast[3].prompt_logprobs, plain[3].prompt_logprobs
    assert len(got) == len(want) == len(fast[3].prompt_token_ids) and got[0] is None
    for g, w in zip(got[1:], want[1:]):
        assert g.keys() == w.keys()
        assert all(math.isclose(g[t], w[t], abs_tol=1e-4) for t in g)
