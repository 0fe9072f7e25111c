"""Uneven plans (#35): prediction at an LBS between profiled ones, the balanced split, and when it is chosen.

Synthetic profiles of two one-device CPU servers whose compute time is proportional to the batch
(``MS_PER_SAMPLE`` per sample, the slow server ``SLOWDOWN`` times that), profiled at LBS 32, 64, 128 and 256,
with one all-reduce of ``ALL_REDUCE_MS`` whatever its size: every figure a test expects follows from those.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from jabascli.cli.trial import plan_trial
from jabascli.config import load_config
from jabascli.config.models import BUCKET_DIRNAME, COMMUNICATION_DIRNAME, COMPUTATION_DIRNAME, MEMORY_DIRNAME
from jabascli.elastic.plans import plan_for
from jabascli.errors import InputError
from jabascli.perfmodel import GroupConfig
from jabascli.perfmodel.online import fingerprint
from jabascli.profiles import (
    BucketProfile,
    CommProfile,
    CompProfile,
    MemoryProfile,
    write_bucket_profile,
    write_comm_profile,
    write_comp_profile,
    write_memory_profile,
)
from jabascli.profiles.refit import ObservedAssignment, ObservedPlan, RefitRecord, read_refit, write_refit
from jabascli.solver.autoplan import solve_for_run
from jabascli.solver.choice import choose_plan, solver_for
from jabascli.solver.online import learn_from_run, measured_profiles, observations
from jabascli.solver.plan import Assignment, Plan, read_plan, write_plan
from jabascli.solver.uneven import GA_SPLIT_MARGIN, best_uneven_plan, candidate_allocations, uneven_plan
from tests.refit_support import write_measured_error

LBS = (32, 64, 128, 256)
MS_PER_SAMPLE = 0.5  # data 0.1, forward 0.15, backward 0.25 ms per sample
SLOWDOWN = 1.5
ALL_REDUCE_MS = 8.0
# An adaptive job's [batching]: no uneven plans for it.
ADAPTIVE = '[batching]\nmetric = "similarity"\ngbs_min = 64\ngbs_max = 1024\ninitial_gbs = 256\n\n'


def write_profiles(root: Path, vsw_gain: bool = False, small_pays: float = 0.0, slowdown: float = SLOWDOWN) -> None:
    """Both servers' profiles; ``vsw_gain``: the fast one also runs 2 VSWs in 1.2x one VSW's time (VSWs pay);
    ``small_pays``: a sample costs ``1 + small_pays * LBS / 128`` times as much, so small micro-batches are the
    cheapest (below 0: the dearest); ``slowdown``: the slow server's."""
    for server, factor in (("fast", 1.0), ("slow", slowdown)):
        device = f"cpu-{server}"
        for lbs in LBS:
            two = vsw_gain and server == "fast"
            memory = MemoryProfile(gpu_type=device, total_memory=10**10, lbs=lbs, max_num_models=2 if two else 1)
            write_memory_profile(root / MEMORY_DIRNAME, server, memory)
            for vsw, scale in ((1, 1.0), (2, 1.2)) if two else ((1, 1.0),):
                t = lbs * factor * scale * (1 + small_pays * lbs / 128)
                comp = CompProfile(
                    model="tiny", gpu_type=device, lbs=lbs, num_models=vsw, total_time=t * MS_PER_SAMPLE,
                    data_time=0.1 * t, fwd_time=0.15 * t, bwd_time=0.25 * t, update_time=0.0, copy_time=0.0,
                )  # fmt: skip
                write_comp_profile(root / COMPUTATION_DIRNAME, server, comp)
    write_bucket_profile(root / BUCKET_DIRNAME, BucketProfile(model="tiny", bucket_size_distribution=[0.01]))
    for kind in ("intra", "inter"):
        comm = CommProfile(kind=kind, ideal_ms=[0.01, 0.1], measured_ms=[ALL_REDUCE_MS, ALL_REDUCE_MS])  # type: ignore[arg-type]
        write_comm_profile(root / COMMUNICATION_DIRNAME, comm)


