"""`mempath serve [MODEL]`: the OpenAI-compatible server on uvicorn."""
import argparse
import json
import logging
import os
from pathlib import Path
from urllib.parse import urlsplit

from mempath.config import lookup
from mempath.safe_io import loads_json
from mempath.server.settings import (DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_HEADERS,
                                     DEFAULT_MAX_N, DEFAULT_SHUTDOWN_TIMEOUT, DEFAULT_STREAM_STALL_TIMEOUT,
                                     MIN_MAX_HEADER_BYTES, check_api_key)

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")

log = logging.getLogger(__name__)


def add_several_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Naming and sharing the device between several models (docs/multi_model.md)."""
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="the name clients pass as 'model' (default: the model directory's name); "
                             "one name per model (vLLM takes several names for one model)")
    parser.add_argument("--kv-min-share", type=float, default=0.0,
                        help="with several models: the fraction of the shared KV pool each one is "
                             "guaranteed whatever the others use (default 0)")
    parser.add_argument("--sleep-after", type=float, default=None, metavar="S",
                        help="with several models: a model idle for S seconds gives its guaranteed KV pages "
                             "to the others until its next request (default: never)")
    parser.add_argument("--sleep-offload-weights", action="store_true",
                        help="with --sleep-after: an asleep model's weights wait in pinned host memory and their "
                             "device memory goes back to the device; its next request copies them back first")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    from mempath.engine_flags import Refuse, add_engine_arguments
    parser.add_argument("positional", nargs="*", default=[], metavar="MODEL",
                        help="model directory (default: the built-in mempath-tiny); several (DIR or NAME=DIR) "
                             "serve several models on one device (docs/multi_model.md)")
    add_engine_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 for all)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("MEMPATH_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 (default: $MEMPATH_API_KEY)")
    add_several_model_arguments(parser)
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="largest request body accepted (413 above)")
    parser.add_argument("--max-tokens-limit", type=int, default=None,
                        help="most tokens one request may generate (default: max_model_len)")
    parser.add_argument("--max-n", type=int, default=DEFAULT_MAX_N,
                        help="most choices (prompts x n) one request may ask for")
    parser.add_argument("--max-header-bytes", type=int, default=DEFAULT_MAX_HEADER_BYTES,
                        help="largest request head (request line and headers) accepted (431/400 above)")
    parser.add_argument("--max-headers", type=int, default=DEFAULT_MAX_HEADERS,
                        help="most headers one request may carry (431 above)")
    parser.add_argument("--allowed-origins", default=None,
                        help="web origins allowed to call the API from a browser (CORS), as "
                             "'https://a.example,http://localhost:3000' or a JSON list; '*' for any "
                             "(default: none, CORS off)")
    parser.add_argument("--stream-stall-timeout", type=float, default=DEFAULT_STREAM_STALL_TIMEOUT,
                        help="seconds a streaming client may read nothing before its request is "
                             "stopped and its KV blocks freed (meanwhile it is not scheduled)")
    parser.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT,
                        help="on SIGINT/SIGTERM, seconds running requests get to finish before the "
                             "rest end with an error event")
    parser.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS, help="uvicorn's own log level")
    from mempath.server.stats_log import add_stats_log_arguments
    add_stats_log_arguments(parser)  # --disable-log-stats, --log-stats-interval
    parser.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"],
                        help="how tool calls are read from the model's text (default: the chat template's format)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let the model decide whether to call a tool (tool_choice "auto")')
    parser.add_argument("--chat-template", default=None, help=CHAT_TEMPLATE_HELP)
    parser.add_argument("--root-path", default="",
                        help="the path prefix a reverse proxy serves this server under, e.g. /llm")
    parser.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                        help="log one line per request: id, prompt tokens, sampling parameters")
    parser.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false",
                        help="vLLM's older spelling of --no-enable-log-requests (off is the default)")
    parser.add_argument("--disable-fastapi-docs", action="store_true",
                        help="no /docs page and no /openapi.json")
    for flag, reason in SERVE_REFUSED.items():
        parser.add_argument(flag, action=Refuse, reason=reason, dest=f"refused_{flag[2:].replace('-', '_')}",
                            **({"nargs": 0} if flag == "--allow-credentials" else {"metavar": "VALUE"}),
                            help=f"refused: {reason}")


TLS = "TLS is not terminated here: put a reverse proxy (nginx, Caddy) in front, or a tunnel"
CORS = "CORS allows GET and POST with Authorization and Content-Type; only --allowed-origins is set here"
# vLLM's serve flags mempath cannot honour (engine_flags.REFUSED has the engine's).
SERVE_REFUSED = {"--ssl-keyfile": TLS, "--ssl-certfile": TLS, "--ssl-ca-certs": TLS,
                 "--allowed-methods": CORS, "--allowed-headers": CORS,
                 "--allow-credentials": CORS + " (without credentials mode: the key is a header)"}
CHAT_TEMPLATE_HELP = ("a Jinja chat template, as a file or inline (the text itself), replacing the "
                      "tokenizer's (default: the tokenizer_config.json's)")


def read_chat_template(value: str | None) -> str | None:
    """--chat-template as vLLM reads it: a file that exists, else the template itself if it looks like one."""
    if value is None:
        return None
    if not value.strip():  # Path("") is the current directory
        raise ValueError("--chat-template is empty; give the template's file or its text")
    path = Path(value)
    is_dir, is_file = lookup(path)  # a name longer than a path may be: an inline template, not a file
    if is_dir:
        raise ValueError(f"--chat-template {value}: is a directory; give the template's file or its text")
    if is_file:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as error:
            raise ValueError(f"--chat-template {value}: cannot read it ({error.strerror})") from None
        except UnicodeDecodeError:
            raise ValueError(f"--chat-template {value}: is not UTF-8 text; save the template as UTF-8") from None
        check_chat_template(text, f"--chat-template {value}")
        return text
    if any(mark in value for mark in "{}\n"):  # vLLM's test for an inline template
        check_chat_template(value, f"--chat-template {value!r}")
        return value
    raise ValueError(f"--chat-template {value}: no such file, and it is not a Jinja template ({{{{ ... }}}}): "
                     f"give an existing file or the template's text")


def check_chat_template(text: str, what: str) -> None:
    """Compile the template as transformers will at the first chat request, so that a broken one is refused at
    start-up, not blamed on every request's messages. Skipped where transformers' compiler is not found."""
    try:
        from jinja2 import TemplateError
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return
    try:
        _compile_jinja_template(text)
    except TemplateError as error:
        where = f" (line {error.lineno})" if getattr(error, "lineno", None) else ""
        raise ValueError(f"{what}: not a valid Jinja template: {error.message}{where}; fix the template") from None


def resolve_models(args) -> list[str]:
    if args.positional and args.model:
        raise ValueError("give the model either as --model or as the first argument, not both")
    models = args.positional or ([args.model] if args.model else [])
    if not models:
        from mempath.assets import default_model_path
        models = [default_model_path()]
    names = args.served_model_name
    if names and any(not name.strip() for name in names):
        raise ValueError("--served-model-name: a name is empty; give the name clients pass as 'model', or drop the flag")
    if names and len(models) == 1 and len(names) > 1:
        raise ValueError("--served-model-name: one name per model (several names for one model are not served)")
    if len(models) == 1 and (args.kv_min_share or args.sleep_after is not None or args.sleep_offload_weights):
        raise ValueError("--kv-min-share, --sleep-after and --sleep-offload-weights are for several models on one "
                         "device (mempath serve A B ...)")
    return models


def one_served_model(arg: str, served_names: list[str] | None) -> tuple[str | None, str]:
    """(served name, directory) of the one model: ``NAME=DIR`` names it as it does one of several
    (multi/names.py, which refuses a NAME that --served-model-name contradicts); None: its directory's name."""
    from mempath.multi.names import served_models, split_model_arg
    if split_model_arg(arg)[0] is None and not served_names:
        return None, arg  # build_server_app names it after the resolved directory ("." included)
    [(name, path)] = served_models([arg], served_names)
    return name, path


