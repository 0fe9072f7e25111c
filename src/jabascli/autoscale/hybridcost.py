"""The auto-scaler's cost model for hybrid jobs: the hybrid planner's best plan on each candidate allocation.

:class:`HybridCostModel` answers ``iteration_time(choice, gbs)`` for a job with ``[parallel]`` and hybrid profiles
(docs/autoscaling.md, "Hybrid jobs"):

* the allocation's used servers, grouped by device type, are handed to the hybrid planner
  (:func:`jabascli.hybrid.job.solve`, the same search ``jabas solve --hybrid`` runs; no second planner): its
  fastest plan's predicted iteration time, or ``inf`` when no plan fits every device's memory (or none deals a
  micro-batch to every device, or no profiled micro-batch size divides the GBS). An allocation no plan fits is
  so never chosen;
* the hybrid planner takes one device count per type, so an allocation that uses part of one server of a type and
  all of another (allocation units smaller than a server) has no hybrid plan: ``inf`` for the hybrid part;
* ``plain``: the plain data-parallel cost model (:class:`~jabascli.autoscale.costmodel.SolverCostModel`, when the
  job has plain profiles too); the time is the lesser of the two, so a model that fits one device still gets plain
  IIDP's pricing when that is fastest (issue 21);
* ``lower_bound``: ``g W / N``, ``N`` the allocation's devices and ``W`` the least device-seconds a sample can
  take through the model, block by block the least of ``t (f_i + g_i) / b`` over the allocation's device types and
  every profiled ``(b, t)``. It holds for every plan of the cost model: a replica's ``T_r >= M_r max_s c_s >= M_r
  sum_s t_s c_s / n_r`` (``n_r`` its devices), so its ``M_r b`` samples take at most ``T n_r / W`` and summing over
  replicas ``g <= T N / W``; with plain pricing beside it, the lesser of the two bounds. The planner sorts and
  prunes candidates by it;
* every ``(allocation, GBS)`` is searched once (the search is the expensive part), and every device-count shape's
  :class:`~jabascli.hybrid.job.HybridJob` is built once, so its per-TP cost models and their memos serve every
  allocation and GBS of that shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from jabascli.autoscale.allocation import AllocationSpace, Choice
from jabascli.autoscale.costmodel import IterationCostModel, SolverCostModel
from jabascli.errors import InputError
from jabascli.hybrid.job import HybridJob, solve
from jabascli.hybrid.search import Choice as PlanChoice
from jabascli.perfmodel import PerformanceModel


@dataclass(frozen=True)
class Priced:
    """What one allocation at one GBS was priced at, and by which model."""

    time_s: float
    by: str
    """``hybrid`` (the hybrid planner's plan), ``plain`` (the data-parallel solver) or ``none`` (inf)."""
    plan: PlanChoice | None = None
    """The hybrid planner's plan, when it priced it or was beaten by plain."""


class HybridCostModel:
    """Iteration times of a hybrid job: the hybrid planner's best plan, or plain IIDP's time when faster."""

    def __init__(self, job: HybridJob, space: AllocationSpace, plain: IterationCostModel | None = None) -> None:
        """``job``: the hybrid profiles and the config's server names per device type (:func:`~jabascli.hybrid.job.
        load_job` on the available servers); ``plain``: the data-parallel cost model, None without plain profiles."""
        self.job = job
        self.space = space
        self.plain = plain
        self._jobs: dict[tuple[tuple[str, int], ...], HybridJob] = {}
        self._priced: dict[tuple[Choice, int], Priced] = {}
        self._work: dict[frozenset[str], float] = {}
        self.searches = 0
        """Hybrid searches run (each (allocation, GBS) once): for the measurements in docs/autoscaling.md."""

    # What the auto-scaler's wiring reads of a plain cost model (elastic/autoscaling.py) -------------------

    @property
    def model(self) -> PerformanceModel:
        """The plain performance model (the adaptive batching's LBS values, the simulator's profiles)."""
        if not isinstance(self.plain, SolverCostModel):
            raise InputError.at(
                None, "profiles", "a hybrid job without plain profiles: run `jabas profile all` for plain IIDP too"
            )
        return self.plain.model

    @property
    def warm_gbs(self) -> int | None:
        return self.plain.warm_gbs if isinstance(self.plain, SolverCostModel) else None

    @warm_gbs.setter
    def warm_gbs(self, value: int | None) -> None:
        if isinstance(self.plain, SolverCostModel):
            self.plain.warm_gbs = value

    # Pricing -----------------------------------------------------------------------------------------------

    def iteration_time(self, choice: Choice, gbs: int) -> float:
        return self.priced(choice, gbs).time_s

    def priced(self, choice: Choice, gbs: int) -> Priced:
        """The allocation's price at ``gbs``: the lesser of the hybrid plan's and plain IIDP's time (cached)."""
        key = (choice, gbs)
        if key not in self._priced:
            plan = self.hybrid_plan(choice, gbs)
            hybrid = plan.prediction.iteration_s if plan is not None else math.inf
            plain = self.plain.iteration_time(choice, gbs) if self.plain is not None else math.inf
            if plain < hybrid:
                self._priced[key] = Priced(plain, "plain", plan)
            elif math.isfinite(hybrid):
                self._priced[key] = Priced(hybrid, "hybrid", plan)
            else:
                self._priced[key] = Priced(math.inf, "none", None)
        return self._priced[key]

    def lower_bound(self, choice: Choice, gbs: int) -> float:
        """A value never above :meth:`iteration_time` (module doc), without a search."""
        key = (choice, gbs)
        if key in self._priced:
            return self._priced[key].time_s
        types = {s.device_type for s in self.space.servers if s.name in self.space.used(choice)}
        hybrid = gbs * self.sample_work(frozenset(types)) / self.space.gpus(choice)
        lower = getattr(self.plain, "lower_bound", None)
        plain = lower(choice, gbs) if lower is not None else math.inf
        return min(hybrid, plain)

    def sample_work(self, types: frozenset[str]) -> float:
        """``W``: the least device-seconds of one sample through every block on devices of ``types`` (cached)."""
        if types not in self._work:
            devices = self.job.profiles.devices
            work = 0.0
            for i in range(self.job.profiles.num_blocks):
                work += min(
                    (t * (rows[i][0] + rows[i][1]) / b)
                    for d in types
                    if d in devices
                    for b, per_tp in devices[d].times.items()
                    for t, rows in per_tp.items()
                )
            self._work[types] = work
        return self._work[types]

    def hybrid_plan(self, choice: Choice, gbs: int) -> PlanChoice | None:
        """The hybrid planner's fastest plan on the allocation at ``gbs``; None if no plan fits or it has no
        hybrid shape (one device count per type)."""
        job = self.job_of(choice)
        if job is None:
            return None
        self.searches += 1
        try:
            return solve(job, gbs)
        except InputError:
            return None

    def job_of(self, choice: Choice) -> HybridJob | None:
        """The hybrid job on the allocation's used servers: each type with the GPUs its servers use (one count per
        type, else None), the servers named as the config names them."""
        used = self.space.used(choice)
        types = {s.name: s.device_type for s in self.space.servers}
        per_type: dict[str, list[str]] = {}
        counts: dict[str, set[int]] = {}
        for name, gpus in used.items():
            per_type.setdefault(types[name], []).append(name)
            counts.setdefault(types[name], set()).add(gpus)
        if any(len(c) > 1 for c in counts.values()):
            return None
        shape = tuple(sorted((d, c.pop()) for d, c in counts.items()))
        base = self._jobs.get(shape)
        if base is None:
            devices = dict(self.job.profiles.devices)
            for device, gpus in shape:
                if device not in devices:
                    return None
                devices[device] = devices[device].model_copy(update={"devices_per_server": gpus})
            profiles = self.job.profiles.model_copy(update={"devices": devices})
            base = self._jobs[shape] = HybridJob(profiles, [], {}, self.job.folder, self.job.tp)
        return base.on_servers(per_type)