def write_config(
    tmp_path: Path, extra: str = "", vsw_gain: bool = False, small_pays: float = 0.0, slowdown: float = SLOWDOWN
) -> Path:
    root = tmp_path / "profiles"
    write_profiles(root, vsw_gain, small_pays, slowdown)
    config = tmp_path / "jabas.toml"
    servers = "".join(
        f'[[cluster.servers]]\nname = "{s}"\ndevice_type = "cpu-{s}"\ndevices = 1\n\n' for s in ("fast", "slow")
    )
    config.write_text(
        f'[job]\nname = "job"\n\n[profiles]\nmemory = "{root / MEMORY_DIRNAME}"\n'
        f'computation = "{root / COMPUTATION_DIRNAME}"\ncommunication = "{root / COMMUNICATION_DIRNAME}"\n'
        f'bucket = "{root / BUCKET_DIRNAME}"\n\n[storage]\nrun_dir = "{tmp_path / "runs"}"\n\n' + extra + servers
    )
    return config


def compute_ms(server: str, samples: int) -> float:
    return samples * MS_PER_SAMPLE * (SLOWDOWN if server == "slow" else 1.0)


def test_an_lbs_between_two_profiled_ones_is_on_their_chord(tmp_path: Path) -> None:
    solver = solver_for(load_config(write_config(tmp_path)), "all")
    model, fast = solver.model, next(s for s in solver.servers if s.name == "fast")
    for lbs in (64, 80, 96, 128, 200):  # profiled, and between profiled ones
        data, forward, backward = (float(x) * 1e3 for x in model.device("fast", lbs).phases(1))
        assert (data, forward, backward) == pytest.approx((0.1 * lbs, 0.15 * lbs, 0.25 * lbs))
    # A prediction at LBS 96 lies between those at 64 and 128 (each group at its own LBS).
    time = {b: model.predict(b, "sequential", [GroupConfig(fast, 1, 1, 0)]).time_s for b in (64, 96, 128)}
    own = model.predict(32, "sequential", [GroupConfig(fast, 1, 1, 0, lbs=96)])
    assert own.time_s == pytest.approx(time[96]) and own.gbs == 96
    assert time[64] < time[96] < time[128] and time[96] == pytest.approx((time[64] + time[128]) / 2)
    for outside in (16, 300):  # beyond the profiled range: refused, not extrapolated
        with pytest.raises(InputError, match="no memory profile"):
            model.device("fast", outside)


def test_the_uneven_split_follows_the_speeds(tmp_path: Path) -> None:
    solver = solver_for(load_config(write_config(tmp_path)), "all")
    plan = best_uneven_plan(solver, 256)
    assert plan is not None and plan.uneven
    sizes = {a.server: a.samples(plan.lbs) for a in plan.assignments}
    assert sum(sizes.values()) == 256 == plan.gbs
    # The 1.5x slower server gets about 1 / 2.5 of the samples: the split of least max compute time.
    best_slow = min(range(1, 256), key=lambda s: max(compute_ms("fast", 256 - s), compute_ms("slow", s)))
    assert sizes["slow"] == best_slow and abs(sizes["slow"] - 256 / 2.5) < 1
    assert all(a.vsw == 1 and a.ga == 0 and a.lbs == sizes[a.server] for a in plan.assignments)
    assert plan.lbs == min(sizes.values()) and plan.lbs_text() == f"{sizes['fast']}+{sizes['slow']}"
    expected_ms = max(compute_ms("fast", sizes["fast"]), compute_ms("slow", sizes["slow"])) + ALL_REDUCE_MS
    assert plan.iteration_time_s == pytest.approx(expected_ms * 1e-3)
    assert solver.predict(plan).time_s == plan.iteration_time_s and solver.predict(plan).gbs == 256


def test_a_share_beyond_the_profiled_lbs_trains_with_ga(tmp_path: Path) -> None:
    solver = solver_for(load_config(write_config(tmp_path)), "all")
    plan = best_uneven_plan(solver, 768)  # the fast server's share (about 461) is above LBS 256
    assert plan is not None and sum(a.samples(plan.lbs) for a in plan.assignments) == 768
    fast = next(a for a in plan.assignments if a.server == "fast")
    assert fast.ga >= 1 and fast.lbs is not None and fast.lbs <= 256
    assert abs(fast.samples(plan.lbs) - 768 / 2.5 * SLOWDOWN) <= 4


