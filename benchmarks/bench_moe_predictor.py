"""Which predictor of the next MoE layer's experts hits more (CPU, tests' tiny random models).

    PYTHONPATH=. python benchmarks/bench_moe_predictor.py [--layers 6] [--tokens 32]

For every step and MoE layer l with a next one, the experts layer l+1 routes to are
predicted two ways (docs/moe.md, Prefetch):
  next-router  the next layer's router (with its synthetic bias, not advanced) applied to
               layer l's MLP input: what Experts.prefetch uses;
  repeat       the experts layer l itself routed to, the same indices again.
Per-token recall: the share of each token's k experts in layer l+1 that the predictor
named for that token (k guesses each, so precision is the same figure), over every step. Each router is named in its result line: the model's (random weights,
nearly uniform) and the synthetic skewed bias (synthetic_router_bias, skew 1.0).
"""
import argparse
import atexit
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mempath import LLM, SamplingParams  # noqa: E402
from mempath.model.moe import synthetic_router_bias  # noqa: E402
from tests.conftest import make_model  # noqa: E402

PROMPTS = [[1, 5, 9, 33, 7], list(range(10, 47)), [3] * 20 + [8, 9], [100 + i % 50 for i in range(70)]]


def next_layer_top_k(block, x):
    """The experts ``block``'s router would pick per token of ``x`` (its bias not advanced): [T, k]."""
    logits = block.gate(x)
    if block.router_bias is not None:
        logits = block.router_bias.apply(logits)
    return logits.topk(block.top_k, dim=-1).indices


def measure(llm: LLM, tokens: int) -> dict:
    """Per-token recall of each predictor over a greedy run of PROMPTS (each block's route wrapped):
    the share of a token's k experts in layer l+1 that the predictor named for it."""
    blocks = llm.engine.model.moe_blocks()
    guesses = {}  # layer -> per-token predictions, made when the layer before routed (as prefetch does)
    counts = {name: [0, 0] for name in ("next-router", "repeat")}  # hits, routed (token, expert) pairs

    def wrap(index, block):
        original = block.route

        def route(x):
            weights, ids = original(x)
            for name, guess in guesses.pop(index, {}).items():
                counts[name][0] += int((guess.unsqueeze(-1) == ids.unsqueeze(-2)).any(dim=-2).sum())
                counts[name][1] += ids.numel()
            if index + 1 < len(blocks):  # before the next layer's bias advances, as Experts.prefetch
                guesses[index + 1] = {"next-router": next_layer_top_k(blocks[index + 1], x), "repeat": ids}
            return weights, ids
        block.route = route

    for index, block in enumerate(blocks):
        wrap(index, block)
    try:
        llm.generate(PROMPTS, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
    finally:
        for block in blocks:
            del block.route  # the class's method again
    return {name: round(hits / routed, 3) for name, (hits, routed) in counts.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    for arch in ("mixtral", "qwen3_moe"):
        path = tempfile.mkdtemp(prefix=f"mempath-predictor-{arch}-")
        atexit.register(shutil.rmtree, path, True)  # the bench made it: gone when it exits
        make_model(path, arch, num_hidden_layers=args.layers)
        llm = LLM(path, dtype="float32", device="cpu", show_progress=False, enable_prefix_caching=False)
        for router in ("model", "skewed"):
            if router == "skewed":
                synthetic_router_bias(llm.engine.model, skew=1.0, seed=0)
            figures = measure(llm, args.tokens)
            name = llm.stats()["expert_cache"]["router"]
            print("RESULT " + json.dumps({"arch": arch, "layers": args.layers, "router": name, **figures}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
