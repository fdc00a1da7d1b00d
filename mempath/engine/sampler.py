"""Batched sampling on the device: greedy, temperature, top-k, top-p, min-p, seeds.

Random rows are drawn with the exponential race (argmax of p / q with
q ~ Exp(1)), which samples exactly from p. A request with its own seed draws its
q row from its own generator, so its tokens do not depend on its batch mates;
the rest share one generator for a single batched draw.
"""
from dataclasses import dataclass

import torch

from mempath.sampling import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: {token_id: logprob} for the sampled token and the top-n, or None.
    logprobs: list[dict[int, float] | None]


class Sampler:
    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def make_generator(self, seed: int) -> torch.Generator:
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        return generator

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> SamplerOutput:
        logits = logits.float()
        num_rows = logits.shape[0]
        want_logprobs = [p.logprobs for p in params]
        raw_logprobs = None
        if any(n is not None for n in want_logprobs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)

        greedy_tokens = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            tokens = greedy_tokens
        else:
            tokens = self._sample(logits, params, generators, greedy_tokens)

        token_list = tokens.tolist()
        logprobs: list[dict[int, float] | None] = [None] * num_rows
        if raw_logprobs is not None:
            max_n = max(n or 0 for n in want_logprobs)
            top_values, top_ids = raw_logprobs.topk(max(max_n, 1), dim=-1)
            chosen = raw_logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
            top_values, top_ids = top_values.tolist(), top_ids.tolist()
            for row, n in enumerate(want_logprobs):
                if n is None:
                    continue
                entry = {token_list[row]: chosen[row]}
                for token_id, value in zip(top_ids[row][:n], top_values[row][:n]):
                    entry.setdefault(token_id, value)
                logprobs[row] = entry
        return SamplerOutput(token_list, logprobs)

    def _sample(self, logits, params, generators, greedy_tokens):
        device = logits.device
        temperature = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params],
                                   device=device, dtype=torch.float32)
        logits = logits / temperature[:, None]
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            logits = apply_top_k_top_p(logits, top_k, top_p)
        min_p = [p.min_p for p in params]
        if any(m > 0 for m in min_p):
            probs = torch.softmax(logits, dim=-1)
            threshold = torch.tensor(min_p, device=device)[:, None] * probs.max(dim=-1, keepdim=True).values
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs)
        noise.exponential_(generator=self.generator)
        for row, generator in enumerate(generators):
            if generator is not None:
                noise[row].exponential_(generator=generator)
        sampled = (probs / noise).argmax(dim=-1)
        greedy = torch.tensor([p.greedy for p in params], device=device)
        return torch.where(greedy, greedy_tokens, sampled)


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p nucleus (k=0, p=1: off)."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.tensor([kk if 0 < kk < vocab else vocab for kk in top_k], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    remove = ranks >= k[:, None]
    p = torch.tensor(top_p, device=logits.device, dtype=torch.float32)
    probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    # Drop a token when the tokens ranked above it already cover p; the top one always stays.
    mass_before = probs.cumsum(dim=-1) - probs
    remove |= mass_before >= p[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
