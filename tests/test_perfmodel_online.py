"""The online performance model: the profiles refit to measured iteration times, saved as generations of the run.

Synthetic profiles are written out number by number here (not scaled by the code under test), so the factors a
refit recovers are checked against figures the test chose. The end-to-end test trains digits with ``jabas run``
from profiles that are deliberately wrong and checks what the refit predicts against what the run measured.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import tomli_w
from typer.testing import CliRunner

from jabascli.autoscale.setup import scaling_from_config
from jabascli.cli.app import app
from jabascli.config import LoadedConfig, load_config
from jabascli.engine.metrics import median_iteration_s
from jabascli.errors import InputError
from jabascli.perfmodel import GroupConfig, PerformanceModel, ServerSpec
from jabascli.perfmodel.online import Observation, Refit, errors, fit
from jabascli.profiles import (
    BucketProfile,
    CommMeta,
    CommProfile,
    CompProfile,
    MemoryProfile,
    ProfileSet,
    load_profile_set,
    write_bucket_profile,
    write_comm_profile,
    write_comp_profile,
    write_memory_profile,
)
from jabascli.profiles.refit import read_refit, refit_generations, write_refit
from jabascli.solver import solver_from_config
from jabascli.solver.autoplan import solve_for_run
from jabascli.solver.online import (
    host_disturbed,
    job_refit,
    learn_from_run,
    measured_error,
    measured_profiles,
    observed_assignments,
)
from jabascli.solver.plan import Assignment, Plan

# Per VSW at LBS 32 (ms): data, forward, backward; the update; LBS 16 takes 0.6 of it.
BASE = {"fast": (1.0, 10.0, 20.0, 2.0), "slow": (3.0, 30.0, 60.0, 6.0)}
BUCKETS_MIB = [4.0, 4.0, 8.0]
BANDWIDTH = 1e9  # the comm profiles' meta bandwidth, bytes/s
LINK_MS = {"intra": (0.2, 1.0), "inter": (1.0, 3.0)}  # all-reduce: intercept, slope against the ideal time


def synthetic(
    compute: dict[str, float], comm: dict[str, float], at_lbs: dict[tuple[str, int], float] | None = None
) -> ProfileSet:
    """Profiles of the two servers with each one's times times ``compute[server]`` (and at one LBS times
    ``at_lbs[(server, lbs)]``), links' by ``comm[kind]``."""
    memory, comp = {}, {}
    for server, (d, f, b, u) in BASE.items():
        gpu = "cpu" if server == "fast" else "cpu-x3"
        for lbs, share in ((16, 0.6), (32, 1.0)):
            a = compute.get(server, 1.0) * (at_lbs or {}).get((server, lbs), 1.0)
            memory[(server, lbs)] = MemoryProfile(gpu_type=gpu, total_memory=10**10, lbs=lbs, max_num_models=2)
            for n in (1, 2):
                dd, ff, bb = (x * share * n * a for x in (d, f, b))
                comp[(server, lbs, n)] = CompProfile(
                    model="toy", gpu_type=gpu, lbs=lbs, num_models=n, total_time=dd + ff + bb + u * a,
                    data_time=dd, fwd_time=ff, bwd_time=bb, update_time=u * a, copy_time=0.5 * a * (n - 1),
                )  # fmt: skip
    links = {}
    for kind, (intercept, slope) in LINK_MS.items():
        c = comm.get(kind, 1.0)
        ideal = [0.5, 2.0, 8.0, 32.0]
        meta = CommMeta(bandwidth=BANDWIDTH, world_size=2)
        measured = [c * (intercept + slope * x) for x in ideal]
        links[kind] = CommProfile(kind=kind, ideal_ms=ideal, measured_ms=measured, meta=meta)  # type: ignore[arg-type]
    return ProfileSet(memory, comp, BucketProfile(model="toy", bucket_size_distribution=BUCKETS_MIB), links)  # type: ignore[arg-type]


