"""Trace-driven simulation of a whole training run under allocation policies, without training.

The run is a *true* GBS trajectory, one value per adjustment point (the GBS is
held for ``adjust_interval`` iterations), and ``epochs`` epochs of
``dataset_size`` samples; every epoch starts at a new adjustment point and
ends when its samples are used (:func:`~jabascli.autoscale.trajectory.epoch_segments`).
On allocation ``A`` an epoch of segments ``(g, n)`` takes
``sum n * t(A, g)`` seconds (the cost model, e.g. the solver's prediction from
the profiles), plus the move downtime when the policy moved before it; it costs
that time x ``A``'s price per hour, and uses that time x ``A``'s GPUs.

Policies:

* ``all``: every available server, the whole run;
* ``best-fixed``: the single allocation that is best for the whole run in
  hindsight (by the objective, without per-epoch budget or deadline);
* ``jabas``: at each epoch start, forecast the epoch from the GBS seen so far
  (:mod:`~jabascli.autoscale.forecast`) and let the planner choose, with the
  margin rule and the move downtime, seeing only the past;
* ``oracle``: the same planner fed the true next epoch.

A policy that cannot train at some GBS of the run (too many GPUs for it) has
no time: ``time_s`` and the rest are None.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jabascli.autoscale.allocation import AllocationSpace, Choice
from jabascli.autoscale.costmodel import IterationCostModel
from jabascli.autoscale.forecast import Model, forecast, horizon_for
from jabascli.autoscale.planner import Objective, Planner, epoch_time
from jabascli.autoscale.trajectory import Segment, epoch_segments
from jabascli.errors import InputError
from jabascli.inputs import read_text

POLICIES = ("all", "best-fixed", "jabas", "oracle")


# The true trajectory ----------------------------------------------------------------------


@dataclass(frozen=True)
class Trajectory:
    """GBS per adjustment point, and where it came from (for the report)."""

    values: tuple[int, ...]
    source: str


def synthetic_trajectory(
    spec: str, *, epochs: int, dataset_size: int, adjust_interval: int, lo: int, hi: int, step: int = 1
) -> Trajectory:
    """``grow:LO:HI``, ``shrink:HI:LO`` (geometric over the run) or ``flat:G``, within ``[lo, hi]``.

    The GBS moves by a constant ratio per adjustment point, the smallest with
    which it reaches its end value by the last point of the run; every value
    is rounded to a multiple of ``step`` (a GBS the cluster can reach).
    """
    kind, _, rest = spec.partition(":")
    try:
        numbers = [int(x) for x in rest.split(":")] if rest else []
    except ValueError:
        numbers = []
    expected = {"grow": 2, "shrink": 2, "flat": 1}.get(kind)
    if expected is None or len(numbers) != expected or min(numbers) <= 0:
        raise InputError.at(
            None, "--trajectory", f"expected a run folder, a CSV file, grow:LO:HI, shrink:HI:LO or flat:G, got {spec!r}"
        )
    for n in numbers:
        if not lo <= n <= hi:
            raise InputError.at(
                None,
                "--trajectory",
                f"GBS {n} in {spec!r} is outside the bounds {lo}..{hi} (batching.gbs_min, batching.gbs_max)",
            )
    if kind == "flat":
        return Trajectory((numbers[0],), spec)
    start, end = numbers
    if (kind == "grow") != (end > start):
        raise InputError.at(None, "--trajectory", f"{spec!r}: grow goes from low to high, shrink from high to low")

    grow = end > start

    def points(ratio: float) -> list[int]:
        """The run's points when the GBS moves by ``ratio`` per point until it reaches ``end``."""
        values: list[int] = []
        for _ in range(epochs):
            left = dataset_size
            while left > 0:
                k = len(values)
                factor = math.exp(min(k * math.log(ratio), 700.0))
                g = min(start * factor, end) if grow else max(start / factor, end)
                values.append(max(step, round(g / step) * step))
                left -= values[-1] * min(adjust_interval, math.ceil(left / values[-1]))
        return values

    # The smallest ratio with which the GBS reaches its end value by the run's last point.
    low, high = 1.0, max(end / start, start / end)
    for _ in range(50):
        mid = (low + high) / 2
        if points(mid)[-1] == max(step, round(end / step) * step):
            high = mid
        else:
            low = mid
    return Trajectory(tuple(points(high)), spec)


