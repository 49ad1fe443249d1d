"""The listening socket of `serve`, bound before the model loads.

    sock = bind("127.0.0.1", 8000, uds=None)     # ValueError: one line saying why not
    url = listen_url(sock, uds=None, https=False)

Invariants:
* A port in use, an address that is not this machine's, or a Unix socket path that cannot be
  taken fails here, as a ValueError naming the flag, before any weights load.
* A Unix socket path left behind by a server that is gone (nothing accepts on it) is
  replaced; one a live server holds is refused, as is a path that is not a socket.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat


def _bind_uds(path: str) -> socket.socket:
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None:
        if not stat.S_ISSOCK(mode):
            raise ValueError(f"--uds {path}: the path exists and is not a socket")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)  # stale: its server is gone
            else:
                raise ValueError(f"--uds {path}: another server is listening on this socket")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        raise ValueError(f"--uds {path}: cannot bind: {exc.strerror or exc}") from None
    return sock


def bind(host: str, port: int, uds: str | None = None) -> socket.socket:
    """A bound (not yet listening) socket for `uds`, else `host:port`."""
    if uds is not None:
        return _bind_uds(uds)
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise ValueError(f"--host {host}: cannot resolve it: {exc.strerror or exc}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if exc.errno in (98, 48):  # EADDRINUSE (Linux, macOS)
            raise ValueError(f"--port {port}: address {where} is already in use") from None
        raise ValueError(f"--host/--port: cannot bind {where}: {exc.strerror or exc}") from None
    return sock


def listen_url(sock: socket.socket, uds: str | None, https: bool) -> str:
    """Where clients reach the server: `unix:PATH`, or `http(s)://HOST:PORT`."""
    if uds is not None:
        return f"unix:{uds}"
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    return f"{'https' if https else 'http'}://{host}:{port}"


def close_uds(path: str | None) -> None:
    """Remove the socket file `serve` created (on shutdown)."""
    if path is not None:
        with contextlib.suppress(OSError):
            os.unlink(path)
