"""What the engine hands back for a request: each step's new tokens, and the finished result."""
from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]  # all generated tokens once finished; while streaming, see new_token_ids
    text: str
    finished: bool
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    num_cached_tokens: int = 0
    logprobs: list[dict[int, float]] | None = None
    error: str | None = None
    time_to_first_token: float | None = None  # seconds from arrival
    total_time: float | None = None  # seconds from arrival to finish
    new_text: str = ""  # text added since the previous output for this request
    new_token_ids: list[int] = field(default_factory=list)
    num_output_tokens: int = 0
    # With SamplingParams.prompt_logprobs: per prompt token {token_id: logprob} (None for the
    # first), and the prompt token's rank among the vocabulary (1: the most likely).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None