def trajectory_from_csv(path: Path, *, adjust_interval: int) -> Trajectory:
    """A CSV with ``step`` and ``gbs`` columns (a run's ``steps.csv`` has them): GBS per adjustment point.

    Point ``k`` is the GBS in effect at step ``k * adjust_interval`` (the last
    row at or before it, or the first row), for every such step up to the last
    row's.
    """
    text = read_text(path, what="trajectory file")
    reader = csv.DictReader(text.splitlines())
    fields = reader.fieldnames or []
    if "step" not in fields or "gbs" not in fields:
        raise InputError.at(path, None, f"expected a CSV header with 'step' and 'gbs' columns, got {fields}")
    rows: list[tuple[int, int]] = []
    for line, row in enumerate(reader, start=2):
        try:
            step, gbs = int(float(row["step"])), int(float(row["gbs"]))
        except (TypeError, ValueError):
            raise InputError.at(
                path, f"line {line}", f"expected integer step and gbs, got {row.get('step')!r}, {row.get('gbs')!r}"
            ) from None
        if gbs <= 0 or step < 0:
            raise InputError.at(path, f"line {line}", f"expected step >= 0 and gbs > 0, got {step}, {gbs}")
        rows.append((step, gbs))
    if not rows:
        raise InputError.at(path, None, "has no rows: no GBS to simulate")
    rows.sort()
    values, k, i = [], 0, 0
    last_step = rows[-1][0]
    while k * adjust_interval <= last_step:
        while i + 1 < len(rows) and rows[i + 1][0] <= k * adjust_interval:
            i += 1
        values.append(rows[i][1])
        k += 1
    return Trajectory(tuple(values), str(path))


def trajectory_from_spec(
    spec: str, *, epochs: int, dataset_size: int, adjust_interval: int, lo: int, hi: int, step: int = 1
) -> Trajectory:
    """A run folder (its ``steps.csv``), a CSV of ``step,gbs``, or a synthetic spec."""
    path = Path(spec)
    if path.is_dir():
        steps = path / "steps.csv"
        if not steps.is_file():
            raise InputError.at(path, None, "is not a run folder with metrics: no steps.csv in it")
        return trajectory_from_csv(steps, adjust_interval=adjust_interval)
    if path.suffix == ".csv" or path.is_file():
        return trajectory_from_csv(path, adjust_interval=adjust_interval)
    return synthetic_trajectory(
        spec, epochs=epochs, dataset_size=dataset_size, adjust_interval=adjust_interval, lo=lo, hi=hi, step=step
    )


# Policies --------------------------------------------------------------------------------------


@dataclass
class EpochRecord:
    epoch: int
    servers: dict[str, int]
    gpus: int
    time_s: float
    cost: float
    moved: bool
    mean_gbs: float


@dataclass
class PolicyResult:
    policy: str
    time_s: float | None
    cost: float | None
    gpu_hours: float | None
    moves: int
    epochs: list[EpochRecord] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "time_s": self.time_s,
            "cost": self.cost,
            "gpu_hours": self.gpu_hours,
            "moves": self.moves,
            "epochs": [e.__dict__ for e in self.epochs],
        }


