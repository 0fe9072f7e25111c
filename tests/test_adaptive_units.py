"""Adaptive batching's parts, on known answers: estimators, smoothing, policies, anti-flapping, LR rules, replanning."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from jabascli.adaptive.estimators import HalfGradients, half_split
from jabascli.adaptive.lr_scaling import ScaledLr, lr_factor
from jabascli.adaptive.noise import NoiseScale
from jabascli.adaptive.policy import Reading, Steadiness, efficiency, propose
from jabascli.adaptive.replan import choose, fallback_candidates, in_rank_order, rank_shape, spread
from jabascli.engine.plan import RankPlan, TrainingPlan


def halves(g_a: np.ndarray, g_b: np.ndarray, workers: int, lbs: int = 4) -> HalfGradients:
    """What the engine all-reduces when the first half's mean gradient is ``g_a`` and the second's ``g_b``."""
    w_a = half_split(workers)
    f = g_a * w_a / workers  # sum over the first half of g_w / W
    t = f + g_b * (workers - w_a) / workers
    return HalfGradients(float(f @ f), float(f @ t), float(t @ t), workers, lbs)


# -- estimators ----------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [2, 7, 11])
def test_identical_halves_have_similarity_one(workers: int) -> None:
    g = np.random.default_rng(0).normal(size=500)
    assert halves(g, g.copy(), workers).similarity() == pytest.approx(1.0, abs=1e-12)
    assert halves(g, -g, workers).similarity() == pytest.approx(-1.0, abs=1e-12)


def test_independent_zero_mean_halves_have_similarity_about_zero() -> None:
    rng = np.random.default_rng(1)
    values = [halves(rng.normal(size=20_000), rng.normal(size=20_000), 7).similarity() for _ in range(5)]
    assert max(abs(v) for v in values) < 0.03  # the standard deviation is 1/sqrt(20000) = 0.007


@pytest.mark.parametrize(("workers", "lbs"), [(2, 8), (7, 4), (11, 3)])
def test_the_noise_scale_recovers_a_planted_value_on_gaussian_gradients(workers: int, lbs: int) -> None:
    # Per-sample gradients G + N(0, s^2 I) in d dimensions: tr(Sigma) = d s^2, |G|^2 = 1, B_noise = d s^2.
    rng = np.random.default_rng(2)
    d, planted = 400, 50.0
    true_g = np.full(d, 1 / math.sqrt(d))
    sigma = math.sqrt(planted / d)
    w_a = half_split(workers)
    smoothed = NoiseScale(beta=0.99)
    for _ in range(600):
        # A half's mean gradient over B_X samples: G + N(0, Sigma / B_X).
        g_a = true_g + rng.normal(scale=sigma / math.sqrt(w_a * lbs), size=d)
        g_b = true_g + rng.normal(scale=sigma / math.sqrt((workers - w_a) * lbs), size=d)
        smoothed.update(*halves(g_a, g_b, workers, lbs).noise())
    assert smoothed.value() == pytest.approx(planted, rel=0.10)
    assert smoothed.trace() == pytest.approx(planted, rel=0.10) and smoothed.grad_sq() == pytest.approx(1.0, rel=0.1)


def test_one_worker_has_nothing_to_split() -> None:
    assert half_split(1) == 0 and half_split(2) == 1 and half_split(7) == 3


def test_the_smoothed_noise_scale_is_the_ratio_of_bias_corrected_averages() -> None:
    s = NoiseScale(beta=0.5)
    assert s.value() is None
    s.update(2.0, 10.0)
    assert s.value() == pytest.approx(5.0)  # bias-corrected: the first estimate itself
    s.update(1.0, 10.0)
    # averages: |G|^2 (0.5*1 + 0.25*2... ) = (0.5*0.5*2 + 0.5*1) / 0.75, tr = 10
    assert s.grad_sq() == pytest.approx((0.25 * 2 + 0.5 * 1) / 0.75) and s.trace() == pytest.approx(10.0)
    assert NoiseScale.from_state(s.state_dict()) == s
    s.update(-5.0, -3.0)  # negative estimates are clipped in the ratio, not in the averages
    assert s.grad_sq() == pytest.approx(1e-12) or s.grad_sq() > 0


# -- policies ------------------------------------------------------------------------------------

BOUNDS = {"low": 16, "high": 1024, "rate": 0.25, "similarity_target": 0.1, "initial_gbs": 64}


@pytest.mark.parametrize(("similarity", "expected"), [(0.05, 125.0), (0.2, 75.0), (0.1, 100.0)])
def test_similarity_grows_below_the_target_shrinks_above_and_keeps_at_it(similarity: float, expected: float) -> None:
    assert propose("similarity", 100, Reading(similarity, None), **BOUNDS) == pytest.approx(expected)


def test_targets_are_clamped_to_the_bounds() -> None:
    assert propose("similarity", 1000, Reading(0.0, None), **BOUNDS) == 1024
    assert propose("similarity", 18, Reading(0.9, None), **BOUNDS) == 16
    assert propose("noise_scale", 900, Reading(0.5, 5000.0), **BOUNDS) == 1024


def test_noise_scale_moves_towards_the_noise_scale_at_most_the_rate() -> None:
    assert propose("noise_scale", 100, Reading(0.5, 110.0), **BOUNDS) == 110.0
    assert propose("noise_scale", 100, Reading(0.5, 400.0), **BOUNDS) == 125.0
    assert propose("noise_scale", 100, Reading(0.5, 10.0), **BOUNDS) == 75.0


def test_goodput_maximises_throughput_times_efficiency_within_the_rate() -> None:
    # Throughput saturates: 128 samples/s at 64, 200 at 128; with B_noise 100 the efficiency falls.
    throughput = {64: 128.0, 72: 140.0, 80: 150.0, 96: 170.0, 128: 200.0}
    noise = 100.0
    best = max((m for m in throughput if 60 <= m <= 100), key=lambda m: throughput[m] * efficiency(m, noise, 64))
    got = propose("goodput", 80, Reading(0.5, noise), throughput=throughput, **BOUNDS)
    assert got == best and got != 128  # 128 is beyond the rate (80 * 1.25 = 100)
    assert efficiency(64, noise, 64) == 1.0 and efficiency(128, noise, 64) == pytest.approx(164 / 228)


def test_fixed_never_moves_and_one_worker_grows_to_two_workers() -> None:
    assert propose("fixed", 100, Reading(0.0, 1e9), **BOUNDS) == 100
    assert propose("similarity", 32, Reading(None, None), **BOUNDS) == 64  # beyond the rate: W 1 -> 2
    assert propose("goodput", 32, Reading(None, None), **BOUNDS) == 64


def test_readings_around_the_target_do_not_flap_the_gbs() -> None:
    steady, gbs, sizes = Steadiness(), 100, []
    for similarity in [0.05, 0.15] * 6:  # alternately below and above the target
        target = propose("similarity", gbs, Reading(similarity, None), **BOUNDS)
        direction = steady.direction(gbs, target)
        if direction:
            gbs = round(target)
            steady.changed(direction)
        sizes.append(gbs)
    assert sizes == sorted(sizes)  # only ever up: a single contrary reading is ignored


def test_a_sustained_reversal_is_made_one_adjustment_late_and_the_dead_band_holds() -> None:
    steady = Steadiness()
    assert steady.direction(100, 125) == 1
    steady.changed(1)
    assert steady.direction(125, 100) == 0  # first contrary request: wait
    assert steady.direction(125, 100) == -1  # second in a row: shrink
    assert steady.direction(100, 104) == 0  # within 5%
    assert Steadiness.from_state(steady.state_dict()) == steady


# -- LR scaling ----------------------------------------------------------------------------------


def test_lr_rules() -> None:
    assert lr_factor("linear", 256, 64) == 4.0 and lr_factor("sqrt", 256, 64) == 2.0 and lr_factor("none", 256, 64) == 1
    assert lr_factor("adascale", 256, 64) == 1.0  # no noise estimate yet
    assert lr_factor("adascale", 256, 64, noise_scale=1e12) == pytest.approx(4.0)  # pure noise: linear
    assert lr_factor("adascale", 256, 64, noise_scale=0.0) == pytest.approx(1.0)  # no noise: no gain
    assert lr_factor("adascale", 256, 64, noise_scale=64.0) == pytest.approx(128 * 4 / 320)


@pytest.mark.parametrize("kind", ["step", "lambda", "none"])
def test_the_factor_scales_what_the_scheduler_sets(kind: str) -> None:
    def make() -> tuple[torch.optim.Optimizer, object]:
        params = [torch.nn.Parameter(torch.zeros(2))]
        opt = torch.optim.SGD([{"params": params}, {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.3}], lr=0.1)
        if kind == "step":
            return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        if kind == "lambda":
            return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
        return opt, None

    plain_opt, plain = make()
    scaled_opt, inner = make()
    scaled = ScaledLr(scaled_opt, inner)
    for step in range(10):
        factor = 1.0 if step < 4 else 2.5  # the factor changes mid-way
        scaled.set_factor(factor)
        for g_plain, g_scaled in zip(plain_opt.param_groups, scaled_opt.param_groups, strict=True):
            assert g_scaled["lr"] == pytest.approx(g_plain["lr"] * factor, rel=1e-15)
        plain_opt.step()
        scaled_opt.step()
        if plain is not None:
            plain.step()  # type: ignore[attr-defined]
        scaled.step()


# -- replanning ----------------------------------------------------------------------------------


def plan_of(lbs: int, shapes: list[tuple[int, int]]) -> TrainingPlan:
    ranks = tuple(RankPlan(r, f"s{r}", "cpu", v, g) for r, (v, g) in enumerate(shapes))
    return TrainingPlan(lbs, ranks)


def test_workers_spread_in_proportion_at_least_one_each() -> None:
    assert spread(11, [2, 3, 6]) == [2, 3, 6]
    assert spread(5, [2, 3, 6]) == [1, 1, 3]
    assert spread(3, [1, 1, 9]) == [1, 1, 1]
    assert spread(2, [2, 3, 6]) is None  # fewer workers than ranks
    assert sum(spread(40, [1, 7, 2]) or []) == 40


def test_a_rank_adds_ga_before_vsw() -> None:
    assert rank_shape(6, 3) == (3, 1) and rank_shape(5, 3) == (1, 4) and rank_shape(4, 3) == (2, 1)
    assert rank_shape(1, 4) == (1, 0)


def test_the_fallback_keeps_lbs_and_changes_it_only_below_one_worker_per_rank() -> None:
    plan = plan_of(4, [(3, 1), (1, 0)])  # 7 workers, GBS 28
    candidates = fallback_candidates(plan, 1, 200)
    grow = choose(candidates, 28, 34.0, +1)
    assert grow is not None and grow.plan.gbs == 32 and grow.plan.lbs == 4
    shrink = choose(candidates, 28, 14.0, -1)
    assert shrink is not None and shrink.plan.gbs == 12 and shrink.plan.lbs == 4  # 12 and 16 tie: the smaller
    tiny = choose(candidates, 8, 6.0, -1)
    assert tiny is not None and (tiny.plan.gbs, tiny.plan.lbs) == (6, 3)
    assert [r.micro_steps for r in tiny.plan.ranks] == [1, 1]
    assert choose(fallback_candidates(plan, 28, 28), 28, 40.0, +1) is None  # nothing above within the bounds


def test_a_solver_plan_is_given_to_the_ranks_server_by_server() -> None:
    current = TrainingPlan(
        4, (RankPlan(0, "fast", "cpu", 2, 0), RankPlan(1, "fast", "cpu", 2, 0), RankPlan(2, "slow", "cpu", 1, 0))
    )
    # The solver lists the slow server first; every rank must stay on its server.
    solver = TrainingPlan(
        8, (RankPlan(0, "slow", "cpu", 1, 1), RankPlan(1, "fast", "cpu", 3, 0), RankPlan(2, "fast", "cpu", 2, 1))
    )
    plan = in_rank_order(current, solver)
    assert plan is not None and plan.lbs == 8
    assert [(r.server, r.vsw, r.ga) for r in plan.ranks] == [("fast", 3, 0), ("fast", 2, 1), ("slow", 1, 1)]
    other = TrainingPlan(
        8, (RankPlan(0, "fast", "cpu", 1, 0), RankPlan(1, "fast", "cpu", 1, 0), RankPlan(2, "fast", "cpu", 1, 0))
    )
    assert in_rank_order(current, other) is None


def test_fp16_loss_scale_is_divided_out_and_a_skipped_step_is_not_a_measurement() -> None:
    g = torch.Generator().manual_seed(3)
    f, t = torch.randn(50, generator=g, dtype=torch.float64), torch.randn(50, generator=g, dtype=torch.float64)
    plain = HalfGradients(float(f @ f), float(f @ t), float(t @ t), 5, 4)
    s = 2.0**16  # what fp16's gradients carry until the update unscales them
    scaled = HalfGradients(float((s * f) @ (s * f)), float((s * f) @ (s * t)), float((s * t) @ (s * t)), 5, 4)
    assert scaled.unscaled(s).noise() == pytest.approx(plain.noise(), rel=1e-12)
    assert scaled.unscaled(s).similarity() == pytest.approx(plain.similarity(), rel=1e-12)
    assert plain.finite()
    inf_t = t.clone()
    inf_t[7] = math.inf
    assert not HalfGradients(float(f @ f), float(f @ inf_t), float(inf_t @ inf_t), 5, 4).finite()
