"""Tiny random models of every supported architecture, built with transformers."""
import json
import os

import pytest
import torch

# litellm fetches a model price list at import; the tests run with no network (and must not wait on it).
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

ARCH_CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        "rope_theta": 500000.0}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4096}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "tie_word_embeddings": True}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0, "eos_token_id": 2}),
}
ARCHS = list(ARCH_CONFIGS)
# Mixture-of-experts models (mempath.model.moe), kept out of ARCHS: their decode steps cannot be
# captured in CUDA graphs yet, which tests over ARCHS (test_gpu_engine) require. 8 experts,
# 2 active; Qwen3-MoE with a dense middle layer (mlp_only_layers) and renormalised top-k,
# OLMoE with clip_qkv.
MOE_ARCH_CONFIGS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "head_dim": 32, "num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 48, "norm_topk_prob": True, "mlp_only_layers": [1]}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {
        "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 48}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {
        "num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 48, "clip_qkv": 4.0,
        "pad_token_id": 0}),
}
MOE_ARCHS = list(MOE_ARCH_CONFIGS)

TRAIN_TEXT = (
    "def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n"
    "The quick brown fox jumps over the lazy dog. Hello world! 0123456789\n"
    "class Engine:\n    def step(self):\n        return self.scheduler.schedule()\n"
) * 20


def build_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained on a few lines, saved with the model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TRAIN_TEXT], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}<s>assistant:{% endif %}")
    return fast


def make_model(path, arch: str = "llama", dtype=torch.float32, seed: int = 0, tokenizer: bool = True,
               shard_size=None, **overrides):
    import transformers
    config_name, model_name, arch_overrides = {**ARCH_CONFIGS, **MOE_ARCH_CONFIGS}[arch]
    kwargs = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2)
    kwargs.update(arch_overrides)
    kwargs.update(overrides)
    config = getattr(transformers, config_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(dtype).eval()
    # Random init leaves norms at 1 and biases at 0; perturb them so those paths are tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    save_kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(path, **save_kwargs)
    if tokenizer:
        build_tokenizer(config.vocab_size).save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """model_factory(arch, **overrides) -> (path, hf_model); built once per argument set."""
    cache = {}

    def factory(arch: str = "llama", **overrides):
        key = (arch, json.dumps(overrides, sort_keys=True, default=str))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"{arch}-model")
            cache[key] = (str(path), make_model(path, arch, **overrides))
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def two_models(model_factory):
    """Two models to serve together (tests/test_multi_model*.py): a Llama and a Qwen3 of another
    vocabulary and twice the KV per token (in a shared page pool the Llama's blocks hold 32 tokens)."""
    llama, _ = model_factory("llama")
    qwen, _ = model_factory("qwen3", vocab_size=384, seed=1)
    return llama, qwen


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(autouse=True)
def _quiet_threads():
    torch.set_num_threads(min(2, os.cpu_count() or 1))


def release_cuda() -> None:
    """Free what dropped engines held on the device: an engine's budget is the device's less
    what the rest of the process holds, so one left behind starves the next one's KV cache."""
    import gc
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _release_cuda_after_each_test():
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        release_cuda()