@dataclass
class Simulation:
    """One run's trajectory on one cluster; ``run(policy)`` for each policy."""

    space: AllocationSpace
    cost_model: IterationCostModel
    objective: Objective
    trajectory: Trajectory
    epochs: int
    dataset_size: int
    adjust_interval: int
    lo: int
    hi: int
    step: int = 1
    forecast_model: str | Model = "holt"

    def __post_init__(self) -> None:
        self.planner = Planner(self.space, self.cost_model, self.objective)
        self.epoch_plans = self._split()

    def _split(self) -> list[tuple[int, list[Segment]]]:
        """(first adjustment point, true segments) of every epoch."""
        values, out, point = list(self.trajectory.values), [], 0
        for _ in range(self.epochs):
            ahead = values[point:] or values[-1:]
            segments = epoch_segments(ahead, self.dataset_size, self.adjust_interval)
            out.append((point, segments))
            point += len(segments)
        return out

    def history(self, point: int) -> list[float]:
        values = list(self.trajectory.values)
        return [float(v) for v in (values[:point] or values[:1])]

    def run(self, policy: str) -> PolicyResult:
        if policy == "all":
            return self._fixed(policy, self.space.everything())
        if policy == "best-fixed":
            whole = [s for _, segments in self.epoch_plans for s in segments]
            objective = Objective(self.objective.kind, margin=0.0, move_downtime_s=0.0)
            try:
                choice = Planner(self.space, self.cost_model, objective).plan(whole).choice
            except InputError:
                return PolicyResult(policy, None, None, None, 0)
            return self._fixed(policy, choice)
        if policy in ("jabas", "oracle"):
            return self.planned(policy, self._forecast if policy == "jabas" else self._truth)
        raise InputError.at(None, "--policy", f"expected one of {', '.join(POLICIES)}, got {policy!r}")

    def _forecast(self, epoch: int) -> list[Segment]:
        point, _ = self.epoch_plans[epoch]
        horizon = horizon_for(self.dataset_size, self.adjust_interval, self.lo)
        values = forecast(
            self.history(point), horizon, lo=self.lo, hi=self.hi, step=self.step, model=self.forecast_model
        )
        return epoch_segments(values, self.dataset_size, self.adjust_interval)

    def _truth(self, epoch: int) -> list[Segment]:
        return self.epoch_plans[epoch][1]

    def _fixed(self, policy: str, choice: Choice) -> PolicyResult:
        return self.account(policy, [choice] * self.epochs)

    def planned(self, policy: str, segments_for: Callable[[int], Sequence[Segment]]) -> PolicyResult:
        """The planner epoch by epoch, fed ``segments_for(epoch)`` (a forecast, the truth, or another
        simulator's view), moving under the margin rule; accounted on the true epochs."""
        choices: list[Choice] = []
        current: Choice | None = None
        for epoch in range(self.epochs):
            current = self.planner.plan(segments_for(epoch), current).choice
            choices.append(current)
        return self.account(policy, choices)

    def account(self, policy: str, choices: list[Choice]) -> PolicyResult:
        """Time, cost, GPU-hours and moves of running epoch ``e`` on ``choices[e]``."""
        result = PolicyResult(policy, 0.0, 0.0, 0.0, 0)
        previous: Choice | None = None
        for epoch, ((_, segments), choice) in enumerate(zip(self.epoch_plans, choices, strict=True)):
            moved = previous is not None and choice != previous
            time_s = epoch_time(self.cost_model, choice, segments) + (self.objective.move_downtime_s if moved else 0.0)
            cost = time_s / 3600 * self.space.price_per_hour(choice)
            mean = sum(s.samples for s in segments) / sum(s.iterations for s in segments)
            result.epochs.append(
                EpochRecord(epoch, self.space.used(choice), self.space.gpus(choice), time_s, cost, moved, mean)
            )
            result.moves += moved
            previous = choice
        if not all(math.isfinite(e.time_s) for e in result.epochs):
            return PolicyResult(policy, None, None, None, result.moves, result.epochs)
        result.time_s = sum(e.time_s for e in result.epochs)
        result.cost = sum(e.cost for e in result.epochs)
        result.gpu_hours = sum(e.time_s / 3600 * e.gpus for e in result.epochs)
        return result

    def to_dict(self, results: Sequence[PolicyResult]) -> dict[str, Any]:
        return {
            "policies": [r.to_dict() for r in results],
            "objective": self.objective.__dict__,
            "trajectory": {"source": self.trajectory.source, "gbs": list(self.trajectory.values)},
            "epochs": self.epochs,
            "dataset_size": self.dataset_size,
            "adjust_interval": self.adjust_interval,
            "seed_prices": self.space.seed_prices,
            "servers": {s.name: s.devices for s in self.space.servers},
        }


# From a config -----------------------------------------------------------------------------------

GBS_CEILING = 1 << 24
"""The upper GBS bound when ``[batching] gbs_max`` is not set."""


def dataset_size_of(loaded: Any) -> int:
    """The workload's training set size (the workload is imported and its dataset built)."""
    job = loaded.config.job
    if job.workload is None:
        raise InputError.at(
            None,
            "--dataset-size",
            "the config names no job.workload to take the training set size from: give --dataset-size N",
        )
    from jabascli.workload import workload_of

    workload = workload_of(loaded)
    return len(workload.train_dataset())


def simulation_from_config(
    loaded: Any, spec: str, *, epochs: int | None = None, dataset_size: int | None = None
) -> Simulation:
    """The simulation of ``spec`` on the config's available servers, profiles, prices and ``[scaling]``."""
    from jabascli.autoscale.setup import scaling_from_config

    config = loaded.config
    epochs = epochs if epochs is not None else config.job.epochs
    if epochs < 1:
        raise InputError.at(None, "--epochs", f"expected a positive number of epochs, got {epochs}")
    if dataset_size is None:
        dataset_size = dataset_size_of(loaded)
    if dataset_size < 1:
        raise InputError.at(None, "--dataset-size", f"expected a positive number of samples, got {dataset_size}")
    batching = config.batching
    lo, hi = batching.gbs_min or 1, batching.gbs_max or GBS_CEILING
    interval = batching.adjust_interval
    setup = scaling_from_config(loaded)
    model = setup.cost_model.model
    lbs_values = [b for s in setup.space.servers for b in model.lbs_values(s.profile_server)]
    if not lbs_values:
        raise InputError.at(None, "profiles", "no LBS has both a memory and a computation profile")
    step = min(lbs_values) * setup.space.unit
    trajectory = trajectory_from_spec(
        spec, epochs=epochs, dataset_size=dataset_size, adjust_interval=interval, lo=lo, hi=hi, step=step
    )
    setup.cost_model.warm_gbs = max(trajectory.values)
    return Simulation(
        setup.space,
        setup.cost_model,
        setup.objective,
        trajectory,
        epochs,
        dataset_size,
        interval,
        lo,
        hi,
        step,
        config.scaling.forecast,
    )
