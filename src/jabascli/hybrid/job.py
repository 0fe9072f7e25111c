"""The hybrid planner on a job: the job's servers and profiles in, the plan the runtime reads out.

``jabas solve --hybrid`` (docs/hybrid-planner.md, "On a job"):

* **servers**: the config's available servers, grouped by device type (:class:`~.search.ServerGroup`); a type's
  devices per server and memory budget are the config's (``devices``; ``[emulate] memory_bytes``, else
  ``memory_bytes``), else the profile's. Every server of a type must have the same number of devices;
* **profiles**: ``<profiles>/hybrid/<model>/`` (``--profiles DIR``, else ``[profiles] dir``, else ``profiles/``
  beside the config); the model is the only one there, else the job's workload name;
* **one TP degree**: the runtime's ``[parallel] tp`` is one degree for the whole job, so the search runs once per
  TP degree profiled on every device type used, with the times of that degree only, and the fastest plan wins;
* **the plan file** (:func:`plan_file`): ``parallel`` holds the ``[parallel]`` keys of the plan's layout and the
  assignments deal each replica's ``M_r`` micro-batches to its ``S t`` ranks, in the runtime's rank order
  (replica by replica, stage by stage, the ``t`` ranks of a TP group), as ``ga``: rank ``k`` of a replica runs
  ``floor(M_r / (S t)) + [k < M_r mod (S t)]``, so that ``GBS = LBS * sum of every rank's micro-batches``; so
  ``M_r >= S t``, which the search keeps to (``search(..., deal=True)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from jabascli.config import LoadedConfig, ServerConfig
from jabascli.config.models import ParallelConfig
from jabascli.errors import InputError
from jabascli.hybrid.costmodel import CostModel
from jabascli.hybrid.plan import Plan
from jabascli.hybrid.search import Choice, ServerGroup, search
from jabascli.profiles.hybrid import HybridProfiles, blocks_file, device_file, profiled_models, read_profiles
from jabascli.solver.plan import Assignment
from jabascli.solver.plan import Plan as PlanFile


@dataclass
class HybridJob:
    """A job's hybrid profiles (devices and budgets as its config says) and servers, ready to plan."""

    profiles: HybridProfiles
    servers: list[ServerGroup]
    names: dict[str, list[str]]
    """Config server names of each device type, in config order: the search's ``<type>-<k>`` is the ``k``-th."""
    folder: Path
    """``<profiles>/hybrid/<model>``: named in errors."""
    tp: int | None = None
    """Plan with this TP degree only (None: every degree profiled on every type used)."""
    _models: dict[int, CostModel] = field(default_factory=dict)

    def degrees(self) -> list[int]:
        """The TP degrees the plan may use: ``tp`` if given, else those profiled on every device type of the job."""
        have = {
            g.device: sorted({t for per_tp in self.profiles.devices[g.device].times.values() for t in per_tp})
            for g in self.servers
        }
        if self.tp is None:
            common = sorted(set.intersection(*(set(v) for v in have.values())))
            if not common:
                raise InputError.at(self.folder, "times", f"no TP degree is profiled on every device type: {have}")
            return common
        for device, degrees in have.items():
            if self.tp not in degrees:
                raise InputError.at(
                    device_file(self.folder, device),
                    "times",
                    f"no block times at TP degree {self.tp} (have {degrees})",
                )
        return [self.tp]

    def on_servers(self, names: dict[str, list[str]]) -> HybridJob:
        """The same profiles, and cost models (their memos), on other servers: ``names`` per device type."""
        groups = [ServerGroup(d, len(of_type)) for d, of_type in names.items()]
        return HybridJob(self.profiles, groups, names, self.folder, self.tp, self._models)

    def model(self, tp: int) -> CostModel:
        """The cost model over the times of TP degree ``tp`` only (kept: its memo serves every GBS)."""
        if tp not in self._models:
            devices = {
                name: dev.model_copy(
                    update={"times": {b: {tp: rows[tp]} for b, rows in dev.times.items() if tp in rows}}
                )
                for name, dev in self.profiles.devices.items()
            }
            self._models[tp] = CostModel(self.profiles.model_copy(update={"devices": devices}))
        return self._models[tp]


def profiles_root(loaded: LoadedConfig, folder: Path | None = None) -> Path:
    """The profiles folder holding ``hybrid/``: ``folder``, else ``[profiles] dir``, else ``profiles/``."""
    return folder or loaded.config.profiles.dir or loaded.folder / "profiles"


