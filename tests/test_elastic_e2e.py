"""The elastic runtime end to end: a real scheduler and two real worker agents on loopback HTTP.

Two emulated CPU servers, A (VSW 2) and B (VSW 1, slower); digits. Each run is
tens of seconds on two busy cores (most of it starting Python and torch in new
trainer processes), so they are few and marked slow.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from jabascli.elastic.job import TERMINAL
from jabascli.engine.plan import load_plan
from jabascli.engine.reference import reference_run
from jabascli.solver.plan import read_plan
from tests.elastic_support import (
    auth,
    jabas,
    load,
    slow_down,
    start_scheduler,
    used_samples,
    wait_status,
    write_config,
)
from tests.engine_support import checkpoint_of, max_abs_diff

EPOCHS = 2  # the first on A, the second moved to A+B at its start and to B alone early in it
N = 1438  # digits' training samples (sklearn's 1797, less the 20 % validation split)


class Cluster:
    """`jabas schedule` and one `jabas worker` per server (``servers`` of them), as real processes."""

    def __init__(self, folder: Path, config: Path, servers: int = 2) -> None:
        self.folder, self.config = folder, config
        self.scheduler = start_scheduler(config, folder / "scheduler.log")
        self.loaded = load(config)  # its port: the one the scheduler listens on
        self.url = f"http://127.0.0.1:{self.loaded.config.scheduler.port}"
        self.workers = [
            jabas("worker", "-c", str(config), "--rank", str(r), log=folder / f"worker{r}.log") for r in range(servers)
        ]

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers=auth(), timeout=10)

    def wait(self, until: Any, timeout: float = 180) -> dict[str, Any]:
        return wait_status(self.url, until, timeout)

    def finish(self, timeout: float = 240) -> dict[str, Any]:
        status = self.wait(lambda s: s["state"] in TERMINAL, timeout)
        assert self.scheduler.wait(30) == (0 if status["state"] != "failed" else 1), self.logs()
        for w in self.workers:
            if w.poll() is None or w.returncode != -signal.SIGKILL:
                assert w.wait(30) == 0, self.logs()
        return status

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.folder.glob("*.log")))

    def kill(self) -> None:
        for p in [self.scheduler, *self.workers]:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def cluster_factory(tmp_path: Path):  # type: ignore[no-untyped-def]
    made: list[Cluster] = []

    def make(**kwargs: Any) -> Cluster:
        cluster = Cluster(tmp_path, write_config(tmp_path, record=True, **kwargs))
        made.append(cluster)
        return cluster

    yield make
    for c in made:
        c.kill()


def _check_epochs(folder: Path, status: dict[str, Any], epochs: int) -> None:
    """Each epoch used every sample at most once, and exactly N minus the remainder its last GBS left."""
    history = checkpoint_of(load(folder / "job.toml"))["progress"]["gbs_history"]
    counts = used_samples(folder, N, epochs)
    for epoch in range(epochs):
        assert max(counts[epoch].values()) == 1, f"epoch {epoch}: a sample was used twice"
        last = [h for h in history if h["epoch"] <= epoch][-1]
        start = last["position"] if last["epoch"] == epoch else 0
        expected = N - (N - start) % last["gbs"]
        assert sum(counts[epoch].values()) == expected, (epoch, history)


def _assert_equals_the_reference(folder: Path) -> None:
    """The job's last checkpoint holds the parameters of a single process that followed its GBS history.

    Run after :func:`_check_epochs`: the reference reads the same recorded dataset, so it records too.
    """
    loaded = load(folder / "job.toml")
    final = checkpoint_of(loaded)
    history = final["progress"]["gbs_history"]
    reference, _ = reference_run(loaded, load_plan(loaded), steps=final["progress"]["step"], schedule=history)
    diffs = max_abs_diff(final["model"], reference.state_dict())
    # The recorded digits train in float64 (tests/elastic_support.py). One iteration more, or a GBS or
    # LR change one iteration late, moves the parameters by 0.03 or more.
    assert max(diffs.values()) <= 1e-9, diffs


@pytest.mark.slow
def test_a_job_moves_from_a_to_a_and_b_to_b_and_continues_where_it_was(cluster_factory) -> None:  # type: ignore[no-untyped-def]
    # Emulated slowdowns (sleeps) of 30x on A and 40x on B: epochs of two seconds or more, so that each
    # request lands before the epoch it aims at is over. The first move waits for B's new rank, whose
    # spare may still be importing torch when the job starts: 6x on A (0.4 s epochs) was too short on
    # a loaded machine, and the move slipped to the second epoch end.
    cluster: Cluster = cluster_factory(available=["A"], epochs=EPOCHS, slowdown=(30.0, 40.0))
    # Asked as soon as the job runs on A (its trainers are still starting): it moves at the first epoch end.
    cluster.wait(lambda s: s["state"] == "running" and len(s["workers"]) == 2)
    assert cluster.post("/v1/job/move", {"servers": ["A", "B"]}).status_code == 200
    # As soon as A+B starts: the move lands early in the second epoch.
    cluster.wait(lambda s: s["generation"] == 2 and s["state"] == "running")
    r = cluster.post("/v1/job/move", {"servers": ["B"], "when": "now"})
    assert r.status_code == 200, r.text
    status = cluster.finish()

    assert status["state"] == "succeeded", cluster.logs()
    # A stays in the first move: its trainer carries on in place (engine/handoff.py); the second
    # drops A, where rank 0 and the job's store live: every trainer restarts from the checkpoint.
    assert [(m["reason"], m["to_servers"], m["when"], m["in_place"]) for m in status["moves"]] == [
        ("move", ["A", "B"], "epoch", True),
        ("move", ["B"], "now", False),
    ]
    gbs = [e["gbs"] for e in status["epoch_history"]]
    assert gbs[0] == 32 and gbs[-1] == 16  # A: 16 x 2 VSW; B: 16 x 1
    first, second = status["moves"]
    assert first["resumed_step"] == first["stopped_step"] == N // 32  # the first epoch's end
    assert second["resumed_step"] == second["stopped_step"]  # nothing repeated or skipped
    assert first["resumed_step"] < second["stopped_step"] < first["resumed_step"] + N // 48  # mid-epoch
    for move in status["moves"]:
        assert move["downtime_s"] is not None and move["downtime_s"] > 0
        # The loss carries on from before the move instead of falling back towards an untrained
        # model's, ln(10) for ten classes.
        assert move["loss_after"] < (math.log(10) + move["loss_before"]) / 2, move
    assert len(status["epoch_history"]) == EPOCHS
    _check_epochs(cluster.folder, status, epochs=EPOCHS)
    # Across the move in place and the restart, it was synchronous SGD at each iteration's GBS: the
    # job ends with the parameters of one process that followed the same GBS schedule.
    _assert_equals_the_reference(cluster.folder)


@pytest.mark.slow
def test_a_killed_trainer_is_restarted_from_the_last_checkpoint(cluster_factory) -> None:  # type: ignore[no-untyped-def]
    every, steps = 4, N // 48  # A+B: GBS 48
    # B 20x slower than the CPU (it sleeps): a couple of seconds per epoch, so the kill lands mid-job.
    # Restarted, not recovered in place (tests/test_faults.py): what a failure costs without that.
    scheduler = {"checkpoint_every": every, "recover_in_place": False}
    kwargs = {"available": ["A", "B"], "epochs": 2, "slowdown": (2.0, 20.0), "scheduler": scheduler}
    cluster: Cluster = cluster_factory(**kwargs)
    status = cluster.wait(lambda s: len(s["trainers"]) == 2 and (s["checkpoint_step"] or 0) >= every + 1)
    # The first generation's trainers are forked by the agents' warm trainer servers too: their start waited for
    # the servers' imports instead of importing torch beside them (elastic/warm.py).
    for trainer in status["trainers"]:
        server = _parent(trainer["pid"])
        assert b"jabascli.cli.spare:warm_up_from_env" in Path(f"/proc/{server}/cmdline").read_bytes(), trainer
    victim = status["trainers"][1]["pid"]
    os.kill(victim, signal.SIGKILL)  # rank 1, on B, mid-job
    # The restart's trainers are forked by the agents' warm trainer servers (cli/spare.py), ready by now; B's
    # is slow (20x), so it is still running when looked at.
    restarted = cluster.wait(lambda s: s["generation"] >= 2 and len(s["trainers"]) == 2)
    server = _parent(restarted["trainers"][1]["pid"])
    assert b"jabascli.cli.spare:warm_up_from_env" in Path(f"/proc/{server}/cmdline").read_bytes()
    status = cluster.finish()

    assert status["state"] == "succeeded" and status["restarts"] == 1, cluster.logs()
    [restart] = status["moves"]
    assert restart["reason"] == "restart" and restart["to_servers"] == ["A", "B"]
    resumed = restart["resumed_step"]
    assert 0 < resumed < 2 * steps and (resumed % every == 0 or resumed == steps)  # a periodic or epoch-end one
    # Count the iterations trained twice: every micro-batch was recorded (3 workers per iteration).
    recorded = sum(len(p.read_text().splitlines()) for p in (cluster.folder / "samples").glob("*.txt"))
    repeated = recorded // 3 - status["step"]
    assert 0 <= repeated <= every, repeated
    assert status["step"] == 2 * steps
    _assert_equals_the_reference(cluster.folder)  # the repeated iterations trained as the first time


@pytest.mark.slow
def test_a_killed_worker_agent_loses_its_server_and_the_job_finishes_on_the_other(cluster_factory) -> None:  # type: ignore[no-untyped-def]
    scheduler = {"checkpoint_every": 4, "recover_in_place": False}
    kwargs = {"available": ["A", "B"], "epochs": 2, "slowdown": (2.0, 20.0), "scheduler": scheduler}
    cluster: Cluster = cluster_factory(**kwargs)
    status = cluster.wait(lambda s: len(s["trainers"]) == 2 and s["step"] >= 5)
    b_trainer = status["trainers"][1]["pid"]
    cluster.workers[1].kill()  # kill -9 the agent of B ...
    os.kill(b_trainer, signal.SIGKILL) if _alive(b_trainer) else None  # ... and its trainer
    status = cluster.finish()
    assert status["state"] == "succeeded", cluster.logs()
    # B's rank never reported an exit: the job waited for B's heartbeat timeout, declared B lost and
    # restarted once, on A alone.
    assert status["restarts"] == 1 and status["moves"][-1]["reason"] == "restart" and status["allocation"] == ["A"]
    assert [w["alive"] for w in status["workers"]] == [True, False]
    _assert_equals_the_reference(cluster.folder)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    time.sleep(0)
    return True


@pytest.mark.slow
def test_jabas_run_elastic_runs_the_scheduler_and_an_agent_per_server_and_can_be_steered(tmp_path: Path) -> None:
    config = write_config(tmp_path, available=["A", "B"], epochs=2, slowdown=(20.0, 30.0), record=True)
    # Each batch takes 0.1 s more until the move is accepted, so that it lands at the first epoch's end (not at
    # the job's, where no iteration follows to time its downtime) however long `jabas job move` takes to start.
    slow = slow_down(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "JABAS_TOKEN"}  # it makes its own
    env.update(OMP_NUM_THREADS="1", COLUMNS="200")
    run = subprocess.Popen(
        [sys.executable, "-m", "jabascli", "run", "-c", str(config), "--elastic"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    folder = tmp_path / "runs" / "digits"
    steering = folder / "scheduler.json"
    deadline = time.monotonic() + 120
    while not steering.exists() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert steering.exists(), run.communicate()
    token_file = Path(json.loads(steering.read_text())["token_file"])
    assert (steering.stat().st_mode & 0o777, token_file.stat().st_mode & 0o777) == (0o600, 0o600)
    # A user steers it from the config alone, as the start line says (no token in the environment).
    while run.poll() is None and time.monotonic() < deadline:
        status = subprocess.run(
            [sys.executable, "-m", "jabascli", "job", "status", "-c", str(config), "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if status.returncode == 0 and json.loads(status.stdout)["state"] == "running":
            break
        time.sleep(0.2)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["allocation"] == ["A", "B"]
    move = subprocess.run(
        [sys.executable, "-m", "jabascli", "job", "move", "-c", str(config), "A"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert move.returncode == 0, move.stderr
    slow.unlink()
    stdout, stderr = run.communicate(timeout=300)
    assert run.returncode == 0, stderr
    assert f"token in {token_file} (steer it: `jabas job status -c {config}`)" in stdout
    assert "digits: succeeded: finished 2 epochs at step" in stdout and f"results in {folder}" in stdout
    # The move is a line of its own, with its downtime.
    moves = [line for line in stdout.splitlines() if line.startswith("moved A,B -> A at an epoch end (in place)")]
    assert len(moves) == 1 and re.search(r"downtime \d+\.\d ms", moves[0]), stdout
    rows = [line for line in stdout.splitlines() if re.match(r"^[│|]\s+[12]\s+[│|]", line)]
    assert len(rows) == 2, stdout  # the validation table, one row per epoch, as `jabas run` ends
    assert stdout.strip().splitlines()[-1].startswith("validation accuracy: ")
    assert not steering.exists() and not token_file.exists()  # gone with the run
    logs = folder / "logs"
    assert {p.name for p in logs.glob("*.log")} >= {"scheduler.log", "worker-A.log", "worker-B.log"}
    # Once it is over, `jabas job status` says how it ended and where its results are, from the run folder.
    after = subprocess.run(
        [sys.executable, "-m", "jabascli", "job", "status", "-c", str(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert after.returncode == 0, after.stderr
    assert (
        after.stdout.startswith("digits ended: succeeded (finished 2 epochs") and f"results in {folder}" in after.stdout
    )
    stop = subprocess.run(
        [sys.executable, "-m", "jabascli", "job", "stop", "-c", str(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert stop.returncode == 2 and "digits ended: succeeded" in stop.stderr and "nothing to stop" in stop.stderr


SEED_PROFILES = Path(__file__).resolve().parents[1] / "examples" / "seed"

FIXED_GBS_JOB = """
[job]
name = "{name}"
workload = "digits"
lbs = 8                  # the configured VSW/GA give GBS 16; the solver's plan is for initial_gbs
options = {{ lr = 0.05 }}

