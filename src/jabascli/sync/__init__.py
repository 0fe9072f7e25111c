"""Profile sync across servers over SSH (``jabas sync``); see ``docs/sync.md``.

- :mod:`~jabascli.sync.tree`: what a profile folder may hold; manifests (size + SHA-256)
- :mod:`~jabascli.sync.plan`: merging manifests, conflicts, what to move (pure)
- :mod:`~jabascli.sync.target`: a server's address, user and keys, from the config and ``~/.ssh/config``
- :mod:`~jabascli.sync.remote`: one SSH/SFTP connection: host keys, auth, atomic transfers
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
