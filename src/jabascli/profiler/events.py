"""The lines a ``--launched`` profiler prints for the ``jabas profile all`` that started it on its node.

Each line is one JSON object whose :data:`EVENT` key names its kind: ``pid`` (the command's process, to
end it by), ``progress``, ``note``, ``result`` (what the command measured) and ``error`` (its exit code and
message lines). Any other line (a warning, a traceback) is shown as it is.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from jabascli.profiler.common import Reporter

EVENT = "jabas-profile"
"""The key of every line a ``--launched`` profiler prints for its launcher; its value is the event's kind."""


def event_line(kind: str, **fields: Any) -> str:
    """One line of a ``--launched`` profiler's output: ``{"jabas-profile": KIND, ...fields}``."""
    return json.dumps({EVENT: kind, **fields})


def parse_event(line: str) -> dict[str, Any] | None:
    """The event a line carries, or None for any other output (a warning, a traceback)."""
    if not line.startswith("{"):
        return None
    try:
        event = json.loads(line)
    except ValueError:
        return None
    return event if isinstance(event, dict) and isinstance(event.get(EVENT), str) else None


class LineReporter(Reporter):
    """A profiler's progress and notes as event lines, handed to ``write`` (``--launched``)."""

    def __init__(self, write: Callable[[str], None]) -> None:
        self._write = write

    def progress(self, completed: float, total: float | None, what: str) -> None:
        self._write(event_line("progress", completed=completed, total=total, what=what))

    def note(self, message: str) -> None:
        self._write(event_line("note", message=message))
