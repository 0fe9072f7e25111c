"""Sockets: a free port on loopback, a listening socket bound to one address, and interfaces."""

from __future__ import annotations

import ipaddress
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now at ``host`` (an address of this machine). Another program may take it
    before it is used: callers that bind it themselves retry (the comm profiler does); a rendezvous that
    fails on it reports it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def is_local(host: str) -> bool:
    """Whether a server's ``host`` is this machine: its name, a loopback address, or an address one of its
    interfaces holds (a name is resolved first)."""
    if host in (socket.gethostname(), socket.gethostname().split(".")[0], socket.getfqdn()):
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for info in infos:
        address = str(info[4][0])
        ip = ipaddress.ip_address(address)
        if ip.is_loopback or ip.is_unspecified or interface_of(address) is not None:
            return True
    return False


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``'s address (not every interface) and listening on ``port`` (0: any).

    For a c10d store (``TCPStore(master_listen_fd=...)``): torch's own store listens on every
    interface, and it has no authentication.
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def local_address_towards(host: str) -> str | None:
    """The address of this machine's interface that traffic to ``host`` leaves from (no packet is sent)."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            return str(probe.getsockname()[0])
    except OSError:
        return None


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds the IPv4 ``address`` (Linux), or None."""
    try:
        import fcntl
        import struct
    except ImportError:
        return None
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                request = struct.pack("256s", name.encode()[:15])
                answer = fcntl.ioctl(sock.fileno(), siocgifaddr, request)
            except OSError:
                continue
            if socket.inet_ntoa(answer[20:24]) == address:
                return name
    return None
