"""Is the address `mempath serve` will listen on free? Asked before the model is loaded."""
import errno
import socket


def check_port_free(host: str, port: int) -> None:
    """Bind host:port as uvicorn will (SO_REUSEADDR) and let it go; ValueError naming the fix if it cannot.

    Another process may still take the port between this check and uvicorn's bind,
    after the model has loaded; uvicorn then says so. Port 0 (any free port) is always free.
    """
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise ValueError(f"--host {host}: not an address or name this machine can resolve ({error.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as error:
            raise ValueError(bind_failure(host, port, error)) from None


def bind_failure(host: str, port: int, error: OSError) -> str:
    where = f"{host}:{port}"
    if error.errno == errno.EADDRINUSE:
        return (f"port {port} is already in use on {host} (another server?): stop that process "
                f"or choose another --port")
    if error.errno == errno.EACCES:
        return f"no permission to listen on {where} (ports below 1024 need privileges): choose --port 1024 or above"
    if error.errno == errno.EADDRNOTAVAIL:
        return f"--host {host} is not an address of this machine: use 127.0.0.1, 0.0.0.0 or one of its addresses"
    return f"cannot listen on {where}: {error.strerror}; choose another --host or --port"
