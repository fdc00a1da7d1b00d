"""A request as the engine tracks it: its tokens, its KV blocks, its progress.

Its KV fields (``block_table``, ``block_hashes``, ``num_registered_blocks``,
``swapped``, ``num_draft_computed``) are written by the KV manager (``mempath.kv.manager``) only.
"""
import enum
import time

import torch

from mempath.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    LOADING = "loading"  # admitted; its KV blocks are on their way from the host or disk tier
    FINISHED = "finished"


class Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, arrival_time: float | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.token_ids = list(prompt_token_ids)  # prompt + generated so far
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens: int | None = None  # prefix-cache hit at first admission
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # of each full block of token_ids
        self.num_registered_blocks = 0  # leading blocks already in the prefix cache
        self.num_draft_computed = 0  # tokens whose draft-model KV is in the cache (speculation)
        self.num_preemptions = 0
        # Set while swapped out: the host-tier blocks holding its KV, and how many tokens they hold.
        self.swapped: tuple[list[int], int] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        self.output_text = ""
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.generator: torch.Generator | None = None
        self.arrival_time = arrival_time if arrival_time is not None else time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")