def test_the_one_micro_batch_split_is_searched_beside_the_ga_one_and_the_faster_offered(tmp_path: Path) -> None:
    """Small micro-batches much cheaper: the GA-free search splits shares into GA steps; the search with one
    micro-batch per GPU (what uneven-batch DDP trains) runs too, and the GA split, well over the margin faster,
    is offered."""
    solver = solver_for(load_config(write_config(tmp_path, small_pays=1.0)), "all")
    groups = candidate_allocations(solver)[0]
    free = uneven_plan(solver.model, groups, 1, "sequential", 256)
    single = uneven_plan(solver.model, groups, 1, "sequential", 256, fewest_steps=True)
    assert free is not None and single is not None
    assert any(a.ga > 0 for a in free.assignments) and all(a.ga == 0 for a in single.assignments)
    sizes = {a.server: a.samples(single.lbs) for a in single.assignments}
    assert sum(sizes.values()) == 256 and sizes["fast"] > sizes["slow"]
    for moved in (-1, 1):  # balanced: a sample moved either way makes the iteration no faster
        fast, slow = (dataclasses.replace(a, lbs=(a.lbs or 0) + (moved if a.server == "fast" else -moved))
                      for a in single.assignments)  # fmt: skip
        assert solver.predict(dataclasses.replace(single, assignments=(fast, slow))).time_s >= single.iteration_time_s
    assert (free.iteration_time_s or 0.0) < (single.iteration_time_s or 0.0) * (1 - GA_SPLIT_MARGIN)
    assert best_uneven_plan(solver, 256) == free


def test_a_ga_split_predicted_faster_only_within_the_margin_is_not_offered(tmp_path: Path) -> None:
    """Small micro-batches slightly cheaper (a profile's noise, as a rule): one micro-batch per GPU is offered."""
    solver = solver_for(load_config(write_config(tmp_path, small_pays=0.05)), "all")
    groups = candidate_allocations(solver)[0]
    free = uneven_plan(solver.model, groups, 1, "sequential", 256)
    single = uneven_plan(solver.model, groups, 1, "sequential", 256, fewest_steps=True)
    assert free is not None and single is not None and any(a.ga > 0 for a in free.assignments)
    assert free.iteration_time_s is not None and single.iteration_time_s is not None
    assert single.iteration_time_s * (1 - GA_SPLIT_MARGIN) <= free.iteration_time_s < single.iteration_time_s
    assert best_uneven_plan(solver, 256) == single


def test_choose_plan_takes_the_uneven_plan_where_the_iidp_split_is_coarse(tmp_path: Path) -> None:
    loaded = load_config(write_config(tmp_path))
    # GBS 256 in whole LBS-32 workers: 5 + 3 at best (160 ms of compute against the balanced 154).
    choice = choose_plan(loaded, 256, "all")
    assert choice.plan.uneven and choice.alternative is not None and not choice.alternative.uneven
    iidp_ms = max(compute_ms("fast", 5 * 32), compute_ms("slow", 3 * 32)) + ALL_REDUCE_MS
    assert choice.alternative.iteration_time_s == pytest.approx(iidp_ms * 1e-3)
    assert choice.plan.iteration_time_s < choice.alternative.iteration_time_s
    assert choose_plan(loaded, 256, "all", uneven=False).plan == choice.alternative


def test_iidp_where_its_vsws_pay(tmp_path: Path) -> None:
    choice = choose_plan(load_config(write_config(tmp_path, vsw_gain=True)), 256, "all")
    assert not choice.plan.uneven and any(a.vsw == 2 for a in choice.plan.assignments)
    assert choice.alternative is not None and choice.alternative.uneven
    assert choice.plan.iteration_time_s < choice.alternative.iteration_time_s


@pytest.mark.parametrize(
    "extra",
    [
        ADAPTIVE,
        "[parallel]\ntp = 1\npp = 1\n\n",
    ],
    ids=["adaptive", "layout"],
)
def test_no_uneven_plan_for_adaptive_batching_or_a_layout(tmp_path: Path, extra: str) -> None:
    choice = choose_plan(load_config(write_config(tmp_path, extra)), 256, "all")
    assert not choice.plan.uneven and choice.alternative is None


