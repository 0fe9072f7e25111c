"""Online performance model: the profiles refit to the iteration times a job measured (numpy only).

The offline profiles are measured minutes or days before a job trains, and a
host's speed moves between the two (7-22% on the 2-core development host,
``docs/performance-model.md``). After a run the job knows what it measured: the
median iteration time ``m_i`` of each plan it trained (``steps.csv``). This
module refits the model's terms to those measurements, with the profiles as the
prior, as Pollux refits its step-time model to the step times it measures.

**Parameters.** One factor per profiled server (a device type's profiles,
:class:`~jabascli.perfmodel.iteration.ServerSpec`'s ``profile_server``),
``a_d``, multiplying every time of its computation profile (data, forward,
backward, update, copy, BatchNorm sync, overhead, overlap update, their
quartiles); and one per link kind (``intra``, ``inter``), ``c_k``, multiplying
its all-reduce times (``measured_ms`` and the after-wait times: the fitted
latency and bandwidth both scale). ``theta = log`` of the factors; the profile
is ``theta = 0``.

**Per-LBS corrections.** A run trains one or two plans, which say how fast a
device is now, not how its time grows with the batch (Pollux fits ``alpha +
beta * LBS`` because it has no per-LBS profile; jabas measured one), so the
profile's shape across LBS and VSW counts is kept while a server has been
measured at one LBS. A profile point is one process's draw of the host's speed,
though (on the 2-core development host a point came out 37% slower than the
trainer that later ran its LBS), and one factor per server cannot explain two
runs at LBS whose points drew differently. Once a server has run at two or more
LBS, each profiled point those runs used (the LBS itself, or the two profiled
points the model interpolates between) gets its own factor ``exp(delta_db)`` on
top of ``a_d``, fit after the server and link factors and with them held, by
the same least squares but weighed by runs, not iterations: a process draws its
speed from the host and keeps much of it (on the development host the same step
measured 88-126 ms in five processes), so a run's hundred iterations say about
its LBS what one would, and a profile point is such a draw too. Each undisturbed
run weighs 1 and the point ``POINT_DRAWS`` (1): one run moves its LBS's point
half way, ``n`` runs ``n / (n + 1)`` of the way to their mean. A run measured
while the host was disturbed is left out. The server factor stays what every
LBS no run used is predicted with.

**Fit** (least squares in log space, as Pollux's ``fit_perf_params``, with the
profile as a Gaussian prior)::

    minimise  sum_i w_i [ (log m_i - log T_i(theta))^2  +  sum_g (r_ig - R_ig(theta))^2 ]
              +  lam * sum_j theta_j^2

``T_i(theta)`` is the model's prediction of observation ``i``'s plan with the
profiles scaled by ``exp(theta)``: the largest time over the plan's GPU groups,
taken during the fit as a smooth maximum (``SMOOTH_MAX``, 0.5% in log space) so
that a group which is not the slowest by a hair still gets a gradient.
``r_ig = log b_ig - mean_g log b_ig`` compares group ``g``'s measured busy time
with the other groups' of the same run, where the run measured two or more (a
rank's computation up to its last gradient bucket, before it waits for the
others: :mod:`jabascli.engine.busy`), and ``R_ig(theta)`` is the same of the
predicted busy times (:attr:`~jabascli.perfmodel.iteration.Breakdown.busy_s`).
The iteration time measures the slowest group only; the busy times measure how
every group's computation compares with the others', at the LBS and micro-steps
the plan gave it, paced or not, so the refit learns each server's speed
relative to the others (what a split between them needs) while the iteration
time keeps the level (what the busy times leave out, the last all-reduce and
the update, the model predicts less well than the computation);
``w_i = min(n_i, MAX_ITERATIONS)``, the observation's measured iterations
(capped: the host drifts over minutes, so a long run is no surer than a
moderate one); ``lam = prior_iterations`` (default ``PRIOR_ITERATIONS``): the
profile counts as that many measured iterations of every parameter. An
observation taken while other processes loaded the host (``disturbed``) weighs
at most ``lam``: never more than the profile.

This is the maximum a-posteriori estimate under log-normal noise of one
variance per iteration and a log-normal prior of each factor centred on the
profile. With one parameter, a run of ``n`` iterations moves ``theta`` by
``n / (n + lam)`` of the way from the profile to the measurement (25
iterations: 93%, 100: 98%): the prior is weak because what it stands for, the
host's speed when the profile was taken, is what drifts; it decides what the
measurements leave open (without busy times, the split between two servers'
factors when only one of them sets the pace, or between computation and
all-reduce in one plan, goes to the smallest change from the profile).
Observations accumulate (the job keeps every one, ``profiles/refit.py``), so
the profile's pull fades as they do. A parameter no observation involves (a
server no plan used, the ``inter`` link of a job that ran on one server) stays
at the profile. Solved by Levenberg-Marquardt with a
numerical Jacobian: a handful of parameters, a few hundred model evaluations.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from jabascli.perfmodel.iteration import Allocation, WeightSyncMethod
from jabascli.perfmodel.model import GroupConfig, PerformanceModel
from jabascli.profiles import CommProfile, CompProfile, ProfileSet

PRIOR_ITERATIONS = 2.0
"""How many measured iterations the profile is worth, per parameter."""
MAX_ITERATIONS = 200
"""An observation weighs at most this many iterations."""
POINT_DRAWS = 1.0
"""How many runs a profile point is worth against the per-LBS correction of its LBS (module doc)."""
SMOOTH_MAX = 0.005
"""Temperature of the smooth maximum over GPU groups during the fit, in log time (0.5%)."""

_COMP_TIMES = ("total_time", "data_time", "fwd_time", "bwd_time", "update_time", "copy_time", "bn_sync_time")


@dataclass(frozen=True)
class Observation:
    """One plan as a job trained it: its median iteration time over ``iterations`` iterations.

    An uneven plan's groups carry their own LBS (:class:`~jabascli.perfmodel.model.GroupConfig`).
    """

    lbs: int
    weight_sync: WeightSyncMethod
    groups: tuple[GroupConfig, ...]
    measured_s: float
    iterations: int
    disturbed: bool = False
    """Other processes loaded the host while it was measured: it weighs at most what the profile does."""
    busy_s: tuple[float | None, ...] = ()
    """Per group (in ``groups``' order), its ranks' median busy time in seconds; None or empty: not measured."""

    def __post_init__(self) -> None:
        if self.busy_s and len(self.busy_s) != len(self.groups):
            raise ValueError(f"{len(self.busy_s)} busy times for {len(self.groups)} GPU groups")

    def link(self) -> str | None:
        """The link kind its all-reduce used (None: one GPU, no all-reduce)."""
        allocation = Allocation.of((g.server, g.gpus) for g in self.groups)
        if allocation.world_size <= 1:
            return None
        return "intra" if allocation.servers <= 1 else "inter"

    def weight(self, prior_iterations: float) -> float:
        w = float(min(max(self.iterations, 0), MAX_ITERATIONS))
        return min(w, prior_iterations) if self.disturbed else w


@dataclass(frozen=True)
class Refit:
    """Factors on the profiles' times (1: the profile): ``compute`` per profiled server, ``comm`` per link kind,
    and ``lbs`` per profiled server and LBS, on top of the server's ``compute`` (the per-LBS correction)."""

    compute: dict[str, float] = field(default_factory=dict)
    comm: dict[str, float] = field(default_factory=dict)
    lbs: dict[str, dict[int, float]] = field(default_factory=dict)

    def apply(self, profiles: ProfileSet) -> ProfileSet:
        """The profiles with every time scaled by its factor (a new set; ``profiles`` is left as it is)."""
        comp = {
            key: _scaled_comp(p, a) if (a := self.compute_at(key[0], key[1])) != 1.0 else p
            for key, p in profiles.comp.items()
        }
        links = {k: _scaled_comm(p, c) if (c := self.comm.get(k, 1.0)) != 1.0 else p for k, p in profiles.comm.items()}
        return ProfileSet(dict(profiles.memory), comp, profiles.bucket, links, dict(profiles.folders))  # type: ignore[arg-type]

    def compute_at(self, server: str, lbs: int) -> float:
        """The factor on ``server``'s computation profile at ``lbs``."""
        return self.compute.get(server, 1.0) * self.lbs.get(server, {}).get(lbs, 1.0)


def _scaled_comp(p: CompProfile, a: float) -> CompProfile:
    update: dict[str, object] = {k: getattr(p, k) * a for k in _COMP_TIMES}
    update["overhead_time"] = p.overhead_time * a
    if p.overlap_update_time is not None:
        update["overlap_update_time"] = p.overlap_update_time * a
    if p.spread is not None:
        update["spread"] = {k: [x * a for x in v] for k, v in p.spread.items()}
    if p.run_totals is not None:
        update["run_totals"] = [x * a for x in p.run_totals]
    return p.model_copy(update=update)


def _scaled_comm(p: CommProfile, c: float) -> CommProfile:
    meta = p.meta
    if meta is not None and meta.after_wait_ms is not None:
        meta = meta.model_copy(update={"after_wait_ms": [x * c for x in meta.after_wait_ms]})
    return p.model_copy(update={"measured_ms": [x * c for x in p.measured_ms], "meta": meta})


def fingerprint(profiles: ProfileSet) -> str:
    """A digest of the computation and communication profiles: which measured profiles a refit was made on."""
    content = {
        "comp": [[list(map(str, k)), p.model_dump(mode="json")] for k, p in sorted(profiles.comp.items())],
        "comm": [[k, p.model_dump(mode="json")] for k, p in sorted(profiles.comm.items())],
        "bucket": profiles.bucket.model_dump(mode="json") if profiles.bucket is not None else None,
    }
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


def predict(profiles: ProfileSet, observation: Observation) -> float:
    """The model's iteration time (s) of an observation's plan on ``profiles``."""
    model = PerformanceModel(profiles)
    return model.predict(observation.lbs, observation.weight_sync, observation.groups).time_s


def errors(profiles: ProfileSet, observations: Sequence[Observation]) -> list[float]:
    """Per observation, ``(measured - predicted) / predicted``, as ``jabas run`` reports its plan's error."""
    out = []
    for o in observations:
        p = predict(profiles, o)
        out.append((o.measured_s - p) / p)
    return out


def _parameters(profiles: ProfileSet, observations: Sequence[Observation]) -> list[tuple[str, str]]:
    compute = sorted({g.server.profile_server for o in observations for g in o.groups})
    links = sorted({k for o in observations if (k := o.link()) is not None and k in profiles.comm})
    return [("compute", s) for s in compute] + [("comm", k) for k in links]


def _log_times(profiles: ProfileSet, observations: Sequence[Observation]) -> tuple[np.ndarray, np.ndarray]:
    """Per observation, the smooth maximum over its groups of the log predicted times; and the relative log busy
    times the model predicts for the groups whose busy time was measured (:func:`_relative`)."""
    model = PerformanceModel(profiles)
    out = np.empty(len(observations))
    busy: list[np.ndarray] = []
    for i, o in enumerate(observations):
        groups = model.predict(o.lbs, o.weight_sync, o.groups).groups
        logs = np.log([max(g.time_s, 1e-12) for g in groups])
        top = logs.max()
        out[i] = top + SMOOTH_MAX * math.log(float(np.exp((logs - top) / SMOOTH_MAX).sum()))
        busy.append(_relative([g.breakdown.busy_s for g in groups], o.busy_s))
    return out, np.concatenate(busy)


def _relative(times: Sequence[float], measured: Sequence[float | None]) -> np.ndarray:
    """``log t_g - mean log t_g`` over the groups whose busy time was ``measured``; nothing for fewer than two."""
    logs = [math.log(max(t, 1e-12)) for t, m in zip(times, measured, strict=False) if m]
    if len(logs) < 2:
        return np.empty(0)
    return np.array(logs) - statistics.fmean(logs)


def _lbs_points(profiles: ProfileSet, observations: Sequence[Observation]) -> list[tuple[str, int]]:
    """``(server, LBS)`` of every profiled point that the groups of a server measured at two or more LBS use: the
    group's LBS, or the profiled LBS on each side of it (:meth:`~jabascli.perfmodel.model.PerformanceModel.points`)."""
    model = PerformanceModel(profiles)
    seen: dict[str, set[int]] = {}
    for o in observations:
        for g in o.groups:
            seen.setdefault(g.server.profile_server, set()).add(g.lbs or o.lbs)
    points = []
    for server, measured in sorted(seen.items()):
        if len(measured) < 2:
            continue  # one LBS says how fast the server is now, not how its time grows with the batch
        used = {b for lbs in measured for b in model.points(server, lbs)}
        points += [(server, b) for b in sorted(used)]
    return points


def _minimise(residuals: Callable[[np.ndarray], np.ndarray], size: int) -> np.ndarray:
    """Levenberg-Marquardt from zero with a numerical Jacobian: ``theta`` minimising ``|residuals(theta)|^2``."""
    theta = np.zeros(size)
    r = residuals(theta)
    cost, damping, step = float(r @ r), 1e-3, 1e-4
    for _ in range(60):
        jac = np.empty((r.size, theta.size))
        for j in range(theta.size):
            shifted = theta.copy()
            shifted[j] += step
            jac[:, j] = (residuals(shifted) - r) / step
        gram, grad = jac.T @ jac, jac.T @ r
        while True:
            delta = np.linalg.solve(gram + damping * (np.diag(np.diag(gram)) + np.eye(theta.size)), -grad)
            candidate = theta + delta
            r_new = residuals(candidate)
            new_cost = float(r_new @ r_new)
            if new_cost < cost:
                theta, r, cost, damping = candidate, r_new, new_cost, max(damping / 3.0, 1e-9)
                break
            damping *= 4.0
            if damping > 1e8:
                return theta
        if float(np.max(np.abs(delta))) < 1e-7:
            break
    return theta


def fit(profiles: ProfileSet, observations: Sequence[Observation], prior_iterations: float = PRIOR_ITERATIONS) -> Refit:
    """The factors that best explain ``observations``, pulled toward the profiles (see the module doc): first
    every server's and link's factor, then, with those held, the per-LBS corrections."""
    observations = [o for o in observations if o.measured_s > 0 and o.iterations > 0]
    params = _parameters(profiles, observations)
    if not observations or not params:
        return Refit()
    measured = np.log([o.measured_s for o in observations])
    # The measured busy times relative to their run's other groups.
    relative = [_relative([b or 0.0 for b in o.busy_s], o.busy_s) for o in observations]
    busy = np.concatenate(relative)

    def roots(weights: Sequence[float], prior: float) -> tuple[np.ndarray, np.ndarray, float]:
        """The square roots of each run's weight, of its busy times' (weighed as the run) and of the prior's."""
        busy_weights = np.concatenate([np.full(r.size, w) for w, r in zip(weights, relative, strict=True)])
        return np.sqrt(weights), np.sqrt(busy_weights), math.sqrt(prior)

    def misses(refit: Refit, theta: np.ndarray, root: tuple[np.ndarray, np.ndarray, float]) -> np.ndarray:
        """Each run's miss and its busy times', and the prior's pull on ``theta``, weighed by ``root``."""
        logs, busy_logs = _log_times(refit.apply(profiles), observations)
        root_w, root_w_busy, root_prior = root
        return np.concatenate([root_w * (measured - logs), root_w_busy * (busy - busy_logs), root_prior * theta])

    def factors(theta: np.ndarray) -> Refit:
        compute = {name: math.exp(t) for (kind, name), t in zip(params, theta, strict=True) if kind == "compute"}
        comm = {name: math.exp(t) for (kind, name), t in zip(params, theta, strict=True) if kind == "comm"}
        return Refit(compute, comm)

    by_iterations = roots([o.weight(prior_iterations) for o in observations], prior_iterations)
    refit = factors(_minimise(lambda t: misses(factors(t), t, by_iterations), len(params)))
    points = _lbs_points(profiles, [o for o in observations if not o.disturbed])
    if not points:
        return refit

    def corrected(delta: np.ndarray) -> Refit:
        lbs: dict[str, dict[int, float]] = {}
        for (server, b), d in zip(points, delta, strict=True):
            lbs.setdefault(server, {})[b] = math.exp(d)
        return Refit(refit.compute, refit.comm, lbs)

    # Each undisturbed run one draw (a run beside other work says nothing of one LBS against another).
    by_draws = roots([0.0 if o.disturbed else 1.0 for o in observations], POINT_DRAWS)
    return corrected(_minimise(lambda d: misses(corrected(d), d, by_draws), len(points)))
