"""The advice of a step's out-of-memory error: every branch, and the advice really fits.

A step needs the planner's activations and logits (``activation_peak_bytes +
logits_bytes``); the explanation offers the largest settings whose planned step fits
in what was free. Each case below is checked against ``plan_memory`` itself at the
settings it advises, so advice that would fail again is caught.
"""
import re
from pathlib import Path

import pytest

from mempath.config import EngineConfig
from mempath.memory.ledger import Ledger
from mempath.memory.oom import explain_oom
from mempath.tools.plan import plan_memory

CONFIGS = Path(__file__).parent / "data" / "configs"
MiB = 1 << 20
SEQS, TOKENS, MAX_LEN = 256, 8192, 8192


def step_bytes(name: str, seqs: int, tokens: int, dtype: str = "bfloat16") -> int:
    plan = plan_memory(CONFIGS / f"{name}.json", dtype=dtype, max_model_len=MAX_LEN,
                       max_num_seqs=seqs, max_num_batched_tokens=tokens)
    return plan.activation_peak_bytes + plan.logits_bytes


def explain_step(name: str, free: int, requested: int | None = None, dtype: str = "bfloat16") -> str:
    config = EngineConfig(model=str(CONFIGS / f"{name}.json"), max_num_seqs=SEQS,
                          max_num_batched_tokens=TOKENS, max_model_len=MAX_LEN)
    return explain_oom("step", Ledger(), requested, free, config, dtype=dtype)


def advised(text: str) -> tuple[int, int]:
    """(max-num-seqs, max-num-batched-tokens) of the first fix that changes the step size."""
    fixes = text.split("what would have fitted:")[1]
    both = re.search(r"--max-num-seqs (\d+) --max-num-batched-tokens (\d+)", fixes)
    if both:
        return int(both.group(1)), int(both.group(2))
    tokens = re.search(r"--max-num-batched-tokens (\d+)", fixes.split("\n", 2)[2])
    assert tokens, text
    return SEQS, int(tokens.group(1))


def budget_of(name: str, free: int, requested: int | None) -> int:
    # A failing allocation larger than the plan scales the planner's figures down.
    planned = step_bytes(name, SEQS, TOKENS)
    return free * planned // max(planned, requested or 0)


# (free, failing allocation) per branch, for a 128k vocabulary (Llama-3.1-8B) and a 152k one
# with a much smaller hidden size (Qwen3-0.6B), where the logit rows weigh the most.
FEWER_TOKENS = [("llama-3.1-8b", 367 * MiB, None), ("qwen3-0.6b", 435 * MiB, None),
                ("llama-3.1-8b", 900 * MiB, 2 << 30)]
ROWS_OVERFLOW = [("llama-3.1-8b", 314 * MiB, None), ("llama-3.1-8b", 122 * MiB, None),
                 ("llama-3.1-8b", 12 * MiB, None), ("llama-3.1-8b", 12 * MiB, 2 << 30),
                 ("qwen3-0.6b", 14 * MiB, None), ("qwen3-0.6b", 371 * MiB, None),
                 ("qwen3-0.6b", 145 * MiB, 1 << 30)]
NOT_ONE_TOKEN = [("llama-3.1-8b", 1384960, None), ("qwen3-0.6b", 1543936, None),
                 ("llama-3.1-8b", 3 * MiB, None), ("qwen3-0.6b", 1 * MiB, None),
                 ("llama-3.1-8b", 6 * MiB, 2 << 30)]


@pytest.mark.parametrize("name,free,requested", FEWER_TOKENS)
def test_fewer_tokens_per_step_fit_and_keep_every_sequence(name, free, requested):
    text = explain_step(name, free, requested)
    seqs, tokens = advised(text)
    assert seqs == SEQS and SEQS <= tokens < TOKENS, text  # every running sequence still decodes
    assert step_bytes(name, seqs, tokens) <= budget_of(name, free, requested), text
    assert step_bytes(name, seqs, tokens + 1) > budget_of(name, free, requested), text  # the largest that fits


@pytest.mark.parametrize("name,free,requested", ROWS_OVERFLOW)
def test_logit_rows_alone_overflow_gives_fewer_sequences_that_fit(name, free, requested):
    """Even one token per sequence does not fit: fewer sequences, each with at least one token."""
    text = explain_step(name, free, requested)
    assert "logit rows alone take" in text, text
    seqs, tokens = advised(text)
    assert 1 <= seqs < SEQS and seqs <= tokens <= TOKENS, text
    assert step_bytes(name, seqs, tokens) <= budget_of(name, free, requested), text
    assert step_bytes(name, seqs + 1, seqs + 1) > budget_of(name, free, requested), text


@pytest.mark.parametrize("name,free,requested", NOT_ONE_TOKEN)
def test_not_even_one_token_fits(name, free, requested):
    assert step_bytes(name, 1, 1) > budget_of(name, free, requested)  # the case is what it says
    text = explain_step(name, free, requested)
    assert "not even one token's activations and logits row" in text, text
    assert "--max-num-batched-tokens" not in text.split("what would have fitted:")[1].split("\n", 2)[2]
    one = re.search(r"row \(([^)]+)\) fit", text).group(1)
    assert one == _format(step_bytes(name, 1, 1)), text  # the figure is the planner's one-token step
    assert "--gpu-memory-utilization" in text
    assert "--dtype bfloat16" not in text  # it runs bfloat16 already


def test_not_even_one_token_in_float32_offers_bfloat16():
    free = step_bytes("qwen3-0.6b", 1, 1, "float32") - 1
    text = explain_step("qwen3-0.6b", free, dtype="float32")
    assert "not even one token's" in text and "or use --dtype bfloat16" in text


def test_fewer_sequences_line_fits_too():
    """The alternative 'or --max-num-seqs N' keeps the token budget: N rows at that budget fit."""
    text = explain_step("qwen3-0.6b", 435 * MiB)
    seqs = int(re.search(r"or --max-num-seqs (\d+)", text).group(1))
    assert 1 <= seqs < SEQS
    assert step_bytes("qwen3-0.6b", seqs, TOKENS) <= 435 * MiB < step_bytes("qwen3-0.6b", seqs + 1, TOKENS)


def _format(n: int) -> str:
    from mempath.memory.ledger import format_bytes
    return format_bytes(n)