def test_an_uneven_plan_round_trips_through_its_file(tmp_path: Path) -> None:
    plan = best_uneven_plan(solver_for(load_config(write_config(tmp_path)), "all"), 256)
    assert plan is not None
    assert read_plan(write_plan(tmp_path / "plan.json", plan)) == plan
    by_hand = Plan(250, 100, "sequential", None, None, (Assignment("fast", None, 1, 1, 0, lbs=150),))
    with pytest.raises(InputError, match="gbs"):  # 150 samples, not 250
        Plan.from_dict(by_hand.to_dict())


def test_a_run_of_an_uneven_plan_refits_the_model(tmp_path: Path) -> None:
    loaded = load_config(write_config(tmp_path))
    plan = choose_plan(loaded, 256, "all").plan
    assert plan.uneven and plan.iteration_time_s is not None
    learned = learn_from_run(loaded, plan, plan.iteration_time_s * 1.2, 50)
    record = read_refit(learned.path)
    assert [a.lbs for a in record.observations[-1].assignments] == [a.lbs for a in plan.assignments]
    # Its groups are predicted at their own LBS: the refit explains the 20% it measured.
    assert learned.predicted_after_s == pytest.approx(plan.iteration_time_s * 1.2, rel=0.05)
    [seen] = observations(loaded, measured_profiles(loaded), record.observations[-1:])
    assert [g.lbs for g in seen.groups] == [a.lbs for a in plan.assignments]


def test_an_older_refit_without_own_lbs_still_reads(tmp_path: Path) -> None:
    loaded = load_config(write_config(tmp_path))
    old = ObservedPlan.model_validate(
        {"lbs": 32, "weight_sync": "sequential", "assignments": [{"server": "fast", "gpus": 1, "vsw": 1, "ga": 0}],
         "measured_s": 0.03, "iterations": 20}
    )  # fmt: skip
    record = RefitRecord(
        generation=1, prior=fingerprint(measured_profiles(loaded)), prior_iterations=2.0, compute={}, comm={},
        observations=[old, old.model_copy(update={"assignments": [ObservedAssignment(server="fast", gpus=1, vsw=1,
                                                                                      ga=0, lbs=96)]})],
    )  # fmt: skip
    back = read_refit(write_refit(tmp_path / "runs" / "job", record))
    assert [a.lbs for o in back.observations for a in o.assignments] == [None, 96]


def test_a_tie_goes_to_the_plan_with_slack_beside_the_pace_setter(tmp_path: Path) -> None:
    """A 3.5x slower server at its smallest LBS, 32, paces both kinds at GBS 128: IIDP's 3 + 1 workers of 32 and
    the uneven 96 + 32 are predicted alike. A sample costs less in a larger micro-batch (15 ms for 32, 38 ms for
    96), so the fast server's one micro-batch of 96 leaves it 7 ms more slack than its three of 32: were the slow
    server faster than its profile, only the uneven plan would gain, so the tie goes to it."""
    solver = solver_for(load_config(write_config(tmp_path, small_pays=-0.25, slowdown=3.5)), "all")
    iidp = solver.solve(128)
    uneven = best_uneven_plan(solver, 128)
    assert uneven is not None and iidp.lbs == 32 and iidp.workers == 4
    assert {a.server: a.samples(uneven.lbs) for a in uneven.assignments} == {"fast": 96, "slow": 32}
    assert uneven.iteration_time_s == pytest.approx(iidp.iteration_time_s, rel=1e-12)  # the slow server's 32
    slack = {p.uneven: next(a.iteration_time_s for a in p.assignments if a.server == "fast") for p in (iidp, uneven)}
    # Each group's time: its computation and the 8 ms all-reduce.
    assert slack[True] == pytest.approx(46e-3) and slack[False] == pytest.approx(53e-3)
    assert choose_plan(load_config(tmp_path / "jabas.toml"), 128, "all").plan == uneven


