"""A free TCP port on loopback, for a rendezvous or a service started right after."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now. Another program may take it before it is used: callers that
    bind it themselves retry (the comm profiler does); a rendezvous that fails on it reports it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
