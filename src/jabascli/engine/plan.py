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

An *uneven* plan (a plan file whose assignments name their own ``lbs``) gives
rank ``r`` micro-batches of ``LBS_r`` samples, so ``GBS = sum over ranks of
LBS_r * VSW_r * (GA_r + 1)``: its workers differ in size and every one's mean
loss is weighted by ``LBS_r * W / GBS`` (1 in an even plan; docs/engine.md). It
trains a fixed GBS on plain IIDP only: adaptive batching's estimators and the
``[parallel]`` layouts need identical workers.
Every check failure is an :class:`~jabascli.errors.InputError` naming the file
and the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jabascli.config import LoadedConfig, ServerConfig
from jabascli.config.models import ParallelConfig
from jabascli.errors import InputError, Problem
from jabascli.solver.plan import Assignment, Plan, read_plan

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
    memory_bytes: int | None = None
    """Emulated servers: the device memory budget the trainer is held to (:mod:`jabascli.engine.memory_limit`)."""
    lbs: int | None = None
    """This rank's own LBS in an uneven plan (None: the plan's)."""

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
    parallel: ParallelConfig | None = None
    """A hybrid plan's layout (the plan file's ``parallel``), which wins over the config's ``[parallel]``."""

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def workers(self) -> int:
        """Workers (micro-batches) per iteration: ``GBS / LBS`` in an even plan."""
        return sum(r.micro_steps for r in self.ranks)

    @property
    def gbs(self) -> int:
        return sum(r.micro_steps * self.rank_lbs(r.rank) for r in self.ranks)

    @property
    def uneven(self) -> bool:
        """Whether some ranks' micro-batches hold more samples than others' (see the module doc)."""
        return len({self.rank_lbs(r.rank) for r in self.ranks}) > 1

    def rank_lbs(self, rank: int) -> int:
        """The samples of each of rank ``rank``'s micro-batches."""
        return self.ranks[rank].lbs or self.lbs

    def sample_offset(self, rank: int) -> int:
        """Samples of an iteration dealt to the ranks before ``rank``: where its first micro-batch starts."""
        return sum(r.micro_steps * self.rank_lbs(r.rank) for r in self.ranks[:rank])

    def micro_batch_sizes(self) -> list[int]:
        """Every worker's samples, in worker order (rank, then VSW, then GA step)."""
        return [self.rank_lbs(r.rank) for r in self.ranks for _ in range(r.micro_steps)]

    def loss_weight(self, rank: int) -> float:
        """What rank ``rank``'s micro-batch mean losses are multiplied by before the ``1 / W`` of every worker:
        ``LBS_r * W / GBS``, their share of the GBS mean loss; exactly 1 in an even plan."""
        return self.rank_lbs(rank) * self.workers / self.gbs

    def replica_micro_batches(self, size: int) -> list[int]:
        """Each replica's micro-batches per iteration, replicas being ``size`` consecutive ranks (``tp x pp`` of a
        ``[parallel]`` layout, the mesh's order): a replica runs those the plan deals to all of its ranks."""
        return [sum(r.micro_steps for r in self.ranks[i : i + size]) for i in range(0, self.world_size, size)]

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

    def to_solver_plan(self) -> Plan:
        """The plan in the plan-file form: one assignment per run of identical ranks."""
        assignments: list[Assignment] = []
        for r in self.ranks:
            last = assignments[-1] if assignments else None
            if last and (last.server, last.vsw, last.ga, last.lbs) == (r.server, r.vsw, r.ga, r.lbs):
                assignments[-1] = dataclasses.replace(last, gpus=last.gpus + 1)
            else:
                assignments.append(Assignment(r.server, r.device_type, 1, r.vsw, r.ga, lbs=r.lbs))
        return Plan(self.gbs, self.lbs, self.weight_sync, None, None, tuple(assignments), self.parallel)

    def describe(self) -> str:
        """The seed's notation, e.g. ``node0:4GPU,VSW:2,GA:0 node1:2GPU,VSW:1,GA:1``."""
        return self.to_solver_plan().seed_form()

    def to_dict(self) -> dict[str, Any]:
        """The plan file format."""
        return self.to_solver_plan().to_dict()


def _rank(
    rank: int, server: ServerConfig | None, name: str, device_type: str, vsw: int, ga: int, lbs: int | None = None
) -> RankPlan:
    emulate = server.emulate if server is not None else None
    return RankPlan(
        rank=rank,
        server=name,
        device_type=device_type,
        vsw=vsw,
        ga=ga,
        slowdown=emulate.slowdown if emulate is not None else 1.0,
        emulated=emulate is not None,
        memory_bytes=emulate.memory_bytes if emulate is not None else None,
        lbs=lbs,
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


def plan_from_dict(data: Any, loaded: LoadedConfig, source: str) -> TrainingPlan:
    """A plan in the plan file form received from a controller (a move in place), as :func:`load_plan` reads one."""
    plan = plan_from_solver(Plan.from_dict(data, source), source, loaded)
    if loaded.config.job.weight_sync != "recommend":
        plan = dataclasses.replace(plan, weight_sync=loaded.config.job.weight_sync)
    return plan


def read_plan_file(path: Path, loaded: LoadedConfig) -> TrainingPlan:
    """Read a plan file (``jabascli.solver.plan`` checks its form) and check it against the config."""
    return plan_from_solver(read_plan(path), path, loaded)


def plan_from_solver(plan: Plan, path: Path | str, loaded: LoadedConfig) -> TrainingPlan:
    """One rank per GPU of each assignment, in order; every server must exist with enough devices."""
    problems: list[Problem] = []
    servers = {s.name: s for s in loaded.config.cluster.servers}
    used: dict[str, int] = {}
    ranks: list[RankPlan] = []
    for i, a in enumerate(plan.assignments):
        at = f"assignments[{i}]"
        server = servers.get(a.server)
        if server is None:
            known = ", ".join(servers) or "none"
            problems.append(
                Problem(path, f"{at}.server", f"server {a.server!r} has no [[cluster.servers]] entry (known: {known})")
            )
            continue
        used[a.server] = used.get(a.server, 0) + a.gpus
        if used[a.server] > server.devices:
            problems.append(
                Problem(
                    path,
                    f"{at}.gpus",
                    f"the plan names {used[a.server]} devices of server {a.server!r}, which has {server.devices}",
                )
            )
        for _ in range(a.gpus):
            device_type = a.device_type or server.device_type
            ranks.append(_rank(len(ranks), server, a.server, device_type, a.vsw, a.ga, a.lbs))
    if plan.uneven:
        problems.extend(_uneven_problems(loaded, path))
    if problems:
        raise InputError(problems)
    return TrainingPlan(
        plan.lbs, tuple(ranks), plan.weight_sync, str(path), from_plan_file=True, parallel=plan.parallel
    )


def _uneven_problems(loaded: LoadedConfig, path: Path | str) -> list[Problem]:
    """An uneven plan trains a fixed GBS on plain IIDP: adaptive batching and layouts need identical workers."""
    cfg = loaded.config
    problems = []
    if cfg.batching.metric != "fixed":
        problems.append(
            Problem(
                path,
                "assignments",
                f"an uneven plan (assignments with their own lbs) trains a fixed GBS, but [batching] metric is "
                f"{cfg.batching.metric!r} in {loaded.path}: its estimators need workers of one LBS",
            )
        )
    if cfg.parallel is not None:
        problems.append(
            Problem(path, "assignments", f"an uneven plan trains plain IIDP, but {loaded.path} has a [parallel] layout")
        )
    return problems
