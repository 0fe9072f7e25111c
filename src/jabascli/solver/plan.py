"""The plan: what ``jabas solve`` decides and ``jabas train`` runs.

A plan is one JSON object::

    {"gbs": 512, "lbs": 32, "weight_sync": "overlap",
     "iteration_time_s": 0.21, "throughput": 2438.1,
     "assignments": [{"server": "node0", "device_type": "Tesla V100-PCIE-16GB",
                      "gpus": 4, "vsw": 2, "ga": 0, "iteration_time_s": 0.21}, ...]}

Each assignment is a group of ``gpus`` GPUs of one server that all run ``vsw``
VSWs with ``ga`` extra GA micro-steps; ``iteration_time_s`` inside an
assignment (optional) is the model's prediction for those GPUs. Ranks are
numbered by walking ``assignments`` in order, one rank per GPU: the first
assignment's GPUs are ranks ``0 .. gpus-1``, and so on. The plan holds
``gbs == lbs * sum(gpus * vsw * (ga + 1))`` exactly.

An *uneven* plan also gives assignments their own ``"lbs"``: those GPUs' micro-batches
hold that many samples instead of the plan's ``lbs``, and the plan holds
``gbs == sum(gpus * vsw * (ga + 1) * (assignment lbs, else lbs))``. It is the
same synchronous SGD at GBS (each micro-batch's mean loss is weighted by its
share of the GBS, docs/engine.md), for a fixed GBS on plain IIDP: no
``[parallel]`` layout and no adaptive batching, whose estimators need identical
workers (:mod:`jabascli.solver.uneven` builds them).

A hybrid plan (``jabas solve --hybrid``) also holds ``"parallel"``: the
``[parallel]`` keys of its layout (tp, pp, stages, schedule, sharding,
checkpointing, layers; docs/hybrid.md), which win over the config's; its
assignments then give every rank of a replica its share of the replica's
micro-batches as ``ga`` (docs/hybrid-planner.md).

Readers ignore keys they do not know, so keys can be added. A plan may also be
written by hand: ``gbs`` (derived), ``device_type`` (the server's), and the
predicted times may be left out, and ``weight_sync`` may be ``recommend`` (the
trainer decides). This module is the one reader of plan files: the solver
writes them, the engine reads them through :func:`read_plan`. It is pure Python
(no numpy, no torch) so any process can read a plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from jabascli.atomic import atomic_write_json
from jabascli.config.models import ParallelConfig
from jabascli.errors import InputError, Problem
from jabascli.inputs import read_json

PLAN_WEIGHT_SYNC = ("sequential", "overlap", "recommend")


@dataclass(frozen=True)
class Assignment:
    """``gpus`` GPUs of ``server``, each running ``vsw`` VSWs and ``ga`` extra GA micro-steps."""

    server: str
    device_type: str | None
    gpus: int
    vsw: int
    ga: int
    iteration_time_s: float | None = None
    lbs: int | None = None
    """These GPUs' own LBS in an uneven plan (None: the plan's)."""

    @property
    def workers(self) -> int:
        """IIDP workers (micro-batches per iteration) of these GPUs: ``gpus * vsw * (ga + 1)``."""
        return self.gpus * self.vsw * (self.ga + 1)

    def samples(self, plan_lbs: int) -> int:
        """Samples these GPUs train per iteration: ``workers * LBS`` (their own LBS, else the plan's)."""
        return self.workers * (self.lbs or plan_lbs)

    def seed_form(self) -> str:
        """The seed's notation, e.g. ``node0:4GPU,VSW:1,GA:0`` (``,LBS:96`` where the GPUs have their own)."""
        own = f",LBS:{self.lbs}" if self.lbs is not None else ""
        return f"{self.server}:{self.gpus}GPU,VSW:{self.vsw},GA:{self.ga}{own}"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "server": self.server,
            "device_type": self.device_type,
            "gpus": self.gpus,
            "vsw": self.vsw,
            "ga": self.ga,
            "iteration_time_s": self.iteration_time_s,
            "lbs": self.lbs,
        }
        return {k: v for k, v in out.items() if v is not None}


