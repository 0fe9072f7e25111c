"""Atomic file writes: nothing on disk is ever half-written.

Every file jabas writes goes to a temporary file in the destination folder,
is flushed and fsynced, then renamed over the destination (``os.replace`` is
atomic on POSIX). A crash at any point leaves either the old file or the new
one, never a mix.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def atomic_write(
    path: Path | str, write: Callable[[IO[bytes]], Any], *, mode: int | None = None, durable: bool = True
) -> Path:
    """Call ``write(f)`` on a temporary file, then move it to ``path`` (with ``mode``, else a plain open()'s).

    ``durable`` False: atomic, not fsynced (about a millisecond less), for a message another process reads
    at once and that is worth nothing after a crash (an agent's order in its trainer's control file).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # The temporary file's name is chosen before it is created, so that an exception at any point (a stop signal
    # turned into SystemExit lands between any two bytecodes) finds the name to remove: with mkstemp, one landing
    # after the file was created and before its name was returned left an empty file behind.
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        # Created 0600 (no other user reads it half-written); the file gets the mode a plain open() would give
        # (or the old file's).
        os.fchmod(fd, _mode_for(path) if mode is None else mode)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)
    return path


def atomic_write_bytes(path: Path | str, data: bytes, *, durable: bool = True) -> Path:
    return atomic_write(path, lambda f: f.write(data), durable=durable)


def atomic_write_text(path: Path | str, text: str, *, durable: bool = True) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"), durable=durable)


def atomic_write_json(path: Path | str, obj: Any, *, indent: int | None = None) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=indent) + ("\n" if indent else ""))


def _read_umask() -> int:
    # os.umask can only be read by setting it; do that once, at import, before any
    # thread could create a file under the temporary value.
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


_UMASK = _read_umask()


def _mode_for(path: Path) -> int:
    try:
        return path.stat().st_mode & 0o7777
    except FileNotFoundError:
        return 0o666 & ~_UMASK


def fsync_dir(folder: Path) -> None:
    # The rename itself lives in the directory entry; fsync it so it survives a crash.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