FAST = ServerSpec("fast", "cpu", 2, "fast", BANDWIDTH, BANDWIDTH)
SLOW = ServerSpec("slow", "cpu-x3", 1, "slow", BANDWIDTH, BANDWIDTH)
PLANS = [  # (lbs, groups): alone, two GPUs of one server, and both servers, at several GA counts
    (32, (GroupConfig(FAST, 1, 1, 0),)),
    (16, (GroupConfig(FAST, 1, 2, 1),)),
    (32, (GroupConfig(SLOW, 1, 1, 1),)),
    (32, (GroupConfig(FAST, 2, 1, 0),)),
    (16, (GroupConfig(FAST, 2, 1, 2),)),
    (32, (GroupConfig(FAST, 1, 1, 2), GroupConfig(SLOW, 1, 1, 0))),
    (16, (GroupConfig(FAST, 1, 2, 0), GroupConfig(SLOW, 1, 1, 0))),
]


def observe(truth: ProfileSet, iterations: int = 200) -> list[Observation]:
    model = PerformanceModel(truth)
    return [
        Observation(lbs, "sequential", groups, model.predict(lbs, "sequential", groups).time_s, iterations)
        for lbs, groups in PLANS
    ]


def test_a_refit_recovers_known_compute_and_allreduce_factors() -> None:
    true_compute, true_comm = {"fast": 1.3, "slow": 0.85}, {"intra": 0.7, "inter": 1.8}
    prior = synthetic({}, {})
    observations = observe(synthetic(true_compute, true_comm))
    assert max(abs(e) for e in errors(prior, observations)) > 0.2  # the profiles are far off

    refit = fit(prior, observations, prior_iterations=1e-3)

    for server, a in true_compute.items():
        assert refit.compute[server] == pytest.approx(a, rel=0.01), refit
    for kind, c in true_comm.items():
        assert refit.comm[kind] == pytest.approx(c, rel=0.02), refit
    assert max(abs(e) for e in errors(refit.apply(prior), observations)) < 0.005


def test_busy_times_measure_the_server_that_does_not_set_the_pace() -> None:
    # The fast server is 30% faster than profiled, and the slow one sets the pace of every two-server plan, so
    # the iteration times cannot see it: only its ranks' busy times, against the slow server's, can. (How the
    # slow server's iteration splits between its computation and the all-reduce is left to the prior.)
    truth = PerformanceModel(synthetic({"fast": 0.7}, {}))
    prior = synthetic({}, {})
    plans = [
        (32, (GroupConfig(FAST, 1, 1, 0), GroupConfig(SLOW, 1, 1, 0))),
        (16, (GroupConfig(FAST, 1, 1, 1), GroupConfig(SLOW, 1, 1, 0))),
    ]
    timed, busy = [], []
    for lbs, groups in plans:
        p = truth.predict(lbs, "sequential", groups)
        assert p.groups[1].time_s == p.time_s  # the slow server sets the pace
        timed.append(Observation(lbs, "sequential", groups, p.time_s, 200))
        busy.append(
            Observation(lbs, "sequential", groups, p.time_s, 200, busy_s=tuple(g.breakdown.busy_s for g in p.groups))
        )

    assert fit(prior, timed).compute["fast"] == pytest.approx(1.0, abs=0.02)  # left at the profile
    refit = fit(prior, busy)
    assert refit.compute["fast"] / refit.compute["slow"] == pytest.approx(0.7, rel=0.01), refit
    assert refit.compute["slow"] == pytest.approx(1.0, rel=0.05), refit
    exact = fit(prior, busy, prior_iterations=1e-3)  # with a negligible prior, every factor as it is
    assert exact.compute["fast"] == pytest.approx(0.7, rel=0.005), exact
    assert exact.compute["slow"] == pytest.approx(1.0, rel=0.005), exact


