"""Whether each server's trainers run as its computation profile was measured.

``jabas run`` asks before it starts the trainers; a server whose profile was
taken otherwise (another thread count, device, slowdown, precision or torch)
gets one line in its trainers' logs and in ``jabas run``'s start line
(:func:`jabascli.profiles.conditions.server_note`).

Threads are the one condition ``jabas run`` can choose: its trainers take the
count their servers were profiled with (:func:`profiled_threads`), so that a
plan leaving a profiled server out does not give the others its cores and run
faster, or slower, than the solver predicted. ``OMP_NUM_THREADS`` still wins.
"""

from __future__ import annotations

from importlib import metadata

from jabascli.config import LoadedConfig
from jabascli.devices import detect_devices
from jabascli.engine.plan import TrainingPlan
from jabascli.errors import InputError
from jabascli.profiles.conditions import Conditions, server_note
from jabascli.profiles.formats import CompProfile, read_comp_profiles


def profile_notes(loaded: LoadedConfig, plan: TrainingPlan, threads: int) -> dict[str, str]:
    """Per server of ``plan``: a line when its trainers (``threads`` torch threads each) run otherwise than profiled."""
    folder = loaded.profile_dirs().computation
    if not folder.is_dir():
        return {}
    try:
        profiles = read_comp_profiles(folder)
    except InputError:
        return {}  # a plan that needs them has read them already; a config's plan runs without them
    try:
        torch_version: str | None = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    backend = None
    notes: dict[str, str] = {}
    for rank in plan.ranks:
        if rank.server in notes:
            continue
        if not rank.emulated and backend is None:
            backend = detect_devices().backend
        device = "emulated" if rank.emulated else backend
        running = Conditions(device, rank.slowdown, threads, loaded.config.job.precision, torch_version)
        note = server_note(rank.server, _profiles_of(profiles, rank.server, rank.device_type), running)
        if note is not None:
            notes[rank.server] = note
    return notes


def profiled_threads(loaded: LoadedConfig, plan: TrainingPlan) -> int | None:
    """The torch threads the CPU and emulated servers of ``plan`` were profiled with, when their profiles agree.

    None when the plan runs on GPUs only, no such profile records its threads, or they disagree.
    """
    folder = loaded.profile_dirs().computation
    if not folder.is_dir():
        return None
    try:
        profiles = read_comp_profiles(folder)
    except InputError:
        return None
    counts = {
        p.threads
        for rank in plan.ranks
        for p in _profiles_of(profiles, rank.server, rank.device_type)
        if p.threads is not None and p.device in ("cpu", "emulated")
    }
    return counts.pop() if len(counts) == 1 else None


def _profiles_of(profiles: dict[tuple[str, int, int], CompProfile], server: str, device_type: str) -> list[CompProfile]:
    """The server's own profiles, else those of its device type (profiles describe a device type)."""
    own = [p for (name, _, _), p in profiles.items() if name == server]
    return own or [p for p in profiles.values() if p.gpu_type == device_type]
