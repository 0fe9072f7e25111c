"""Which servers a job runs on: every server must pull its weight.

The rule, for ``jabas run``, ``jabas solve``, the auto-scaler and adaptive
replanning alike: among allocations, the one with the smallest predicted
iteration time wins, and a tie goes to fewer GPUs.
So a server is left out exactly when the job is predicted no faster with it
than without it: a slow GPU next to fast ones adds its share when the plan can
balance it (IIDP's VSWs and GA), and is dropped when its part of the
all-reduce, or an LBS too coarse for its share, would hold the others back.

``--servers auto`` (the default of ``jabas run`` and ``jabas solve``) applies
it (:func:`~jabascli.solver.cluster.allocation_key`) over the config's
available servers; ``--servers all`` uses every one; ``--servers a,b``
exactly those. :func:`choose_plan` also solves with every
server when ``auto`` left some out, so that the start line can say what
leaving them out gains: ``slow left out: 291 ms with it, 172 ms without``.

IIDP or uneven: for a job that trains a fixed GBS without a ``[parallel]``
layout (adaptive batching's estimators need identical workers), :func:`choose_plan`
also builds the best uneven plan (:mod:`jabascli.solver.uneven`: one
micro-batch per GPU, sized to its speed) and takes it when it is predicted
faster than the best IIDP plan; the other one is kept as
``ServerChoice.alternative``, for ``jabas solve`` to show and for ``jabas
run``'s runner-up trial. A tie (the same pace-setting GPU at the same LBS in
both) goes to the plan whose other GPUs have the most slack, the smaller sum
of the groups' predicted times: where the pace-setter runs faster than its
profile said (one profile point is one process's draw of the host's speed),
the plan with slack runs faster, and where it was predicted right, both run
alike. So IIDP's 3 + 1 workers of 16 (the fast GPU's three micro-batches
predicted 198 ms) and the uneven 48 + 16 (its one micro-batch 154 ms), both
paced by the slow GPU's 212 ms, go to the uneven plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from jabascli.config import LoadedConfig
from jabascli.errors import InputError
from jabascli.solver.plan import Plan
from jabascli.solver.setup import solver_from_config
from jabascli.solver.solve import Solver
from jabascli.solver.uneven import best_uneven_plan

AUTO, ALL = "auto", "all"


@dataclass(frozen=True)
class ServerChoice:
    plan: Plan
    """The plan to train (its assignments name the servers chosen)."""
    left_out: tuple[str, ...] = ()
    """Available servers the plan does not use."""
    with_all: Plan | None = None
    """The best plan on every available server, when some were left out (None: none reaches the GBS)."""
    alternative: Plan | None = None
    """The best plan of the other kind (the uneven one when ``plan`` is IIDP's, and the other way round),
    on the same servers rule; None when uneven plans are not offered or none of that kind reaches the GBS."""

    def line(self) -> str | None:
        """``slow left out: 291 ms with it, 172 ms without``; None when every server is used."""
        if not self.left_out:
            return None
        names = ", ".join(self.left_out)
        it = "it" if len(self.left_out) == 1 else "them"
        without = f"{_ms(self.plan.iteration_time_s)} without"
        if self.with_all is None:
            return f"{names} left out: no plan reaches GBS {self.plan.gbs} with {it}, {without}"
        return f"{names} left out: {_ms(self.with_all.iteration_time_s)} with {it}, {without}"


def _ms(seconds: float | None) -> str:
    """``291 ms``, ``5.9 ms``: three figures or so."""
    ms = (seconds or 0.0) * 1e3
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.1f} ms"


def servers_argument(servers: str | None) -> str | None:
    """``--servers`` as :func:`~jabascli.solver.setup.solver_from_config` takes it (None: every available one)."""
    text = (servers or AUTO).strip()
    if not text:
        raise InputError.at(None, "--servers", "expected auto, all or a comma-separated list of server names")
    return None if text == ALL else text


def solver_for(loaded: LoadedConfig, servers: str | None = None, weight_sync: str | None = None) -> Solver:
    """The solver ``--servers`` asks for; by default ``auto``, or every server where ``auto`` would have
    too many allocations to compare (a large cluster of many server types), where every server is used."""
    chosen = servers_argument(servers)
    try:
        return solver_from_config(loaded, chosen, weight_sync)
    except InputError as exc:
        if servers is None and any(p.field == "--servers auto" for p in exc.problems):
            return solver_from_config(loaded, None, weight_sync)
        raise


def uneven_offered(loaded: LoadedConfig) -> bool:
    """Whether the job may train an uneven plan: a fixed GBS, and no ``[parallel]`` layout."""
    return loaded.config.batching.metric == "fixed" and loaded.config.parallel is None


def best_plan(solver: Solver, gbs: int, uneven: bool) -> tuple[Plan, Plan | None]:
    """The faster of the best IIDP plan and (``uneven``) the best uneven plan, and the other one (or None).

    The uneven plan wins when predicted faster, or as fast with more slack (the module doc); InputError
    (IIDP's reasons) when neither reaches ``gbs``.
    """
    try:
        iidp: Plan | None = solver.solve(gbs)
    except InputError:
        if not uneven:
            raise
        iidp = None
    other = best_uneven_plan(solver, gbs) if uneven else None
    if iidp is None:
        if other is None:
            raise InputError(solver.unreachable(gbs))
        return other, None
    if other is not None and _preferred(other, iidp):
        return other, iidp
    return iidp, other


def _preferred(a: Plan, b: Plan) -> bool:
    """``a`` predicted faster than ``b``, or as fast with the smaller sum of its groups' times (the module doc)."""
    time_a, time_b = (p.iteration_time_s or float("inf") for p in (a, b))
    if not math.isclose(time_a, time_b, rel_tol=1e-9):
        return time_a < time_b
    return _work(a) < _work(b)


def _work(plan: Plan) -> float:
    """The sum of the plan's groups' predicted times: the pace-setter's plus the others' (their slack's complement)."""
    return sum(a.iteration_time_s or 0.0 for a in plan.assignments)


def choose_plan(
    loaded: LoadedConfig,
    gbs: int,
    servers: str | None = None,
    weight_sync: str | None = None,
    uneven: bool | None = None,
) -> ServerChoice:
    """The fastest plan for ``gbs`` on the servers ``servers`` selects (None or ``auto``: by the rule above),
    IIDP's or, for a fixed GBS without a layout, an uneven one where that is predicted faster.

    ``uneven``: False compares IIDP plans only; None (and True): uneven ones too where the job allows them.
    """
    uneven = uneven_offered(loaded) and uneven is not False
    solver = solver_for(loaded, servers, weight_sync)
    plan, alternative = best_plan(solver, gbs, uneven)
    if not solver.auto:
        return ServerChoice(plan, alternative=alternative)
    available = [s.name for s in loaded.config.available()]
    used = {a.server for a in plan.assignments}
    left_out = tuple(n for n in available if n not in used)
    if not left_out:
        return ServerChoice(plan, alternative=alternative)
    try:
        with_all: Plan | None = best_plan(solver_from_config(loaded, None, weight_sync), gbs, uneven)[0]
    except InputError:
        with_all = None
    return ServerChoice(plan, left_out, with_all, alternative)