def test_a_run_s_busy_times_go_to_the_assignments_of_their_ranks() -> None:
    plan = Plan(
        96, 32, "sequential", None, None, (Assignment("fast", "cpu", 2, 1, 0), Assignment("slow", "cpu-x3", 1, 1, 0))
    )
    (fast, slow) = observed_assignments(plan, {0: 0.010, 1: 0.012, 2: 0.030})
    assert (fast.server, fast.busy_s, slow.server, slow.busy_s) == ("fast", pytest.approx(0.011), "slow", 0.030)
    (fast, slow) = observed_assignments(plan, {0: 0.010, 2: 0.030})  # rank 1 measured nothing
    assert fast.busy_s is None and slow.busy_s == 0.030


def test_the_profile_is_a_prior_that_measurements_outweigh_as_they_accumulate() -> None:
    # One server alone: every term is computation, so the time is linear in its factor and the MAP update is exact:
    # log a = n / (n + lam) * log(measured / profile).
    prior, groups = synthetic({}, {}), (GroupConfig(FAST, 1, 1, 0),)
    profile_s = PerformanceModel(prior).predict(32, "sequential", groups).time_s
    measured = 1.5 * profile_s
    for n in (5, 20, 100):
        refit = fit(prior, [Observation(32, "sequential", groups, measured, n)], prior_iterations=5.0)
        assert math.log(refit.compute["fast"]) == pytest.approx(n / (n + 5.0) * math.log(1.5), rel=1e-4)
        assert set(refit.compute) == {"fast"} and refit.comm == {}  # nothing measured the slow server or a link
        assert refit.lbs == {}  # one LBS measured: no per-LBS correction
    busy = fit(prior, [Observation(32, "sequential", groups, measured, 100, disturbed=True)], prior_iterations=5.0)
    assert math.log(busy.compute["fast"]) == pytest.approx(0.5 * math.log(1.5), rel=1e-4)  # weighed as the profile


FAST_AT_TWO_LBS = [(32, (GroupConfig(FAST, 1, 1, 0),)), (16, (GroupConfig(FAST, 1, 2, 1),))]


def test_a_server_measured_at_two_lbs_gets_a_factor_per_lbs_weighed_by_runs() -> None:
    # The fast server ran LBS 16 at 0.7x its profile and LBS 32 at 1.2x (one profile point drew a slow host, the
    # other a fast one): one factor per server misses both runs by about a quarter. A run and a profile point are
    # one draw each, so one run per LBS moves its point half way (in log time; the miss about halves, less than
    # exactly where a term of the iteration does not scale with the point), and twenty runs 20/21 of the way.
    prior = synthetic({}, {})
    truth = PerformanceModel(synthetic({}, {}, at_lbs={("fast", 16): 0.7, ("fast", 32): 1.2}))
    observed = [
        Observation(lbs, "sequential", groups, truth.predict(lbs, "sequential", groups).time_s, 200)
        for lbs, groups in FAST_AT_TWO_LBS
    ]
    assert fit(prior, observed[:1]).lbs == {}  # one LBS: how fast the server is now, its profile's shape kept

    once = fit(prior, observed)

    assert set(once.lbs) == {"fast"} and set(once.lbs["fast"]) == {16, 32}
    server_only = [math.log1p(e) for e in errors(Refit(once.compute, once.comm).apply(prior), observed)]
    assert min(abs(m) for m in server_only) > 0.15
    per_lbs = [math.log1p(e) for e in errors(once.apply(prior), observed)]
    assert all(0.45 < after / before < 0.55 for after, before in zip(per_lbs, server_only, strict=True))

    many = fit(prior, observed * 20)
    assert many.compute_at("fast", 16) == pytest.approx(0.7, rel=0.03), many
    assert many.compute_at("fast", 32) == pytest.approx(1.2, rel=0.03), many
    assert max(abs(e) for e in errors(many.apply(prior), observed)) < 0.02
    disturbed = [dataclasses.replace(o, disturbed=True) for o in observed]
    assert fit(prior, disturbed).lbs == {}  # runs beside other work say nothing of one LBS against another


