"""Refit generations of a job's performance model, in its run folder (``perfmodel/refit-<N>.json``).

The online model (:mod:`jabascli.perfmodel.online`) refits the measured
profiles to the iteration times a job measured. Each refit is a new generation,
one JSON file, written atomically beside the run's metrics and never over an
older one; the measured profile files are never touched. A generation holds the
factors on the profiles' times, the digest of the measured profiles it was made
on (``prior``: a refit applies to those profiles only, so profiling again
starts the model over), and every observation so far, so that the next refit
starts from the whole history::

    {"generation": 2, "prior": "3f1c...", "prior_iterations": 2.0,
     "compute": {"fast": 0.93, "slow3": 1.08}, "comm": {"inter": 1.4}, "lbs": {"fast": {"64": 1.05, "256": 0.81}},
     "observations": [{"lbs": 64, "weight_sync": "sequential",
                       "assignments": [{"server": "fast", "gpus": 1, "vsw": 1, "ga": 2, "lbs": null,
                                        "busy_s": 0.0118}, ...],
                       "measured_s": 0.0135, "iterations": 55, "disturbed": false,
                       "load": 2.1, "predicted_s": 0.0127, "time": 1796000000.0}, ...],
     "error_before": 0.063, "error_after": 0.004, "time": 1796000000.0}

``lbs``: per server measured at two or more LBS, the factor on each profiled LBS
point its runs used, on top of its ``compute`` factor (absent in older files:
none). An assignment's ``lbs`` is its GPUs' own LBS in an uneven plan (null, or
absent in older files: the observation's ``lbs``); its ``busy_s``, its ranks'
median busy time (:mod:`jabascli.engine.busy`; null or absent: not measured).
``error_before``/``error_after``: the latest observation's ``(measured - predicted) / predicted`` under the
model that planned it and under this refit.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jabascli.atomic import atomic_write_json
from jabascli.errors import InputError, Problem
from jabascli.inputs import read_json

REFIT_DIRNAME = "perfmodel"
_NAME = re.compile(r"^refit-(\d+)\.json$")


class _Format(BaseModel):
    model_config = ConfigDict(extra="allow")


class ObservedAssignment(_Format):
    server: str
    gpus: int = Field(ge=1)
    vsw: int = Field(ge=1)
    ga: int = Field(ge=0)
    lbs: int | None = Field(default=None, ge=1)
    """These GPUs' own LBS in an uneven plan (None, and in files written before uneven plans: the plan's)."""
    busy_s: float | None = Field(default=None, gt=0)
    """The median busy time of these GPUs' ranks (``busy.csv``; None: not measured, as in older files)."""


class ObservedPlan(_Format):
    """One plan as a run trained it, and what it measured."""

    lbs: int = Field(ge=1)
    weight_sync: str
    assignments: list[ObservedAssignment]
    measured_s: float = Field(gt=0)
    iterations: int = Field(ge=1)
    disturbed: bool = False
    load: float | None = None
    """The host's one-minute load average when the run ended."""
    predicted_s: float | None = None
    """What the model that planned the run predicted."""
    time: float | None = None


class RefitRecord(_Format):
    generation: int = Field(ge=1)
    prior: str
    prior_iterations: float = Field(gt=0)
    compute: dict[str, float]
    comm: dict[str, float]
    lbs: dict[str, dict[int, float]] = Field(default_factory=dict)
    """Per server, per profiled LBS: the factor on top of ``compute`` (:attr:`jabascli.perfmodel.online.Refit.lbs`)."""
    observations: list[ObservedPlan]
    error_before: float | None = None
    error_after: float | None = None
    time: float | None = None


def refit_folder(run_folder: Path) -> Path:
    return Path(run_folder) / REFIT_DIRNAME


def refit_generations(run_folder: Path) -> list[tuple[int, Path]]:
    """``(generation, path)`` of every refit in a run folder, oldest first."""
    folder = refit_folder(run_folder)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


def read_refit(path: Path) -> RefitRecord:
    try:
        return RefitRecord.model_validate(read_json(path, what="refit"))
    except ValidationError as exc:
        problems = [Problem(path, ".".join(str(p) for p in e["loc"]) or None, e["msg"]) for e in exc.errors()]
        raise InputError(problems) from None


def write_refit(run_folder: Path, record: RefitRecord) -> Path:
    """Write generation ``record.generation``; an existing generation is never replaced."""
    path = refit_folder(run_folder) / f"refit-{record.generation}.json"
    if path.exists():
        raise InputError.at(path, "generation", "exists already: a refit generation is never overwritten")
    return atomic_write_json(path, record.model_dump(mode="json"), indent=1)