def model_name(loaded: LoadedConfig, root: Path, model: str | None = None) -> str:
    """``model``, else the only model under ``<root>/hybrid/``, else the job's workload name."""
    if model is not None:
        return model
    found = profiled_models(root)
    if len(found) == 1:
        return found[0]
    workload = loaded.config.job.workload
    if workload is not None and Path(workload).stem in found:
        return Path(workload).stem
    have = ", ".join(found) or "none"
    raise InputError.at(
        root / "hybrid",
        None,
        f"which model? name one with --model (hybrid profiles here: {have}; "
        "`jabas profile hybrid` or `jabas profile import` writes them)",
    )


def load_job(
    loaded: LoadedConfig, root: Path, model: str, tp: int | None = None, servers: list[str] | None = None
) -> HybridJob:
    """The job's servers and the hybrid profiles of ``model`` under ``root``, checked against each other.

    ``servers``: plan on these config servers only (a running job's, when adaptive batching re-plans it), not the
    config's available ones."""
    profiles = read_profiles(root, model)
    folder = root / "hybrid" / model
    check_blocks(profiles, folder)
    by_type: dict[str, list[ServerConfig]] = {}
    chosen = loaded.config.available()
    if servers is not None:
        named = {s.name: s for s in loaded.config.cluster.servers}
        chosen = [named[name] for name in servers if name in named]
    for server in chosen:
        by_type.setdefault(server.device_type, []).append(server)
    if not by_type:
        raise InputError.at(loaded.path, "cluster.servers", "no servers to plan for")
    devices = dict(profiles.devices)
    for device, of_type in by_type.items():
        if device not in devices:
            have = ", ".join(sorted(devices)) or "none"
            raise InputError.at(
                device_file(folder, device),
                None,
                f"no hybrid profile of device type {device!r} (server {of_type[0].name}; have: {have})",
            )
        counts = sorted({s.devices for s in of_type})
        if len(counts) > 1:
            raise InputError.at(
                loaded.path,
                "cluster.servers",
                f"servers of device type {device!r} have {counts} devices: the hybrid planner takes one count per type",
            )
        budget = of_type[0].emulate.memory_bytes if of_type[0].emulate else of_type[0].memory_bytes
        update: dict[str, object] = {"devices_per_server": counts[0]}
        if budget is not None:
            update["memory_bytes"] = float(budget)
        devices[device] = devices[device].model_copy(update=update)
    job_profiles = profiles.model_copy(update={"devices": devices})
    groups = [ServerGroup(d, len(s)) for d, s in by_type.items()]
    names = {d: [s.name for s in of_type] for d, of_type in by_type.items()}
    return HybridJob(job_profiles, groups, names, folder, tp)


def check_blocks(profiles: HybridProfiles, folder: Path) -> None:
    """Every device's times cover every block of ``blocks.json``, and the blocks every TP degree measured."""
    n = profiles.num_blocks
    for name, dev in sorted(profiles.devices.items()):
        for b, per_tp in sorted(dev.times.items()):
            for t, rows in sorted(per_tp.items()):
                if len(rows) != n:
                    raise InputError.at(
                        device_file(folder, name),
                        f"times.{b}.{t}",
                        f"{len(rows)} blocks timed at micro-batch size {b}, TP degree {t}; the block profile has {n}",
                    )
                if t > 1 and any(
                    t not in blk.params_bytes and 1 not in blk.params_bytes for blk in profiles.blocks.blocks
                ):
                    raise InputError.at(blocks_file(folder), "blocks", f"no parameter bytes at TP degree {t}")


def solve(job: HybridJob, gbs: int) -> Choice:
    """The fastest plan for ``gbs`` on the job's servers with one TP degree, every device of a replica running one
    micro-batch at least (the runtime deals a replica's micro-batches to its ranks); InputError if none fits."""
    found: list[Choice] = []
    failure: InputError | None = None
    for tp in job.degrees():
        try:
            found.append(search(job.model(tp), job.servers, gbs, deal=True))
        except InputError as err:
            failure = failure or err
    if not found:
        assert failure is not None
        raise failure
    return min(found, key=lambda c: c.prediction.iteration_s)


def dealable(plan: Plan) -> str | None:
    """Why the runtime cannot run ``plan`` (a replica with fewer micro-batches than ranks: every rank runs at least
    one), or None. :func:`solve`'s plans can (``search(deal=True)``)."""
    for r, rep in enumerate(plan.replicas):
        size = sum(p.tp for p in rep.stages)
        if rep.microbatches < size:
            return f"replica {r} has {rep.microbatches} micro-batches for {size} devices: each runs one at least"
    return None


