"""Reading input files, with one-line errors that name the file.

Every reader of a user's file goes through here, so a missing file, a file
that is not UTF-8 and malformed JSON read the same way everywhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jabascli.errors import InputError


def read_text(path: Path | str, *, what: str = "file") -> str:
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError.at(path, None, f"{what} not found") from None
    except IsADirectoryError:
        raise InputError.at(path, None, f"is a folder, expected a {what}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError.at(path, None, f"cannot read: {exc}") from None


def read_json(path: Path | str, *, what: str = "file") -> Any:
    text = read_text(path, what=what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError.at(path, None, f"invalid JSON: {exc}") from None
