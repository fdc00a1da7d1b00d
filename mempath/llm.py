"""LLM: the offline API. generate() and chat() over an LLMEngine."""
import itertools
import logging
import numbers

from tqdm.auto import tqdm

from mempath.config import EngineConfig
from mempath.constants import as_kind
from mempath.engine.engine import LLMEngine
from mempath.engine.input import PROMPT_FIELDS, check_text, join_text_parts
from mempath.generation_config import generation_defaults
from mempath.outputs import RequestOutput
from mempath.sampling import SamplingParams

log = logging.getLogger(__name__)


def is_one_prompt(prompts) -> bool:
    """A text, a token-id list or a vLLM prompt dict, rather than a list of them."""
    return isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and bool(prompts)
                                                 and isinstance(prompts[0], numbers.Integral))


def check_flag(name: str, value) -> bool:
    """``value`` as a bool (numpy's too); ValueError in one line for anything else, which a truthiness
    test would have taken (the text "false" switches a flag on)."""
    flag = as_kind(value, bool)
    if flag is None:
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return flag


def progress_option(use_tqdm):
    """``use_tqdm`` as vLLM takes it: a flag (numpy's too), or a callable that makes the bar
    (``functools.partial(tqdm, leave=False)``, say), returned as it is; ValueError in one line otherwise."""
    if callable(use_tqdm):
        return use_tqdm
    flag = as_kind(use_tqdm, bool)
    if flag is None:
        raise ValueError(f"use_tqdm must be true, false or a callable that makes the progress bar (e.g. "
                         f"functools.partial(tqdm, leave=False)), got {use_tqdm!r}")
    return flag


def as_prompts(prompts):
    """``prompts`` with a token-id array or tuple (numpy, torch: one prompt, not a batch of one-token prompts)
    as a list; ValueError in one line for what is no prompt or list of them."""
    if hasattr(prompts, "tolist") and getattr(prompts, "ndim", None) == 1:  # a numpy array or a torch tensor
        prompts = prompts.tolist()
    if isinstance(prompts, tuple) and prompts and all(isinstance(t, numbers.Integral) for t in prompts):
        prompts = list(prompts)
    if not isinstance(prompts, (str, bytes, dict, list, tuple)) and hasattr(prompts, "__iter__"):
        prompts = list(prompts)  # a generator of prompts
    if not isinstance(prompts, (str, dict, list, tuple)):
        raise ValueError(f"prompts must be a string, a list of token ids, a prompt dict or a list of them, "
                         f"got {type(prompts).__name__}")
    return prompts


def _abort(engine, group: list) -> None:
    """Abort a prompt's samples already in the engine that added them (ids; a refused sample's output is no
    request)."""
    for added in group:
        if isinstance(added, str):
            engine.abort_request(added)


# apply_chat_template's own arguments, which LLM.chat sets: a template variable of the same name cannot reach it.
RESERVED_TEMPLATE_KWARGS = ("conversation", "tokenize", "chat_template", "return_dict", "return_tensors")


def _template_options(add_generation_prompt: bool, continue_final_message, tools, chat_template_kwargs) -> dict:
    """LLM.chat's options for apply_chat_template, checked: ValueError in one line for a wrong type or pair.
    As in vLLM, ``chat_template_kwargs`` is applied last, so its add_generation_prompt (say) wins."""
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise ValueError(f"chat_template_kwargs must be a dict of template variables, got "
                         f"{type(chat_template_kwargs).__name__}")
    reserved = sorted(set(chat_template_kwargs or {}) & set(RESERVED_TEMPLATE_KWARGS))
    if reserved:
        raise ValueError(f"chat_template_kwargs cannot set {', '.join(reserved)}: LLM.chat passes "
                         f"{'it' if len(reserved) == 1 else 'them'} to the template itself; leave "
                         f"{'it' if len(reserved) == 1 else 'them'} out")
    options = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
               "tools": tools, **(chat_template_kwargs or {})}
    for name in ("add_generation_prompt", "continue_final_message"):
        options[name] = check_flag(name, options[name])
    if options["continue_final_message"] and options["add_generation_prompt"]:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true: pass "
                         "add_generation_prompt=False to continue the last message")
    tools = options["tools"]
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        shown = type(tools).__name__ if not isinstance(tools, list) else "a list holding " + ", ".join(
            sorted({type(t).__name__ for t in tools if not isinstance(t, dict)}))
        raise ValueError(f"tools must be a list of tool dicts (OpenAI's format), got {shown}")
    options["tools"] = tools or None
    return options


