"""Errors the library raises; the CLI maps them to exit codes.

The library never prints or exits. It raises :class:`InputError` for bad input
(exit 2) and :class:`RuntimeFailure` for everything that went wrong while doing
valid work (exit 1). Both carry messages meant for a person, one line each.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Problem:
    """One thing wrong with an input: where it is and what was expected."""

    file: Path | str | None
    field: str | None
    message: str

    def __str__(self) -> str:
        parts = [str(p) for p in (self.file, self.field) if p not in (None, "")]
        return ": ".join([*parts, self.message])


class JabasError(Exception):
    """Base class of the errors the CLI turns into a message and an exit code."""

    exit_code = 1

    def __init__(self, problems: Iterable[Problem | str]) -> None:
        self.problems = [p if isinstance(p, Problem) else Problem(None, None, p) for p in problems]
        super().__init__("\n".join(str(p) for p in self.problems))

    @classmethod
    def at(cls, file: Path | str | None, field: str | None, message: str) -> JabasError:
        return cls([Problem(file, field, message)])

    def lines(self) -> list[str]:
        return [str(p) for p in self.problems]


class InputError(JabasError):
    """A file, option or field is not what was expected (exit code 2)."""

    exit_code = 2


class RuntimeFailure(JabasError):
    """Valid work that failed: a crashed trainer, a lost connection (exit code 1)."""

    exit_code = 1
