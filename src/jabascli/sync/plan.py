"""What to move: merging the servers' profile folders and deciding the transfers.

Pure functions on manifests (relative path -> size and SHA-256); nothing here
touches a network or a disk, so every rule is tested without SSH.

Rules:

- A file that every server holding it has with the same content is gathered
  once (from the first such server, in config order), unless the gathered
  folder already has that content.
- A file that two servers hold with different content is a *conflict*: it is
  reported and left out of the sync in both directions, so neither version
  silently replaces the other (nor an older copy already gathered).
- The same goes for a path that is a file in one place and a folder in another.
- Files already in the gathered folder and in no server's folder are kept and
  broadcast: nothing is ever deleted.
- A server is sent exactly the files of the merged folder it lacks or holds
  with other content.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from jabascli.sync.tree import FileInfo, Manifest

GATHERED = "(gathered folder)"
"""Stands for the main node's gathered folder where a conflict names who holds what."""


@dataclass(frozen=True)
class Conflict:
    """One path whose versions disagree; ``None`` means it is a folder there."""

    path: str
    versions: Mapping[str, FileInfo | None]

    def describe(self) -> str:
        parts = []
        for owner, info in self.versions.items():
            parts.append(f"{owner} (a folder)" if info is None else f"{owner} ({info.short()})")
        return f"{self.path} differs between {', '.join(parts)}; left out of the sync"


@dataclass(frozen=True)
class Fetch:
    server: str
    path: str
    info: FileInfo


@dataclass(frozen=True)
class GatherPlan:
    fetches: list[Fetch]
    conflicts: list[Conflict]
    merged: Manifest
    """The gathered folder once every fetch is done, without the conflicting paths."""

    @property
    def excluded(self) -> set[str]:
        return {c.path for c in self.conflicts}


def _parents(path: str) -> list[str]:
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


def plan_gather(sources: Mapping[str, Manifest], gathered: Manifest) -> GatherPlan:
    """Merge the servers' manifests (in server order) into the gathered folder's."""
    versions: dict[str, dict[str, FileInfo]] = {}
    for server, manifest in sources.items():
        for path, info in manifest.items():
            versions.setdefault(path, {})[server] = info

    folder_owners: dict[str, list[str]] = {}
    for owner, manifest in [*sources.items(), (GATHERED, gathered)]:
        for folder in {parent for path in manifest for parent in _parents(path)}:
            folder_owners.setdefault(folder, []).append(owner)

    fetches: list[Fetch] = []
    conflicts: list[Conflict] = []
    merged: Manifest = dict(gathered)
    for path in sorted(set(versions) | set(gathered)):
        held = versions.get(path, {})
        if path in folder_owners:
            as_file: dict[str, FileInfo | None] = dict(held)
            if path in gathered:
                as_file[GATHERED] = gathered[path]
            conflicts.append(Conflict(path, {**as_file, **dict.fromkeys(folder_owners[path])}))
            merged.pop(path, None)
            continue
        if not held:
            continue  # only in the gathered folder: kept as it is
        distinct = set(held.values())
        if len(distinct) > 1:
            conflicts.append(Conflict(path, held))
            merged.pop(path, None)
            continue
        info = distinct.pop()
        if gathered.get(path) != info:
            fetches.append(Fetch(next(iter(held)), path, info))
        merged[path] = info
    return GatherPlan(fetches, conflicts, merged)


def plan_push(merged: Manifest, remote: Mapping[str, FileInfo | None]) -> list[str]:
    """Paths of the merged folder a server lacks or holds with other content.

    ``remote`` maps the server's files to their size and hash; a file whose
    size already differs may be given without its hash (``None``).
    """
    return [path for path, info in sorted(merged.items()) if remote.get(path) != info]