def test_an_uneven_group_between_two_profiled_lbs_corrects_both() -> None:
    # A group at LBS 24 is predicted from the chord of the LBS-16 and LBS-32 points: both carry what it measured.
    prior = synthetic({}, {})
    truth = PerformanceModel(synthetic({"fast": 0.8}, {}))
    plans = [(32, (GroupConfig(FAST, 1, 1, 0),)), (32, (GroupConfig(FAST, 1, 1, 0, lbs=24),))]
    observed = [Observation(b, "sequential", g, truth.predict(b, "sequential", g).time_s, 200) for b, g in plans]
    refit = fit(prior, observed)
    assert set(refit.lbs.get("fast", {})) == {16, 32}
    assert max(abs(e) for e in errors(refit.apply(prior), observed)) < 0.02


def write_profiles(root: Path, profiles: ProfileSet) -> None:
    for (server, _), p in profiles.memory.items():
        write_memory_profile(root / "memory", server, p)
    for (server, _, _), c in profiles.comp.items():
        write_comp_profile(root / "computation", server, c)
    assert profiles.bucket is not None
    write_bucket_profile(root / "bucket", profiles.bucket)
    for comm in profiles.comm.values():
        write_comm_profile(root / "comm", comm)


def job_config(folder: Path, servers: list[dict[str, object]], profiles: Path, job: dict[str, object]) -> Path:
    config = {
        "job": job,
        "cluster": {"servers": servers},
        "profiles": {
            "memory": str(profiles / "memory"),
            "computation": str(profiles / "computation"),
            "communication": str(profiles / "comm"),
            "bucket": str(profiles / "bucket"),
        },
        "storage": {"checkpoint_dir": str(folder / "checkpoints"), "run_dir": str(folder / "runs")},
    }
    path = folder / "jabas.toml"
    path.write_bytes(tomli_w.dumps(config).encode())
    return path


