"""What the server's command line (server/cli.py) and its app (app.py, async_engine.py) share:
the default limits and the API-key rule.

Here rather than in protocol.py so that building the CLI's parser does not import
pydantic (the other subcommands need none).
"""

# Limits a request cannot exceed by default.
DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_N = 16  # choices (prompts x n) per request
# Seconds a stream's client may read nothing before the request is stopped (its KV freed),
# and seconds running requests get to finish after SIGINT / SIGTERM.
DEFAULT_STREAM_STALL_TIMEOUT = 60.0
DEFAULT_SHUTDOWN_TIMEOUT = 20.0
# A request's head: uvicorn's own default size (h11), and Apache's default count.
DEFAULT_MAX_HEADER_BYTES = 16 * 1024
MIN_MAX_HEADER_BYTES = 1024  # below this, ordinary clients' requests would not fit
DEFAULT_MAX_HEADERS = 100


def check_api_key(key: str) -> None:
    """Refuse a key that would turn authentication off or could never match a client's header."""
    where = "the API key (--api-key or $MEMPATH_API_KEY)"
    if key == "":
        raise ValueError(f"{where} is empty, which would turn authentication off: unset it to serve "
                         f"without a key, or give a key")
    for position, char in enumerate(key, 1):
        if char.isspace():
            raise ValueError(f"{where} has whitespace at character {position}: clients' tokens are "
                             f"stripped and split at spaces, so it could never match; remove it")
        if not "!" <= char <= "~":
            raise ValueError(f"{where} must be printable ASCII (headers carry nothing else reliably); "
                             f"character {position} is U+{ord(char):04X}")
