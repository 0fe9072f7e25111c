"""``jabas sync``: gather every server's profile folder, merge them, broadcast the union.

Three rounds, each across the servers in parallel, over one connection per
server kept for the whole sync:

1. connect to every server and read its LOCAL_DIR (sizes, then hashes);
2. merge the manifests (:func:`~jabascli.sync.plan.plan_gather`) and fetch
   into the local GATHERED_DIR what it lacks;
3. read every server's GATHERED_DIR and send it what it lacks.

A server that fails gets one line in the report and the others carry on; a
server whose LOCAL_DIR could not be read still receives the merged folder.

Folders on the servers: an absolute path is used as it is; a relative one
resolves against the server's ``sync_root`` when the config sets one, and
otherwise against the folder ``jabas sync`` runs in, taken as the same absolute
path on every server (the seed's scripts assumed the same).

The library never prints. It reports progress as events to a callback, which
is called from worker threads, and returns a :class:`SyncReport`.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from paramiko import SSHConfig

from jabascli.config.loader import LoadedConfig
from jabascli.config.models import ServerConfig
from jabascli.errors import InputError, Problem
from jabascli.ssh.connect import KnownHosts
from jabascli.ssh.target import load_ssh_config, resolve_target
from jabascli.sync.plan import Conflict, Fetch, plan_gather, plan_push
from jabascli.sync.remote import Connection
from jabascli.sync.tree import FileInfo, Manifest, SyncError, local_manifest

Direction = Literal["fetch", "send"]


# Events ---------------------------------------------------------------------


@dataclass(frozen=True)
class Status:
    """What a server's worker is doing now ("connecting", "reading ..." ...)."""

    server: str
    text: str


@dataclass(frozen=True)
class Planned:
    """A server is about to move this many files and bytes in one direction."""

    server: str
    direction: Direction
    files: int
    nbytes: int


@dataclass(frozen=True)
class Moved:
    """Bytes just moved for a server (many per file)."""

    server: str
    direction: Direction
    nbytes: int


@dataclass(frozen=True)
class Failed:
    server: str
    message: str


@dataclass(frozen=True)
class Note:
    server: str
    message: str


SyncEvent = Status | Planned | Moved | Failed | Note
OnEvent = Callable[[SyncEvent], None]


# Options and results ----------------------------------------------------------


@dataclass(frozen=True)
class SyncOptions:
    dry_run: bool = False
    """Connect, read and plan; move nothing."""
    accept_new_host_keys: bool = False
    """Record the keys of hosts not yet in known_hosts instead of refusing them."""
    known_hosts: Path | None = None
    """Default: ``~/.ssh/known_hosts`` (plus ``/etc/ssh/ssh_known_hosts``, read only)."""
    ssh_config: Path | None = None
    """Default: ``~/.ssh/config`` where present."""
    timeout: float = 15.0
    """Seconds to wait for a connection, and for a silent server before giving it up."""
    parallel: int = 8
    """Servers worked on at once."""


@dataclass(frozen=True)
class Move:
    path: str
    nbytes: int


@dataclass
class ServerReport:
    server: str
    address: str = ""
    local_dir: str = ""
    gathered_dir: str = ""
    fetched: list[Move] = field(default_factory=list)
    sent: list[Move] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


@dataclass
class SyncReport:
    local_dir: str
    gathered_dir: Path
    dry_run: bool
    servers: list[ServerReport]
    conflicts: list[Conflict]

    @property
    def failed(self) -> list[ServerReport]:
        return [s for s in self.servers if not s.ok]

    @property
    def ok(self) -> bool:
        return not self.failed and not self.conflicts

    @property
    def moved(self) -> int:
        """Files fetched and sent (or that would be, in a dry run)."""
        return sum(len(s.fetched) + len(s.sent) for s in self.servers)

    def problems(self) -> list[str]:
        """One line per failed server, then one per conflict."""
        lines = [f"{s.server}: {'; '.join(s.errors)}" for s in self.failed]
        return lines + [f"conflict: {c.describe()}" for c in self.conflicts]

    def to_dict(self) -> dict[str, Any]:
        def moves(items: list[Move]) -> list[dict[str, Any]]:
            return [{"path": m.path, "bytes": m.nbytes} for m in items]

        return {
            "ok": self.ok,
            "dry_run": self.dry_run,
            "local_dir": self.local_dir,
            "gathered_dir": str(self.gathered_dir),
            "servers": [
                {
                    "name": s.server,
                    "address": s.address,
                    "local_dir": s.local_dir,
                    "gathered_dir": s.gathered_dir,
                    "fetched": moves(s.fetched),
                    "sent": moves(s.sent),
                    "notes": s.notes,
                    "errors": s.errors,
                }
                for s in self.servers
            ],
            "conflicts": [
                {
                    "path": c.path,
                    "versions": {
                        owner: "folder" if info is None else {"bytes": info.size, "sha256": info.sha256}
                        for owner, info in c.versions.items()
                    },
                }
                for c in self.conflicts
            ],
        }


