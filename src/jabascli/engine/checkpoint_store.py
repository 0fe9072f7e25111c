"""A job's checkpoints on disk: the last ``keep`` of them, each with the digest it was written with.

In the job's checkpoint folder (``[storage] checkpoint_dir / <job name>``)::

    checkpoint-<step>.pt    one checkpoint (engine/checkpoint.py's payload, torch.save)
    checkpoint-<step>.dcp/  or one written by every rank of a hybrid layout (engine/parallel/dcp.py)
    checkpoints.json        the manifest: newest first, {file, step, epoch, sha256, bytes, files} each

A checkpoint is written whole to its own file (atomically: temporary name,
fsync, rename), then the manifest is replaced (atomically) to name it first
and to drop all but the newest ``keep``; files the manifest no longer names
are removed last. The manifest's rename is the commit point: a save cut off
before it leaves the previous manifest, whose checkpoints are untouched.

Reading takes the newest checkpoint whose bytes still have the SHA-256 written
with them; one that does not (truncated, overwritten, a disk error) is named
as corrupt and the one before it is used, so a damaged newest checkpoint costs
the iterations since the previous one, never the job. A folder written before
the manifest existed holds a single ``checkpoint.pt``, read without a digest.

A ``.dcp`` checkpoint is a folder, written by every rank under a temporary
name (``.checkpoint-<step>.dcp.tmp``) and committed by rank 0 alone: renamed to
its name, then named by the manifest with every file's SHA-256 and size
(``files``). It is intact only when every file it was committed with is
there with its digest; a cut-off one is passed over as a corrupt ``.pt`` is.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from jabascli.atomic import atomic_write_bytes, atomic_write_json, fsync_dir
from jabascli.errors import InputError

MANIFEST = "checkpoints.json"
LEGACY = "checkpoint.pt"
DEFAULT_KEEP = 2


@dataclass(frozen=True)
class Entry:
    """One checkpoint the manifest names."""

    file: str
    step: int
    epoch: int
    sha256: str | None
    """None only for a folder written before digests (``checkpoint.pt``)."""
    bytes: int | None
    files: dict[str, dict[str, Any]] | None = None
    """A ``.dcp`` folder's files (relative path -> {sha256, bytes}); None for a ``.pt`` file."""


@dataclass(frozen=True)
class Found:
    """The newest intact checkpoint of a folder, and what was passed over to reach it."""

    path: Path
    data: bytes
    """The checkpoint file's bytes; empty for a ``.dcp`` folder (its files are read where they are)."""
    entry: Entry
    passed_over: list[str] = field(default_factory=list)
    """One line per newer checkpoint that failed its integrity check."""


