"""One server's SSH connection for ``jabas sync``: SFTP transfers over a checked connection.

- The connection is opened by :func:`jabascli.ssh.connect.open_client`: host
  keys checked against ``known_hosts``, key authentication only.
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
import posixpath
import secrets
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import paramiko
from paramiko.ssh_exception import SSHException

from jabascli.atomic import atomic_write
from jabascli.ssh.connect import KnownHosts, open_client
from jabascli.ssh.target import SshTarget
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

HASH_COMMAND = "xargs -0 -r sha256sum --"
HASH_BATCH = 256

Progress = Callable[[int], None]
"""Called with the number of bytes just moved."""


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
        client, accepted = open_client(target, known, timeout=timeout)
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
        connection.new_host_key = accepted
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
                # A connection cut during prefetch reads as a short file; asking the server again tells
                # a lost connection (this raises) from a file that really changed.
                self._sftp.stat(remote)
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