# Inputs -----------------------------------------------------------------------


def select_servers(loaded: LoadedConfig, names: Sequence[str] | None) -> list[ServerConfig]:
    """The servers to sync, in config order unless named; unknown names are bad input."""
    servers = loaded.config.cluster.servers
    if not servers:
        raise InputError.at(loaded.path, "cluster.servers", "no servers to sync: add [[cluster.servers]] entries")
    by_name = {s.name: s for s in servers}
    if names is None:
        chosen = list(servers)
    else:
        unknown = [n for n in names if n not in by_name]
        if unknown or not names:
            known = ", ".join(by_name)
            raise InputError(
                [
                    Problem(None, "--servers", f"no server named {n!r} in {loaded.path} (known: {known})")
                    for n in unknown
                ]
                or [Problem(None, "--servers", f"names no server (known: {known})")]
            )
        chosen = [by_name[n] for n in dict.fromkeys(names)]
    problems = [
        Problem(loaded.path, f"cluster.servers[{servers.index(s)}].ssh_key", f"{s.ssh_key}: file not found")
        for s in chosen
        if s.ssh_key is not None and not s.ssh_key.is_file()
    ]
    if problems:
        raise InputError(problems)
    return chosen


def _check_folders(local_dir: str, gathered_dir: str, cwd: Path) -> None:
    for name, arg in (("LOCAL_DIR", local_dir), ("GATHERED_DIR", gathered_dir)):
        if not arg.strip():
            raise InputError.at(None, name, "is empty")
    a, b = (PurePosixPath(posixpath.normpath(posixpath.join(cwd.as_posix(), p))) for p in (local_dir, gathered_dir))
    if a == b or a in b.parents or b in a.parents:
        raise InputError.at(
            None, "GATHERED_DIR", f"{gathered_dir} and LOCAL_DIR {local_dir} overlap: give two separate folders"
        )


def working_dir() -> Path:
    """The working folder as the shell names it (``$PWD``, which keeps symbolic links), else the real one.

    Relative sync folders name the same absolute path on the servers, so a
    project reached as ``/home/alice/jabas`` through a link is looked for there
    too, not at wherever the link points on this machine (as the seed's ``$PWD`` did).
    """
    cwd = Path.cwd()
    pwd = os.environ.get("PWD")
    if pwd and os.path.isabs(pwd):
        with contextlib.suppress(OSError):
            if os.path.samefile(pwd, cwd):
                return Path(pwd)
    return cwd


def remote_folder(arg: str, sync_root: str | None, cwd: Path) -> str:
    """Where a sync folder argument is on a server (before ``~`` and login-folder expansion)."""
    if posixpath.isabs(arg):
        return arg
    if sync_root:
        return posixpath.join(sync_root, arg)
    return posixpath.join(cwd.as_posix(), arg)


def _local_destination(root: Path, rel: str) -> Path:
    """``root/rel``, refusing to write through a symbolic link inside ``root``."""
    path = root
    for part in rel.split("/"):
        path = path / part
        if path.is_symlink():
            raise SyncError(f"{path} is a symbolic link; jabas sync does not write through links")
    return path


# The sync ---------------------------------------------------------------------


@dataclass
class _Server:
    config: ServerConfig
    report: ServerReport
    conn: Connection | None = None
    local_root: str = ""
    gathered_root: str = ""
    manifest: Manifest | None = None

    @property
    def name(self) -> str:
        return self.config.name


