"""Reruns keep what the job had: `jabas run` resumes the newest intact checkpoint, never starts over silently.

Every run here is the real `jabas` command with real trainer processes; the
parameters at the end are compared with a single process that trained the
same iterations without interruption (engine/reference.py).
"""

from __future__ import annotations

import csv
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from jabascli.cli.app import app
from jabascli.engine.checkpoint import read_checkpoint
from jabascli.engine.plan import load_plan
from jabascli.engine.reference import reference_run
from tests.conftest import WITH_SIGINT, run_jabas
from tests.engine_support import checkpoint_of, load, max_abs_diff, write_job
from tests.test_engine_launch import live_trainers

STEPS = 20  # 80 samples at GBS 8 (two ranks of LBS 4), two epochs


def _job(folder: Path, **options: object) -> Path:
    return write_job(folder, [(1, 0), (1, 0)], options={"samples": 80, **options}, epochs=2)


def _steps(folder: Path) -> list[int]:
    with (folder / "runs" / "job" / "steps.csv").open() as f:
        return [int(row["step"]) for row in csv.DictReader(f)]


def _ends_as_uninterrupted(config: Path) -> None:
    loaded = load(config)
    final = checkpoint_of(loaded)
    assert final["progress"]["step"] == STEPS
    reference, _ = reference_run(loaded, load_plan(loaded), steps=STEPS)
    assert max(max_abs_diff(final["model"], reference.state_dict()).values()) < 1e-9


# The two tests that go on from the job's first 12 iterations run on one worker under `make test`, so that
# those iterations are trained once.
FROM_TWELVE_STEPS = pytest.mark.xdist_group("rerun-twelve-steps")


@pytest.fixture(scope="module")
def _twelve_steps_trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The job's first run, 12 of its 20 iterations, once for the module: its folder and a copy of it as it was."""
    folder = tmp_path_factory.mktemp("rerun") / "job"
    config = _job(folder)
    first = run_jabas("run", "-c", str(config), "--max-steps", "12", "--checkpoint-every", "5")
    assert first.returncode == 0, first.stderr
    checkpoints = folder / "checkpoints" / "job"
    assert sorted(p.name for p in checkpoints.glob("*.pt")) == ["checkpoint-10.pt", "checkpoint-12.pt"]  # keep 2
    as_left = folder.parent / "as-left"
    shutil.copytree(folder, as_left, symlinks=True)
    return folder, as_left


@pytest.fixture
def twelve_steps(_twelve_steps_trained: tuple[Path, Path]) -> Path:
    """The job's folder, at the same path every time, as its first run left it (a test changes it at will)."""
    folder, as_left = _twelve_steps_trained
    shutil.rmtree(folder)
    shutil.copytree(as_left, folder, symlinks=True)
    return folder


@FROM_TWELVE_STEPS
def test_a_rerun_resumes_the_job_and_fresh_moves_the_old_run_aside(twelve_steps: Path) -> None:
    config = twelve_steps / "job.toml"
    checkpoints = twelve_steps / "checkpoints" / "job"
    kept = (checkpoints / "checkpoint-12.pt").read_bytes()
    metrics = (twelve_steps / "runs" / "job" / "steps.csv").read_text()

    fewer = run_jabas("run", "-c", str(config), "--max-steps", "7")  # the rerun: it destroyed step 12
    assert fewer.returncode == 0, fewer.stderr
    assert "nothing to train: the job is already at step 12" in fewer.stderr
    assert (checkpoints / "checkpoint-12.pt").read_bytes() == kept
    assert (twelve_steps / "runs" / "job" / "steps.csv").read_text() == metrics

    rest = run_jabas("run", "-c", str(config))
    assert rest.returncode == 0, rest.stderr
    assert f"resuming job from {checkpoints / 'checkpoint-12.pt'} (epoch 2, step 12)" in rest.stdout
    assert (twelve_steps / "runs" / "job" / "steps.csv").read_text().startswith(metrics)  # appended, never truncated
    assert _steps(twelve_steps)[-1] == STEPS
    tensorboard = twelve_steps / "runs" / "job" / "tensorboard"
    assert sorted(p.name for p in tensorboard.iterdir()) == ["attempt-1", "attempt-2"]
    _ends_as_uninterrupted(config)

    done = run_jabas("run", "-c", str(config))
    assert done.returncode == 0 and "nothing to train: the job has already trained its 2 epochs" in done.stderr

    final = (checkpoints / f"checkpoint-{STEPS}.pt").read_bytes()
    fresh = run_jabas("run", "-c", str(config), "--fresh", "--max-steps", "3")
    assert fresh.returncode == 0, fresh.stderr
    [aside] = [p for p in (twelve_steps / "checkpoints").iterdir() if p.name.startswith("job.")]
    assert f"moved {checkpoints} aside to {aside}" in fresh.stderr
    assert (aside / f"checkpoint-{STEPS}.pt").read_bytes() == final  # the old run is kept whole
    assert read_checkpoint(checkpoints)["progress"]["step"] == 3 and _steps(twelve_steps)[-1] == 3


