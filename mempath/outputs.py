"""What the engine hands back for a request, in vLLM's shape: a RequestOutput holding CompletionOutputs.

`LLM.generate` returns one RequestOutput per prompt whose ``outputs`` hold its ``n``
samples (vLLM's ``out.outputs[0].text``). ``text``, ``token_ids``, ``finish_reason``,
``stop_reason``, ``logprobs`` and ``cumulative_logprob`` on the RequestOutput itself are
its first sample's, so the common ``n == 1`` case reads ``out.text``. The engine's
streaming outputs (``LLMEngine.step``) are one sample each, with the tokens that step
added in ``new_text`` / ``new_token_ids``. docs/vllm.md maps the fields to vLLM's.
"""
from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One sample of a request (vLLM's CompletionOutput)."""
    index: int
    text: str
    token_ids: list[int]  # all generated tokens once finished; while streaming, see new_token_ids
    logprobs: list[dict[int, float]] | None = None  # per token: top-n token id -> logprob
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: str | int | None = None  # the stop string or token id that ended it

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the sampled tokens' logprobs; None unless logprobs were requested (as vLLM)."""
        if self.logprobs is None or len(self.logprobs) != len(self.token_ids):
            return None
        return sum(entry[token_id] for token_id, entry in zip(self.token_ids, self.logprobs))


@dataclass
class RequestMetrics:
    """Timings of a request, seconds from its arrival."""
    time_to_first_token: float | None
    total_time: float | None
    num_cached_tokens: int


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None
    time_to_first_token: float | None = None  # seconds from arrival (the first sample's, for n > 1)
    total_time: float | None = None  # seconds from arrival to finish (the last sample's)
    new_text: str = ""  # streaming: text added since the previous output for this request
    new_token_ids: list[int] = field(default_factory=list)
    num_output_tokens: int = 0
    # With SamplingParams.prompt_logprobs: per prompt token {token_id: logprob} (None for the
    # first), and the prompt token's rank among the vocabulary (1: the most likely).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None
    # The request field that made it fail (its bad_words left its grammar no token): a 400 on the server.
    error_param: str | None = None

    @classmethod
    def of_sample(cls, *, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                  token_ids: list[int], text: str, finished: bool, finish_reason: str | None = None,
                  stop_reason: str | int | None = None, logprobs=None, **fields) -> "RequestOutput":
        """The output of one engine request: one sample, index 0."""
        sample = CompletionOutput(0, text, token_ids, logprobs, finish_reason, stop_reason)
        return cls(request_id, prompt, prompt_token_ids, [sample], finished, **fields)

    @classmethod
    def grouped(cls, samples: list["RequestOutput"]) -> "RequestOutput":
        """The n samples of one prompt (each one engine request) as one output, indexed 0..n-1."""
        first = samples[0]
        if len(samples) == 1:
            return first
        outputs = [CompletionOutput(i, s.text, s.token_ids, s.logprobs, s.finish_reason, s.stop_reason)
                   for i, s in enumerate(samples)]
        totals = [s.total_time for s in samples if s.total_time is not None]
        return cls(first.request_id, first.prompt, first.prompt_token_ids, outputs,
                   all(s.finished for s in samples), first.num_cached_tokens,
                   next((s.error for s in samples if s.error), None), first.time_to_first_token,
                   max(totals) if totals else None,
                   num_output_tokens=sum(s.num_output_tokens for s in samples),
                   prompt_logprobs=first.prompt_logprobs, prompt_logprob_ranks=first.prompt_logprob_ranks)

    # The first sample's fields, so that n == 1 reads as out.text (vLLM: out.outputs[0].text).
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        return self.outputs[0].stop_reason

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs

    @property
    def cumulative_logprob(self) -> float | None:
        return self.outputs[0].cumulative_logprob

    @property
    def metrics(self) -> RequestMetrics:
        return RequestMetrics(self.time_to_first_token, self.total_time, self.num_cached_tokens)
