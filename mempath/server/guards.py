"""ASGI middleware that refuses a request before the app sees it: oversized heads, foreign Hosts.

Both answer with the OpenAI error body every other failure uses. CORS is Starlette's
CORSMiddleware (build_app installs it only for ``--allowed-origins``).
"""
import ipaddress
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from mempath.server.protocol import error_body


class HeaderLimits:
    """431 for a request with more than ``max_headers`` headers or more than ``max_bytes`` of them.

    uvicorn's h11 parser already refuses a head it must buffer beyond its limit
    (server/cli.py:uvicorn_options), but one that arrives in a single read passes,
    and other servers or parsers may have no limit at all: this holds whatever
    delivered the request.
    """

    def __init__(self, app, max_bytes: int, max_headers: int):
        self.app = app
        self.max_bytes = max_bytes
        self.max_headers = max_headers

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            problem = self.problem(scope["headers"])
            if problem is not None:
                body = error_body(problem, "invalid_request_error", None, "request_header_fields_too_large")
                await JSONResponse(body, 431)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def problem(self, headers: list[tuple[bytes, bytes]]) -> str | None:
        if len(headers) > self.max_headers:
            return (f"the request has {len(headers)} headers; this server accepts at most "
                    f"{self.max_headers} (--max-headers)")
        size = sum(len(name) + len(value) + 4 for name, value in headers)  # "name: value\r\n"
        if size > self.max_bytes:
            return (f"the request's headers take {size} bytes; this server accepts at most "
                    f"{self.max_bytes} bytes (--max-header-bytes)")
        return None


class LoopbackHostOnly:
    """400 for a request whose Host header is not a loopback name.

    A server bound to a loopback address is reachable only from this machine, but
    a web page can still reach it by DNS rebinding: its own name, re-resolved to
    127.0.0.1, makes the browser treat the server as the page's origin and let the
    page read the answers. The browser then sends the page's name as Host; a local
    client sends a loopback name or address.
    """

    def __init__(self, app, bind_host: str):
        self.app = app
        self.bind_host = bind_host

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket"):
            host = Headers(scope=scope).get("host")
            if not is_loopback_name(host):
                message = (f"the Host header {host!r} is not a name of this machine; this server is "
                           f"bound to {self.bind_host} and answers only loopback names such as "
                           f"localhost (bind another address with --host to serve other names)")
                body = error_body(message, "invalid_request_error", None, "invalid_host")
                await JSONResponse(body, 400)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def is_loopback_name(host: str | None) -> bool:
    """localhost, *.localhost (browsers resolve those to loopback themselves) or a loopback address."""
    if not host:
        return False
    try:
        name = urlsplit(f"//{host}").hostname
    except ValueError:  # e.g. an unbalanced "[" in an IPv6 literal
        return False
    if not name:
        return False
    name = name.rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def is_loopback_address(host: str) -> bool:
    """Whether binding `host` listens on this machine only."""
    return is_loopback_name(f"[{host}]" if ":" in host else host)
