"""Output processing: a sampled token joins its request, stops are checked, outputs are built.

The processor owns the registry of live requests and their detokenizers: a request
enters it when it is added and leaves it with its finished output.
"""
import logging
import time
from typing import Callable

from mempath.engine.detokenizer import SlowIncrementalDetokenizer, find_stop, incremental_detokenizer
from mempath.engine.request import Request
from mempath.engine.sampler import NOT_FINITE
from mempath.outputs import RequestOutput

log = logging.getLogger(__name__)


def not_finite_logits(position: int) -> str:
    return (f"the model's logits at output token {position} are not finite (NaN or +inf), so no token can be "
            f"sampled: its activations overflowed (under --dtype float16, try --dtype bfloat16) or its weights "
            f"hold NaN or inf (check the checkpoint)")


class ConstraintConflict(ValueError):
    """A request's own constraints leave no token to sample: its fault, named by ``param``, not the engine's."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def constraint_conflict(request: Request) -> ConstraintConflict | None:
    """Why a token the grammar refused was sampled, when the request's bad_words banned every token the
    grammar allowed (the sampler then had only -inf scores); None when they did not: the engine's bug."""
    allowed = request.grammar.allowed_tokens()
    generated = request.token_ids[request.num_prompt_tokens:-1]  # before the refused token
    banned = set()
    for word in request.params.bad_words_token_ids:
        rest = len(word) - 1
        if rest == 0 or (len(generated) >= rest and generated[-rest:] == word[:-1]):
            banned.add(word[-1])
    if not allowed or not allowed <= banned:
        return None
    return ConstraintConflict(f"bad_words rule out every token the request's structured output allows after "
                              f"{len(generated)} generated tokens; leave those words out or loosen the "
                              f"constraint", "bad_words")


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int,
                 finish: Callable[[Request, str], None]):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.finish = finish  # the scheduler's: frees the request's blocks
        self.requests: dict[str, Request] = {}
        self.detokenizers: dict[str, SlowIncrementalDetokenizer] = {}  # or its Fast subclass
        # Every token is reported (streaming callers); offline callers that only want
        # finished requests turn this off and save an output object per token.
        self.emit_progress = True
        # Finished outputs carry every token's logprobs; a caller that takes them from each
        # step's output (the server) turns this off, and none of them are kept.
        self.keep_all_logprobs = True
        self.num_generation_tokens = 0
        # Called with each request as it finishes, whatever ended it (the server's metrics).
        self.on_finish: Callable[[Request], None] | None = None

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        if self.tokenizer is not None:
            self.detokenizers[request.request_id] = incremental_detokenizer(
                self.tokenizer, request.params.skip_special_tokens)

    def emit(self, sampling: list[Request], token_ids: list[int], logprobs: list) -> list[RequestOutput]:
        """One step's tokens, a row per sampling request; a request whose bookkeeping fails fails alone."""
        outputs = []
        now = time.perf_counter()
        for request, token_id, row_logprobs in zip(sampling, token_ids, logprobs):
            if request.is_finished:
                continue  # finished or aborted while its step ran: the token is surplus
            if request.grammar is not None and request.grammar.error is not None:
                # The request's constraint cannot go on in this vocabulary: its fault, named as a field.
                kind = request.params.structured_outputs.kind
                request.error = f"structured_outputs.{kind}: {request.grammar.error}"
                request.error_param = "structured_outputs"
                self.finish(request, "error")
                outputs.append(self.finished(request))
                continue
            if token_id == NOT_FINITE:
                request.error = not_finite_logits(request.num_output_tokens + 1)
                log.error("request %s failed: %s", request.request_id, request.error)
                self.finish(request, "error")
                outputs.append(self.finished(request))
                continue
            try:
                output = self._append_token(request, token_id, row_logprobs, now)
            except ConstraintConflict as error:
                log.info("request %s failed: %s", request.request_id, error)
                request.error, request.error_param = str(error), error.param
                self.finish(request, "error")
                output = self.finished(request)
            except Exception as error:
                log.exception("request %s failed after its step", request.request_id)
                request.error = f"{type(error).__name__}: {error}"
                self.finish(request, "error")
                output = self.finished(request)
            if output is not None:
                outputs.append(output)
        return outputs

    def _append_token(self, request: Request, token_id: int, logprobs, now: float) -> RequestOutput | None:
        request.token_ids.append(token_id)
        self.num_generation_tokens += 1
        if request.first_token_time is None:
            request.first_token_time = now
        request.last_token_time = now
        if request.logprobs is not None:
            request.logprobs.append(logprobs)
        new_text, reason = "", "stop" if self._ends_on(request, token_id) else None
        detok = self.detokenizers.get(request.request_id)
        if detok is not None and reason is None:  # the token that ends a request adds no text, as in vLLM
            new_text = detok.delta(token_id)
            request.output_text += new_text
        if reason is None:
            reason, new_text = self._stop_reason(request, new_text)
        if reason is not None:
            if detok is not None and reason != "stop":
                tail = detok.flush()
                request.output_text += tail
                new_text += tail
                cut = self._match_stop(request, new_text) if tail else None  # the held-back text may end one
                if cut is not None:
                    reason, new_text = "stop", cut
            self.finish(request, reason)
        elif not self.emit_progress:
            return None
        return self.output(request, new_text, [token_id], finished=reason is not None)

    def _ends_on(self, request: Request, token_id: int) -> bool:
        """Whether this token ends the request by itself: its grammar's end, a stop id or EOS (the grammar
        advances by it)."""
        params = request.params
        if request.grammar is not None:
            try:
                request.grammar.accept(token_id)
            except ValueError:
                conflict = constraint_conflict(request)
                if conflict is not None:
                    raise conflict from None
                raise
            if request.grammar.finished:  # it took a stop token: the output is complete
                return True
        if request.num_output_tokens < params.min_tokens:  # EOS and stop ids are masked before min_tokens
            return False
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return True
        return not params.ignore_eos and token_id in self.eos_token_ids

    def _stop_reason(self, request: Request, new_text: str) -> tuple[str | None, str]:
        """Why the request ends with a token that did not end it by itself, if it does, and its new text cut
        at a stop string."""
        params = request.params
        if request.num_output_tokens < params.min_tokens:
            # Nothing but the length ends it before min_tokens.
            return ("length" if request.num_tokens >= self.max_model_len else None), new_text
        cut = self._match_stop(request, new_text)
        if cut is not None:
            return "stop", cut
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return "length", new_text
        return None, new_text

    @staticmethod
    def _match_stop(request: Request, new_text: str) -> str | None:
        """``new_text`` cut at a stop string it completes (the output text cut there too), or None. As vLLM's,
        stop strings count once more than min_tokens tokens are out."""
        params = request.params
        if not (params.stop and new_text and request.num_output_tokens > params.min_tokens):
            return None
        hit = find_stop(request.output_text, params.stop, len(new_text))
        if hit is None:
            return None
        index, stop = hit
        kept = len(request.output_text) - len(new_text)
        request.output_text = request.output_text[:index]
        request.stop_reason = stop
        return request.output_text[kept:] if index > kept else ""

    def finished(self, request: Request) -> RequestOutput:
        """The output of a request the scheduler has just finished (error, abort)."""
        return self.output(request, "", [], finished=True)

    def output(self, request: Request, new_text: str, new_token_ids: list[int],
               finished: bool) -> RequestOutput:
        if finished:
            request.finish_time = time.perf_counter()
            self.requests.pop(request.request_id, None)
            self.detokenizers.pop(request.request_id, None)
            if self.on_finish is not None:
                self.on_finish(request)
        ttft = None if request.first_token_time is None else request.first_token_time - request.arrival_time
        total = None if request.finish_time is None else request.finish_time - request.arrival_time
        logprobs = request.logprobs
        if logprobs is not None and not self.keep_all_logprobs:
            request.logprobs = []  # this output hands them over
        return RequestOutput.of_sample(
            request_id=request.request_id, prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=request.output_token_ids if finished else [],
            text=request.output_text, finished=finished, finish_reason=request.finish_reason,
            stop_reason=request.stop_reason, num_cached_tokens=request.num_cached_tokens or 0,
            logprobs=logprobs, error=request.error, error_param=request.error_param, time_to_first_token=ttft,
            total_time=total, new_text=new_text, new_token_ids=new_token_ids,
            num_output_tokens=request.num_output_tokens,
            prompt_logprobs=request.prompt_logprobs, prompt_logprob_ranks=request.prompt_logprob_ranks)