def check_serve_arguments(args) -> None:
    if args.root_path and (not args.root_path.startswith("/") or args.root_path.endswith("/")):
        raise ValueError(f"--root-path must start with / and not end with one, such as /llm; got {args.root_path!r}")
    for name in ("max_body_bytes", "max_n", "max_headers"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_header_bytes < MIN_MAX_HEADER_BYTES:
        raise ValueError(f"--max-header-bytes must be >= {MIN_MAX_HEADER_BYTES}, got {args.max_header_bytes}")
    if args.max_tokens_limit is not None and args.max_tokens_limit < 1:
        raise ValueError("--max-tokens-limit must be >= 1")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    for name in ("stream_stall_timeout", "shutdown_timeout"):
        if not getattr(args, name) >= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0 seconds, got {getattr(args, name)}")
    if args.api_key is not None:
        check_api_key(args.api_key)
    args.allowed_origins = parse_allowed_origins(args.allowed_origins)


def parse_allowed_origins(text: str | list[str] | None) -> list[str]:
    """--allowed-origins as a list: comma-separated or a JSON list (vLLM's form)."""
    if text is None or isinstance(text, list):
        return list(text or [])
    if text.strip().startswith("["):
        try:
            origins = loads_json(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--allowed-origins is not a valid JSON list: {error}") from None
    else:
        origins = [part.strip() for part in text.split(",") if part.strip()]
    for origin in origins:
        if origin == "*":
            continue
        parts = urlsplit(origin) if isinstance(origin, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.netloc \
                or parts.path or parts.query or parts.fragment:
            raise ValueError(f"--allowed-origins: {origin!r} is not an origin; give scheme://host[:port] "
                             f"such as http://localhost:3000, or *")
    return origins


def uvicorn_options(max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES) -> dict:
    """How uvicorn must parse requests for the header limit to hold.

    h11 refuses (400) a request head it has to buffer beyond ``max_header_bytes``;
    httptools, which uvicorn prefers when installed, has no such limit. The app
    checks the headers it is given as well (431), whatever parser delivered them.
    """
    return {"http": "h11", "h11_max_incomplete_event_size": max_header_bytes}


def build_server_app(model: str, engine_options: dict, served_model_name: str | None = None,
                     api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                     max_tokens_limit: int | None = None, max_n: int = DEFAULT_MAX_N,
                     show_progress: bool = True,
                     stream_stall_timeout: float = DEFAULT_STREAM_STALL_TIMEOUT,
                     log_stats_interval: float | None = None, chat_template: str | None = None,
                     **http_options):
    """Load the engine and wrap it in the app; (app, served name). Also used by tests and benchmarks.

    ``chat_template``: the template's text (read_chat_template), replacing the tokenizer's.
    ``http_options``: build_app's bind_host, allowed_origins, max_header_bytes, max_headers,
    root_path, enable_docs.
    """
    from mempath.config import EngineConfig
    from mempath.engine.engine import LLMEngine
    from mempath.server.app import build_app
    from mempath.server.async_engine import AsyncEngine
    from mempath.server.metrics import ServerMetrics

    from mempath.generation_config import generation_defaults
    config = EngineConfig.from_kwargs(model, **engine_options)
    sampling_defaults = generation_defaults(model, config.generation_config)  # before the weights load
    engine = LLMEngine(config, show_progress=show_progress)
    if chat_template is not None:
        if engine.tokenizer is None:
            raise ValueError("--chat-template needs a tokenizer; the model directory has none (--tokenizer DIR)")
        engine.tokenizer.chat_template = chat_template
    name = served_model_name or Path(model).resolve().name
    client = AsyncEngine(engine, ServerMetrics.for_engine(name, engine),
                         stream_stall_timeout=stream_stall_timeout, log_stats_interval=log_stats_interval)
    app = build_app(client, name, api_key=api_key, max_body_bytes=max_body_bytes,
                    max_tokens_limit=max_tokens_limit, max_n=max_n, sampling_defaults=sampling_defaults,
                    **http_options)
    return app, name


def run_serve(args) -> int:
    from mempath.engine_flags import engine_options
    from mempath.server.app import serve
    from mempath.server.port import check_port_free
    from mempath.server.stats_log import enable_stats_logging
    from mempath.server.calls import request_log
    check_serve_arguments(args)
    log_stats_interval = enable_stats_logging(args)
    check_port_free(args.host, args.port)  # before the model loads: a busy port fails in a second
    models = resolve_models(args)
    request_log.setLevel(logging.INFO if args.enable_log_requests else logging.WARNING)
    http_options = dict(bind_host=args.host, allowed_origins=args.allowed_origins,
                        max_header_bytes=args.max_header_bytes, max_headers=args.max_headers,
                        root_path=args.root_path, enable_docs=not args.disable_fastapi_docs,
                        tool_call_parser=args.tool_call_parser, enable_auto_tool_choice=args.enable_auto_tool_choice)
    if len(models) > 1:
        from mempath.multi.http import build_multi_server_app
        limits = dict(max_body_bytes=args.max_body_bytes, max_tokens_limit=args.max_tokens_limit, max_n=args.max_n)
        app, names = build_multi_server_app(models, engine_options(args), args.served_model_name, args.kv_min_share,
                                            args.api_key, limits, True, args.stream_stall_timeout,
                                            log_stats_interval, read_chat_template(args.chat_template), http_options,
                                            sleep_after=args.sleep_after,
                                            sleep_offload_weights=args.sleep_offload_weights)
        name = "', '".join(names)
    else:
        served, model = one_served_model(models[0], args.served_model_name)
        app, name = build_server_app(model, engine_options(args), served, args.api_key,
                                     args.max_body_bytes, args.max_tokens_limit, args.max_n,
                                     stream_stall_timeout=args.stream_stall_timeout,
                                     log_stats_interval=log_stats_interval,
                                     chat_template=read_chat_template(args.chat_template), **http_options)
    if args.host not in LOOPBACK_HOSTS and not args.api_key:
        log.warning("serving on %s without --api-key: anyone who can reach this port can use it",
                    args.host)
    # Port 0: uvicorn binds a free port (held from then on) and its "Uvicorn running on" line names it.
    port = args.port or "<the free port uvicorn's next line names>"
    print(f"mempath: serving '{name}' on http://{args.host}:{port}{args.root_path}/v1", flush=True)
    serve(app, args.shutdown_timeout, host=args.host, port=args.port,
          log_level=args.uvicorn_log_level, **uvicorn_options(args.max_header_bytes))
    return 0