@FROM_TWELVE_STEPS
def test_a_cut_off_newest_checkpoint_falls_back_to_the_previous_and_training_stays_exact(twelve_steps: Path) -> None:
    config = twelve_steps / "job.toml"
    checkpoints = twelve_steps / "checkpoints" / "job"
    newest = checkpoints / "checkpoint-12.pt"
    whole = newest.read_bytes()
    newest.write_bytes(whole[: len(whole) // 2])

    named = run_jabas("run", "-c", str(config), "--resume", str(newest))
    assert named.returncode == 2 and "Traceback" not in named.stderr
    assert named.stderr.strip() == (
        f"error: {newest}: corrupt: {len(whole) // 2} bytes, {len(whole)} were written (cut off?)"
    )

    rerun = run_jabas("run", "-c", str(config))
    assert rerun.returncode == 0, rerun.stderr
    assert f"{newest}: corrupt: {len(whole) // 2} bytes" in rerun.stderr
    assert f"resuming from {checkpoints / 'checkpoint-10.pt'}" in rerun.stderr
    _ends_as_uninterrupted(config)  # iterations 11 and 12 trained again, once each in the parameters

    for path in checkpoints.glob("checkpoint-*.pt"):
        path.write_bytes(b"overwritten")
    broken = run_jabas("run", "-c", str(config))
    assert broken.returncode == 2 and "Traceback" not in broken.stderr
    assert broken.stderr.startswith(f"error: {checkpoints}: no intact checkpoint: ")
    assert len(broken.stderr.strip().splitlines()) == 1


def _start(config: Path) -> subprocess.Popen[str]:
    """`jabas run` with Ctrl-C delivered to it as a user's terminal does, checkpointing every 2 iterations."""
    return subprocess.Popen(
        [sys.executable, "-c", WITH_SIGINT, "run", "-c", str(config), "--checkpoint-every", "2"],
        env={**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"},  # what it printed before a kill -9 too
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _checkpointed(proc: subprocess.Popen[str], manifest: Path, step: int) -> int:
    """Wait until the running job has checkpointed ``step`` or later; the step it checkpointed."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if manifest.exists() and (now := read_checkpoint(manifest.parent)["progress"]["step"]) >= step:
            return int(now)
        time.sleep(0.05)
    raise AssertionError(proc.communicate())


def test_a_rerun_after_ctrl_c_or_kill_9_resumes_the_checkpoint_the_run_left(tmp_path: Path) -> None:
    """Ctrl-C the run; its rerun resumes where it stopped, and is killed -9 mid-training; the next rerun resumes."""
    config = _job(tmp_path, sleep=0.3)
    manifest = tmp_path / "checkpoints" / "job" / "checkpoints.json"

    interrupted = _start(config)
    _checkpointed(interrupted, manifest, 4)
    interrupted.send_signal(signal.SIGINT)
    _, stderr = interrupted.communicate(timeout=60)
    assert f"`jabas run -c {config}` resumes from the last checkpoint" in stderr
    left = read_checkpoint(manifest.parent)["progress"]["step"]

    # The rerun after Ctrl-C resumes that checkpoint and trains on, until the machine is lost: the launcher
    # and its trainers are killed at once, once it has checkpointed an iteration beyond the one it resumed.
    killed = _start(config)
    _checkpointed(killed, manifest, left + 1)
    for pid in [killed.pid, *live_trainers(config)]:
        os.kill(pid, signal.SIGKILL)
    stdout, _ = killed.communicate(timeout=60)
    assert f"(epoch 1, step {left})" in stdout or f"(epoch 2, step {left})" in stdout, stdout
    left = read_checkpoint(manifest.parent)["progress"]["step"]

    rerun = run_jabas("run", "-c", str(config), "--max-steps", str(left + 1))
    assert rerun.returncode == 0, rerun.stderr
    assert f"(epoch 1, step {left})" in rerun.stdout or f"(epoch 2, step {left})" in rerun.stdout
    assert read_checkpoint(manifest.parent)["progress"]["step"] == left + 1
    steps = _steps(tmp_path)
    assert steps[0] <= 2 and steps[-1] == left + 1  # every attempt's rows, the first run's included


SEED_PROFILES = Path(__file__).resolve().parents[1] / "examples" / "seed"

JOB_WITH_PROFILES = """
[job]
name = "two"
workload = "digits"
lbs = 32

[batching]
initial_gbs = 256

[profiles]
dir = "profiles"

[[cluster.servers]]
name = "fast"
device_type = "cpu"

[[cluster.servers]]
name = "slow"
device_type = "cpu-slow"
emulate = { slowdown = 3.0, memory_bytes = 50_000_000 }

[scaling]
enabled = {scaling}

[storage]
run_dir = "runs"
checkpoint_dir = "checkpoints"
"""


def _tree(folder: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def test_rejected_input_leaves_every_file_where_it_was(tmp_path: Path, cli: CliRunner) -> None:
    """Bad input to a command that moves or writes (run --fresh, schedule --new-token) changes nothing on disk."""
    for name in ("cluster_mem_profile_data", "cluster_comp_profile_data", "comm_profile_data", "bucket_profile_data"):
        shutil.copytree(SEED_PROFILES / name, tmp_path / "profiles" / name)
    config = tmp_path / "two.toml"
    config.write_text(JOB_WITH_PROFILES.replace("{scaling}", "false"))
    scaling = tmp_path / "scaling.toml"  # its profile folder is missing: the auto-scaler cannot plan
    scaling.write_text(JOB_WITH_PROFILES.replace("{scaling}", "true").replace('dir = "profiles"', 'dir = "none"'))
    unknown = tmp_path / "unknown.toml"
    unknown.write_text(JOB_WITH_PROFILES.replace("{scaling}", "false").replace('"digits"', '"no_such_workload"'))
    for folder in ("checkpoints", "runs"):  # a previous run of the job, which --fresh would move aside
        (tmp_path / folder / "two").mkdir(parents=True)
        (tmp_path / folder / "two" / "kept.txt").write_text(folder)
    before = _tree(tmp_path)
    rejected = {
        # Below the smallest profiled LBS (32): neither an IIDP nor an uneven plan reaches it.
        "a GBS no plan reaches": ["run", "-c", str(config), "--fresh", "--gbs", "20"],
        "a plan file that is not there": ["run", "-c", str(config), "--fresh", "--plan", str(tmp_path / "nope.json")],
        "an unknown server": ["run", "-c", str(config), "--fresh", "--servers", "bogus"],
        "an unknown server, --elastic": ["run", "-c", str(config), "--fresh", "--elastic", "--servers", "bogus"],
        "--port without --elastic": ["run", "-c", str(config), "--fresh", "--port", "4567"],
        "--gbs with --elastic": ["run", "-c", str(config), "--fresh", "--elastic", "--gbs", "64"],
        "scaling without profiles": ["run", "-c", str(scaling), "--fresh"],
        "a workload that does not exist": ["run", "-c", str(unknown), "--fresh"],
        "the same, without --fresh": ["run", "-c", str(unknown)],
        "a scheduler without profiles": ["schedule", "-c", str(scaling), "--new-token", str(tmp_path / "token")],
    }
    # The command as a user types it, then every case through the same CLI in this process.
    result = run_jabas(*rejected["a GBS no plan reaches"], cwd=tmp_path)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and lines and all(line.startswith("error:") for line in lines), result
    assert "moved" not in result.stdout + result.stderr and _tree(tmp_path) == before
    for why, args in rejected.items():
        invoked = cli.invoke(app, args)
        assert invoked.exit_code == 2, (why, invoked.output)
        assert "error:" in invoked.output and "moved" not in invoked.output, (why, invoked.output)
        assert _tree(tmp_path) == before, why


def test_the_start_line_counts_in_the_singular_and_says_where_weight_sync_came_from(tmp_path: Path) -> None:
    """One server's one device: "1 trainer", "1 worker"; the run's own plan is where its weight sync is set."""
    for name in ("cluster_mem_profile_data", "cluster_comp_profile_data", "comm_profile_data", "bucket_profile_data"):
        shutil.copytree(SEED_PROFILES / name, tmp_path / "profiles" / name)
    config = tmp_path / "two.toml"
    config.write_text(JOB_WITH_PROFILES.replace("{scaling}", "false"))
    result = run_jabas("run", "-c", str(config), "--gbs", "64", "--servers", "fast", "--max-steps", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    start = next(line for line in result.stdout.splitlines() if line.startswith("two: "))
    assert "two: 1 trainer on cpu, GBS 64 = LBS 64 x 1 worker (fast:1GPU,VSW:1,GA:0)" in start, start
    assert f"(from the plan in {tmp_path / 'runs' / 'two' / 'plan.json'})" in start, start
    solved = run_jabas("solve", "-c", str(config), "--gbs", "64", "--servers", "fast")
    assert "GBS 64 = LBS 64 x 1 worker on 1 GPU," in solved.stdout, solved.stdout
