"""Profile sync across servers over SSH (``jabas sync``); see ``docs/sync.md``.

- :mod:`~jabascli.sync.tree`: what a profile folder may hold; manifests (size + SHA-256)
- :mod:`~jabascli.sync.plan`: merging manifests, conflicts, what to move (pure)
- :mod:`jabascli.ssh`: a server's address, user and keys (``~/.ssh/config``), host keys and authentication
- :mod:`~jabascli.sync.remote`: one SFTP connection: atomic transfers, remote hashes
- :mod:`~jabascli.sync.run`: the sync itself, across servers in parallel, reporting events
"""

from jabascli.sync.run import (
    Failed,
    Moved,
    Note,
    Planned,
    ServerReport,
    Status,
    SyncEvent,
    SyncOptions,
    SyncReport,
    sync_profiles,
)

__all__ = [
    "Failed",
    "Moved",
    "Note",
    "Planned",
    "ServerReport",
    "Status",
    "SyncEvent",
    "SyncOptions",
    "SyncReport",
    "sync_profiles",
]
