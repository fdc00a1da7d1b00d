"""The HTTP server for several models: one app per model, one engine thread, routed by ``model``.

Every model gets the one-model app (server/app.py's build_app, with its guards, limits and
routes) over a ``ModelClient``: the shared AsyncEngine with that model's tokenizer and
lengths, adding its requests to that model. ``MultiModelApp`` is the ASGI app uvicorn runs:
a POST's JSON body is read once (within --max-body-bytes) and the request is passed, body
replayed, to the app of the model its ``model`` field names; no ``model``, or anything that
is not a JSON body within the limit, goes to the first model's app (which refuses what it
must). A name no model has gets a 404 naming the served models, from an app with the same
guards and API key check. Every other route (/v1/models, which lists all models,
/metrics, /health, ...) is the first app's.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

from fastapi import Depends, FastAPI, Request

from mempath.safe_io import loads_json
from mempath.server.app import install_error_handlers, install_guards
from mempath.server.async_engine import AsyncEngine
from mempath.server.calls import api_key_checker
from mempath.server.protocol import APIError
from mempath.server.settings import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_HEADERS, DEFAULT_MAX_N


class ModelClient:
    """One model's face of the shared AsyncEngine, with the attributes build_app reads."""

    def __init__(self, shared: AsyncEngine, name: str, engine):
        self.shared, self.name = shared, name
        self.tokenizer, self.max_model_len = engine.tokenizer, engine.max_model_len
        self.max_request_tokens = engine.max_request_tokens
        self.metrics = ModelMetrics(shared.metrics, name)

    async def add_request(self, prompt, params, request_id: str, queue) -> None:
        await self.shared.add_request(prompt, params, request_id, queue, model=self.name)

    def abort(self, request_id: str) -> None:
        self.shared.abort(request_id)

    def check_request(self, prompt, params, request_id: str) -> None:
        self.shared.check_request(prompt, params, request_id, model=self.name)

    async def grammar_error(self, constraint) -> str | None:
        return await self.shared.grammar_error(constraint, model=self.name)

    async def stats(self) -> dict:
        return await self.shared.stats()

    @property
    def is_alive(self) -> bool:
        return self.shared.is_alive

    def start(self) -> None:
        self.shared.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self.shared.shutdown(timeout)

    def drain(self, timeout: float):
        return self.shared.drain(timeout)


class ModelMetrics:
    """What build_app reads of the metrics, with its events in this model's series."""

    def __init__(self, metrics, name: str):
        self.metrics, self.name = metrics, name

    def render(self, stats: dict) -> bytes:
        return self.metrics.render(stats)

    def record_disconnect(self, stage: str) -> int:
        return self.metrics.record_disconnect(stage, model=self.name)


def unknown_model_app(served: list[str], api_key: str | None, http_options: dict) -> FastAPI:
    """Answers every request with the 404 of a model not served, behind the same guards and key."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    install_guards(app, http_options.get("bind_host"), http_options.get("allowed_origins", ()),
                   http_options.get("max_header_bytes", DEFAULT_MAX_HEADER_BYTES),
                   http_options.get("max_headers", DEFAULT_MAX_HEADERS))
    names = ", ".join(f"'{name}'" for name in served)

    @app.post("/{path:path}", dependencies=[Depends(api_key_checker(api_key))])
    async def not_served(request: Request):
        model = json.loads(await request.body())["model"]  # MultiModelApp read it: a JSON object's string
        raise APIError(404, f"the model '{model}' does not exist; this server serves {names}",
                       "model", "model_not_found")

    return app


class MultiModelApp:
    """The ASGI app: lifespan starts and stops the shared engine thread; requests go by ``model``."""

    def __init__(self, shared: AsyncEngine, apps: dict[str, FastAPI], unknown: FastAPI, max_body_bytes: int):
        self.shared, self.apps, self.unknown = shared, apps, unknown
        self.first = next(iter(apps.values()))
        self.max_body_bytes = max_body_bytes
        self.state = SimpleNamespace(engine_client=shared)  # what server/app.py's serve() reads

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http" or scope["method"] != "POST" or not self._json_within_limit(scope):
            return await self.first(scope, receive, send)
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_body_bytes or not message.get("more_body"):
                break
        app = self._app_for(b"".join(m.get("body", b"") for m in messages) if size <= self.max_body_bytes else None)

        async def replay():
            return messages.pop(0) if messages else await receive()
        return await app(scope, replay, send)

    def _json_within_limit(self, scope) -> bool:
        headers = dict(scope.get("headers") or [])
        content_type = headers.get(b"content-type", b"").partition(b";")[0].strip().lower()
        declared = headers.get(b"content-length", b"")
        return content_type == b"application/json" and not (declared.isdigit() and int(declared) > self.max_body_bytes)

    def _app_for(self, body: bytes | None):
        """The app of the model the body names; the first one's for anything it cannot read."""
        try:
            model = loads_json(body).get("model") if body is not None else None
        except (ValueError, AttributeError):
            model = None
        if not isinstance(model, str):
            return self.first
        return self.apps.get(model, self.unknown)

    async def _lifespan(self, receive, send):
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.shared.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.shared.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return


