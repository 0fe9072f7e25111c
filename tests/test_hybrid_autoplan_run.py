"""`jabas run` on `[parallel] plan = "auto"` trains the hybrid planner's plan end to end (real trainers, gloo):
the plan is solved from hybrid profiles for the job's GBS, written to the run folder, its layout is the one the
trainers start with, and the run ends with the predicted beside the measured iteration time.

The hybrid profiles are written by the test (not measured: `tests/test_hybrid_profile.py` measures them) so that the
planner's choice is known: 4 blocks of 1 GB of parameters each (16 GB with gradients and Adam) on devices of 11 GB
leave one layout, two pipeline stages. The memory is the planner's only: the real tiny GPT is what trains."""

from __future__ import annotations

import json
from pathlib import Path

from jabascli.config import load_config
from jabascli.engine.plan import load_plan
from jabascli.profiles.hybrid import write_profiles
from tests.conftest import run_jabas
from tests.test_hybrid_solve_cli import profiles

GBS = 8


def write_job(folder: Path) -> Path:
    base = profiles()
    names = {"cpu": "fast", "cpu-slow": "slow"}  # the config's device types: the profiles' fast and slow
    devices = {n: base.devices[p].model_copy(update={"device": n, "devices_per_server": 1}) for n, p in names.items()}
    network = base.network.model_copy(
        update={"intra": {n: base.network.intra[p] for n, p in names.items()}}
        | {"inter": {n: base.network.inter[p] for n, p in names.items()}}
    )
    write_profiles(folder / "profiles", base.model_copy(update={"devices": devices, "network": network}))
    config = folder / "jabas.toml"
    config.write_text(
        '[job]\nname = "auto"\nworkload = "gpt"\nepochs = 1\n'
        # 50 iterations: steps.csv's rows come every 0.25 s, and the comparison leaves out each row that starts
        # within the 5 warm-up iterations; with 10, a row covering steps 5-10 left nothing to compare
        f'options = {{ variant = "tiny", context = 8, synthetic_size = {50 * GBS} }}\n\n'
        f'[batching]\nmetric = "fixed"\ninitial_gbs = {GBS}\n\n[parallel]\nplan = "auto"\n\n'
        f'[storage]\nrun_dir = "{folder / "runs"}"\ncheckpoint_dir = "{folder / "checkpoints"}"\n\n'
        '[[cluster.servers]]\nname = "fast"\ndevice_type = "cpu"\nmemory_bytes = 11_000_000_000\n\n'
        '[[cluster.servers]]\nname = "slow"\ndevice_type = "cpu-slow"\n'
        "emulate = { slowdown = 3.0, memory_bytes = 11_000_000_000 }\n"
    )
    return config


def test_run_trains_the_planners_hybrid_plan(tmp_path: Path) -> None:
    config = write_job(tmp_path)
    done = run_jabas("run", "-c", str(config))
    assert done.returncode == 0, done.stdout + done.stderr

    plan_path = tmp_path / "runs" / "auto" / "plan.json"
    plan = load_plan(load_config(config), plan_path)
    assert plan.parallel is not None and plan.parallel.pp == 2  # the only layout that fits 11 GB
    assert plan.gbs == GBS and sorted(r.server for r in plan.ranks) == ["fast", "slow"]
    blocks = " | ".join(f"{a}-{b}" for a, b in plan.parallel.stages)
    assert f"hybrid layout (the planner's): tp 1, pp 2, stages {plan.parallel.stages}" in done.stdout
    assert f"layout pp 2 (blocks {blocks}, {plan.parallel.schedule})" in done.stdout  # what the trainers run
    assert "predicted " in done.stdout and " ms per iteration (" in done.stdout
    assert json.loads(plan_path.read_text())["iteration_time_s"] > 0
    steps = (tmp_path / "runs" / "auto" / "steps.csv").read_text().splitlines()
    assert len(steps) > 1  # it trained
