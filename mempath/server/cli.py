"""`mempath serve [MODEL]`: the OpenAI-compatible server on uvicorn."""
import argparse
import logging
import os
from pathlib import Path

# Limits a request cannot exceed by default. Here rather than in protocol.py so that
# building the CLI's parser does not import pydantic (the other subcommands need none).
DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_N = 16  # choices (prompts x n) per request

log = logging.getLogger(__name__)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    from mempath.cli import add_engine_arguments
    parser.add_argument("positional", nargs="?", default=None, metavar="MODEL",
                        help="model directory (default: the built-in mempath-tiny)")
    add_engine_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 for all)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("MEMPATH_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 (default: $MEMPATH_API_KEY)")
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients pass as 'model' (default: the model directory's name)")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="largest request body accepted (413 above)")
    parser.add_argument("--max-tokens-limit", type=int, default=None,
                        help="most tokens one request may generate (default: max_model_len)")
    parser.add_argument("--max-n", type=int, default=DEFAULT_MAX_N,
                        help="most choices (prompts x n) one request may ask for")
    parser.add_argument("--uvicorn-log-level", default="info")


def resolve_model(args) -> str:
    if args.positional and args.model:
        raise ValueError("give the model either as --model or as the first argument, not both")
    model = args.positional or args.model
    if model is None:
        from mempath.assets import default_model_path
        model = default_model_path()
    return model


def check_serve_arguments(args) -> None:
    for name in ("max_body_bytes", "max_n"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_tokens_limit is not None and args.max_tokens_limit < 1:
        raise ValueError("--max-tokens-limit must be >= 1")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")


def build_server_app(model: str, engine_options: dict, served_model_name: str | None = None,
                     api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                     max_tokens_limit: int | None = None, max_n: int = DEFAULT_MAX_N,
                     show_progress: bool = True):
    """Load the engine and wrap it in the app; (app, served name). Also used by tests and benchmarks."""
    from mempath.config import EngineConfig
    from mempath.engine.engine import LLMEngine
    from mempath.server.app import build_app
    from mempath.server.async_engine import AsyncEngine
    from mempath.server.metrics import ServerMetrics

    config = EngineConfig.from_kwargs(model, **engine_options)
    engine = LLMEngine(config, show_progress=show_progress)
    name = served_model_name or Path(model).resolve().name
    client = AsyncEngine(engine, ServerMetrics(name, config.block_size))
    app = build_app(client, name, api_key=api_key, max_body_bytes=max_body_bytes,
                    max_tokens_limit=max_tokens_limit, max_n=max_n)
    return app, name


def run_serve(args) -> int:
    import uvicorn

    from mempath.cli import engine_options
    check_serve_arguments(args)
    model = resolve_model(args)
    app, name = build_server_app(model, engine_options(args), args.served_model_name, args.api_key,
                                 args.max_body_bytes, args.max_tokens_limit, args.max_n)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        log.warning("serving on %s without --api-key: anyone who can reach this port can use it",
                    args.host)
    print(f"mempath: serving '{name}' on http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                timeout_graceful_shutdown=5)
    return 0