def sync_profiles(
    loaded: LoadedConfig,
    local_dir: str | Path,
    gathered_dir: str | Path,
    *,
    servers: Sequence[str] | None = None,
    options: SyncOptions | None = None,
    on_event: OnEvent | None = None,
    cwd: Path | None = None,
) -> SyncReport:
    """Gather every server's ``local_dir`` into ``gathered_dir`` here, then broadcast it.

    Raises :class:`~jabascli.errors.InputError` for bad input found before
    connecting (unknown server names, a missing key file, a local
    ``gathered_dir`` that is not a profile folder); everything that goes wrong
    with a server is in the report instead.
    """
    options = options or SyncOptions()
    cwd = cwd or working_dir()
    local_arg, gathered_arg = str(local_dir), str(gathered_dir)
    _check_folders(local_arg, gathered_arg, cwd)
    chosen = select_servers(loaded, servers)
    gathered = Path(os.path.normpath(cwd / gathered_arg))
    try:
        gathered_manifest, _ = local_manifest(gathered, what=f"GATHERED_DIR {gathered}")
    except SyncError as exc:
        raise InputError.at(None, "GATHERED_DIR", str(exc)) from None
    try:
        known = KnownHosts(options.known_hosts, accept_new=options.accept_new_host_keys, dry_run=options.dry_run)
    except OSError as exc:
        raise InputError.at(exc.filename, None, f"cannot read known_hosts: {exc.strerror or exc}") from None
    sync = _Sync(options, load_ssh_config(options.ssh_config), known, cwd, on_event or (lambda event: None))
    states = [_Server(s, ServerReport(s.name)) for s in chosen]
    return sync.run(states, local_arg, gathered_arg, gathered, gathered_manifest)


