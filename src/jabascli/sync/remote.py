"""One server's SSH connection: host-key check, key authentication, SFTP transfers.

- Host keys are checked against a ``known_hosts`` file. An unknown host is
  refused unless new keys are accepted, in which case its key is appended to
  the file (never rewritten: comments and hashed entries stay as they were). A
  key that differs from the recorded one, or is marked ``@revoked``, is always refused.
- Authentication is by key only: the keys named for the server, then ssh-agent,
  then (when no key is named) ``~/.ssh/id_*``. There is no password option.
- Every file sent is written under a hidden temporary name in its destination
  folder and renamed into place with the ``posix-rename@openssh.com`` extension
  once complete and checked, so a cut connection never leaves a partial file
  under the real name. Files fetched are written locally the same way
  (:mod:`jabascli.atomic`), after their SHA-256 is checked.
- Remote hashes come from ``sha256sum`` run with a fixed command line, the
  paths travelling NUL-separated on its standard input (so no remote path is
  ever parsed by a shell). Where commands cannot run (SFTP-only accounts), the
  files are read over SFTP and hashed here instead.

Every failure is raised as :class:`~jabascli.sync.tree.SyncError` with one line
that names what went wrong and, where there is one, what to do about it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import posixpath
import secrets
import socket
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

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

from jabascli.atomic import atomic_write
from jabascli.sync.target import SshTarget
from jabascli.sync.tree import (
    CHUNK,
    TEMP_SUFFIX,
    DirEntry,
    FileInfo,
    Scan,
    SyncError,
    entry_kind,
    scan_tree,
    sha256_of,
)

DEFAULT_KNOWN_HOSTS = Path("~/.ssh/known_hosts")
SYSTEM_KNOWN_HOSTS = Path("/etc/ssh/ssh_known_hosts")
HASH_COMMAND = "xargs -0 -r sha256sum --"
HASH_BATCH = 256
KEEPALIVE_S = 15
DEFAULT_KEY_NAMES = ("id_ed25519", "id_ecdsa", "id_rsa")

Progress = Callable[[int], None]
"""Called with the number of bytes just moved."""


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
            text += f" (it allows only {', '.join(sorted(allowed))}, and jabas sync uses keys)"
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


class Connection:
    """An SSH connection to one server, with an SFTP session on it."""

    def __init__(
        self, target: SshTarget, client: paramiko.SSHClient, sftp: paramiko.SFTPClient, timeout: float
    ) -> None:
        self.target = target
        self.timeout = timeout
        self._client = client
        self._sftp = sftp
        self._folders: set[str] = set()
        self._lost = False
        self.new_host_key: paramiko.PKey | None = None
        """The host key accepted as new on connecting (recorded unless in a dry run)."""
        self.home = sftp.normalize(".")

    @classmethod
    def open(cls, target: SshTarget, known: KnownHosts, *, timeout: float = 15.0) -> Connection:
        """Connect, check the host key, authenticate and start SFTP."""
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
            raise SyncError(message) from exc
        except (SSHException, OSError, EOFError) as exc:
            client.close()
            raise SyncError(_connect_problem(exc, target, known, connect_timeout)) from exc
        finally:
            offer.close()
        transport = client.get_transport()
        assert transport is not None
        transport.set_keepalive(KEEPALIVE_S)
        try:
            sftp = client.open_sftp()
            sftp.get_channel().settimeout(timeout)
            connection = cls(target, client, sftp, timeout)
        except (SSHException, OSError, EOFError) as exc:
            client.close()
            raise SyncError(
                f"{target.address} refused an SFTP session ({exc or type(exc).__name__}): "
                "jabas sync needs the server's sftp subsystem"
            ) from exc
        connection.new_host_key = policy.accepted
        return connection

    def alive(self) -> bool:
        transport = self._client.get_transport()
        return not self._lost and transport is not None and transport.is_active()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._sftp.close()
        self._client.close()

    def _give_up(self) -> None:
        """After a timeout nothing more is expected from the server: drop the connection now, so
        that closing files and removing temporary ones do not each wait out the timeout again."""
        self._lost = True
        with contextlib.suppress(Exception):
            self._client.close()

    @contextlib.contextmanager
    def _open(self, path: str, mode: str) -> Iterator[paramiko.SFTPFile]:
        f = self._sftp.open(path, mode)
        try:
            yield f
        except TimeoutError:
            self._give_up()
            raise
        except BaseException:
            with contextlib.suppress(Exception):
                f.close()
            raise
        f.close()

    @contextlib.contextmanager
    def _failing(self, doing: str) -> Iterator[None]:
        """Turn what paramiko and the OS raise into one :class:`SyncError` line."""
        try:
            yield
        except SyncError:
            raise
        except (OSError, EOFError, SSHException) as exc:
            if isinstance(exc, TimeoutError):
                self._give_up()
                raise SyncError(f"no answer from the server for {self.timeout:g} s while {doing}") from exc
            # SFTP reports file errors as OSError; transport trouble shows as the rest, or as a dead transport
            # (which paramiko's reader thread may notice only a moment after the error reached us).
            if isinstance(exc, EOFError | SSHException | ConnectionError) or not self.alive():
                self._lost = True
                raise SyncError(f"connection lost while {doing}") from exc
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__
            raise SyncError(f"{doing}: {reason}") from exc

    # Paths and folders -----------------------------------------------------

    def absolute(self, path: str) -> str:
        """An absolute remote path: ``~`` and relative paths start at the login folder."""
        if path == "~" or path.startswith("~/"):
            path = path[2:]
        return posixpath.normpath(posixpath.join(self.home, path))

    def scan(self, root: str, what: str, *, missing_ok: bool = False) -> Scan:
        """The files of a remote profile folder (see :func:`~jabascli.sync.tree.scan_tree`)."""
        with self._failing(f"reading {what}"):
            try:
                mode = self._sftp.stat(root).st_mode or 0
            except FileNotFoundError:
                if missing_ok:
                    return Scan()
                raise SyncError(f"{what} does not exist") from None
            if not stat.S_ISDIR(mode):
                raise SyncError(f"{what} is not a folder")

            def list_dir(rel: str) -> list[DirEntry]:
                entries = self._sftp.listdir_attr(posixpath.join(root, rel) if rel else root)
                return [DirEntry(a.filename, entry_kind(a.st_mode or 0), a.st_size or 0) for a in entries]

            return scan_tree(list_dir, what=what)

    def _is_folder(self, path: str) -> bool | None:
        """Whether ``path`` is a folder (False: something else), or None where nothing is."""
        try:
            return stat.S_ISDIR(self._sftp.stat(path).st_mode or 0)
        except FileNotFoundError:
            return None

    def _makedirs(self, folder: str) -> None:
        missing = []
        probe = folder
        while probe not in self._folders and probe != "/":
            is_folder = self._is_folder(probe)
            if is_folder is None:
                missing.append(probe)
                probe = posixpath.dirname(probe)
                continue
            if not is_folder:
                raise SyncError(f"cannot create folder {folder}: {probe} is a file")
            break
        for path in reversed(missing):
            try:
                self._sftp.mkdir(path)
            except OSError as exc:
                if not self._is_folder(path):  # created meanwhile by someone else is fine
                    raise SyncError(f"cannot create folder {path}: {exc.strerror or exc}") from exc
        self._folders.add(folder)

    def remove(self, path: str) -> None:
        with self._failing(f"removing {path}"):
            self._sftp.remove(path)

    # Hashes ---------------------------------------------------------------

    def hashes(self, root: str, rels: list[str], note: Callable[[str], None]) -> dict[str, str]:
        """SHA-256 of each file (relative to ``root``), computed on the server where possible."""
        paths = {posixpath.join(root, rel): rel for rel in rels}
        found: dict[str, str] = {}
        with self._failing(f"hashing files in {root}"):
            todo = list(paths)
            for start in range(0, len(todo), HASH_BATCH):
                batch = self._hash_by_command(todo[start : start + HASH_BATCH])
                if not batch:
                    break  # the command cannot run there; read the files instead
                found.update(batch)
        rest = [p for p in paths if p not in found]
        if rest and len(rest) == len(paths):
            note("cannot run sha256sum there; hashing by reading the files over SFTP")
        for path in rest:
            with self._failing(f"reading {path}"), self._open(path, "rb") as f:
                f.prefetch()
                found[path] = sha256_of(f)
        return {paths[p]: h for p, h in found.items()}

    def _hash_by_command(self, paths: list[str]) -> dict[str, str]:
        try:
            stdin, stdout, _ = self._client.exec_command(HASH_COMMAND, timeout=self.timeout)
            stdin.write(b"".join(p.encode() + b"\0" for p in paths))
            stdin.channel.shutdown_write()
            output = stdout.read()
            stdout.channel.recv_exit_status()
        except (SSHException, EOFError, OSError) as exc:
            if isinstance(exc, TimeoutError) or not self.alive():
                raise
            return {}
        wanted = set(paths)
        found = {}
        for line in output.decode("utf-8", "replace").splitlines():
            digest, sep, path = line[:64], line[64:66], line[66:]
            if sep in ("  ", " *") and path in wanted and all(c in "0123456789abcdef" for c in digest):
                found[path] = digest
        return found

    # Transfers ------------------------------------------------------------

    def fetch(self, remote: str, local: Path, info: FileInfo, progress: Progress) -> None:
        """Copy a remote file to ``local`` atomically, checking its size and SHA-256."""

        def write(dst: IO[bytes]) -> None:
            with self._open(remote, "rb") as src:
                if info.size:
                    src.prefetch(info.size)
                copied = _copy(src, dst, progress)
            if copied != info:
                raise SyncError(f"{remote} changed while it was being copied; run jabas sync again")

        with self._failing(f"fetching {remote}"):
            atomic_write(local, write)

    def push(self, local: Path, remote: str, info: FileInfo, progress: Progress) -> None:
        """Send a file under a temporary name, then rename it over ``remote`` once complete."""
        folder, name = posixpath.split(remote)
        temp = posixpath.join(folder, f".{name}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
        with self._failing(f"sending {remote}"):
            self._makedirs(folder)
            try:
                with open(local, "rb") as src, self._open(temp, "wb") as dst:
                    dst.set_pipelined(True)
                    copied = _copy(src, dst, progress)
                if copied != info:
                    raise SyncError(f"{local} changed while it was being sent; run jabas sync again")
                written = self._sftp.stat(temp).st_size
                if written != copied.size:
                    raise SyncError(f"the server holds {written} of the {copied.size} bytes sent")
                self._sftp.posix_rename(temp, remote)
            except BaseException as exc:
                if not isinstance(exc, TimeoutError):
                    self._discard(temp)
                raise

    def _discard(self, path: str) -> None:
        if self.alive():
            with contextlib.suppress(Exception):
                self._sftp.remove(path)


def _copy(src: Any, dst: Any, progress: Progress) -> FileInfo:
    """Copy ``src`` to ``dst`` in chunks, reporting progress; the size and SHA-256 of what was copied."""
    digest, size = hashlib.sha256(), 0
    while chunk := src.read(CHUNK):
        dst.write(chunk)
        digest.update(chunk)
        size += len(chunk)
        progress(len(chunk))
    return FileInfo(size, digest.hexdigest())
