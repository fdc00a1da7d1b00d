"""LLM: the offline API. generate() and chat() over an LLMEngine."""
import itertools
import logging

from tqdm.auto import tqdm

from mempath.config import EngineConfig
from mempath.engine.engine import LLMEngine
from mempath.outputs import RequestOutput
from mempath.sampling import SamplingParams

log = logging.getLogger(__name__)


class LLM:
    """``LLM(model_dir, **engine_options)``; options are EngineConfig's fields."""

    def __init__(self, model: str | None = None, show_progress: bool = True, **engine_options):
        if model is None:
            from mempath.assets import default_model_path
            model = default_model_path()
        self.config = EngineConfig.from_kwargs(model, **engine_options)
        self.engine = LLMEngine(self.config, show_progress=show_progress)
        self.engine.outputs.emit_progress = False  # generate() only collects finished requests
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for one prompt or a list (strings or token-id lists), in input order.

        A bad request in a list comes back finished with ``finish_reason == "error"``
        and the message in ``error``, while the others run; a bad single prompt
        raises ValueError. With ``n > 1`` each prompt yields n consecutive outputs.
        """
        single = isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        prompt_list = [prompts] if single else list(prompts)
        if params is None:
            params = SamplingParams()
        param_list = params if isinstance(params, list) else [params] * len(prompt_list)
        if len(param_list) != len(prompt_list):
            raise ValueError(f"got {len(prompt_list)} prompts but {len(param_list)} SamplingParams")

        order: list[str] = []
        results: dict[str, RequestOutput] = {}
        for prompt, p in zip(prompt_list, param_list):
            for index in range(p.n):
                request_id = f"gen-{next(self._ids)}"
                order.append(request_id)
                sample_params = p
                if p.n > 1:
                    seed = None if p.seed is None else p.seed + index
                    sample_params = SamplingParams(**{**p.__dict__, "n": 1, "seed": seed})
                try:
                    self.engine.add_request(prompt, sample_params, request_id)
                except ValueError as error:
                    if single:
                        raise
                    results[request_id] = RequestOutput(
                        request_id, prompt if isinstance(prompt, str) else None,
                        [] if isinstance(prompt, str) else list(prompt), [], "", True,
                        finish_reason="error", error=str(error))
        bar = tqdm(total=len(order), desc="Generating", unit="req",
                   disable=not use_tqdm or len(order) < 2)
        bar.update(len(results))
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    results[output.request_id] = output
                    bar.update(1)
        bar.close()
        return [results[i] for i in order]

    def chat(self, messages, params: SamplingParams | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"{self.config.model} has no chat template in its tokenizer_config.json")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(
            conv, tokenize=False, add_generation_prompt=add_generation_prompt) for conv in conversations]
        # The template already contains the special tokens: tokenize without adding more.
        token_lists = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        outputs = self.generate(token_lists, params, use_tqdm) if len(token_lists) > 1 else \
            self.generate(token_lists[0], params, use_tqdm)
        for output, text in zip(outputs, prompts):
            output.prompt = text
        return outputs

    def stats(self) -> dict:
        return self.engine.stats()