def template_conversations(conversations: list[list[dict]]) -> list[list[dict]]:
    """The conversations as the chat template takes them: each message's content parts joined into one text
    (``join_text_parts``, as vLLM and the server do). ValueError naming the first message without a role or
    content (an assistant's may carry tool_calls instead), as the server's 400 does: a template fills a
    missing field with nothing, or raises in Jinja's words; and the first part that is not text."""
    result = []
    for c, conversation in enumerate(conversations):
        result.append([])
        for i, message in enumerate(conversation):
            where = f"conversation {c}, message {i}" if len(conversations) > 1 else f"message {i}"
            if not isinstance(message.get("role"), str):
                raise ValueError(f"{where} has no role: give 'role' (system, user, assistant or tool) and 'content'")
            content = message.get("content")
            if not (isinstance(content, str) or isinstance(content, list) and content) and not (
                    message["role"] == "assistant" and message.get("tool_calls")):
                raise ValueError(f"{where} ({message['role']}) needs 'content', a string or a list of parts; "
                                 f"got {content!r}"[:200])
            if isinstance(content, list):
                content = join_text_parts([_part_text(part, j, where) for j, part in enumerate(content)])
            if isinstance(content, str):
                check_text(content, f"{where}'s content")
            result[-1].append({**message, "content": content})
    return result


def _part_text(part, index: int, where: str) -> str:
    """A content part's text: a string, or {"type": "text", "text": ...}; ValueError naming any other part."""
    if isinstance(part, str):
        return part
    kind = part.get("type") if isinstance(part, dict) else None
    if isinstance(kind, str) and kind != "text":
        shown = kind if len(kind) <= 40 else kind[:40] + "..."
        raise ValueError(f"{where}: {shown} content parts are not supported (text only: text parts or a string)")
    if kind != "text" or not isinstance(part.get("text"), str):
        raise ValueError(f'{where}: content part {index} needs "type": "text" and a string "text", got {part!r}'[:300])
    return part["text"]


