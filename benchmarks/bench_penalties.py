"""What penalties cost a decode step on the GPU: the same batch greedy without and with
repetition / presence / frequency penalties (and logit_bias + min_tokens), async scheduling on.

    python benchmarks/bench_penalties.py [--layers 4] [--batch 1 64 256] [--tokens 256]

Dummy Qwen3-0.6B-shaped weights (V = 151,936); prints ms per decode step per case.
"""
import argparse
import json
import tempfile
import time

import torch

from mempath import LLM, SamplingParams

QWEN3_SHAPE = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=1024,
                   intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                   max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                   tie_word_embeddings=True, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=512)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as path:
        with open(f"{path}/config.json", "w") as f:
            json.dump({**QWEN3_SHAPE, "num_hidden_layers": args.layers}, f)
        llm = LLM(path, load_format="dummy", show_progress=False, max_num_seqs=max(args.batch),
                  max_model_len=args.prompt + args.tokens + 16)
        cases = {
            "plain": SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True),
            "penalties": SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True,
                                        repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.3),
            "bias+min_tokens": SamplingParams(max_tokens=args.tokens, temperature=0, min_tokens=args.tokens,
                                              logit_bias={5: 1.0, 6: -1.0}),
        }
        for batch in args.batch:
            prompts = [[(7 * i + j) % 50000 + 10 for j in range(args.prompt)] for i in range(batch)]
            llm.generate(prompts[:1], cases["plain"], use_tqdm=False)  # warm-up
            for name, params in cases.items():
                torch.cuda.synchronize()
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                torch.cuda.synchronize()
                elapsed = time.perf_counter() - start
                print(f"batch {batch:4d}  {name:16s} {1000 * elapsed / args.tokens:8.3f} ms/step "
                      f"(incl. prefill of {batch}x{args.prompt})", flush=True)


if __name__ == "__main__":
    main()