[batching]
initial_gbs = 64

[profiles]
dir = "{profiles}"

[[cluster.servers]]
name = "fast"
device_type = "cpu"

[[cluster.servers]]
name = "slow"
device_type = "cpu-slow"
emulate = {{ slowdown = 3.0, memory_bytes = 50_000_000 }}

[storage]
run_dir = "runs"
checkpoint_dir = "checkpoints"
"""


@pytest.mark.slow
def test_jabas_run_elastic_trains_the_plan_a_plain_run_of_the_config_trains(tmp_path: Path) -> None:
    """A fixed-GBS job with profiles: --elastic trains the solver's plan for initial_gbs, as plain `jabas run`."""
    for name in ("cluster_mem_profile_data", "cluster_comp_profile_data", "comm_profile_data", "bucket_profile_data"):
        shutil.copytree(SEED_PROFILES / name, tmp_path / "profiles" / name)
    env = {k: v for k, v in os.environ.items() if k != "JABAS_TOKEN"}
    env.update(OMP_NUM_THREADS="1", COLUMNS="200")
    plans = {}
    for name, extra in (("plain", ["--max-steps", "2"]), ("elastic", ["--elastic", "--json"])):
        config = tmp_path / f"{name}.toml"
        config.write_text(FIXED_GBS_JOB.format(name=name, profiles=tmp_path / "profiles"))
        ran = subprocess.run(
            [sys.executable, "-m", "jabascli", "run", "-c", str(config), "--servers", "all", *extra],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert ran.returncode == 0, ran.stderr
        plans[name] = ran.stdout
    plain = read_plan(tmp_path / "runs" / "plain" / "plan.json")
    elastic = json.loads(plans["elastic"])
    assert elastic["state"] == "succeeded" and plain.gbs == 64
    assert (elastic["gbs"], elastic["plan"]) == (plain.gbs, plain.seed_form())
    assert elastic["allocation"] == ["fast", "slow"]  # --servers all, as the plain run's


def _parent(pid: int) -> int:
    """The parent of a live process (/proc/PID/stat: the field after the state)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