def test_the_runner_up_trial_takes_the_other_kind(tmp_path: Path) -> None:
    loaded = load_config(write_config(tmp_path))
    solved = solve_for_run(loaded, 256, servers="all")
    assert solved is not None and solved.plan.uneven and solved.choice is not None
    last = ObservedPlan(
        lbs=32, weight_sync="sequential", assignments=[ObservedAssignment(server="fast", gpus=1, vsw=1, ga=0)],
        measured_s=0.0208, iterations=20, predicted_s=0.016,
    )  # fmt: skip
    write_measured_error(loaded, tmp_path / "runs" / "job", last)  # 30% off the profiles' 16 ms for that plan
    trial = plan_trial(loaded, solved, None, 0)
    # IIDP's best (5 + 3 workers of LBS 32) is predicted within the measured 30% of the uneven plan.
    assert trial is not None and trial.error == pytest.approx(0.3)
    assert trial.best == solved.plan and trial.runners_up == (solved.choice.alternative,)


def test_the_trial_tries_every_plan_within_the_error_closest_first(tmp_path: Path) -> None:
    loaded = load_config(write_config(tmp_path))
    solved = solve_for_run(loaded, 256, servers="all")
    assert solved is not None and solved.choice is not None
    last = ObservedPlan(
        lbs=32, weight_sync="sequential", assignments=[ObservedAssignment(server="fast", gpus=1, vsw=1, ga=0)],
        measured_s=0.0256, iterations=20, predicted_s=0.016,
    )  # fmt: skip
    write_measured_error(loaded, tmp_path / "runs" / "job", last)  # 60% off
    trial = plan_trial(loaded, solved, None, 0)
    # A model 60% off cannot rank the fast server alone (256 samples, 128 ms, no all-reduce) behind the uneven
    # plan (154 + 102: 85 ms) either; the slow server alone (192 ms) is out of reach.
    assert trial is not None and trial.error == pytest.approx(0.6)
    assert solved.plan.iteration_time_s is not None and 0.128 < 1.6 * solved.plan.iteration_time_s < 0.192
    closer, alone = trial.runners_up
    assert closer == solved.choice.alternative
    assert alone.servers() == ["fast"] and alone.iteration_time_s == pytest.approx(256 * MS_PER_SAMPLE * 1e-3)
    # A run with room for three trials of 15 iterations and no more tries the closer one only.
    short = plan_trial(loaded, solved, 45, 0)
    assert short is not None and short.runners_up == (closer,)
    assert plan_trial(loaded, solved, 44, 0) is None


def test_jabas_solve_shows_the_uneven_plan_and_the_other_kind(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from jabascli.cli.app import app

    config = str(write_config(tmp_path))
    result = CliRunner().invoke(
        app, ["solve", "-c", config, "--gbs", "256", "--servers", "all"], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output
    assert "GBS 256 = LBS 154+102" in result.stdout and "fast:1GPU,VSW:1,GA:0,LBS:154" in result.stdout
    assert "IIDP alternative: LBS 32," in result.stdout and "(--kind iidp)" in result.stdout
    iidp = CliRunner().invoke(app, ["solve", "-c", config, "--gbs", "256", "--kind", "iidp"], env={"COLUMNS": "200"})
    assert iidp.exit_code == 0 and "GBS 256 = LBS 32 x 8 workers" in iidp.stdout
    refused = CliRunner().invoke(app, ["solve", "-c", config, "--range", "64:256", "--kind", "uneven"])
    assert refused.exit_code == 2 and "--kind" in refused.stderr


def test_a_move_keeps_the_gbs_with_the_uneven_plan_where_it_is_faster(tmp_path: Path) -> None:
    """An elastic move or recovery solves the new allocation as ``jabas run`` does: the uneven plan where the
    job may train one and it is predicted faster, else IIDP's."""
    loaded = load_config(write_config(tmp_path))
    plan, source = plan_for(loaded, ["fast", "slow"], gbs=256)
    chosen = choose_plan(loaded, 256, "all").plan
    assert plan.uneven and source == "solver plan at GBS 256" and plan.gbs == 256
    assert [plan.rank_lbs(r.rank) for r in plan.ranks] == [a.lbs for a in chosen.assignments]
    alone, _ = plan_for(loaded, ["fast"], gbs=256)
    assert not alone.uneven and alone.gbs == 256

    plan, _ = plan_for(load_config(write_config(tmp_path / "adaptive", ADAPTIVE)), ["fast", "slow"], gbs=256)
    assert not plan.uneven and plan.gbs == 256