def digests(folder: Path) -> dict[str, tuple[str, int]]:
    return {
        str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_a_refit_is_a_new_generation_and_never_touches_the_measured_profiles(tmp_path: Path) -> None:
    profiles = tmp_path / "profiles"
    write_profiles(profiles, synthetic({}, {}))
    (tmp_path / "toy.py").write_text("")
    servers = [
        {"name": "fast", "device_type": "cpu", "devices": 2},
        {"name": "slow", "device_type": "cpu-x3", "devices": 1},
    ]
    job = {"name": "toy", "workload": str(tmp_path / "toy.py"), "lbs": 32}
    loaded = load_config(job_config(tmp_path, servers, profiles, job))
    before = digests(profiles)
    plan = solver_from_config(loaded, "fast,slow").solve(128)
    assert plan is not None and plan.iteration_time_s is not None

    assert scaling_from_config(loaded).objective.margin == pytest.approx(0.05)  # [scaling] margin alone

    first = learn_from_run(loaded, plan, 1.4 * plan.iteration_time_s, 60)
    # The auto-scaler moves only for a gain above the model's measured error (the run was 40% off) and the margin.
    assert scaling_from_config(loaded).objective.margin == pytest.approx(0.05 + 0.4)
    run = tmp_path / "runs" / "toy"
    assert first.path == run / "perfmodel" / "refit-1.json" and first.record.generation == 1
    # Both servers and the link between them were in the plan (the fast server's two GPUs as two groups).
    assert set(first.record.compute) == {"fast", "slow"} and set(first.record.comm) == {"inter"}
    assert abs(first.record.error_after or 1.0) < 0.02 and first.record.error_before == pytest.approx(0.4)
    written = first.path.read_bytes()
    in_use = job_refit(loaded)
    assert in_use is not None and in_use.path == first.path
    # The job's model is now the refit one: the same plan is predicted at the refit's figure.
    again = solver_from_config(loaded, "fast,slow")
    specs = {s.name: s for s in again.servers}
    groups = [GroupConfig(specs[a.server], a.gpus, a.vsw, a.ga) for a in plan.assignments]
    refit_s = again.model.predict(plan.lbs, plan.weight_sync, groups).time_s  # type: ignore[arg-type]
    assert refit_s == pytest.approx(first.predicted_after_s, rel=1e-12)

    solved = CliRunner().invoke(app, ["solve", "-c", str(loaded.path), "--gbs", "128", "--servers", "fast,slow"])
    assert solved.exit_code == 0, solved.output
    assert "performance model: refit generation 1 from 1 run (fast compute x" in solved.output.replace("\n", "")

    second = learn_from_run(loaded, plan, 1.4 * plan.iteration_time_s, 60)
    assert second.record.generation == 2 and len(second.record.observations) == 2
    assert [g for g, _ in refit_generations(run)] == [1, 2] and first.path.read_bytes() == written
    assert abs(second.record.error_after or 0) <= abs(first.record.error_after or 0)  # two runs outweigh the prior
    with pytest.raises(InputError, match="never overwritten"):
        write_refit(run, read_refit(first.path))
    assert digests(profiles) == before  # the measured profiles: not one byte, not one mtime

    # `jabas run --fresh` moves the run folder aside: the job's model still starts from its refit there (the
    # newest folder moved aside), and a folder of another job whose name only begins the same is not looked in.
    other = tmp_path / "runs" / "toy.v2" / "perfmodel" / "refit-9.json"
    other.parent.mkdir(parents=True)
    other.write_bytes(second.path.read_bytes())  # a refit that would apply, in the other job's folder
    run.rename(run.with_name("toy.20261127-200000"))
    aside = job_refit(loaded)
    assert aside is not None and aside.path == tmp_path / "runs" / "toy.20261127-200000" / "perfmodel" / "refit-2.json"

    # Profiled again: the refit was made on other profiles and no longer applies.
    slower = synthetic({"fast": 2.0}, {})
    for c in slower.comp.values():
        if c.gpu_type == "cpu":
            write_comp_profile(profiles / "computation", "fast", c)
    assert job_refit(loaded) is None


def fast_alone_job(folder: Path) -> LoadedConfig:
    """A job on the fast server alone, on the synthetic profiles as they are."""
    profiles = folder / "profiles"
    write_profiles(profiles, synthetic({}, {}))
    (folder / "toy.py").write_text("")
    servers: list[dict[str, object]] = [{"name": "fast", "device_type": "cpu", "devices": 1}]
    job = {"name": "toy", "workload": str(folder / "toy.py"), "lbs": 32}
    return load_config(job_config(folder, servers, profiles, job))


def test_runs_at_two_lbs_save_a_factor_per_lbs_that_the_next_plan_uses(tmp_path: Path) -> None:
    loaded = fast_alone_job(tmp_path)
    solver = solver_from_config(loaded, "fast")
    runs = []
    for lbs, vsw, ga in ((32, 1, 1), (16, 2, 1)):  # GBS 64 at LBS 32 and at LBS 16
        plan = Plan(64, lbs, "sequential", None, None, (Assignment("fast", "cpu", 1, vsw, ga),))
        runs.append(dataclasses.replace(plan, iteration_time_s=solver.predict(plan).time_s))
    (at_32, at_16) = runs
    assert at_32.iteration_time_s is not None and at_16.iteration_time_s is not None
    learn_from_run(loaded, at_32, 1.2 * at_32.iteration_time_s, 100)
    learned = learn_from_run(loaded, at_16, 0.7 * at_16.iteration_time_s, 100)

    record = read_refit(learned.path)  # the factors parse back from the file as the fit made them
    assert set(record.lbs) == {"fast"} and set(record.lbs["fast"]) == {16, 32}
    in_use = job_refit(loaded)
    assert in_use is not None and re.search(
        r"fast compute x\d\.\d\d \(at LBS 16 x0\.\d\d, 32 x1\.\d\d\)", in_use.line()
    )
    # The job's model: each LBS half way from the server factor's prediction to what its one run measured.
    again = solver_from_config(loaded, "fast")
    server_only = PerformanceModel(Refit(record.compute, record.comm).apply(measured_profiles(loaded)))
    for plan, measured_s in ((at_32, 1.2 * at_32.iteration_time_s), (at_16, 0.7 * at_16.iteration_time_s)):
        (a,) = plan.assignments
        groups = (GroupConfig(again.servers[0], a.gpus, a.vsw, a.ga),)
        before = math.log(measured_s / server_only.predict(plan.lbs, "sequential", groups).time_s)
        assert abs(before) > 0.1
        assert 0.45 < math.log(measured_s / again.predict(plan).time_s) / before < 0.55


def test_the_measured_error_counts_what_the_refit_cannot_explain(tmp_path: Path) -> None:
    """The last run predicted exactly, but two earlier runs of the same plan 1.3x and 0.8x its profile: no one
    factor puts both within 23.8% (the best, 1.05, misses each by that much), so the model's measured error,
    which the runner-up trial and the auto-scaler's margin use, is at least that, not the last run's 0."""
    loaded = fast_alone_job(tmp_path)
    plan = solver_from_config(loaded, "fast").solve(64)
    assert plan is not None and plan.iteration_time_s is not None
    assert measured_error(loaded) is None  # no refit yet: nothing measured

    learn_from_run(loaded, plan, 1.3 * plan.iteration_time_s, 60)
    learn_from_run(loaded, plan, 0.8 * plan.iteration_time_s, 60)
    again = solver_from_config(loaded, "fast").predict(plan).time_s  # the refit model's, which plans the next run
    learn_from_run(loaded, dataclasses.replace(plan, iteration_time_s=again), again, 60)
    error = measured_error(loaded)
    assert error is not None and error >= 0.238 - 0.005


def run_digits(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # One thread, as the benchmarks train: an idle core's worth of OpenMP threads spinning on a busy 2-core host
    # made this plan's iterations 80x slower (320 ms against 4 ms).
    env = {**os.environ, "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "jabascli", "run", "-c", str(config), *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def test_after_a_short_digits_run_the_refit_predicts_it_and_the_next_run_starts_from_it(tmp_path: Path) -> None:
    # Profiles about 1.5x too slow for this host: one VSW fits, at LBS 32 only, so GBS 64 is LBS 32 with GA 1.
    profiles = tmp_path / "profiles"
    memory = MemoryProfile(gpu_type="cpu", total_memory=10**10, lbs=32, max_num_models=1)
    write_memory_profile(profiles / "memory", "fast", memory)
    comp = CompProfile(
        model="digits", gpu_type="cpu", lbs=32, num_models=1, total_time=3.2, data_time=0.4, fwd_time=0.8,
        bwd_time=1.6, update_time=0.4, copy_time=0.0,
    )  # fmt: skip
    write_comp_profile(profiles / "computation", "fast", comp)
    write_bucket_profile(profiles / "bucket", BucketProfile(model="digits", bucket_size_distribution=[0.1]))
    write_comm_profile(profiles / "comm", CommProfile(kind="intra", ideal_ms=[0.1, 1.0], measured_ms=[0.2, 1.1]))
    job = {"name": "digits", "workload": "digits", "lbs": 32, "epochs": 4, "options": {"width": 4}}
    config = job_config(tmp_path, [{"name": "fast", "device_type": "cpu", "devices": 1}], profiles, job)
    before = digests(profiles)

    # 75 timed iterations: the profile, worth 2 iterations, keeps under 3% of the way in log time, so the refit
    # lands within 5% of the measurement even where this host runs twice as fast as the profiles say.
    first = run_digits(config, "--gbs", "64", "--max-steps", "80")
    assert first.returncode == 0, first.stderr + first.stdout
    run = tmp_path / "runs" / "digits"
    record = read_refit(run / "perfmodel" / "refit-1.json")
    (observed,) = record.observations
    predicted_before = observed.predicted_s
    assert predicted_before == pytest.approx(2 * 2.8e-3 + 0.4e-3)  # the profiles' plan: two micro-steps, an update
    # The measurement, read from steps.csv here: its rows' medians, each counted once per iteration it covers.
    with (run / "steps.csv").open() as f:
        rows = [(int(r["step"]), float(r["iteration_s"])) for r in csv.DictReader(f)]
    assert rows[-1][0] == 80 and observed.measured_s == pytest.approx(_median_after_warmup(rows))
    after = predicted_before * record.compute["fast"]  # every term of a one-server plan is computation
    assert (observed.measured_s - after) / after == pytest.approx(record.error_after, rel=1e-6, abs=1e-9)
    assert f"generation 1, {run / 'perfmodel' / 'refit-1.json'}" in first.stdout.replace("\n", "")
    # Within 5% of the run it measured; a run on a busy host weighs only as the profile (then the refit moves
    # halfway in log time, checked in the unit test above), so the 5% is checked of the run weighed in full too.
    quiet = Observation(32, "sequential", (GroupConfig(ServerSpec("fast", "cpu", 1, "fast", 1e9, 1e9), 1, 1, 1),),
                        observed.measured_s, observed.iterations)  # fmt: skip
    measured_profiles = load_config(config).profile_dirs()
    prior = load_profile_set(measured_profiles.memory, measured_profiles.computation, measured_profiles.communication,
                             measured_profiles.bucket)  # fmt: skip
    (full_error,) = errors(fit(prior, [quiet]).apply(prior), [quiet])
    assert abs(full_error) < 0.05, (record, first.stdout)
    if not observed.disturbed:
        assert abs(record.error_after or 1.0) < 0.05, (record, first.stdout)

    # The next run of the job plans with the refit model (what `jabas run --gbs 64` solves, in this process).
    solved = solve_for_run(load_config(config), 64)
    assert solved is not None and solved.plan.seed_form() == "fast:1GPU,VSW:1,GA:1"
    assert solved.plan.iteration_time_s == pytest.approx(after, rel=1e-9)
    assert digests(profiles) == before


def _median_after_warmup(rows: list[tuple[int, float]], warmup: int = 5) -> float:
    """Each row's median once per iteration it covers after the first ``warmup``."""
    times: list[float] = []
    previous = 0
    for step, t in rows:
        times += [t] * max(0, step - max(previous, warmup))
        previous = step
    return statistics.median(times)


def test_the_measured_median_counts_a_row_for_its_iterations_after_the_warmup(tmp_path: Path) -> None:
    # steps.csv as a short run writes it: four slow first steps logged one by one, then a row for steps 5-18.
    steps = tmp_path / "steps.csv"
    rows = [(1, 0.30), (2, 0.30), (3, 0.30), (4, 0.30), (18, 0.005), (19, 0.32), (20, 0.19)]
    lines = ["time,epoch,step,gbs,loss,samples_per_s,lr,iteration_s"]
    lines += [f"0,0,{s},64,1.0,100.0,0.05,{t}" for s, t in rows]
    steps.write_text("\n".join(lines) + "\n")
    # After 5 warm-up iterations: steps 6-18 (13 of them) at 5 ms, then 320 and 190 ms.
    assert median_iteration_s(steps) == (0.005, 15)
    assert median_iteration_s(steps, first_step=10) == (0.005, 5)  # resumed at step 10: steps 16-20 count


def test_a_host_is_busy_when_other_work_loads_half_its_cores() -> None:
    assert not host_disturbed(2.9, trainers=2, cpus=2) and host_disturbed(3.1, trainers=2, cpus=2)
    assert not host_disturbed(None, trainers=1, cpus=2)
