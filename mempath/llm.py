"""LLM: the offline API. generate() and chat() over an LLMEngine."""
import itertools
import logging

from tqdm.auto import tqdm

from mempath.config import EngineConfig
from mempath.engine.engine import LLMEngine
from mempath.generation_config import generation_defaults
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
        self.sampling_defaults = generation_defaults(model, self.config.generation_config)  # before the load
        self.engine = LLMEngine(self.config, show_progress=show_progress)
        self.engine.outputs.emit_progress = False  # generate() only collects finished requests
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the generation config's defaults (--generation-config), as vLLM's."""
        return SamplingParams(**self.sampling_defaults)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for one prompt or a list (strings or token-id lists): one RequestOutput per prompt.

        As in vLLM, each output holds its ``n`` samples in ``outputs`` (``out.outputs[i].text``);
        ``out.text`` is the first sample's. A bad request in a list comes back finished with
        ``finish_reason == "error"`` and the message in ``error``, while the others run; a
        bad single prompt raises ValueError. ``sampling_params`` (vLLM's name): one for all
        prompts or one each; None: get_default_sampling_params().
        """
        single = isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        prompt_list = [prompts] if single else list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        param_list = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompt_list)
        if len(param_list) != len(prompt_list):
            raise ValueError(f"got {len(prompt_list)} prompts but {len(param_list)} SamplingParams")
        groups = [self._add_samples(prompt, p, single) for prompt, p in zip(prompt_list, param_list)]
        results = {r.request_id: r for group in groups for r in group if isinstance(r, RequestOutput)}
        total = sum(len(group) for group in groups)
        bar = tqdm(total=total, desc="Generating", unit="req", disable=not use_tqdm or total < 2)
        bar.update(len(results))
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    results[output.request_id] = output
                    bar.update(1)
        bar.close()
        return [RequestOutput.grouped([results[r if isinstance(r, str) else r.request_id] for r in group])
                for group in groups]

    def _add_samples(self, prompt, params: SamplingParams, single: bool) -> list:
        """Add one engine request per sample; a refused one is its finished error output instead of its id."""
        group = []
        for index in range(params.n):
            request_id = f"gen-{next(self._ids)}"
            sample_params = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + index
                sample_params = SamplingParams(**{**params.__dict__, "n": 1, "seed": seed})
            try:
                self.engine.add_request(prompt, sample_params, request_id)
                group.append(request_id)
            except ValueError as error:
                if single:
                    raise
                group.append(RequestOutput.of_sample(
                    request_id=request_id, prompt=prompt if isinstance(prompt, str) else None,
                    prompt_token_ids=[] if isinstance(prompt, str) else list(prompt), token_ids=[], text="",
                    finished=True, finish_reason="error", error=str(error)))
        return group

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template: str | None = None) -> list[RequestOutput]:
        """Apply the chat template (``chat_template``, else the tokenizer's) to one conversation or a list."""
        if self.tokenizer is None:
            raise ValueError(f"{self.config.model} has no tokenizer")
        if not (chat_template or getattr(self.tokenizer, "chat_template", None)):
            raise ValueError(f"{self.config.model} has no chat template in its tokenizer_config.json")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(
            conv, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=chat_template)
            for conv in conversations]
        # The template already contains the special tokens: tokenize without adding more.
        token_lists = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        outputs = self.generate(token_lists, sampling_params, use_tqdm) if len(token_lists) > 1 else \
            self.generate(token_lists[0], sampling_params, use_tqdm)
        for output, text in zip(outputs, prompts):
            output.prompt = text
        return outputs

    def stats(self) -> dict:
        return self.engine.stats()
