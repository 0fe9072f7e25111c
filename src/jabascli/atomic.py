"""Atomic file writes: nothing on disk is ever half-written.

Every file jabas writes goes to a temporary file in the destination folder,
is flushed and fsynced, then renamed over the destination (``os.replace`` is
atomic on POSIX). A crash at any point leaves either the old file or the new
one, never a mix.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def atomic_write(path: Path | str, write: Callable[[IO[bytes]], Any]) -> Path:
    """Call ``write(f)`` on a temporary file, then move it to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def atomic_write_bytes(path: Path | str, data: bytes) -> Path:
    return atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: Path | str, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path | str, obj: Any, *, indent: int | None = None) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=indent) + ("\n" if indent else ""))


def _fsync_dir(folder: Path) -> None:
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
