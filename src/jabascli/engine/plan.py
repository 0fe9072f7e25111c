"""The per-rank training plan: LBS, and (VSW, GA) for every trainer rank.

A plan comes from one of two places:

* a plan file written by ``jabas solve --out`` (``[job] plan`` or ``--plan``)::

      {"gbs": 512, "lbs": 32, "weight_sync": "overlap",
       "assignments": [{"server": "node0", "device_type": "...", "gpus": 4, "vsw": 2, "ga": 0}, ...]}

  Ranks are numbered by walking ``assignments`` in order, one rank per GPU;
* otherwise the config: ``devices`` ranks per available server, in order, each
  with that server's ``vsw``/``ga``, and ``[job] lbs``.

Either way ``GBS = LBS * sum over ranks of VSW * (GA + 1)``, and the job has
``GBS / LBS`` identical *workers*; rank ``r`` runs the ``VSW_r * (GA_r + 1)``
workers numbered from :meth:`TrainingPlan.worker_offset` on.
Every check failure is an :class:`~jabascli.errors.InputError` naming the file
and the field.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jabascli.config import LoadedConfig, ServerConfig
from jabascli.errors import InputError, Problem

WEIGHT_SYNC_METHODS = ("sequential", "overlap")


@dataclass(frozen=True)
class RankPlan:
    """What one trainer rank (one GPU, or one emulated device) runs."""

    rank: int
    server: str
    device_type: str
    vsw: int
    ga: int
    slowdown: float = 1.0
    """Emulated servers: every compute step takes this many times as long (1.0: not emulated)."""
    emulated: bool = False

    @property
    def micro_steps(self) -> int:
        """Worker micro-steps this rank runs per iteration: ``VSW * (GA + 1)``."""
        return self.vsw * (self.ga + 1)


@dataclass(frozen=True)
class TrainingPlan:
    """LBS, weight sync and the rank plans of a whole job."""

    lbs: int
    ranks: tuple[RankPlan, ...]
    weight_sync: str = "recommend"
    """``sequential``, ``overlap`` or ``recommend`` (decided by the trainer from the bucket profile)."""
    file: str = ""
    """The file the plan came from: the plan file, or the config."""
    from_plan_file: bool = False

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def workers(self) -> int:
        """Identical workers per iteration: ``GBS / LBS``."""
        return sum(r.micro_steps for r in self.ranks)

    @property
    def gbs(self) -> int:
        return self.lbs * self.workers

    def rank(self, rank: int) -> RankPlan:
        return self.ranks[rank]

    def worker_offset(self, rank: int) -> int:
        """Index of rank ``rank``'s first worker: workers are numbered by rank, then VSW, then GA step."""
        return sum(r.micro_steps for r in self.ranks[:rank])

    def check_world_size(self, world_size: int) -> None:
        """A plan must name exactly the ranks that exist."""
        if world_size != self.world_size:
            field = "assignments" if self.from_plan_file else "cluster.servers"
            raise InputError.at(
                self.file,
                field,
                f"the plan has {self.world_size} ranks (one per GPU) but WORLD_SIZE is {world_size}: "
                f"start one trainer per rank (`jabas run`, or torchrun --nproc-per-node {self.world_size})",
            )

    def describe(self) -> str:
        """The seed's notation, e.g. ``node0:4GPU,VSW:2,GA:0 node1:2GPU,VSW:1,GA:1``."""
        groups: list[list[Any]] = []
        for r in self.ranks:
            if groups and groups[-1][0] == (r.server, r.vsw, r.ga):
                groups[-1][1] += 1
            else:
                groups.append([(r.server, r.vsw, r.ga), 1])
        return " ".join(f"{server}:{n}GPU,VSW:{vsw},GA:{ga}" for (server, vsw, ga), n in groups)

    def to_dict(self) -> dict[str, Any]:
        """The plan file format (with one assignment per run of identical ranks)."""
        assignments: list[dict[str, Any]] = []
        for r in self.ranks:
            last = assignments[-1] if assignments else None
            if last and (last["server"], last["vsw"], last["ga"]) == (r.server, r.vsw, r.ga):
                last["gpus"] += 1
            else:
                assignments.append(
                    {"server": r.server, "device_type": r.device_type, "gpus": 1, "vsw": r.vsw, "ga": r.ga}
                )
        return {"gbs": self.gbs, "lbs": self.lbs, "weight_sync": self.weight_sync, "assignments": assignments}


def _rank(rank: int, server: ServerConfig | None, name: str, device_type: str, vsw: int, ga: int) -> RankPlan:
    emulate = server.emulate if server is not None else None
    return RankPlan(
        rank=rank,
        server=name,
        device_type=device_type,
        vsw=vsw,
        ga=ga,
        slowdown=emulate.slowdown if emulate is not None else 1.0,
        emulated=emulate is not None,
    )