def build_multi_server_app(models: list[str], engine_options: dict, served_model_names: list[str] | None,
                           kv_min_share: float, api_key: str | None, limits: dict, show_progress: bool,
                           stream_stall_timeout: float, log_stats_interval: float | None,
                           chat_template: str | None, http_options: dict,
                           sleep_after: float | None = None,
                           sleep_offload_weights: bool = False) -> tuple[MultiModelApp, list[str]]:
    """Load every model over one page pool and build the routed app; (app, served names).

    ``limits``: build_app's max_body_bytes, max_tokens_limit, max_n; ``http_options``: its
    bind_host, allowed_origins, max_header_bytes, max_headers, root_path, enable_docs and
    tool options. The chat template, when given, replaces every model's tokenizer's.
    ``sleep_after``: seconds idle after which a model gives up its KV guarantee (multi/sleep.py),
    ``sleep_offload_weights``: and its weights wait in host memory.
    """
    from mempath.generation_config import generation_defaults
    from mempath.multi.engine import MultiEngine
    from mempath.multi.names import served_models
    from mempath.multi.sleep import check_sleep_after, offload_options
    from mempath.multi.startup import build_engines
    from mempath.multi.pipeline_route import pipeline_router
    from mempath.server.app import build_app
    from mempath.server.calls import Limits
    from mempath.server.metrics import ServerMetrics
    if engine_options.get("tokenizer"):
        raise ValueError("--tokenizer names one tokenizer; with several models each uses the one in its directory")
    pairs = served_models(models, served_model_names)
    check_sleep_after(sleep_after)
    engine_options = offload_options(engine_options, sleep_offload_weights, sleep_after)
    defaults = {name: generation_defaults(path, engine_options.get("generation_config", "auto"))
                for name, path in pairs}
    engines, pool = build_engines(pairs, engine_options, show_progress, kv_min_share)
    if chat_template is not None:
        for name, engine in engines.items():
            if engine.tokenizer is None:
                raise ValueError(f"--chat-template needs a tokenizer; {name}'s directory has none")
            engine.tokenizer.chat_template = chat_template
    multi = MultiEngine(engines, pool, sleep_after)
    names = list(engines)
    metrics = ServerMetrics.for_models(engines)  # each model's series under its name (docs/server.md, "Metrics")
    shared = AsyncEngine(multi, metrics, stream_stall_timeout=stream_stall_timeout,
                         log_stats_interval=log_stats_interval)
    listed = [(name, engine.max_model_len) for name, engine in engines.items()]
    route_limits = {name: Limits(max_tokens=limits.get("max_tokens_limit") or engine.max_model_len,
                                 max_n=limits.get("max_n", DEFAULT_MAX_N),
                                 max_body_bytes=limits.get("max_body_bytes", DEFAULT_MAX_BODY_BYTES))
                    for name, engine in engines.items()}
    apps = {}
    for name, engine in engines.items():
        client = ModelClient(shared, name, engine)
        apps[name] = build_app(client, name, api_key=api_key, sampling_defaults=defaults[name], models_listed=listed,
                               extra_routers=[pipeline_router(client, names, api_key, route_limits, defaults)],
                               **limits, **http_options)
    guard_options = {k: http_options[k] for k in ("bind_host", "allowed_origins", "max_header_bytes", "max_headers")
                     if k in http_options}
    app = MultiModelApp(shared, apps, unknown_model_app(names, api_key, guard_options),
                        limits.get("max_body_bytes", DEFAULT_MAX_BODY_BYTES))
    return app, names
