"""CUDA graphs of the speculative step (engine/spec/graphs.py). On the CPU, the graphs' padded
layout (rows of a fixed length, padded at the front, buckets past the batch) with an eager
stand-in for each replay keeps greedy output identical to plain decoding. On CUDA: each
family's replay equals the same forward run eagerly, bit for bit, on rows of live requests;
greedy output with the graphs equals plain decoding's; the graphs' bytes are in the draft
tenant's ledger."""
import pytest
import torch

from mempath import LLM, SamplingParams
from mempath.engine.spec.graphs import RowGraphs
from mempath.engine.spec.rows import Row
from tests.test_correctness import GREEDY, PROMPTS

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def spec(draft: str, k: int = 3) -> dict:
    return {"model": draft, "num_speculative_tokens": k, "adaptive": False}


def running_requests(llm: LLM, steps: int = 12):
    engine = llm.engine
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    for _ in range(steps):
        engine.step()
    return [engine.outputs.requests[i] for i in ids]


class EagerReplay:
    """A stand-in for one captured graph: what its replay computes, run eagerly."""

    def __init__(self, graphs: RowGraphs, size: int):
        self.graphs, self.size, self.replays = graphs, size, 0

    def replay(self) -> None:
        self.replays += 1
        self.graphs._out(self.size).copy_(self.graphs._forward(self.size))


def install_stand_ins(decoder) -> list[RowGraphs]:
    families = []
    for name, runner, q, all_logits in (("verify_graphs", decoder.target, decoder.max_k + 1, True),
                                        ("catch_up_graphs", decoder.draft, 2, False),
                                        ("step_graphs", decoder.draft, 1, False)):
        graphs = RowGraphs(runner, q, all_logits, 4)
        graphs.logits = torch.empty(4 * q if all_logits else 4, runner.spec.vocab_size)
        graphs.graphs = {size: EagerReplay(graphs, size) for size in graphs.sizes}
        setattr(decoder, name, graphs)
        families.append(graphs)
    decoder.cost.fixed_verify_len = decoder.max_k + 1
    return families


@pytest.mark.parametrize("draft_is_target", [True, False])
def test_the_graphs_layout_keeps_greedy_output_on_the_cpu(draft_is_target, model_factory):
    path, _ = model_factory("llama")
    draft = path if draft_is_target else model_factory("llama", seed=7, num_hidden_layers=1)[0]
    # Requests of different lengths: the batch shrinks through the buckets.
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (9, 17, 26, 32)]
    plain = LLM(path, dtype="float32", device="cpu", show_progress=False).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(path, dtype="float32", device="cpu", show_progress=False, max_num_seqs=4,
              speculative_config=spec(draft))
    families = install_stand_ins(llm.engine.spec_decoder)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    for graphs in families:  # every family ran, in more than one bucket
        used = [g.replays for g in graphs.graphs.values()]
        assert sum(used) > 0 and sum(1 for n in used if n) > 1, graphs.query_len
    assert llm.stats()["kv_blocks_used"] == 0


@cuda_only
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_graph_replays_equal_eager_forwards(dtype, model_factory):
    path, _ = model_factory("llama")
    draft, _ = model_factory("llama", seed=7, num_hidden_layers=1)
    llm = LLM(path, dtype=dtype, show_progress=False, speculative_config=spec(draft))
    decoder = llm.engine.spec_decoder
    assert decoder.num_graphs() > 0
    requests = running_requests(llm)
    assert all(r.num_draft_computed >= 3 for r in requests)
    # Rows over computed positions only: a forward rewrites their KV with what is already there.
    q = decoder.verify_graphs.query_len
    cases = [
        (decoder.verify_graphs, [Row(r, r.num_computed_tokens - q + 1, r.token_ids[r.num_computed_tokens - q + 1:
                                                                                   r.num_computed_tokens], q - 1)
                                 for r in requests]),
        (decoder.catch_up_graphs, [Row(r, r.num_draft_computed - 2, r.token_ids[r.num_draft_computed - 2:
                                                                               r.num_draft_computed - 1], 1)
                                   for r in requests]),
        (decoder.step_graphs, [Row(r, r.num_draft_computed - 1, [r.token_ids[r.num_draft_computed - 1]], 1)
                               for r in requests]),
    ]
    for graphs, rows in cases:
        for n in (1, len(rows)):
            size = graphs.size_for(rows[:n])
            assert size is not None, (graphs.query_len, n)
            eager = graphs.run(rows[:n], size, eager=True).clone()
            replayed = graphs.run(rows[:n], size).clone()
            assert torch.equal(eager, replayed), (graphs.query_len, n)


@cuda_only
def test_greedy_output_on_graphs_equals_plain_decoding(model_factory):
    path, _ = model_factory("llama")
    plain = LLM(path, dtype="float32", show_progress=False).generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = LLM(path, dtype="float32", show_progress=False, speculative_config=spec(path))
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    stats = llm.stats()
    assert stats["spec_decode"]["acceptance_rate"] > 0.9
    assert stats["kv_blocks_used"] == 0
    # Measured as what the captures added: they share the decode graphs' pool and may fit in its free space
    # (0 bytes for this model on an H100 once the decode graphs' trial captures ran first).
    assert llm.engine.spec_decoder.num_graphs() > 0
    assert stats["draft_ledger"]["cuda_graphs"]["source"] == "measured"


@cuda_only
def test_enforce_eager_captures_no_speculative_graphs(model_factory):
    path, _ = model_factory("llama")
    llm = LLM(path, dtype="float32", show_progress=False, enforce_eager=True, speculative_config=spec(path))
    assert llm.engine.spec_decoder.num_graphs() == 0
    assert "cuda_graphs" not in llm.stats()["draft_ledger"]
