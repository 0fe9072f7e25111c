"""The allocation planner: equal to brute force, no flapping, and cost weighed against speed."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from jabascli.autoscale.allocation import AllocationSpace, Choice
from jabascli.autoscale.costmodel import SolverCostModel
from jabascli.autoscale.forecast import forecast
from jabascli.autoscale.planner import Objective, Planner
from jabascli.autoscale.trajectory import Segment, epoch_segments
from jabascli.errors import InputError
from jabascli.perfmodel import PerformanceModel, ServerSpec
from jabascli.solver import weight_sync_methods
from tests.test_solver_random import LBS_VALUES, brute_force, clusters, packed_allocations

# Brute force, written from the definitions in planner.py's docstring -------------------------


def reference_time(model: PerformanceModel, servers: list[ServerSpec], unit: int, gbs: int) -> float:
    """Seconds per iteration by exhaustive (VSW, GA) search, at ``gbs`` or its nearest reachable neighbour."""
    methods = weight_sync_methods(model, "recommend")
    gpus = sum(s.devices for s in servers)
    common = set.intersection(*(set(model.lbs_values(s.profile_server)) for s in servers))
    if not common or gbs < min(common) * gpus:
        return math.inf  # every GPU needs a worker
    # Each LBS's multiples of LBS x unit just below and above gbs, that give every GPU a worker.
    around = {m * b * unit for b in common for m in (gbs // (b * unit), gbs // (b * unit) + 1)}
    around = {g for g in around if g > 0 and any(g % b == 0 and g // b >= gpus for b in common)}
    if gbs in around and math.isfinite(t := brute_force(model, servers, unit, gbs, methods)):
        return t
    for g in sorted(around - {gbs}, key=lambda g: (abs(math.log(g / gbs)), -g)):
        t = brute_force(model, servers, unit, g, methods)
        if math.isfinite(t):
            return t * gbs / g
    return math.inf


def brute_force_plan(
    model: PerformanceModel,
    servers: list[ServerSpec],
    unit: int,
    prices: dict[str, float],
    segments: list[Segment],
    objective: Objective,
    current: dict[str, int] | None,
) -> tuple[dict[str, int], float] | None:
    """Every packed allocation (as ``jabas solve --servers auto`` may choose), the rules applied one by one."""
    rows = []
    for alloc in packed_allocations(servers, unit):
        used = {s.name: s.devices for s in alloc}
        move = current is not None and used != current
        time_s = sum(s.iterations * reference_time(model, alloc, unit, s.gbs) for s in segments)
        time_s += objective.move_downtime_s if move else 0.0
        price = sum(s.devices * prices[s.name] for s in alloc)
        cost = time_s / 3600 * price if math.isfinite(time_s) else math.inf
        ok = math.isfinite(time_s)
        ok = ok and (objective.budget_per_epoch is None or cost <= objective.budget_per_epoch)
        ok = ok and (objective.deadline_per_epoch_s is None or time_s <= objective.deadline_per_epoch_s)
        value = time_s if objective.kind == "time" else cost
        rows.append((used, value, sum(used.values()), ok))
    feasible = [r for r in rows if r[3]]
    if not feasible:
        return None
    best = min(feasible, key=lambda r: (r[1], r[2]))
    if current is None:
        return best[0], best[1]
    now = next(r for r in rows if r[0] == current)
    if not now[3] or best[1] < (1 - objective.margin) * now[1]:
        return best[0], best[1]
    return now[0], now[1]


@st.composite
def planning_cases(draw: st.DrawFn) -> tuple:  # type: ignore[type-arg]
    model, servers, unit = draw(clusters(max_units=4))
    device_price = {s.profile_server: draw(st.sampled_from([1.0, 2.0, 3.5])) for s in servers}
    prices = {s.name: device_price[s.profile_server] for s in servers}
    gpus = sum(s.devices for s in servers)
    gbs = draw(st.lists(st.integers(1, gpus + 3).map(lambda k: k * LBS_VALUES[0] * unit), min_size=1, max_size=3))
    if draw(st.booleans()):
        gbs.append(draw(st.integers(3, 40)))  # anything: the nearest reachable GBS rule
    segments = [Segment(g, draw(st.integers(1, 50))) for g in gbs]
    return model, servers, unit, prices, segments


def space_for(servers: list[ServerSpec], unit: int, prices: dict[str, float]) -> AllocationSpace:
    return AllocationSpace(servers, unit, prices)


@pytest.mark.parametrize("kind", ["time", "cost", "time+budget", "cost+deadline"])
@settings(max_examples=30, deadline=None)
@given(case=planning_cases(), data=st.data())
def test_equal_to_brute_force(kind: str, case: tuple, data: st.DataObject) -> None:  # type: ignore[type-arg]
    model, servers, unit, prices, segments = case
    space = space_for(servers, unit, prices)
    cost_model = SolverCostModel(model, space)
    current: Choice | None = None
    if data.draw(st.booleans()):
        current = data.draw(st.sampled_from(list(space)))
    downtime = data.draw(st.sampled_from([0.0, 0.01, 1.0]))
    objective = Objective(kind.split("+")[0], move_downtime_s=downtime, margin=data.draw(st.sampled_from([0, 0.05])))  # type: ignore[arg-type]
    if "+" in kind:
        # A limit between the candidates' values, so that it binds.
        everyone = [Planner(space, cost_model, objective).estimate(c, segments, current) for c in space]
        values = sorted(e.cost if kind == "time+budget" else e.time_s for e in everyone if math.isfinite(e.time_s))
        if not values:
            return
        limit = values[data.draw(st.integers(0, len(values) - 1))] * data.draw(st.sampled_from([0.99, 1.01]))
        key = "budget_per_epoch" if kind == "time+budget" else "deadline_per_epoch_s"
        objective = Objective(**{**objective.__dict__, key: limit})
    used_now = space.used(current) if current is not None else None
    expected = brute_force_plan(model, servers, unit, prices, segments, objective, used_now)
    planner = Planner(space, cost_model, objective)
    if expected is None:
        with pytest.raises(InputError, match="no allocation"):
            planner.plan(segments, current)
        event("nothing feasible")
        return
    decision = planner.plan(segments, current)
    event(f"{space.count()} allocations, solved {len(decision.candidates)}, moved {decision.moved}")
    assert space.used(decision.choice) == expected[0]
    assert math.isclose(decision.chosen.value(objective), expected[1], rel_tol=1e-9)


@settings(max_examples=40, deadline=None)
@given(case=planning_cases())
def test_local_search_on_small_clusters_comes_within_1_percent_of_the_optimum(case: tuple) -> None:  # type: ignore[type-arg]
    """The search used beyond exhaustive_limit, forced on clusters small enough to check. It is a heuristic:
    hypothesis has found a cluster where it stops 0.07% above the optimum, so it is held to 1%, not to equality."""
    model, servers, unit, prices, segments = case
    space = space_for(servers, unit, prices)
    cost_model = SolverCostModel(model, space)
    for kind in ("time", "cost"):
        exhaustive = Planner(space, cost_model, Objective(kind))  # type: ignore[arg-type]
        local = Planner(space, cost_model, Objective(kind), exhaustive_limit=0)  # type: ignore[arg-type]
        try:
            expected = exhaustive.plan(segments)
        except InputError:
            continue
        best = expected.chosen.value(exhaustive.objective)
        assert best <= local.plan(segments).chosen.value(local.objective) <= best * 1.01


# Behaviour ------------------------------------------------------------------------------------


class TableCostModel:
    """Iteration times given per allocation (the planner's interface, filled by hand)."""

    def __init__(self, times: dict[Choice, float]) -> None:
        self.times = times

    def iteration_time(self, choice: Choice, gbs: int) -> float:
        return self.times.get(choice, math.inf) * gbs / 1024


def two_servers(price_a: float, price_b: float) -> AllocationSpace:
    a = ServerSpec("a", "dev-a", 1, "a", 1e9, 1e9)
    b = ServerSpec("b", "dev-b", 1, "b", 1e9, 1e9)
    return AllocationSpace([a, b], 1, {"a": price_a, "b": price_b})


def test_cost_does_not_buy_two_percent_for_thirty_percent_more() -> None:
    space = two_servers(1.0, 1.3)
    model = TableCostModel({(1, 0): 1.0, (0, 1): 0.98, (1, 1): 0.9})  # both together: 10 % faster, 2.3 x the price
    segments = [Segment(1024, 1000)]
    assert space.used(Planner(space, model, Objective("cost")).plan(segments).choice) == {"a": 1}
    # The same allocations by time: the faster ones win, so the test above can fail.
    assert space.used(Planner(space, model, Objective("time")).plan(segments).choice) == {"a": 1, "b": 1}
    # From b by time, 2 % is below the 5 % margin: b stays; by cost the move pays.
    assert Planner(space, model, Objective("time", margin=0.05)).plan(segments, (0, 1)).choice == (0, 1)
    by_cost = Planner(space, model, Objective("cost", move_downtime_s=1.0)).plan(segments, (0, 1))
    assert by_cost.choice == (1, 0) and by_cost.moved and "lower" in by_cost.reason


def test_budget_and_deadline() -> None:
    space = two_servers(1.0, 1.3)
    model = TableCostModel({(1, 0): 1.0, (0, 1): 0.98, (1, 1): 0.5})
    segments = [Segment(1024, 3600)]  # (1, 0): 1 h at 1 $/h; (1, 1): 0.5 h at 2.3 $/h
    assert Planner(space, model, Objective("time", budget_per_epoch=1.2)).plan(segments).choice == (1, 1)
    assert Planner(space, model, Objective("time", budget_per_epoch=1.1)).plan(segments).choice == (1, 0)
    assert Planner(space, model, Objective("cost", deadline_per_epoch_s=3000)).plan(segments).choice == (1, 1)
    with pytest.raises(InputError, match=r"no allocation meets budget_per_epoch 0\.5"):
        Planner(space, model, Objective("time", budget_per_epoch=0.5)).plan(segments)


def test_a_tie_within_the_band_goes_to_the_other_measure() -> None:
    space = two_servers(1.0, 3.0)
    model = TableCostModel({(1, 0): 1.0, (0, 1): 0.96, (1, 1): 0.8})
    segments = [Segment(1024, 3600)]  # (1, 0): 1 h, 1 $; (0, 1): 0.96 h, 2.88 $; (1, 1): 0.8 h, 3.2 $
    budget = 2.9  # (1, 1) over it
    plain = Objective("time", budget_per_epoch=budget)
    assert Planner(space, model, plain).plan(segments).choice == (0, 1)  # the fastest within the budget
    tied = Objective("time", budget_per_epoch=budget, tie=0.05)
    assert Planner(space, model, tied).plan(segments).choice == (1, 0)  # 4 % slower: a tie, and 2.9 x cheaper
    assert Planner(space, model, Objective("time", budget_per_epoch=budget, tie=0.03)).plan(segments).choice == (0, 1)
    # by cost, a tie goes to the faster
    model = TableCostModel({(1, 0): 1.0, (0, 1): 0.34, (1, 1): 0.9})  # (0, 1): 1.02 $ in 0.34 h
    assert Planner(space, model, Objective("cost")).plan(segments).choice == (1, 0)
    assert Planner(space, model, Objective("cost", tie=0.05)).plan(segments).choice == (0, 1)
    # the margin still keeps the current allocation: the tied winner is no gain over it
    assert Planner(space, model, Objective("cost", tie=0.05)).plan(segments, (1, 0)).choice == (1, 0)


@pytest.fixture
def reference_space(reference_dir: Path) -> tuple[AllocationSpace, SolverCostModel]:
    from jabascli.autoscale.setup import scaling_from_config
    from jabascli.config import load_config

    setup = scaling_from_config(load_config(reference_dir / "config.json"))
    return setup.space, setup.cost_model


def flat_noisy_moves(space: AllocationSpace, cost_model: SolverCostModel, objective: Objective) -> int:
    """20 epochs of a GBS flat at 2048 with 10 % noise per adjustment, planned epoch by epoch."""
    planner = Planner(space, cost_model, objective)
    rng = np.random.default_rng(7)
    dataset, interval = 128_000, 10
    history = [2048.0]
    current, moves = None, 0
    for _ in range(20):
        values = forecast(history, 40, lo=256, hi=32768, step=32)
        decision = planner.plan(epoch_segments(values, dataset, interval), current)
        moves += decision.moved
        current = decision.choice
        # The epoch as it really goes: one noisy value per adjustment point.
        history += [float(round(2048 * math.exp(rng.normal(0, 0.1)) / 32) * 32) for _ in range(7)]
    return moves


@pytest.mark.parametrize("kind", ["time", "cost"])
def test_noisy_flat_trajectory_moves_at_most_once_in_20_epochs(
    reference_space: tuple[AllocationSpace, SolverCostModel], kind: str
) -> None:
    space, cost_model = reference_space
    moves = flat_noisy_moves(space, cost_model, Objective(kind))  # type: ignore[arg-type]
    flapping = flat_noisy_moves(space, cost_model, Objective(kind, margin=0.0, move_downtime_s=0.0))  # type: ignore[arg-type]
    print(f"{kind}: {moves} moves with the 5 % margin and 60 s downtime, {flapping} with neither")
    assert moves <= 1
    assert flapping >= 2  # the noise alone is enough to make a planner without the rule flap


def test_reference_cluster_candidates_and_seed_prices(reference_space: tuple[AllocationSpace, SolverCostModel]) -> None:
    space, cost_model = reference_space
    assert space.seed_prices and space.count() == 24
    assert [round(t.gpu_hour_price, 4) for t in space.types] == [3.06, round(3.06 * 9.52 / 14.13, 4)]
    decision = Planner(space, cost_model, Objective("time")).plan([Segment(4096, 100)])
    record = decision.to_dict(space)
    assert record["choice"] == {"node0": 4, "node1": 4}
    assert record["candidates"][0]["time_s"] == pytest.approx(decision.chosen.time_s)
