"""Prompt logprobs: at each prompt token, its logprob under the logits of the position
before it, with the top-n and the token's rank, as vLLM returns them (None for the
first prompt token).

They are computed from a step's hidden states, chunk by chunk of a chunked prefill,
``prompt_logprob_rows`` positions at a time: the lm_head output of a slice, its float32
copy, the log-normaliser's work and the rank comparison are the only [positions, V]
temporaries, and only the top-n leave the device, so the peak stays under the
sampler's (``prompt_logprobs_peak_bytes`` in mempath.memory.formulas). Requests that
ask for them take nothing from the prefix cache or the KV tiers (every prompt
position must be computed; ``KVCacheManager._reusable_blocks``); a request preempted
by recompute does not record a position twice.
"""
import torch

from mempath.constants import SAMPLER_SORT_ROWS


def prompt_logprob_rows(max_num_seqs: int) -> int:
    """Positions per slice: as many as the sampler sorts at once, at most max_num_seqs."""
    return max(1, min(max_num_seqs, SAMPLER_SORT_ROWS))


def wanted_positions(batch) -> list[tuple[object, list[int], list[int]]]:
    """(request, flat token indices in the step, the prompt tokens they predict) per request.

    Position p of a prompt of P tokens predicts prompt token p + 1; positions recorded
    already (a recompute after preemption) are skipped.
    """
    wanted, offset = [], 0
    for request, num_new in zip(batch.requests, batch.num_new_tokens):
        done = request.prompt_logprobs
        if done is not None:
            start = request.num_computed_tokens
            first = max(start, len(done) - 1)
            last = min(start + num_new, request.num_prompt_tokens - 1)  # exclusive
            if first < last:
                wanted.append((request, [offset + p - start for p in range(first, last)],
                               request.prompt_token_ids[first + 1:last + 1]))
        offset += num_new
    return wanted


@torch.no_grad()
def record_prompt_logprobs(model, hidden: torch.Tensor, batch, rows_per_slice: int) -> None:
    """Append this step's prompt logprobs to each asking request (``request.prompt_logprobs``)."""
    for request, indices, targets in wanted_positions(batch):
        n = request.params.prompt_logprobs
        for start in range(0, len(indices), rows_per_slice):
            index = torch.tensor(indices[start:start + rows_per_slice], device=hidden.device)
            target = torch.tensor(targets[start:start + rows_per_slice], device=hidden.device)
            entries, ranks = _slice_logprobs(model.compute_logits(hidden.index_select(0, index)), target, n)
            request.prompt_logprobs.extend(entries)
            request.prompt_logprob_ranks.extend(ranks)


def _slice_logprobs(logits: torch.Tensor, target: torch.Tensor, n: int):
    scores = logits.float()
    del logits
    log_z = torch.logsumexp(scores, dim=-1, keepdim=True)
    actual = scores.gather(1, target[:, None])
    ranks = ((scores > actual).sum(dim=-1) + 1).tolist()
    actual = (actual - log_z).squeeze(1).tolist()
    top_ids, top_values = [], []
    if n:
        top = scores.topk(n, dim=-1)
        top_ids, top_values = top.indices.tolist(), (top.values - log_z).tolist()
    entries = []
    for i, token_id in enumerate(target.tolist()):
        entry = {token_id: actual[i]}
        if n:
            for t, v in zip(top_ids[i], top_values[i]):
                entry.setdefault(t, v)
        entries.append(entry)
    return entries, ranks
