"""The shared secret every client of the scheduler presents as ``Authorization: Bearer <token>``.

It comes from ``JABAS_TOKEN``, else from ``[scheduler] token_file``, which must
not be readable by group or others (as ssh treats a private key). A fresh token
is 32 random bytes (``secrets.token_urlsafe``) written atomically with mode 0600.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

from jabascli.atomic import atomic_write
from jabascli.config import LoadedConfig
from jabascli.errors import InputError

TOKEN_ENV = "JABAS_TOKEN"
MIN_LENGTH = 16


def new_token() -> str:
    return secrets.token_urlsafe(32)


def write_token(path: Path) -> str:
    """Write a fresh token to ``path`` (mode 0600, atomically) and return it."""
    token = new_token()
    data = (token + "\n").encode()
    atomic_write(path, lambda f: f.write(data), mode=0o600)  # private from its first byte: never chmod later
    return token


def read_token_file(path: Path) -> str:
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise InputError.at(path, None, f"token file cannot be read: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise InputError.at(
            path, None, f"token file is open to group or others (mode {stat.S_IMODE(mode):04o}); run: chmod 600 {path}"
        )
    try:
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError.at(path, None, f"token file cannot be read: {exc}") from None
    return _checked(token, str(path))


def load_token(loaded: LoadedConfig, environ: Mapping[str, str] | None = None) -> str:
    """``JABAS_TOKEN``, else ``[scheduler] token_file``; InputError when neither gives a usable token."""
    value = (os.environ if environ is None else environ).get(TOKEN_ENV)
    if value:
        return _checked(value.strip(), TOKEN_ENV)
    path = loaded.config.scheduler.token_file
    if path is None:
        raise InputError.at(
            loaded.path,
            "scheduler.token_file",
            f"no token: set [scheduler] token_file or {TOKEN_ENV} (make one with `jabas token FILE`)",
        )
    return read_token_file(path)


def same_token(given: str, expected: str) -> bool:
    """Constant-time comparison: how long it takes says nothing about how much of the token matched."""
    return hmac.compare_digest(given.encode(), expected.encode())


def _checked(token: str, source: str) -> str:
    if len(token) < MIN_LENGTH:
        raise InputError.at(source, None, f"token is {len(token)} characters; at least {MIN_LENGTH} expected")
    return token
