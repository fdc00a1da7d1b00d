"""A one-layer Llama built by hand to find a needle in a long context: the retrieval check of
the fp8 KV cache (#20; tests/test_fp8_kv_retrieval.py on the CPU, benchmarks/bench_fp8_kv.py
on a GPU at 4k-32k tokens).

Random weights cannot retrieve anything and the shipped model was trained on 1,024
positions, so the model is written down instead. Its vocabulary:

- *pair* tokens ``pair(key, value)``: "this key holds this value";
- *query* tokens ``query(key)``: "which value does this key hold?";
- *value* tokens ``value(v)``: the answer;
- *filler* tokens: text that holds no key.

A prompt is a haystack of filler tokens and distractor pairs (every key but the asked one),
the needle ``pair(key, v)`` at a random depth, then ``query(key)``; the greedy next token is
the answer, ``value(v)`` when the model finds the needle. One attention head does the work:
its query is the asked key's code, every pair token's K is its key's code (random unit
vectors scaled to ``key_norm``, so K looks like a real model's: entries of a few units, the
range an fp8 cache with scale 1.0 stores), its V the value's code, and the LM head reads the
value codes back. Keys are random, so a distractor whose key lies close to the asked one
competes for the attention: how often the needle wins depends on ``sharpness`` (the
needle's score), the number of distractors (the length), and on the precision of the cached
K and V, which is what an fp8 cache changes. The codes sit in the rotary dimensions that
turn least (rope_theta 1e12: at most 0.033 rad over 32k positions), so a score depends on
what the tokens are, not where.
"""
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 256, 4, 2, 64
INTERMEDIATE = 64  # the MLP's weights are zero: its output is too
ROPE_THETA = 1e12
# Head dimensions whose rotary frequency is theta^(-d/32) <= 1e-6 (d in 16..31 and their
# rotate_half partners): where the codes live.
STILL_DIMS = list(range(16, 32)) + list(range(48, 64))
CODE_DIM = len(STILL_DIMS)
KEY_SLOT, QUERY_SLOT, VALUE_SLOT = slice(0, 32), slice(32, 64), slice(64, 96)
BIAS_DIM, PAD_DIM = 96, HIDDEN - 1


@dataclass(frozen=True)
class NeedleSpec:
    num_keys: int = 256
    num_values: int = 32
    num_fillers: int = 256
    sharpness: float = 8.0  # the needle's attention score (q . k / sqrt(head_dim))
    key_norm: float = 8.0
    value_norm: float = 4.0
    filler_key_norm: float = 2.0
    distractor_fraction: float = 0.5  # of the haystack's tokens
    max_position_embeddings: int = 32768 + 64
    seed: int = 0

    # Token ids: 0 is never produced (its LM-head row is negative like every non-answer's).
    def filler(self, i: int) -> int:
        return 1 + i

    def query(self, key: int) -> int:
        return 1 + self.num_fillers + key

    def value(self, v: int) -> int:
        return 1 + self.num_fillers + self.num_keys + v

    def pair(self, key: int, v: int) -> int:
        return 1 + self.num_fillers + self.num_keys + self.num_values + key * self.num_values + v

    @property
    def vocab_size(self) -> int:
        return self.pair(self.num_keys - 1, self.num_values - 1) + 1


def _unit_codes(n: int, gen: torch.Generator) -> torch.Tensor:
    codes = torch.randn(n, CODE_DIM, generator=gen, dtype=torch.float64)
    return codes / codes.norm(dim=1, keepdim=True)


