"""Opening an SSH connection to one server: host-key check against ``known_hosts``, key authentication.

Shared by ``jabas sync`` (:mod:`jabascli.sync.remote`) and the cluster launcher
(:mod:`jabascli.elastic.remote`).

- Host keys are checked against a ``known_hosts`` file. An unknown host is
  refused unless new keys are accepted, in which case its key is appended to
  the file (never rewritten: comments and hashed entries stay as they were). A
  key that differs from the recorded one, or is marked ``@revoked``, is always refused.
- Authentication is by key only: the keys named for the server, then ssh-agent,
  then (when no key is named) ``~/.ssh/id_*``. There is no password option.

Every failure is raised as :class:`~jabascli.ssh.SshError` with one line that
names what went wrong and, where there is one, what to do about it.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paramiko
from paramiko.auth_strategy import AuthFailure, AuthStrategy, InMemoryPrivateKey
from paramiko.hostkeys import HostKeyEntry
from paramiko.pkey import UnknownKeyType
from paramiko.ssh_exception import (
    AuthenticationException,
    BadAuthenticationType,
    BadHostKeyException,
    NoValidConnectionsError,
    PasswordRequiredException,
    SSHException,
)

from jabascli.ssh import SshError
from jabascli.ssh.target import SshTarget

DEFAULT_KNOWN_HOSTS = Path("~/.ssh/known_hosts")
SYSTEM_KNOWN_HOSTS = Path("/etc/ssh/ssh_known_hosts")
KEEPALIVE_S = 15
DEFAULT_KEY_NAMES = ("id_ed25519", "id_ecdsa", "id_rsa")


class UnknownHostKey(SSHException):
    def __init__(self, hostname: str, key: paramiko.PKey) -> None:
        super().__init__(f"unknown host key for {hostname}")
        self.hostname = hostname
        self.key = key


class RevokedHostKey(SSHException):
    def __init__(self, key: paramiko.PKey) -> None:
        super().__init__("host key is marked @revoked")
        self.key = key


def _key_line(key: paramiko.PKey) -> str:
    return f"{key.get_name()} {key.get_base64()}"


def read_known_hosts(path: Path) -> tuple[list[HostKeyEntry], set[str]]:
    """The entries of a known_hosts file, and the keys it marks ``@revoked`` ("type base64").

    Lines paramiko cannot use (``@cert-authority``, key types it does not know,
    damaged lines) are skipped, as OpenSSH skips what it cannot parse; a host
    known only through them is then unknown.
    """
    entries, revoked = [], set()
    for raw in path.read_text(encoding="utf-8", errors="replace").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("@"):
            fields = line.split()
            if fields[0] == "@revoked" and len(fields) >= 4:
                revoked.add(f"{fields[2]} {fields[3]}")
            continue
        try:
            entry = HostKeyEntry.from_line(line)
        except Exception:  # a damaged line (paramiko raises several kinds): skipped
            continue
        if entry is not None and entry.key is not None:
            entries.append(entry)
    return entries, revoked


class KnownHosts:
    """The ``known_hosts`` file host keys are checked against, shared by every connection of a sync.

    Read once (``OSError`` if it cannot be); ``/etc/ssh/ssh_known_hosts`` is read
    too when no file is named.
    """

    def __init__(self, path: Path | None = None, *, accept_new: bool = False, dry_run: bool = False) -> None:
        self.path = (path or DEFAULT_KNOWN_HOSTS).expanduser()
        self.accept_new = accept_new
        self.dry_run = dry_run
        """Accept new keys for this run only, writing nothing."""
        self.entries: list[HostKeyEntry] = []
        self.revoked: set[str] = set()
        for source in [*([SYSTEM_KNOWN_HOSTS] if path is None else []), self.path]:
            if source.is_file():
                entries, revoked = read_known_hosts(source)
                self.entries += entries
                self.revoked |= revoked
        self._lock = threading.Lock()

    def attach(self, client: paramiko.SSHClient) -> _MissingHostKey:
        """Give the client the known keys and the policy for others (which says what it accepted)."""
        keys = client.get_host_keys()
        for entry in self.entries:
            for name in entry.hostnames:
                keys.add(name, entry.key.get_name(), entry.key)
        policy = _MissingHostKey(self)
        client.set_missing_host_key_policy(policy)
        return policy

    def check_not_revoked(self, key: paramiko.PKey) -> None:
        if _key_line(key) in self.revoked:
            raise RevokedHostKey(key)

    def record(self, hostname: str, key: paramiko.PKey) -> None:
        """Append one entry; the file and its folder are created private when missing."""
        line = HostKeyEntry([hostname], key).to_line()
        with self._lock:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
            with os.fdopen(fd, "rb+") as f:
                end = f.seek(0, os.SEEK_END)
                if end and os.pread(fd, 1, end - 1) != b"\n":
                    f.write(b"\n")
                f.write(line.encode())
                f.flush()
                os.fsync(fd)


class _MissingHostKey(paramiko.MissingHostKeyPolicy):
    def __init__(self, known: KnownHosts) -> None:
        self.known = known
        self.accepted: paramiko.PKey | None = None

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        self.known.check_not_revoked(key)
        if not self.known.accept_new:
            raise UnknownHostKey(hostname, key)
        if not self.known.dry_run:
            self.known.record(hostname, key)
        self.accepted = key


class _OfferKeys(AuthStrategy):
    """The target's keys, then ssh-agent's, then (when none is named) ``~/.ssh/id_*``."""

    def __init__(self, target: SshTarget, known: KnownHosts) -> None:
        super().__init__(ssh_config=None)
        self.target = target
        self.known = known
        self.offered: list[str] = []
        self.unusable: list[str] = []
        self.agent: paramiko.Agent | None = None

    def authenticate(self, transport: paramiko.Transport) -> list[Any]:
        # The host key has been checked against known_hosts by now; a recorded one may still be revoked.
        self.known.check_not_revoked(transport.get_remote_server_key())
        return super().authenticate(transport)

    def get_sources(self) -> Iterator[InMemoryPrivateKey]:
        user = self.target.user
        for path in self.target.key_files:
            key = self._load(path)
            if key is not None:
                self.offered.append(f"key {path} ({key.get_name()} {key.fingerprint})")
                yield InMemoryPrivateKey(user, key)
        if self.target.allow_agent:
            try:
                self.agent = paramiko.Agent()
                agent_keys = self.agent.get_keys()
            except SSHException as exc:
                self.unusable.append(f"ssh-agent could not be used ({exc})")
                agent_keys = ()
            if agent_keys:
                self.offered.append(f"{len(agent_keys)} ssh-agent key{'s' if len(agent_keys) > 1 else ''}")
            for key in agent_keys:
                yield InMemoryPrivateKey(user, key)
        if self.target.default_keys:
            for name in DEFAULT_KEY_NAMES:
                path = Path("~/.ssh", name).expanduser()
                key = self._load(path) if path.is_file() else None
                if key is not None:
                    self.offered.append(f"key {path}")
                    yield InMemoryPrivateKey(user, key)

    def _load(self, path: Path) -> paramiko.PKey | None:
        try:
            return paramiko.PKey.from_path(path)
        except PasswordRequiredException:
            self.unusable.append(f"{path} is encrypted: load it into ssh-agent (ssh-add {path})")
        except OSError as exc:
            self.unusable.append(f"cannot read {path}: {exc.strerror or exc}")
        except (SSHException, ValueError, UnknownKeyType):
            self.unusable.append(
                f"{path} is not a private key jabas can read (a public key, a damaged file, or a type paramiko lacks)"
            )
        return None

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()

    def failure(self, exc: AuthenticationException) -> str:
        allowed: set[str] = set()
        for result in getattr(exc, "result", []):
            if isinstance(result.result, BadAuthenticationType):
                allowed.update(result.result.allowed_types)
        text = f"authentication failed as {self.target.address}: "
        if self.offered:
            text += "the server accepted none of " + ", ".join(self.offered)
        else:
            text += (
                "no key to offer (set ssh_key for this server, an IdentityFile in ~/.ssh/config, "
                "or load a key into ssh-agent)"
            )
        if allowed and "publickey" not in allowed:
            text += f" (it allows only {', '.join(sorted(allowed))}, and jabas uses keys)"
        return "; ".join([text, *self.unusable])


def _connect_problem(exc: BaseException, target: SshTarget, known: KnownHosts, timeout: float) -> str:
    where = f"{target.hostname}:{target.port}"
    if isinstance(exc, UnknownHostKey):
        return (
            f"unknown host key for {exc.hostname} ({exc.key.get_name()} {exc.key.fingerprint}), not in "
            f"{known.path}: check the fingerprint, then run again with --accept-new-host-keys to record it"
        )
    if isinstance(exc, RevokedHostKey):
        return (
            f"the host key of {target.hostname}:{target.port} ({exc.key.get_name()} {exc.key.fingerprint}) "
            f"is marked @revoked in {known.path}: refusing to connect"
        )
    if isinstance(exc, BadHostKeyException):
        name = target.hostname if target.port == 22 else f"[{target.hostname}]:{target.port}"
        return (
            f"host key of {name} does not match {known.path} (the server offered {exc.key.get_name()} "
            f"{exc.key.fingerprint}, the file has {exc.expected_key.fingerprint}): someone may be intercepting "
            f"the connection; if the server was reinstalled, remove the old key with "
            f"ssh-keygen -R '{name}' -f {known.path}"
        )
    if isinstance(exc, NoValidConnectionsError | ConnectionRefusedError):
        return f"connection refused by {where} (is an SSH server listening there?)"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the host name {target.hostname!r}"
    if isinstance(exc, TimeoutError):
        return f"no answer from {where} within {timeout:g} s"
    if isinstance(exc, OSError):
        return f"cannot connect to {where}: {exc.strerror or exc}"
    if isinstance(exc, SSHException) and "banner" in str(exc).lower():
        return f"{where} did not answer as an SSH server ({exc})"
    return f"SSH connection to {where} failed: {exc or type(exc).__name__}"


def open_client(target: SshTarget, known: KnownHosts, *, timeout: float = 15.0) -> tuple[paramiko.SSHClient, Any]:
    """Connect, check the host key and authenticate; the client and the host key accepted as new (or None).

    Raises :class:`SshError` with one line naming the server and the problem.
    """
    client = paramiko.SSHClient()
    policy = known.attach(client)
    offer = _OfferKeys(target, known)
    connect_timeout = target.connect_timeout or timeout
    try:
        client.connect(
            target.hostname,
            target.port,
            username=target.user,
            timeout=connect_timeout,
            banner_timeout=timeout,
            auth_timeout=timeout,
            channel_timeout=timeout,
            auth_strategy=offer,
        )
    except AuthenticationException as exc:
        client.close()
        message = offer.failure(exc) if isinstance(exc, AuthFailure) else f"authentication failed: {exc}"
        raise SshError(message) from exc
    except (SSHException, OSError, EOFError) as exc:
        client.close()
        raise SshError(_connect_problem(exc, target, known, connect_timeout)) from exc
    finally:
        offer.close()
    transport = client.get_transport()
    assert transport is not None
    transport.set_keepalive(KEEPALIVE_S)
    return client, policy.accepted
