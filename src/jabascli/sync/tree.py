"""Profile trees: which files belong in a profile folder, and manifests of them.

A profile folder holds files in the seed layout (``docs/sync.md`` has examples).
Every file in it must sit at one of these relative paths:

- ``<LBS>/<server>/.../<file>``: a memory or computation profile tree, as in
  ``cluster_mem_profile_data`` and ``cluster_comp_profile_data``;
- ``<file>.txt`` or ``<file>.json``: a communication or bucket profile folder itself;
- either of the above under its seed folder name, so that a whole profile root
  (``cluster_comp_profile_data/<LBS>/...``, ``comm_profile_data/*.txt`` ...) is a
  profile folder too.

Names starting with a dot are not profiles and are skipped: they are the
temporary files of writes in progress (or cut short), editor files and the like.
The check is strict on purpose: pointing ``jabas sync`` at a home folder by
mistake stops at the first stray file instead of copying it to every server.

The walk is written against a ``list_dir`` function so that the same rules
apply to a local folder and to one read over SFTP.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Literal

from jabascli.config.models import BUCKET_DIRNAME, COMMUNICATION_DIRNAME, COMPUTATION_DIRNAME, MEMORY_DIRNAME
from jabascli.ssh import SshError

LBS_TREE_DIRNAMES = frozenset({MEMORY_DIRNAME, COMPUTATION_DIRNAME})
FLAT_DIRNAMES = frozenset({COMMUNICATION_DIRNAME, BUCKET_DIRNAME})
FLAT_SUFFIXES = (".txt", ".json")

TEMP_SUFFIX = ".jabas-tmp"
"""Suffix of the hidden temporary name a file is written under before it is renamed into place."""

EXPECTED = (
    "expected <LBS>/<server>/<file>, <file>.txt or <file>.json, or those under "
    f"{MEMORY_DIRNAME}/, {COMPUTATION_DIRNAME}/, {COMMUNICATION_DIRNAME}/ or {BUCKET_DIRNAME}/"
)
MAX_DEPTH = 16

CHUNK = 32 * 1024

EntryKind = Literal["file", "dir", "symlink", "other"]


SyncError = SshError
"""Something went wrong with one server; the message is one line for a person."""


class NotAProfileTree(SyncError):
    """A folder holds something other than profiles."""


@dataclass(frozen=True)
class FileInfo:
    """What identifies a file's content: its size and SHA-256."""

    size: int
    sha256: str

    def short(self) -> str:
        return f"{self.size} B, sha256 {self.sha256[:12]}"


Manifest = dict[str, FileInfo]
"""Relative POSIX path of every file in a profile folder -> its size and hash."""


@dataclass(frozen=True)
class DirEntry:
    name: str
    kind: EntryKind
    size: int = 0


ListDir = Callable[[str], Iterable[DirEntry]]
"""Entries of a folder given by its relative POSIX path ("" is the root), without following links."""


@dataclass
class Scan:
    """The files of a profile folder (sizes only; hashing is up to the caller)."""

    sizes: dict[str, int] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    """Symbolic links and special files, which are never followed or copied."""
    leftovers: list[str] = field(default_factory=list)
    """Temporary files left by an interrupted transfer."""


def name_problem(name: str) -> str | None:
    """Why a file name is not accepted (it came from another machine), or None."""
    if name in ("", ".", ".."):
        return "is not a file name"
    if "/" in name or "\\" in name:
        return "contains a slash or backslash"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        return "contains control characters"
    return None


def _is_lbs(name: str) -> bool:
    return name.isascii() and name.isdigit() and int(name) > 0


def _is_flat_file(name: str) -> bool:
    return name.endswith(FLAT_SUFFIXES)


def _fits_lbs(parts: list[str], *, is_file: bool) -> bool:
    # <LBS>/<server>/<file>: a file needs at least three parts; a folder may still be on its way there.
    return _is_lbs(parts[0]) and (len(parts) >= 3 or not is_file)


def path_fits(rel: str, *, is_file: bool = True) -> bool:
    """Whether a file (or folder) at this relative POSIX path belongs in a profile folder."""
    parts = rel.split("/")
    if len(parts) == 1 and is_file:
        return _is_flat_file(parts[0])
    head, rest = parts[0], parts[1:]
    if head in LBS_TREE_DIRNAMES:
        return not rest or _fits_lbs(rest, is_file=is_file)
    if head in FLAT_DIRNAMES:
        return not rest or (len(rest) == 1 and is_file and _is_flat_file(rest[0]))
    return _fits_lbs(parts, is_file=is_file)


def scan_tree(list_dir: ListDir, *, what: str = "folder") -> Scan:
    """Walk a profile folder; raise :class:`NotAProfileTree` at the first thing that does not belong."""
    result = Scan()

    def walk(rel: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise NotAProfileTree(f"{what} is nested deeper than {MAX_DEPTH} levels at {rel}/")
        for entry in sorted(list_dir(rel), key=lambda e: e.name):
            problem = name_problem(entry.name)
            if problem:
                raise NotAProfileTree(
                    f"{what} has a file name that {problem}: {rel + '/' if rel else ''}{entry.name!r}"
                )
            path = f"{rel}/{entry.name}" if rel else entry.name
            if entry.name.startswith("."):
                if entry.kind == "file" and entry.name.endswith(TEMP_SUFFIX):
                    result.leftovers.append(path)
                continue
            if entry.kind in ("symlink", "other"):
                result.skipped.append(path)
            elif entry.kind == "dir":
                if not path_fits(path, is_file=False):
                    raise NotAProfileTree(f"{what} is not a profile folder: {path}/ does not belong there ({EXPECTED})")
                walk(path, depth + 1)
            elif not path_fits(path):
                raise NotAProfileTree(f"{what} is not a profile folder: {path} does not belong there ({EXPECTED})")
            else:
                result.sizes[path] = entry.size

    walk("", 0)
    return result


def entry_kind(mode: int) -> EntryKind:
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISREG(mode):
        return "file"
    return "other"


def local_lister(root: Path) -> ListDir:
    def list_dir(rel: str) -> list[DirEntry]:
        entries = []
        with os.scandir(root / rel if rel else root) as it:
            for e in it:
                st = e.stat(follow_symlinks=False)
                entries.append(DirEntry(e.name, entry_kind(st.st_mode), st.st_size))
        return entries

    return list_dir


def sha256_of(stream: BinaryIO) -> str:
    digest = hashlib.sha256()
    while chunk := stream.read(CHUNK):
        digest.update(chunk)
    return digest.hexdigest()


def local_manifest(root: Path, *, what: str | None = None) -> tuple[Manifest, Scan]:
    """Hash every file of a local profile folder (an absent folder is an empty one)."""
    what = what or str(root)
    if not root.exists():
        return {}, Scan()
    if not root.is_dir():
        raise NotAProfileTree(f"{what} is not a folder")
    try:
        scan = scan_tree(local_lister(root), what=what)
        manifest = {}
        for rel in scan.sizes:
            with open(root / rel, "rb") as f:
                manifest[rel] = FileInfo(os.fstat(f.fileno()).st_size, sha256_of(f))
    except OSError as exc:
        raise SyncError(f"cannot read {what}: {exc.strerror or exc} ({exc.filename or root})") from exc
    return manifest, scan