def needle_weights(spec: NeedleSpec) -> dict[str, torch.Tensor]:
    """The model's tensors under transformers' Llama names (float64; the caller casts)."""
    gen = torch.Generator().manual_seed(spec.seed)
    keys, values = _unit_codes(spec.num_keys, gen), _unit_codes(spec.num_values, gen)
    fillers = _unit_codes(spec.num_fillers, gen) * spec.filler_key_norm
    emb = torch.zeros(spec.vocab_size, HIDDEN, dtype=torch.float64)
    emb[0, BIAS_DIM] = 1.0
    for i in range(spec.num_fillers):
        emb[spec.filler(i), KEY_SLOT] = fillers[i]
        emb[spec.filler(i), BIAS_DIM] = 1.0
    for key in range(spec.num_keys):
        emb[spec.query(key), QUERY_SLOT] = keys[key] * spec.key_norm
        emb[spec.query(key), BIAS_DIM] = 1.0
    for v in range(spec.num_values):
        emb[spec.value(v), BIAS_DIM] = 1.0
    for key in range(spec.num_keys):
        for v in range(spec.num_values):
            row = spec.pair(key, v)
            emb[row, KEY_SLOT] = keys[key] * spec.key_norm
            emb[row, VALUE_SLOT] = values[v] * spec.value_norm
            emb[row, BIAS_DIM] = 1.0
    # Every row gets RMS 1 (the pad dimension takes up the rest), so the RMSNorm before the
    # attention passes the codes through unscaled and the scores are what the spec says.
    rest = (emb[:, :PAD_DIM] ** 2).sum(dim=1)
    assert float(rest.max()) < HIDDEN, "codes too large for RMS 1: lower key_norm or value_norm"
    emb[:, PAD_DIM] = (HIDDEN - rest).sqrt()

    q = torch.zeros(HEADS * HEAD_DIM, HIDDEN, dtype=torch.float64)
    k = torch.zeros(KV_HEADS * HEAD_DIM, HIDDEN, dtype=torch.float64)
    v = torch.zeros(KV_HEADS * HEAD_DIM, HIDDEN, dtype=torch.float64)
    o = torch.zeros(HIDDEN, HEADS * HEAD_DIM, dtype=torch.float64)
    # score = (alpha * key_norm * c_q) . (key_norm * c_k) / sqrt(head_dim): sharpness at c_q = c_k.
    alpha = spec.sharpness * math.sqrt(HEAD_DIM) / spec.key_norm ** 2
    for j, d in enumerate(STILL_DIMS):  # head 0 asks, KV head 0 answers; the others are zero
        q[d, QUERY_SLOT.start + j] = alpha
        k[d, KEY_SLOT.start + j] = 1.0
    for j in range(CODE_DIM):
        v[j, VALUE_SLOT.start + j] = 1.0
        o[VALUE_SLOT.start + j, j] = 1.0
    lm_head = torch.zeros(spec.vocab_size, HIDDEN, dtype=torch.float64)
    lm_head[:, BIAS_DIM] = -4.0
    for value in range(spec.num_values):
        row = spec.value(value)
        lm_head[row, BIAS_DIM] = 0.0
        lm_head[row, VALUE_SLOT] = values[value] * 64.0
    return {
        "model.embed_tokens.weight": emb, "lm_head.weight": lm_head,
        "model.norm.weight": torch.ones(HIDDEN, dtype=torch.float64),
        "model.layers.0.input_layernorm.weight": torch.ones(HIDDEN, dtype=torch.float64),
        "model.layers.0.post_attention_layernorm.weight": torch.ones(HIDDEN, dtype=torch.float64),
        "model.layers.0.self_attn.q_proj.weight": q, "model.layers.0.self_attn.k_proj.weight": k,
        "model.layers.0.self_attn.v_proj.weight": v, "model.layers.0.self_attn.o_proj.weight": o,
        "model.layers.0.mlp.gate_proj.weight": torch.zeros(INTERMEDIATE, HIDDEN, dtype=torch.float64),
        "model.layers.0.mlp.up_proj.weight": torch.zeros(INTERMEDIATE, HIDDEN, dtype=torch.float64),
        "model.layers.0.mlp.down_proj.weight": torch.zeros(HIDDEN, INTERMEDIATE, dtype=torch.float64),
    }


def needle_config(spec: NeedleSpec) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": spec.vocab_size,
        "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "num_hidden_layers": 1,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "max_position_embeddings": spec.max_position_embeddings, "rope_theta": ROPE_THETA,
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 0, "torch_dtype": "float32",
        "needle_spec": spec.__dict__,
    }


def build_needle_model(path: str | Path, spec: NeedleSpec = NeedleSpec()) -> Path:
    """config.json and model.safetensors (float32) of the needle model in ``path``."""
    from safetensors.torch import save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(needle_config(spec), indent=1))
    tensors = {name: t.to(torch.float32).contiguous() for name, t in needle_weights(spec).items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def needle_prompts(spec: NeedleSpec, length: int, count: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """``count`` prompts of ``length`` tokens (the query included) and each one's answer token."""
    gen = torch.Generator().manual_seed(seed)
    haystack_len = length - 2
    prompts = []
    for _ in range(count):
        key = int(torch.randint(spec.num_keys, (), generator=gen))
        answer = int(torch.randint(spec.num_values, (), generator=gen))
        fillers = torch.randint(spec.num_fillers, (haystack_len,), generator=gen) + spec.filler(0)
        others = torch.randint(spec.num_keys - 1, (haystack_len,), generator=gen)
        others = others + (others >= key).long()  # every key but the asked one
        distractors = others * spec.num_values + torch.randint(spec.num_values, (haystack_len,), generator=gen) \
            + spec.pair(0, 0)
        is_pair = torch.rand(haystack_len, generator=gen) < spec.distractor_fraction
        haystack = torch.where(is_pair, distractors, fillers).tolist()
        depth = int(torch.randint(haystack_len + 1, (), generator=gen))
        ids = haystack[:depth] + [spec.pair(key, answer)] + haystack[depth:] + [spec.query(key)]
        prompts.append((ids, spec.value(answer)))
    return prompts


def accuracy(answers: list[int], prompts: list[tuple[list[int], int]]) -> float:
    return sum(a == expected for a, (_, expected) in zip(answers, prompts)) / len(prompts)