@dataclass(frozen=True)
class Plan:
    """LBS, weight sync and (VSW, GA) per group of GPUs for one global batch size."""

    gbs: int
    lbs: int
    weight_sync: str
    iteration_time_s: float | None
    throughput: float | None
    assignments: tuple[Assignment, ...]
    parallel: ParallelConfig | None = None
    """The layout of every replica (a hybrid plan); None: the config's ``[parallel]``, if any."""

    @property
    def gpus(self) -> int:
        return sum(a.gpus for a in self.assignments)

    @property
    def workers(self) -> int:
        return sum(a.workers for a in self.assignments)

    @property
    def uneven(self) -> bool:
        """Whether some GPUs' micro-batches differ in size from others' (an uneven plan)."""
        return len({a.lbs or self.lbs for a in self.assignments}) > 1

    def lbs_text(self) -> str:
        """``32``, or an uneven plan's LBS per assignment: ``160+96``."""
        if not self.uneven:
            return str(self.lbs)
        return "+".join(str(a.lbs or self.lbs) for a in self.assignments)

    def shape(self) -> tuple[tuple[str, int, int, int, int], ...]:
        """What the plan trains: each group's server, GPUs, VSW, GA and LBS (not the times predicted from one or
        another model), so an uneven plan whose groups share one LBS has IIDP's plan's shape."""
        return tuple((a.server, a.gpus, a.vsw, a.ga, a.lbs or self.lbs) for a in self.assignments)

    def servers(self) -> list[str]:
        """Servers the plan uses, in rank order."""
        return list(dict.fromkeys(a.server for a in self.assignments))

    def seed_form(self) -> str:
        """Every assignment in the seed's notation, space-separated."""
        return " ".join(a.seed_form() for a in self.assignments)

    def ranks(self) -> list[Assignment]:
        """The assignment each rank belongs to: rank ``r`` runs ``ranks()[r]``."""
        return [a for a in self.assignments for _ in range(a.gpus)]

    def to_dict(self) -> dict[str, Any]:
        out = {
            "gbs": self.gbs,
            "lbs": self.lbs,
            "weight_sync": self.weight_sync,
            "iteration_time_s": self.iteration_time_s,
            "throughput": self.throughput,
            "assignments": [a.to_dict() for a in self.assignments],
            "parallel": self.parallel.model_dump(mode="json") if self.parallel is not None else None,
        }
        return {k: v for k, v in out.items() if v is not None}

    @classmethod
    def from_dict(cls, data: Any, source: Path | str | None = None) -> Plan:
        """Validate a plan's JSON object; every problem is reported with its field."""
        problems: list[Problem] = []

        def bad(field: str, message: str) -> None:
            problems.append(Problem(source, field, message))

        if not isinstance(data, dict):
            raise InputError.at(source, None, "expected a JSON object (a plan written by `jabas solve --out`)")
        gbs = _int(data, "gbs", 1, bad) if "gbs" in data else None
        lbs = _int(data, "lbs", 1, bad)
        weight_sync = data.get("weight_sync", "recommend")
        if weight_sync not in PLAN_WEIGHT_SYNC:
            bad("weight_sync", f"expected sequential, overlap or recommend, got {weight_sync!r}")
        time_s = _float(data, "iteration_time_s", bad) if "iteration_time_s" in data else None
        throughput = _float(data, "throughput", bad) if "throughput" in data else None
        raw = data.get("assignments")
        assignments: list[Assignment] = []
        if not isinstance(raw, list) or not raw:
            bad("assignments", "expected a non-empty list of assignments")
            raw = []
        for i, item in enumerate(raw):
            where = f"assignments[{i}]"
            if not isinstance(item, dict):
                bad(where, "expected an object with server, device_type, gpus, vsw, ga")
                continue

            def bad_item(field: str, message: str, where: str = where) -> None:
                bad(f"{where}.{field}", message)

            server, device_type = item.get("server"), item.get("device_type")
            if not isinstance(server, str) or not server:
                bad_item("server", f"expected a non-empty string, got {server!r}")
            if device_type is not None and (not isinstance(device_type, str) or not device_type):
                bad_item("device_type", f"expected a non-empty string, got {device_type!r}")
            gpus = _int(item, "gpus", 1, bad_item)
            vsw = _int(item, "vsw", 1, bad_item)
            ga = _int(item, "ga", 0, bad_item)
            item_time = _float(item, "iteration_time_s", bad_item) if "iteration_time_s" in item else None
            own = _int(item, "lbs", 1, bad_item) if "lbs" in item else None
            assignments.append(Assignment(str(server), device_type, gpus, vsw, ga, item_time, own))
        parallel = _parallel(data["parallel"], bad) if "parallel" in data else None
        samples = sum(a.samples(lbs) for a in assignments)
        if gbs is None:
            gbs = samples
        elif not problems and samples != gbs:
            if any(a.lbs is not None for a in assignments):
                bad("gbs", f"is {gbs} but the assignments train sum(gpus * vsw * (ga + 1) * lbs) = {samples}")
            else:
                workers = sum(a.workers for a in assignments)
                bad("gbs", f"is {gbs} but lbs * sum(gpus * vsw * (ga + 1)) = {lbs} * {workers} = {samples}")
        plan = cls(gbs, lbs, str(weight_sync), time_s, throughput, tuple(assignments), parallel)
        if not problems and plan.uneven and parallel is not None:
            bad("parallel", "an uneven plan (assignments with their own lbs) trains plain IIDP, without a layout")
        if problems:
            raise InputError(problems)
        return plan


def _parallel(value: Any, bad: Any) -> ParallelConfig | None:
    try:
        return ParallelConfig.model_validate(value)
    except ValidationError as err:
        first = err.errors()[0]
        bad(".".join(["parallel", *(str(p) for p in first["loc"])]), first["msg"])
        return None


def _int(data: dict[str, Any], key: str, minimum: int, bad: Any) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        bad(key, f"expected an integer >= {minimum}, got {value!r}")
        return minimum
    return value


def _float(data: dict[str, Any], key: str, bad: Any) -> float:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        bad(key, f"expected a positive number, got {value!r}")
        return 1.0
    return float(value)


def write_plan(path: Path | str, plan: Plan) -> Path:
    """Write a plan atomically, as indented JSON."""
    return atomic_write_json(path, plan.to_dict(), indent=2)


def read_plan(path: Path | str) -> Plan:
    """Read and validate a plan file; InputError names the file and every bad field."""
    return Plan.from_dict(read_json(path, what="plan file"), path)