class CheckpointStore:
    """The checkpoints of one job: write the next, find the newest intact one."""

    def __init__(self, folder: Path, keep: int = DEFAULT_KEEP) -> None:
        self.folder = folder
        self.keep = max(1, keep)

    @property
    def manifest(self) -> Path:
        return self.folder / MANIFEST

    def entries(self) -> list[Entry]:
        """The checkpoints the folder holds, newest first (empty when it holds none)."""
        if not self.manifest.is_file():
            legacy = self.folder / LEGACY
            return [Entry(LEGACY, -1, -1, None, None)] if legacy.is_file() else []
        try:
            rows = json.loads(self.manifest.read_text(encoding="utf-8"))["checkpoints"]
            return [Entry(**row) for row in rows]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InputError.at(self.manifest, None, f"not a readable checkpoint manifest: {exc}") from None

    def write(self, data: bytes, *, step: int, epoch: int) -> Path:
        """Add a checkpoint (the serialised payload) as the newest; keep the newest ``keep``."""
        name = f"checkpoint-{step}.pt"
        path = self.folder / name
        atomic_write_bytes(path, data)
        self._commit(Entry(name, step, epoch, hashlib.sha256(data).hexdigest(), len(data)))
        return path

    def staging(self, step: int) -> Path:
        """The temporary folder every rank writes a ``.dcp`` checkpoint of ``step`` into, before
        :meth:`commit_folder`."""
        return self.folder / f".checkpoint-{step}.dcp.tmp"

    def commit_folder(self, staged: Path, *, step: int, epoch: int) -> Path:
        """Make the written folder ``staged`` the newest checkpoint (rank 0 alone, once every rank has written):
        digest its files, rename it to ``checkpoint-<step>.dcp``, then name it in the manifest."""
        name = f"checkpoint-{step}.dcp"
        path = self.folder / name
        files = {str(f.relative_to(staged)): _file_digest(f) for f in sorted(staged.rglob("*")) if f.is_file()}
        if path.exists():  # the same step saved again (a resumed job): the manifest falls back meanwhile
            shutil.rmtree(path)
        os.replace(staged, path)
        fsync_dir(self.folder)
        self._commit(Entry(name, step, epoch, None, None, files))
        return path

    def _commit(self, entry: Entry) -> None:
        """Name ``entry`` first in the manifest (the commit point), keep the newest ``keep``, remove the rest."""
        older = [e for e in self._entries_for_update() if e.file != entry.file]
        kept = [entry, *older][: self.keep]
        rows = [{k: v for k, v in asdict(e).items() if k != "files" or v is not None} for e in kept]
        atomic_write_json(self.manifest, {"checkpoints": rows}, indent=1)
        self._remove_unlisted({e.file for e in kept})

    def newest(self) -> Found | None:
        """The newest checkpoint whose bytes match their digest; None when the folder holds none.

        Raises InputError when it holds checkpoints but none is intact.
        """
        passed_over: list[str] = []
        entries = self.entries()
        for entry in entries:
            path = self.folder / entry.file
            problem, data = self._check(path, entry)
            if problem is None:
                return Found(path, data, entry, passed_over)
            passed_over.append(f"{path}: {problem}")
        if passed_over:
            raise InputError.at(self.folder, None, "no intact checkpoint: " + "; ".join(passed_over))
        return None

    def verify(self, path: Path, data: bytes) -> Entry:
        """The manifest's entry of ``path`` (one without a digest when none names it); InputError unless
        ``data``, read from ``path``, is what was written there."""
        unlisted = Entry(path.name, -1, -1, None, len(data))
        if path.parent.resolve() != self.folder.resolve():
            return unlisted  # a file outside a manifest's folder: nothing to check it against
        entry = next((e for e in self.entries() if e.file == path.name), unlisted)
        problem = _digest_problem(entry, data)
        if problem is not None:
            raise InputError.at(path, None, problem)
        return entry

    def verify_folder(self, path: Path) -> Entry:
        """The manifest's entry of the ``.dcp`` folder ``path``; InputError unless every file it was committed
        with is there with its digest (a folder no manifest names is not checked)."""
        unlisted = Entry(path.name, -1, -1, None, None)
        if path.parent.resolve() != self.folder.resolve():
            return unlisted
        entry = next((e for e in self.entries() if e.file == path.name), unlisted)
        problem = _folder_problem(path, entry.files)
        if problem is not None:
            raise InputError.at(path, None, problem)
        return entry

    def _check(self, path: Path, entry: Entry) -> tuple[str | None, bytes]:
        if entry.files is not None:
            return _folder_problem(path, entry.files), b""
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return "corrupt: missing (the manifest names it)", b""
        except OSError as exc:
            return f"corrupt: unreadable ({exc.strerror})", b""
        return _digest_problem(entry, data), data

    def _entries_for_update(self) -> list[Entry]:
        try:
            return [e for e in self.entries() if e.file != LEGACY]
        except InputError:
            return []  # an unreadable manifest is replaced: the checkpoint just written is intact

    def _remove_unlisted(self, listed: set[str]) -> None:
        """Remove older checkpoints, and what saves cut off by a kill left (rank 0 commits every checkpoint,
        once the ranks writing a ``.dcp`` one are done)."""
        for path in [*self.folder.glob("checkpoint-*.pt"), *self.folder.glob(".checkpoint-*.pt.*.tmp")]:
            if path.name not in listed:
                path.unlink(missing_ok=True)
        for path in [*self.folder.glob("checkpoint-*.dcp"), *self.folder.glob(".checkpoint-*.dcp.tmp")]:
            if path.name not in listed:
                shutil.rmtree(path, ignore_errors=True)


def _digest_problem(entry: Entry, data: bytes) -> str | None:
    if entry.sha256 is None:
        return None
    if entry.bytes is not None and len(data) != entry.bytes:
        return f"corrupt: {len(data)} bytes, {entry.bytes} were written (cut off?)"
    if hashlib.sha256(data).hexdigest() != entry.sha256:
        return "corrupt: its SHA-256 differs from the one written with it"
    return None


def _file_digest(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return {"sha256": digest.hexdigest(), "bytes": path.stat().st_size}


def _folder_problem(path: Path, files: dict[str, dict[str, Any]] | None) -> str | None:
    if not path.is_dir():
        return "corrupt: missing (the manifest names it)"
    for name, written in (files or {}).items():
        try:
            found = _file_digest(path / name)
        except OSError as exc:
            return f"corrupt: {name} is {'missing' if isinstance(exc, FileNotFoundError) else 'unreadable'}"
        if found["bytes"] != written["bytes"]:
            return f"corrupt: {name} has {found['bytes']} bytes, {written['bytes']} were written (cut off?)"
        if found["sha256"] != written["sha256"]:
            return f"corrupt: the SHA-256 of {name} differs from the one written with it"
    return None


def newest_checkpoint(folder: Path) -> Found | None:
    """The newest intact checkpoint of a job's checkpoint folder (None: it holds none); see CheckpointStore."""
    return CheckpointStore(folder).newest() if folder.is_dir() else None