class _Sync:
    def __init__(
        self, options: SyncOptions, ssh_config: SSHConfig | None, known: KnownHosts, cwd: Path, emit: OnEvent
    ) -> None:
        self.options = options
        self.ssh_config = ssh_config
        self.known = known
        self.cwd = cwd
        self.emit = emit

    def run(
        self, states: list[_Server], local_arg: str, gathered_arg: str, gathered: Path, gathered_manifest: Manifest
    ) -> SyncReport:
        pool = ThreadPoolExecutor(max_workers=max(1, min(self.options.parallel, len(states))))

        def each(step: Callable[[_Server], None], which: list[_Server]) -> None:
            list(pool.map(lambda s: self._guarded(step, s), which))

        try:
            # 1. Connect to every server and read its LOCAL_DIR.
            each(lambda s: self._open_and_read(s, local_arg, gathered_arg), states)

            # 2. Merge, and fetch what the gathered folder here lacks.
            sources = {s.name: s.manifest for s in states if s.manifest is not None}
            plan = plan_gather(sources, gathered_manifest)
            by_server: dict[str, list[Fetch]] = {}
            for fetch in plan.fetches:
                by_server.setdefault(fetch.server, []).append(fetch)
            done: set[str] = set()
            each(lambda s: self._fetch(s, by_server.get(s.name, []), gathered, done), states)

            # What the gathered folder holds now: the plan, less the fetches that did not happen.
            merged = dict(plan.merged)
            if not self.options.dry_run:
                for fetch in plan.fetches:
                    if fetch.path not in done:
                        if fetch.path in gathered_manifest:
                            merged[fetch.path] = gathered_manifest[fetch.path]
                        else:
                            merged.pop(fetch.path)

            # 3. Send every server still connected what its GATHERED_DIR lacks.
            each(lambda s: self._send(s, merged, gathered), [s for s in states if s.conn and s.conn.alive()])
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            for s in states:
                if s.conn is not None:
                    s.conn.close()
        for s in states:
            self.emit(Status(s.name, "failed" if s.report.errors else "done"))
        return SyncReport(local_arg, gathered, self.options.dry_run, [s.report for s in states], plan.conflicts)

    def _guarded(self, step: Callable[[_Server], None], s: _Server) -> None:
        try:
            step(s)
        except SyncError as exc:
            self._fail(s, str(exc))
        except Exception as exc:
            # Unforeseen (a bug, or something paramiko raises that nobody expected): still one line for
            # this server while the others carry on; JABAS_DEBUG=1 shows the traceback instead.
            if os.environ.get("JABAS_DEBUG"):
                raise
            self._fail(s, f"unexpected {type(exc).__name__}: {exc} (JABAS_DEBUG=1 shows where)")

    def _fail(self, s: _Server, message: str) -> None:
        s.report.errors.append(message)
        self.emit(Failed(s.name, message))

    def _note(self, s: _Server) -> Callable[[str], None]:
        def note(message: str) -> None:
            s.report.notes.append(message)
            self.emit(Note(s.name, message))

        return note

    def _open_and_read(self, s: _Server, local_arg: str, gathered_arg: str) -> None:
        self.emit(Status(s.name, "connecting"))
        target = resolve_target(s.config, self.ssh_config)
        s.report.address = target.address
        s.conn = conn = Connection.open(target, self.known, timeout=self.options.timeout)
        if conn.new_host_key is not None:
            key = conn.new_host_key
            verb = "would record" if self.options.dry_run else "recorded"
            self._note(s)(f"{verb} its host key ({key.get_name()} {key.fingerprint}) in {self.known.path}")
        s.local_root = s.report.local_dir = conn.absolute(remote_folder(local_arg, target.sync_root, self.cwd))
        s.gathered_root = s.report.gathered_dir = conn.absolute(remote_folder(gathered_arg, target.sync_root, self.cwd))
        self.emit(Status(s.name, "reading LOCAL_DIR"))
        scan = conn.scan(s.local_root, f"LOCAL_DIR {s.local_root}")
        for path in scan.skipped:
            self._note(s)(f"skipped {path} in LOCAL_DIR: links and special files are not synced")
        hashes = conn.hashes(s.local_root, list(scan.sizes), self._note(s))
        s.manifest = {rel: FileInfo(size, hashes[rel]) for rel, size in scan.sizes.items()}

    def _fetch(self, s: _Server, fetches: list[Fetch], gathered: Path, done: set[str]) -> None:
        if not fetches:
            return
        assert s.conn is not None
        self.emit(Planned(s.name, "fetch", len(fetches), sum(f.info.size for f in fetches)))
        self.emit(Status(s.name, "fetching"))
        for fetch in fetches:
            if not self.options.dry_run:
                destination = _local_destination(gathered, fetch.path)
                s.conn.fetch(
                    posixpath.join(s.local_root, fetch.path),
                    destination,
                    fetch.info,
                    lambda n: self.emit(Moved(s.name, "fetch", n)),
                )
                done.add(fetch.path)  # one fetch per path, so no two threads add the same one
            s.report.fetched.append(Move(fetch.path, fetch.info.size))

    def _send(self, s: _Server, merged: Manifest, gathered: Path) -> None:
        assert s.conn is not None
        conn, root = s.conn, s.gathered_root
        self.emit(Status(s.name, "reading GATHERED_DIR"))
        scan = conn.scan(root, f"GATHERED_DIR {root}", missing_ok=True)
        for rel in scan.leftovers:
            if not self.options.dry_run:
                conn.remove(posixpath.join(root, rel))
                self._note(s)(f"removed {rel} in GATHERED_DIR, left by an interrupted transfer")
        same_size = [rel for rel, size in scan.sizes.items() if rel in merged and merged[rel].size == size]
        hashes = conn.hashes(root, same_size, self._note(s))
        remote = {rel: FileInfo(size, hashes[rel]) if rel in hashes else None for rel, size in scan.sizes.items()}
        to_send = plan_push(merged, remote)
        if not to_send:
            return
        self.emit(Planned(s.name, "send", len(to_send), sum(merged[rel].size for rel in to_send)))
        self.emit(Status(s.name, "sending"))
        for rel in to_send:
            if not self.options.dry_run:
                conn.push(
                    gathered / rel,
                    posixpath.join(root, rel),
                    merged[rel],
                    lambda n: self.emit(Moved(s.name, "send", n)),
                )
            s.report.sent.append(Move(rel, merged[rel].size))
