"""/tokenize and /detokenize, in vLLM's request and response shapes.

Both need the API key when one is set (vLLM leaves them open; here everything that
runs the served model's tokenizer or template is behind the key).
"""
from fastapi import APIRouter, Depends, Request
from pydantic import Field, model_validator

from mempath.server.async_engine import AsyncEngine
from mempath.server.calls import Limits, api_key_checker, chat_text, check_model, off_the_loop, read_body
from mempath.server.protocol import APIError, ChatMessage, _Strict, ignored_in_messages, parse_request, \
    refuse_not_honoured, refuse_not_honoured_in_messages

# vLLM's tokenize fields this server does not honour, with the values that ask for nothing.
NOT_HONOURED_TOKENIZE = {"chat_template": (), "chat_template_kwargs": ({},), "tools": ([],),
                         "continue_final_message": (False,), "mm_processor_kwargs": ()}


class TokenizeRequest(_Strict):
    """A prompt (vLLM's TokenizeCompletionRequest) or chat messages (TokenizeChatRequest)."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages (as vLLM)
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="before")
    @classmethod
    def _refuse_not_honoured(cls, data):
        refuse_not_honoured(data, NOT_HONOURED_TOKENIZE)
        refuse_not_honoured_in_messages(data)
        return data

    @classmethod
    def nested_ignored(cls, data: dict) -> set[str]:
        return ignored_in_messages(data)

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give either prompt or messages", "prompt")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def tokens_router(engine_client: AsyncEngine, served_model_name: str, api_key: str | None,
                  limits: Limits) -> APIRouter:
    api = APIRouter(dependencies=[Depends(api_key_checker(api_key))])

    def tokenizer():
        if engine_client.tokenizer is None:
            raise APIError(400, "this model has no tokenizer; send token ids", None, "no_tokenizer")
        return engine_client.tokenizer

    @api.post("/tokenize")
    async def tokenize(request: Request):
        req = parse_request(TokenizeRequest, await read_body(request, limits.max_body_bytes))
        check_model(req.model, served_model_name)
        tok = tokenizer()
        if req.messages is not None:
            text = await off_the_loop(chat_text, tok, [m.as_template_input() for m in req.messages], "messages",
                                      req.add_generation_prompt)
            special = bool(req.add_special_tokens)
        else:
            text, special = req.prompt, req.add_special_tokens is not False
        ids = await off_the_loop(tok.encode, text, add_special_tokens=special)
        return {"count": len(ids), "max_model_len": engine_client.max_model_len, "tokens": ids,
                "token_strs": tok.convert_ids_to_tokens(ids) if req.return_token_strs else None}

    @api.post("/detokenize")
    async def detokenize(request: Request):
        req = parse_request(DetokenizeRequest, await read_body(request, limits.max_body_bytes))
        check_model(req.model, served_model_name)
        tok = tokenizer()
        bad = next((t for t in req.tokens if not 0 <= t < len(tok)), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {len(tok)})", "tokens")
        return {"prompt": tok.decode(req.tokens)}

    return api
