"""Penalties, logit_bias, min_tokens, bad words and prompt logprobs on CUDA (graphs, async
scheduling) against the CPU path; no device allocation outside the plan. Skipped without CUDA."""
import pytest
import torch

from mempath import LLM, SamplingParams
from mempath.memory.formulas import sampler_peak_bytes
from tests.conftest import make_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = [[1, 5, 9, 33, 7], list(range(10, 47)), [3] * 20 + [8, 9], [100 + i % 50 for i in range(70)]]
PARAMS = [SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, repetition_penalty=1.3,
                         presence_penalty=0.5, frequency_penalty=0.4),
          SamplingParams(max_tokens=32, temperature=0, ignore_eos=True),
          SamplingParams(max_tokens=32, temperature=0, min_tokens=8, logit_bias={2: 20.0}),
          SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, repetition_penalty=0.9,
                         frequency_penalty=-0.3, prompt_logprobs=3)]


def run(llm):
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [o.token_ids for o in outputs], outputs[3].prompt_logprobs


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_cuda_penalties_match_the_cpu_path(tmp_path, async_scheduling):
    make_model(tmp_path, "llama")
    cpu_tokens, cpu_prompt = run(LLM(str(tmp_path), dtype="float32", device="cpu", show_progress=False))
    for eager in (True, False):
        gpu = LLM(str(tmp_path), dtype="float32", device="cuda", show_progress=False, enforce_eager=eager,
                  max_num_seqs=8, max_num_batched_tokens=64, async_scheduling=async_scheduling)
        tokens, prompt = run(gpu)
        assert tokens == cpu_tokens, f"eager={eager}"
        for got, want in zip(prompt[1:], cpu_prompt[1:]):
            assert list(got) == list(want) and got == pytest.approx(want, abs=1e-3)
        if async_scheduling:
            assert gpu.stats()["steps_launched_ahead"] > 0
        del gpu
        torch.cuda.empty_cache()


def test_cuda_penalty_peak_is_within_the_sampler_plan(tmp_path):
    from mempath.engine.penalties import build_adjustments
    from mempath.engine.request import Request
    from mempath.engine.sampler import Sampler
    rows, vocab = 64, 32_000
    device = torch.device("cuda")
    logits = torch.randn(rows, vocab, dtype=torch.bfloat16, device=device)
    requests = []
    for _ in range(rows):
        request = Request("r", None, list(range(500)), SamplingParams(repetition_penalty=1.2, presence_penalty=0.2,
                                                                       frequency_penalty=0.2, temperature=0))
        request.token_ids += list(range(300))
        requests.append(request)
    last = torch.tensor([r.token_ids[-1] for r in requests], device=device)
    sampler = Sampler(device, 0)
    adjust = build_adjustments(requests, False, lambda: last, vocab, device)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    sampler(logits, [r.params for r in requests], [None] * rows, adjust)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    assert peak <= sampler_peak_bytes(vocab, rows) * 1.02