class LLM:
    """``LLM(model_dir, **engine_options)``; options are EngineConfig's fields.

    ``LLM([A, B], ...)`` (or ``models=[...]``) serves several models on one device, sharing
    one KV page pool (docs/multi_model.md): each entry a directory or ``NAME=DIR``, or
    named by ``served_model_name`` (one per model); ``kv_min_share`` is the fraction of the
    pool each model is guaranteed, ``sleep_after`` the seconds idle after which a model gives
    that guarantee up until its next request, and with ``sleep_offload_weights`` its weights
    wait in host memory meanwhile. ``generate(..., model=NAME)`` picks one; the first by default.
    """

    def __init__(self, model: str | list[str] | None = None, show_progress: bool = True, *,
                 models: list[str] | None = None, served_model_name: list[str] | None = None,
                 kv_min_share: float = 0.0, sleep_after: float | None = None, sleep_offload_weights: bool = False,
                 **engine_options):
        show_progress = check_flag("show_progress", show_progress)
        sleep_offload_weights = check_flag("sleep_offload_weights", sleep_offload_weights)
        if model is not None and models is not None:
            raise TypeError("give the models once: LLM([A, B], ...) or LLM(models=[A, B], ...), not model too")
        if isinstance(model, (list, tuple)) or models is not None:
            from mempath.multi.sleep import offload_options
            engine_options = offload_options(engine_options, sleep_offload_weights, sleep_after)
            self._init_several(list(models if models is not None else model), served_model_name, kv_min_share,
                               show_progress, engine_options, sleep_after)
            return
        if served_model_name is not None or kv_min_share or sleep_after is not None or sleep_offload_weights:
            raise TypeError("served_model_name, kv_min_share, sleep_after and sleep_offload_weights are for "
                            "several models: LLM([A, B], ...)")
        if model is None:
            from mempath.assets import default_model_path
            model = default_model_path()
        self.config = EngineConfig.from_kwargs(model, **engine_options)
        self.sampling_defaults = generation_defaults(model, self.config.generation_config)  # before the load
        self.engine = LLMEngine(self.config, show_progress=show_progress)
        self.engine.outputs.emit_progress = False  # generate() only collects finished requests
        self.engines: dict[str, LLMEngine] = {}  # several models' engines by name (empty: one model)
        self.defaults_by_model: dict[str, dict] = {}
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def _init_several(self, models: list[str], served_names, kv_min_share: float, show_progress: bool,
                      engine_options: dict, sleep_after: float | None = None) -> None:
        from mempath.multi.engine import MultiEngine
        from mempath.multi.names import served_models
        from mempath.multi.pages import check_min_share
        from mempath.multi.sleep import check_sleep_after
        from mempath.multi.startup import build_engines
        if not models:
            raise ValueError("LLM(models=[...]): name at least one model directory")
        if engine_options.get("tokenizer"):
            raise ValueError("tokenizer names one tokenizer; with several models each uses the one in its directory")
        pairs = served_models(models, served_names)
        check_sleep_after(sleep_after)
        check_min_share(kv_min_share, len(pairs))
        source = engine_options.get("generation_config", "auto")
        self.defaults_by_model = {name: generation_defaults(path, source) for name, path in pairs}  # before the load
        engines, pool = build_engines(pairs, engine_options, show_progress, kv_min_share)
        self.engine = MultiEngine(engines, pool, sleep_after)
        self.engines = engines
        for engine in engines.values():
            engine.outputs.emit_progress = False
        first = next(iter(engines.values()))
        self.config, self.tokenizer = first.config, first.tokenizer
        self.sampling_defaults = next(iter(self.defaults_by_model.values()))
        self._ids = itertools.count()

    def _engine_for(self, model: str | None) -> LLMEngine:
        """The model's engine: None is the first; one model answers to None only."""
        if not self.engines:
            if model is not None:
                raise ValueError(f"this LLM serves one model ({self.config.model}); leave model out")
            return self.engine
        return self.engine.engine(model)

    def get_default_sampling_params(self, model: str | None = None) -> SamplingParams:
        """SamplingParams with the generation config's defaults (--generation-config), as vLLM's."""
        self._engine_for(model)  # an unknown model is refused here, before its defaults are looked up
        return SamplingParams(**(self.defaults_by_model.get(model) or self.sampling_defaults))

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm=True, model: str | None = None) -> list[RequestOutput]:
        """Generate for one prompt or a list (strings, token-id lists, or vLLM's ``{"prompt": ...}`` /
        ``{"prompt_token_ids": [...]}`` dicts): one RequestOutput per prompt.

        As in vLLM, each output holds its ``n`` samples in ``outputs`` (``out.outputs[i].text``);
        ``out.text`` is the first sample's. A bad request in a list comes back finished with
        ``finish_reason == "error"`` and the message in ``error``, while the others run; a
        bad single prompt raises ValueError. ``sampling_params`` (vLLM's name): one for all
        prompts or one each; None: get_default_sampling_params(). ``use_tqdm``: a flag, or (as vLLM) a
        callable that makes the progress bar from tqdm's keyword arguments.
        """
        use_tqdm = progress_option(use_tqdm)
        prompts = as_prompts(prompts)
        single = is_one_prompt(prompts)
        prompt_list = [prompts] if single else list(prompts)
        engine = self._engine_for(model)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params(model)
        param_list = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompt_list)
        wrong = next((p for p in param_list if not isinstance(p, SamplingParams)), None)
        if wrong is not None:
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got {type(wrong).__name__}"
                            + (": use SamplingParams(**...)" if isinstance(wrong, dict) else ""))
        if len(param_list) != len(prompt_list):
            raise ValueError(f"got {len(prompt_list)} prompts but {len(param_list)} SamplingParams")
        if engine.inputs.grammars is not None:  # a batch's grammars compile in parallel, not one by one as added
            engine.inputs.grammars.compile_all([p.structured_outputs for p in param_list if p.structured_outputs])
        # With several models requests go through the MultiEngine, which wakes an asleep model (its weights back
        # first) and keeps who owns each request; it aborts them too.
        adder = self.engine if self.engines else engine
        groups = []
        try:
            for prompt, p in zip(prompt_list, param_list):
                groups.append(self._add_samples(adder, prompt, p, single, model))
            results = {r.request_id: r for group in groups for r in group if isinstance(r, RequestOutput)}
            self._run_to_completion(results, sum(len(group) for group in groups), use_tqdm)
        except BaseException:  # an error while adding, a bar factory that raises, Ctrl-C: what is in the
            for group in groups:  # engine must not wait there for the next call (a finished one is not aborted)
                _abort(adder, group)
            raise
        return [RequestOutput.grouped([results[r if isinstance(r, str) else r.request_id] for r in group])
                for group in groups]

    def pipeline(self, prompts, first: str, second: str, template: str = "{output}",
                 sampling_params: SamplingParams | None = None, second_sampling_params: SamplingParams | None = None):
        """Model ``first`` answers each prompt; its answer, through ``template`` (``{output}``, and
        ``{prompt}`` for the prompt), is model ``second``'s prompt (docs/multi_model.md, "Hand-off").

        One PipelineOutput per prompt (``.first``, ``.second``, ``.text``: the second's answer). A
        prompt that fails in the first model, or whose hand-off the second refuses, ends there:
        ``.second`` is that failure, with none of the first's answer. Second sampling parameters the
        second model refuses whatever the first answers raise SecondModelError before anything runs.
        """
        from mempath.multi.pipeline import PipelineOutput
        if not self.engines:
            raise ValueError("pipeline() needs several models: LLM([A, B], ...)")
        prompts = as_prompts(prompts)
        single = is_one_prompt(prompts)
        prompt_list = [prompts] if single else list(prompts)
        for name, params in (("sampling_params", sampling_params), ("second_sampling_params", second_sampling_params)):
            if params is not None and not isinstance(params, SamplingParams):
                raise TypeError(f"{name} must be one SamplingParams (for every prompt), got {type(params).__name__}"
                                + (": use SamplingParams(**...)" if isinstance(params, dict) else ""))
        if not isinstance(template, str):
            raise ValueError(f"template must be a string holding {{output}}, got {type(template).__name__}")
        first_params = sampling_params or self.get_default_sampling_params(first)
        second_params = second_sampling_params or self.get_default_sampling_params(second)
        ids = [f"pipe-{next(self._ids)}" for _ in prompt_list]
        added = []
        try:
            for prompt, request_id in zip(prompt_list, ids):
                added.append(self.engine.add_pipeline(prompt, first_params, request_id, first, second, template,
                                                      second_params))
        except ValueError:
            for request_id in ids[:len(added)]:
                self.engine.abort_request(request_id)
            raise
        results = {}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    results[output.request_id] = output
        return [PipelineOutput(p.first_output or results[i], results[i]) for p, i in zip(added, ids)]

    def _run_to_completion(self, results: dict, total: int, use_tqdm) -> None:
        """Step until every request has finished, each finished output into ``results``, with the progress bar."""
        if callable(use_tqdm):
            bar = use_tqdm(total=total, desc="Generating", unit="req")
        else:
            bar = tqdm(total=total, desc="Generating", unit="req", disable=not use_tqdm or total < 2)
        bar.update(len(results))
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    results[output.request_id] = output
                    bar.update(1)
        bar.close()

    def _add_samples(self, engine, prompt, params: SamplingParams, single: bool, model: str | None) -> list:
        """Add one engine request per sample (``engine``: the model's, or the MultiEngine that routes to
        ``model``); a refused one is its finished error output instead of its id."""
        group = []
        # A bad n is one request, which add_request refuses naming it (as any other bad field).
        samples = params.n if isinstance(params.n, int) and not isinstance(params.n, bool) and params.n >= 1 else 1
        for index in range(samples):
            request_id = f"gen-{next(self._ids)}"
            sample_params = params
            try:
                if samples > 1:
                    params.check_sample_seeds()  # else a later sample is refused for a seed nobody gave
                    seed = params.seed + index if type(params.seed) is int else params.seed  # else refused below
                    sample_params = SamplingParams(**{**params.__dict__, "n": 1, "seed": seed})
                engine.add_request(prompt, sample_params, request_id, **({"model": model} if self.engines else {}))
                group.append(request_id)
            except ValueError as error:
                if single:
                    _abort(engine, group)
                    raise
                shown = next((prompt[k] for k in PROMPT_FIELDS if k in prompt), None) if isinstance(prompt, dict) \
                    else prompt
                group.append(RequestOutput.of_sample(
                    request_id=request_id, prompt=shown if isinstance(shown, str) else None,
                    prompt_token_ids=list(shown) if isinstance(shown, (list, tuple)) else [], token_ids=[], text="",
                    finished=True, finish_reason="error", error=str(error)))
            except BaseException:
                _abort(engine, group)  # this prompt's earlier samples (generate aborts the others)
                raise
        return group

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm=True,
             add_generation_prompt: bool = True, chat_template: str | None = None,
             model: str | None = None, *, continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Apply the chat template (``chat_template``, else the tokenizer's) to one conversation or a list.

        As vLLM's: ``tools`` (OpenAI's tool dicts) and ``chat_template_kwargs`` (more template variables) go
        to the template, and ``continue_final_message`` leaves the last message open for the output to
        continue (with ``add_generation_prompt=False``)."""
        use_tqdm = progress_option(use_tqdm)
        add_generation_prompt = check_flag("add_generation_prompt", add_generation_prompt)
        template_options = _template_options(add_generation_prompt, continue_final_message, tools,
                                             chat_template_kwargs)
        engine = self._engine_for(model)
        tokenizer, name = engine.tokenizer, engine.config.model
        if tokenizer is None:
            raise ValueError(f"{name} has no tokenizer; give one with tokenizer=DIR (--tokenizer)")
        if not (chat_template or getattr(tokenizer, "chat_template", None)):
            raise ValueError(f"{name} has no chat template in its tokenizer_config.json; pass chat_template= "
                             "(--chat-template FILE), or use generate() with the prompt's text")
        if isinstance(messages, tuple) or isinstance(messages, list) and any(isinstance(c, tuple) for c in messages):
            messages = [list(c) if isinstance(c, tuple) else c for c in messages]  # tuples of messages too
        conversations = [messages] if messages and isinstance(messages, list) and isinstance(messages[0], dict) \
            else messages
        if not (isinstance(conversations, list) and conversations and all(
                isinstance(c, list) and c and all(isinstance(m, dict) for m in c) for c in conversations)):
            raise ValueError("messages must be a conversation (a non-empty list of {'role': ..., 'content': ...} "
                             f"dicts) or a list of them, got {type(messages).__name__} {str(messages)[:60]!r}")
        conversations = template_conversations(conversations)
        if chat_template is not None and not isinstance(chat_template, str):
            raise ValueError(f"chat_template must be the template's text, got {type(chat_template).__name__}")
        try:
            prompts = [tokenizer.apply_chat_template(conv, tokenize=False, chat_template=chat_template,
                                                     **template_options) for conv in conversations]
        except Exception as error:  # noqa: BLE001 - a template can raise anything
            which = "chat_template" if chat_template is not None else f"{name}'s chat template"
            raise ValueError(f"{which} failed on these messages: {str(error).splitlines()[0][:200]}") from None
        if not all(prompts):
            raise ValueError("the chat template rendered a conversation as empty text: check chat_template")
        # The template already contains the special tokens: tokenize without adding more.
        token_lists = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        outputs = self.generate(token_lists, sampling_params, use_tqdm, model) if len(token_lists) > 1 else \
            self.generate(token_lists[0], sampling_params, use_tqdm, model)
        for output, text in zip(outputs, prompts):
            output.prompt = text
        return outputs

    def stats(self) -> dict:
        return self.engine.stats()
