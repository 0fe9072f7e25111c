"""The hybrid planner's plans over a job's GBS range: each GBS solved once per run, handed to the trainers.

A job with ``[parallel] plan = "auto"`` and hybrid profiles asks the planner for its fastest plan at every GBS
of ``--range LOW:HIGH`` (:func:`jabascli.hybrid.job.range_values`) on the job's servers: ``jabas run``'s
launcher to check the ``[batching]`` bounds (:mod:`jabascli.adaptive.checks`), then every trainer, at its own
start check and for its replanner (:mod:`jabascli.adaptive.batching`, with the top of the range bounded by
the training set). Each GBS is solved once in a process (:func:`plans_for` keeps them), and once per run:
the launcher writes what it solved to the run folder (:data:`FILE_NAME`, :func:`hand_off_plans`) and names the file
to its trainers in :data:`PLANS_ENV`; a trainer takes every GBS found there for the same config, profiles and
servers and solves only the others (the top of a range the launcher did not reach). A trainer without the
variable (plain ``torchrun``, an elastic run's agents) solves for itself.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from jabascli.atomic import atomic_write_json
from jabascli.config import LoadedConfig
from jabascli.errors import InputError, JabasError
from jabascli.solver.plan import Plan as PlanFile

PLANS_ENV = "JABAS_HYBRID_PLANS"
FILE_NAME = "hybrid_plans.json"

Key = tuple[str, str, tuple[str, ...]]
"""(config, profiles folder, servers): what a plan of the range depends on besides its GBS."""

_solved: dict[Key, dict[int, PlanFile | None]] = {}
"""By key, every GBS solved (or handed over) in this process: its plan file, None where it has no plan."""
_read: set[str] = set()
"""The handed-over files already taken into :data:`_solved`."""


def plans_for(loaded: LoadedConfig, servers: list[str], low: int, high: int) -> list[PlanFile] | None:
    """The planner's plan file for every GBS of ``--range low:high`` on ``servers`` that has one, by GBS.

    None when the job has no hybrid profiles, or they cannot be read (the other sources of plans apply then).
    """
    from jabascli.hybrid.job import load_job, model_name, plan_file, profiles_root, range_values, solve

    root = profiles_root(loaded)
    if not (root / "hybrid").is_dir():
        return None
    key: Key = (str(loaded.path), str(root), tuple(servers))
    _take_handed_over()
    known = _solved.get(key, {})
    wanted = range_values(low, high)
    missing = [gbs for gbs in wanted if gbs not in known]
    if missing:
        found: dict[int, PlanFile | None] = {}
        try:
            job = load_job(loaded, root, model_name(loaded, root), servers=servers)
            for gbs in missing:
                try:
                    found[gbs] = plan_file(job, solve(job, gbs))
                except InputError:
                    found[gbs] = None  # no plan at this GBS, or none the runtime can deal out
        except (JabasError, OSError, ValueError):
            return None
        if key not in _solved and len(_solved) >= 4:
            _solved.clear()
        known = _solved.setdefault(key, {})
        known.update(found)
    return [plan for gbs in wanted if (plan := known[gbs]) is not None]


def hand_off_plans(loaded: LoadedConfig, folder: Path) -> dict[str, str]:
    """Write this process's plans for ``loaded`` to ``folder``; the environment that names them to trainers.

    Nothing (an empty environment) when this process solved none for this config.
    """
    entries = [
        {
            "profiles": profiles,
            "servers": list(servers),
            "plans": {str(gbs): None if plan is None else plan.to_dict() for gbs, plan in plans.items()},
        }
        for (config, profiles, servers), plans in _solved.items()
        if config == str(loaded.path) and plans
    ]
    if not entries:
        return {}
    folder.mkdir(parents=True, exist_ok=True)
    path = atomic_write_json(folder / FILE_NAME, {"config": str(loaded.path), "ranges": entries})
    return {PLANS_ENV: str(path)}


def _take_handed_over() -> None:
    """The plans the launcher named in :data:`PLANS_ENV`, into :data:`_solved` (once; a bad file is passed over:
    the trainer solves for itself)."""
    name = os.environ.get(PLANS_ENV)
    if not name or name in _read:
        return
    _read.add(name)
    try:
        data: Any = json.loads(Path(name).read_text(encoding="utf-8"))
        for entry in data["ranges"]:
            key: Key = (str(data["config"]), str(entry["profiles"]), tuple(str(s) for s in entry["servers"]))
            plans = {int(g): None if p is None else PlanFile.from_dict(p, name) for g, p in entry["plans"].items()}
            _solved.setdefault(key, {}).update(plans)
    except (OSError, ValueError, KeyError, TypeError, JabasError):
        return
