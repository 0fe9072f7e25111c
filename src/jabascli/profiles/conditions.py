"""Measuring conditions: how a computation profile was taken, against how a trainer will run.

A profile predicts a trainer only when both run alike: on the same kind of
device (``cpu``, ``cuda``, or ``emulated`` on the CPU with the same
``slowdown``), with the same number of torch threads on the CPU, in the same
precision and under the same torch version. The profilers record these in
every memory and computation profile (:class:`~jabascli.profiles.formats.CompProfile`
fields ``device``, ``slowdown``, ``threads``, ``precision``, ``torch_version``).
Profiles written before that, and the seed's, have none of them: their
conditions are *unknown*, which is reported as such, never as an error.

Pure Python: no torch (the caller says which torch version and device it runs).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from jabascli.profiles.formats import CompProfile


@dataclass(frozen=True)
class Conditions:
    """How one device's work is (or was) run. ``None`` fields are unknown and never compared."""

    device: str | None
    """``cpu``, ``cuda`` or ``emulated``."""
    slowdown: float | None
    threads: int | None
    """torch intra-op threads; compared on the CPU and emulated devices only."""
    precision: str | None
    torch_version: str | None

    @classmethod
    def of_profile(cls, profile: CompProfile) -> Conditions | None:
        """The profile's conditions, or None when it records none (the seed's files, older ones)."""
        if profile.device is None and profile.threads is None and profile.torch_version is None:
            return None
        return cls(profile.device, profile.slowdown, profile.threads, profile.precision, profile.torch_version)

    def describe(self) -> str:
        parts = [self.device or "device unknown"]
        if self.device == "emulated" and self.slowdown is not None:
            parts[0] += f" x{self.slowdown:g}"
        if self.threads is not None and self.device != "cuda":
            parts.append(f"{self.threads} thread{'s' if self.threads != 1 else ''}")
        if self.precision:
            parts.append(self.precision)
        if self.torch_version:
            parts.append(f"torch {self.torch_version}")
        return ", ".join(parts)


def differences(profiled: Conditions, running: Conditions) -> list[str]:
    """What differs between a profile's conditions and a trainer's, one phrase each ("threads 2 vs 1")."""
    found = []

    def compare(what: str, measured: object, now: object) -> None:
        if measured is not None and now is not None and measured != now:
            found.append(f"{what} {measured} (profiled) vs {now} (running)")

    compare("device", profiled.device, running.device)
    if profiled.device == running.device == "emulated":
        compare("slowdown", profiled.slowdown, running.slowdown)
    if "cuda" not in (profiled.device, running.device):
        compare("threads", profiled.threads, running.threads)
    compare("precision", profiled.precision, running.precision)
    compare("torch", profiled.torch_version, running.torch_version)
    return found


def server_note(server: str, profiles: Iterable[CompProfile], running: Conditions) -> str | None:
    """One line when ``server``'s computation profiles were measured otherwise than its trainers run.

    None when they agree, or when there are no profiles. Profiles without
    recorded conditions give "conditions unknown".
    """
    profiles = list(profiles)
    if not profiles:
        return None
    known = [c for c in (Conditions.of_profile(p) for p in profiles) if c is not None]
    if not known:
        return f"server {server!r}: profile conditions unknown (measured before they were recorded)"
    found: list[str] = []
    for conditions in known:
        for difference in differences(conditions, running):
            if difference not in found:
                found.append(difference)
    if not found:
        return None
    return (
        f"server {server!r} runs otherwise than it was profiled ({'; '.join(found)}): its predicted times may "
        "not hold; `jabas profile all --force` measures it as it runs"
    )
