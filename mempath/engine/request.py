"""A request as the engine tracks it: its tokens, its KV blocks, its progress.

Its KV fields (``block_table``, ``block_hashes``, ``num_registered_blocks``,
``swapped``, ``num_draft_computed``) are written by the KV manager (``mempath.kv.manager``) only.

Its timestamps (``time.perf_counter``) are what the server's latency histograms read:
arrival, first scheduled (queue time ends), first and last token, finish.
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
        self.scheduled_time: float | None = None  # first admitted: set by the status setter
        self._status = RequestStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens: int | None = None  # prefix-cache hit at first admission
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # of each full block of token_ids
        self.num_registered_blocks = 0  # leading blocks already in the prefix cache
        self.num_draft_computed = 0  # tokens whose draft-model KV is in the cache (speculation)
        self.num_draft_marked_blocks = 0  # leading blocks flagged draft-ready (since the table was last replaced)
        self.num_preemptions = 0
        # Set while swapped out: the host-tier blocks holding its KV, and how many tokens they hold.
        self.swapped: tuple[list[int], int] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        self.error_param: str | None = None  # the request field an error is about: the client's fault
        self.output_text = ""
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        # Per prompt token, from the logits before it: {token_id: logprob} for the actual token and
        # the top-n (None for the first token), and the actual token's rank; filled per chunk.
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.prompt_logprob_ranks: list[int | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        # Masked while fewer than params.min_tokens are out: EOS and stop_token_ids (the engine's).
        self.min_tokens_stop_ids: list[int] = []
        # token_ids as a numpy array, filled up to ``token_array_len``, for the penalties' per-step
        # history copy (mempath.engine.penalties.host_history): tokens are only ever appended.
        self.token_array = None
        self.token_array_len = 0
        # Whether sampling edits its logits (mempath.engine.penalties); fixed for its life.
        self.adjusts_logits = (params.needs_history or bool(params.logit_bias) or params.min_tokens > 0
                               or bool(params.bad_words_token_ids))
        self.generator: torch.Generator | None = None
        self.grammar = None  # its structured-output matcher (mempath.structured.grammar.RequestGrammar)
        self.arrival_time = arrival_time if arrival_time is not None else time.perf_counter()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finish_time: float | None = None

    @property
    def status(self) -> RequestStatus:
        return self._status

    @status.setter
    def status(self, value: RequestStatus) -> None:
        # Recorded here rather than at each place that admits a request (running, or
        # loading its KV from a tier): the queue time ends the first time either happens,
        # whichever scheduler path got it there.
        if self.scheduled_time is None and value in (RequestStatus.RUNNING, RequestStatus.LOADING):
            self.scheduled_time = time.perf_counter()
        self._status = value

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
