"""`jabas run`'s runner-up trial: plans the model cannot tell apart are all tried, exactly, and the fastest kept.

The tiny float64 workload of tests/engine_support.py on two CPU servers, with synthetic profiles in which both
servers together (a slow link between them) are predicted 11% faster than either one alone, and a refit generation
whose last run was 30% off its prediction: the model's measured error covers the gap, so the run tries all three.
"""

from __future__ import annotations

import csv
import os
import statistics
import subprocess
import sys
from pathlib import Path

from jabascli.config import load_config
from jabascli.config.models import BUCKET_DIRNAME, COMMUNICATION_DIRNAME, COMPUTATION_DIRNAME, MEMORY_DIRNAME
from jabascli.engine.plan import load_plan
from jabascli.engine.reference import reference_run
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
from jabascli.profiles.refit import ObservedAssignment, ObservedPlan, read_refit
from jabascli.solver.plan import read_plan
from tests.engine_support import checkpoint_of, max_abs_diff, write_job
from tests.refit_support import write_measured_error

STEPS, TRIAL = 65, 15


def write_profiles(root: Path) -> None:
    for server in ("s0", "s1"):
        memory = MemoryProfile(gpu_type="cpu", total_memory=10**10, lbs=4, max_num_models=1)
        write_memory_profile(root / MEMORY_DIRNAME, server, memory)
        comp = CompProfile(
            model="tiny", gpu_type="cpu", lbs=4, num_models=1, total_time=10.5, data_time=1.0, fwd_time=3.0,
            bwd_time=6.0, update_time=0.5, copy_time=0.0,
        )  # fmt: skip
        write_comp_profile(root / COMPUTATION_DIRNAME, server, comp)
    write_bucket_profile(root / BUCKET_DIRNAME, BucketProfile(model="tiny", bucket_size_distribution=[0.01]))
    for kind in ("intra", "inter"):  # an all-reduce of 8 ms, whatever its size
        comm = CommProfile(kind=kind, ideal_ms=[0.01, 0.1], measured_ms=[8.0, 8.0])  # type: ignore[arg-type]
        write_comm_profile(root / COMMUNICATION_DIRNAME, comm)


def medians(steps_csv: Path, first_step: int, last_step: int, warmup: int = 5) -> float:
    """The median over iterations first_step+warmup+1 .. last_step, each row's median once per iteration it covers."""
    times: list[float] = []
    previous = 0
    with steps_csv.open() as f:
        for row in csv.DictReader(f):
            step = int(row["step"])
            if previous < step <= last_step or (previous < last_step < step):
                times += [float(row["iteration_s"])] * max(0, min(step, last_step) - max(previous, first_step + warmup))
            previous = step
    return statistics.median(times)


def test_the_runner_up_is_tried_exactly_and_the_faster_plan_kept(tmp_path: Path) -> None:
    config = write_job(tmp_path, [(1, 0), (1, 0)], epochs=2, options={"samples": 400})  # one epoch: 50 steps
    write_profiles(tmp_path / "profiles")
    loaded = load_config(config)
    # The job's model was 30% off on its last run: a refit generation that says so (factors left at the profile).
    last = ObservedPlan(
        lbs=4, weight_sync="sequential", assignments=[ObservedAssignment(server="s0", gpus=1, vsw=1, ga=1)],
        measured_s=0.02665, iterations=20, predicted_s=0.0205,
    )  # fmt: skip
    write_measured_error(loaded, tmp_path / "runs" / "job", last)

    env = {**os.environ, "COLUMNS": "300", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "jabascli", "run", "-c", str(config), "--gbs", "8", "--max-steps", str(STEPS)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr + done.stdout
    out = done.stdout.replace("\n", " ")
    run = tmp_path / "runs" / "job"
    both = "s0:1GPU,VSW:1,GA:0 s1:1GPU,VSW:1,GA:0"
    tried = [read_plan(run / f"plan-trial-{i}.json").seed_form() for i in (1, 2, 3)]
    assert tried[0] == both
    assert sorted(tried[1:]) == ["s0:1GPU,VSW:1,GA:1", "s1:1GPU,VSW:1,GA:1"]  # each server alone, GA 1 (a tie)
    assert "runner-up trial (predicted 18.5, 20.5 and 20.5 ms, within the model's measured error of 30%)" in out, out
    assert f"{both} measured" in out and f", {tried[1]} " in out and f", {tried[2]} " in out

    # The plan kept is the one whose trial iterations were fastest, as steps.csv has them (the earlier on a tie).
    steps_csv = run / "steps.csv"
    times = [medians(steps_csv, i * TRIAL, (i + 1) * TRIAL) for i in range(3)]
    kept = tried[times.index(min(times))]
    assert f"each; kept {kept}" in out, (times, out)
    assert read_plan(run / "plan.json").seed_form() == kept

    # Exact: every iteration, trial or not, is synchronous SGD at GBS 8 on the job's samples.
    final = checkpoint_of(loaded)
    assert final["progress"]["step"] == STEPS
    reference, _ = reference_run(loaded, load_plan(loaded), steps=STEPS)
    assert max(max_abs_diff(final["model"], reference.state_dict()).values()) < 1e-9
    # The three trials and the rest of the run refit the model: four more generations.
    latest = read_refit(run / "perfmodel" / "refit-5.json")
    assert len(latest.observations) == 5