def range_values(lo: int, hi: int) -> list[int]:
    """The GBS values of ``--range LO:HI``: ``LO, 2 LO, 4 LO ...`` up to ``HI``, and ``HI``."""
    values = []
    gbs = lo
    while gbs <= hi:
        values.append(gbs)
        gbs *= 2
    if values[-1] != hi:
        values.append(hi)
    return values


def solve_range(job: HybridJob, lo: int, hi: int) -> list[Choice]:
    """The fastest plan of every GBS of :func:`range_values` that has one."""
    out = []
    for gbs in range_values(lo, hi):
        try:
            out.append(solve(job, gbs))
        except InputError:
            continue
    return out


def is_plain(plan: Plan) -> bool:
    """Plain IIDP: every replica holds the whole model on one device, nothing sharded or recomputed."""
    return (
        plan.num_stages == 1
        and all(p.tp == 1 for r in plan.replicas for p in r.stages)
        and plan.sharding == "none"
        and not plan.checkpoint
    )


def parallel_section(plan: Plan) -> ParallelConfig:
    """The ``[parallel]`` keys of a plan's layout (one TP degree: :func:`solve` plans with one)."""
    tps = {p.tp for r in plan.replicas for p in r.stages}
    if len(tps) != 1:
        raise InputError.at(None, "parallel.tp", f"the plan uses TP degrees {sorted(tps)}: the runtime takes one")
    return ParallelConfig(
        tp=tps.pop(),
        pp=plan.num_stages,
        stages=[(plan.bounds[s], plan.bounds[s + 1] - 1) for s in range(plan.num_stages)],
        schedule=plan.schedule,
        sharding=plan.sharding,
        checkpointing=sorted(plan.checkpoint) if plan.checkpoint else "none",
    )


def server_name(job: HybridJob, placement_server: str, device: str) -> str:
    """The config server of the search's ``<type>-<k>``."""
    k = int(placement_server.rsplit("-", 1)[1])
    names = job.names[device]
    if k >= len(names):  # the search packs within the servers it was given: cannot happen
        raise InputError.at(None, "servers", f"the plan needs {k + 1} servers of {device}, the job has {len(names)}")
    return names[k]


def plan_file(job: HybridJob, choice: Choice) -> PlanFile:
    """The plan file the runtime reads: ``parallel`` and every rank's micro-batches (module docstring)."""
    plan, pred = choice.plan, choice.prediction
    ranks: list[tuple[str, str, int, float]] = []  # server, device type, micro-batches, predicted T_r
    why = dealable(plan)
    if why is not None:
        raise InputError.at(None, "gbs", why)
    for r, rep in enumerate(plan.replicas):
        size = sum(p.tp for p in rep.stages)
        base, extra = divmod(rep.microbatches, size)
        k = 0
        for place in rep.stages:
            server = server_name(job, place.server, place.device)
            for _ in range(place.tp):
                ranks.append((server, place.device, base + (1 if k < extra else 0), pred.pipeline_s[r]))
                k += 1
    assignments: list[Assignment] = []
    for server, device, count, time_s in ranks:
        last = assignments[-1] if assignments else None
        if last is not None and (last.server, last.ga) == (server, count - 1) and last.iteration_time_s == time_s:
            assignments[-1] = Assignment(server, device, last.gpus + 1, 1, count - 1, time_s)
        else:
            assignments.append(Assignment(server, device, 1, 1, count - 1, time_s))
    samples_s = plan.gbs / pred.iteration_s
    return PlanFile(
        plan.gbs, plan.mbs, "recommend", pred.iteration_s, samples_s, tuple(assignments), parallel_section(plan)
    )


def plan_for_run(loaded: LoadedConfig, gbs: int) -> PlanFile:
    """``jabas run``'s plan for a job with ``[parallel] plan = "auto"``: ``jabas solve --hybrid``'s for ``gbs``."""
    root = profiles_root(loaded)
    if not (root / "hybrid").is_dir():
        raise InputError.at(
            root / "hybrid",
            None,
            f'no hybrid profiles for [parallel] plan = "auto": run `jabas profile hybrid -c {loaded.path}` first',
        )
    job = load_job(loaded, root, model_name(loaded, root))
    return plan_file(job, solve(job, gbs))