def plan_from_config(loaded: LoadedConfig) -> TrainingPlan:
    """The plan of a config without a plan file: ``devices`` ranks per available server."""
    cfg = loaded.config
    if cfg.job.lbs is None:
        raise InputError.at(loaded.path, "job.lbs", "a local batch size is needed to train without a plan file")
    ranks: list[RankPlan] = []
    for server in cfg.available():
        for _ in range(server.devices):
            ranks.append(_rank(len(ranks), server, server.name, server.device_type, server.vsw, server.ga))
    if not ranks:
        raise InputError.at(loaded.path, "cluster.servers", "no servers to train on")
    return TrainingPlan(cfg.job.lbs, tuple(ranks), cfg.job.weight_sync, str(loaded.path))


def load_plan(loaded: LoadedConfig, plan_path: Path | None = None) -> TrainingPlan:
    """The job's plan: ``plan_path``, else ``[job] plan``, else the config's servers.

    An explicit ``[job] weight_sync`` (``sequential`` or ``overlap``) wins over
    the plan file's; with ``recommend`` the plan file's choice is used.
    """
    path = plan_path or loaded.config.job.plan
    if path is None:
        return plan_from_config(loaded)
    plan = read_plan_file(Path(path), loaded)
    if loaded.config.job.weight_sync != "recommend":
        plan = dataclasses.replace(plan, weight_sync=loaded.config.job.weight_sync)
    return plan


def read_plan_file(path: Path, loaded: LoadedConfig) -> TrainingPlan:
    """Read and check a plan file against the config's servers."""
    if not path.is_file():
        raise InputError.at(path, None, "plan file not found")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise InputError.at(path, None, f"invalid JSON: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError.at(path, None, f"cannot read: {exc}") from None
    return parse_plan(raw, path, loaded)


def parse_plan(raw: Any, path: Path | str, loaded: LoadedConfig) -> TrainingPlan:
    """Check a plan object field by field; every problem is reported at once."""
    problems: list[Problem] = []

    def problem(field: str | None, message: str) -> None:
        problems.append(Problem(path, field, message))

    if not isinstance(raw, dict):
        raise InputError.at(path, None, "expected a JSON object (a plan from `jabas solve --out`)")
    lbs = _int_field(raw, "lbs", 1, problem)
    weight_sync = raw.get("weight_sync", "recommend")
    if weight_sync not in (*WEIGHT_SYNC_METHODS, "recommend"):
        problem("weight_sync", f"expected sequential, overlap or recommend (got {weight_sync!r})")
    assignments = raw.get("assignments")
    if not isinstance(assignments, list) or not assignments:
        problem("assignments", "expected a non-empty list of {server, device_type, gpus, vsw, ga}")
        raise InputError(problems)

    servers = {s.name: s for s in loaded.config.cluster.servers}
    used: dict[str, int] = {}
    ranks: list[RankPlan] = []
    for i, entry in enumerate(assignments):
        at = f"assignments[{i}]"
        if not isinstance(entry, dict):
            problem(at, "expected an object {server, device_type, gpus, vsw, ga}")
            continue
        name = entry.get("server")
        server = servers.get(name) if isinstance(name, str) else None
        if server is None:
            known = ", ".join(servers) or "none"
            problem(f"{at}.server", f"server {name!r} has no [[cluster.servers]] entry in the config (known: {known})")
        gpus = _int_field(entry, "gpus", 1, problem, at)
        vsw = _int_field(entry, "vsw", 1, problem, at)
        ga = _int_field(entry, "ga", 0, problem, at)
        if server is None or gpus is None or vsw is None or ga is None:
            continue
        used[server.name] = used.get(server.name, 0) + gpus
        if used[server.name] > server.devices:
            problem(
                f"{at}.gpus",
                f"the plan names {used[server.name]} devices of server {server.name!r}, which has {server.devices}",
            )
        device_type = entry.get("device_type", server.device_type)
        for _ in range(gpus):
            ranks.append(_rank(len(ranks), server, server.name, str(device_type), vsw, ga))

    if lbs is not None and not problems:
        workers = sum(r.micro_steps for r in ranks)
        gbs = raw.get("gbs")
        if gbs is not None and (isinstance(gbs, bool) or gbs != lbs * workers):
            problem("gbs", f"{gbs!r} does not equal LBS * sum VSW*(GA+1) = {lbs} * {workers} = {lbs * workers}")
    if problems:
        raise InputError(problems)
    assert lbs is not None
    return TrainingPlan(lbs, tuple(ranks), str(weight_sync), str(path), from_plan_file=True)


def _int_field(obj: dict[str, Any], key: str, minimum: int, problem: Any, prefix: str = "") -> int | None:
    field = f"{prefix}.{key}" if prefix else key
    value = obj.get(key)
    if value is None:
        problem(field, "required key is missing")
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        problem(field, f"expected an integer (got {value!r})")
        return None
    if value < minimum:
        problem(field, f"must be at least {minimum} (got {value})")
        return None
    return value
