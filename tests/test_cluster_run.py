"""`jabas run` on a cluster of three emulated nodes, each a network namespace with its own address,
a shaped link and its own sshd: nothing is started by hand on any node.

A fast server and two slower ones (emulated slowdowns), digits in float64 with
every training sample recorded. The job is interrupted with Ctrl-C under way
(no jabas process may be left on any node, and none may listen beyond its
node's address while it runs), then run again: it resumes from its checkpoint,
ends, and its parameters equal one process that followed its GBS history.
Runs as root only (network namespaces), and where sshd is installed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import tomli_w

from jabascli.engine.plan import load_plan
from jabascli.engine.reference import reference_run
from tests.cluster import EmulatedCluster, NodeSpec, cluster_factory  # noqa: F401 (the fixture)
from tests.conftest import WITH_SIGINT
from tests.elastic_support import RECORDED_DIGITS, TRAINER_ENV, load, slow_down, used_samples
from tests.engine_support import checkpoint_of, max_abs_diff
from tests.sshd import require_sshd

pytestmark = pytest.mark.xdist_group("nodes")  # one emulated cluster at a time under `make test`

N = 1438  # digits' training samples (sklearn's 1797, less the 20 % validation split)
EPOCHS = 2


def _config(folder: Path, cluster: EmulatedCluster, key: Path) -> Path:
    (folder / "samples").mkdir(parents=True)
    (folder / "recorded_digits.py").write_text(RECORDED_DIGITS)
    options = {"lr": 0.05, "width": 4, "record": str(folder / "samples")}
    shapes = {"fast": (2, 2.0), "slow1": (1, 4.0), "slow2": (1, 4.0)}  # VSW, emulated slowdown
    servers = [
        {
            "name": node.name,
            "host": node.address,
            "device_type": "cpu",
            "vsw": shapes[node.name][0],
            "emulate": {"slowdown": shapes[node.name][1], "memory_bytes": 2_000_000_000},
            "ssh_user": "root",
            "ssh_key": str(key),
        }
        for node in cluster.nodes
    ]
    config = {
        "job": {
            "name": "digits",
            "workload": str(folder / "recorded_digits.py"),
            "epochs": EPOCHS,
            "lbs": 16,
            "options": options,
        },
        "batching": {"metric": "fixed"},
        "cluster": {"servers": servers},
        "scheduler": {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 10.0, "connect_timeout_s": 30.0},
        "storage": {"checkpoint_dir": str(folder / "checkpoints"), "run_dir": str(folder / "runs")},
    }
    path = folder / "job.toml"
    path.write_bytes(tomli_w.dumps(config).encode())
    return path


def _status(folder: Path) -> dict[str, Any] | None:
    """The running job's status from its scheduler, found as `jabas job status` finds it (None: not yet)."""
    try:
        steering = json.loads((folder / "runs" / "digits" / "scheduler.json").read_text())
        token = Path(steering["token_file"]).read_text().strip()
        answer = httpx.get(
            f"http://{steering['address']}/v1/job", headers={"Authorization": f"Bearer {token}"}, timeout=5
        )
        return answer.json() if answer.status_code == 200 else None
    except (OSError, ValueError, KeyError, httpx.TransportError):
        return None


@pytest.mark.slow
def test_jabas_run_trains_three_nodes_exactly_across_a_ctrl_c(cluster_factory, tmp_path: Path) -> None:  # noqa: F811
    require_sshd()
    cluster: EmulatedCluster = cluster_factory(
        [NodeSpec("fast", "1gbit"), NodeSpec("slow1", "200mbit"), NodeSpec("slow2", "200mbit")]
    )
    key, known_hosts = cluster.start_sshds(tmp_path)
    config = _config(tmp_path, cluster, key)
    run = [sys.executable, "-m", "jabascli", "run", "-c", str(config), "--known-hosts", str(known_hosts)]
    env = {**os.environ, **TRAINER_ENV}

    # 1. Under way, every listening socket of a jabas process in a node is on that node's address;
    #    then Ctrl-C (SIGINT to the launcher's process group, as a terminal sends it). Each batch takes
    #    0.1 s more until then, so that the job is still under way however busy the machine.
    slow = slow_down(tmp_path)
    interruptible = [sys.executable, "-c", WITH_SIGINT, *run[3:]]  # Ctrl-C reaches it even if pytest ignores it
    first = subprocess.Popen(
        interruptible, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 180
        while (status := _status(tmp_path)) is None or status["step"] < 3:
            assert first.poll() is None, first.communicate()[0].decode()[-3000:]
            assert time.monotonic() < deadline, f"no progress; last status {status}"
            time.sleep(0.2)
        listening = {node.name: cluster.listening_sockets(node) for node in cluster.nodes}
        jabas = {node.name: set(cluster.jabas_pids_in(node)) for node in cluster.nodes}
        os.killpg(first.pid, signal.SIGINT)
        output = first.communicate(timeout=120)[0].decode()
        slow.unlink()
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode != 0, output[-3000:]
    for node in cluster.nodes:
        ours = [s for s in listening[node.name] if s.pid in jabas[node.name]]
        assert ours, f"no jabas process listens in {node.name} (rank 0's store, gloo): {listening[node.name]}"
        assert all(s.ip == node.address for s in ours), (node.name, node.address, ours)
    assert cluster.jabas_left() == {}, output[-3000:]
    stopped_at = checkpoint_of(load(config))["progress"]["step"]
    assert stopped_at >= 3
    for server in ("fast", "slow1", "slow2"):
        assert f"[{server}] worker rank" in output, output[-3000:]  # each node's output, with its name

    # 2. Run again: it resumes from the checkpoint the interrupted run wrote, and ends.
    second = subprocess.run(run, cwd=tmp_path, env=env, capture_output=True, timeout=300)
    output = (second.stdout + second.stderr).decode()
    assert second.returncode == 0, output[-3000:]
    assert "resuming digits from" in output and f"step {stopped_at})" in output, output[-3000:]
    # The interrupted run's stop stays in its rank 0's control file: the new generation 1 must not obey it.
    assert "restarted" not in output, output[-3000:]
    assert cluster.jabas_left() == {}, output[-3000:]

    loaded = load(config)
    final = checkpoint_of(loaded)
    history = final["progress"]["gbs_history"]
    counts = used_samples(tmp_path, N, EPOCHS)
    for epoch in range(EPOCHS):
        assert max(counts[epoch].values()) == 1, f"epoch {epoch}: a sample was used twice"
        gbs = [h for h in history if h["epoch"] <= epoch][-1]["gbs"]
        assert sum(counts[epoch].values()) == N - N % gbs, (epoch, history)
    reference, _ = reference_run(loaded, load_plan(loaded), steps=final["progress"]["step"], schedule=history)
    diffs = max_abs_diff(final["model"], reference.state_dict())
    assert max(diffs.values()) <= 1e-9, diffs


def test_nodes_that_cannot_run_the_job_are_named_before_anything_starts(cluster_factory, tmp_path: Path) -> None:  # noqa: F811
    """One node without sshd, one whose Python runs another jabas, one without jabas at that path."""
    require_sshd()
    cluster: EmulatedCluster = cluster_factory([NodeSpec("fast"), NodeSpec("slow1"), NodeSpec("slow2")], rate=None)
    key, known_hosts = cluster.start_sshds(tmp_path, ["slow1", "slow2"])
    config = _config(tmp_path, cluster, key)
    other = tmp_path / "other-python"  # another installation, answering as an older jabas would
    other.write_text("#!/bin/sh\necho 'jabas 0.0.9'\n")
    other.chmod(0o755)
    text = config.read_text()
    text = text.replace('name = "slow1"', f'name = "slow1"\npython = "{other}"')
    text = text.replace('name = "slow2"', 'name = "slow2"\npython = "/nonexistent/bin/python3"')
    config.write_text(text)
    run = [sys.executable, "-m", "jabascli", "run", "-c", str(config), "--known-hosts", str(known_hosts)]
    result = subprocess.run(run, cwd=tmp_path, env={**os.environ, **TRAINER_ENV}, capture_output=True, timeout=120)
    lines = sorted(line for line in result.stderr.decode().splitlines() if line.strip())
    assert result.returncode == 1, lines
    fast, slow1, slow2 = (cluster.node(name).address for name in ("fast", "slow1", "slow2"))
    assert len(lines) == 3 and "Traceback" not in result.stderr.decode(), lines
    assert lines[0].startswith(f"error: server 'fast': connection refused by {fast}:22"), lines
    assert lines[1].startswith(f"error: server 'slow1' (root@{slow1}:22): runs jabas 0.0.9, this machine "), lines
    assert lines[2].startswith(f"error: server 'slow2' (root@{slow2}:22): /nonexistent/bin/python3 -m jabascli"), lines
    assert not (tmp_path / "runs" / "digits" / "scheduler.json").exists()
    assert cluster.jabas_left(timeout=0) == {}


def _wait(folder: Path, process: subprocess.Popen[bytes], until: Any, what: str, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while (status := _status(folder)) is None or not until(status):
        assert process.poll() is None, process.communicate()[0].decode()[-3000:]
        assert time.monotonic() < deadline, f"{what}: timed out; last status {status}"
        time.sleep(0.2)
    return status


def _taken_back(status: dict) -> bool:
    """A node is back in the job: the move that takes it in has resumed."""
    return len(status["moves"]) >= 2 and status["moves"][1]["resumed_step"] is not None


@pytest.mark.slow
def test_a_node_cut_off_and_a_frozen_node_are_recovered_in_place_and_taken_back(
    cluster_factory,  # noqa: F811
    tmp_path: Path,
) -> None:
    """slow2's link goes down and slow1 is frozen (SIGSTOP) at once: fast's collective times out (3 s), the
    scheduler drops both nodes (silent, then missing heartbeats) and fast goes on alone from memory. Both
    come back (link up, SIGCONT): their agents register again and the job takes them back at an epoch end.
    No checkpoint is read and no trainer restarted; the job ends as one process that followed its history."""
    require_sshd()
    cluster: EmulatedCluster = cluster_factory([NodeSpec("fast"), NodeSpec("slow1"), NodeSpec("slow2")])
    key, known_hosts = cluster.start_sshds(tmp_path)
    config = _config(tmp_path, cluster, key)
    # Ten times slower than above (3-5 s an epoch): the nodes that come back are taken in at an epoch end once
    # their trainers have started.
    text = config.read_text().replace(f"epochs = {EPOCHS}", "epochs = 6")
    text = text.replace("slowdown = 2.0", "slowdown = 20.0").replace("slowdown = 4.0", "slowdown = 40.0")
    text = text.replace("heartbeat_timeout_s = 10.0", "heartbeat_timeout_s = 4.0\ncollective_timeout_s = 3.0")
    config.write_text(text.replace("connect_timeout_s = 30.0", "connect_timeout_s = 120.0"))
    run = [sys.executable, "-m", "jabascli", "run", "-c", str(config), "--known-hosts", str(known_hosts)]
    env = {**os.environ, **TRAINER_ENV}
    job = subprocess.Popen(run, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait(tmp_path, job, lambda s: s["step"] >= 3 and len(s["trainers"]) == 3, "start")
        cluster.link_down("slow2")
        cluster.freeze("slow1")
        _wait(tmp_path, job, lambda s: s["state"] == "running" and len(s["moves"]) == 1, "the recovery")
        # Until a node is taken back, each batch takes 0.1 s more, so that the job cannot end before its
        # agents have registered again on a busy host; the rest of the job then runs as before.
        slow = slow_down(tmp_path)
        cluster.link_up("slow2")
        cluster.thaw("slow1")
        _wait(tmp_path, job, _taken_back, "taking a node back", timeout=240)
        slow.unlink()
        output = job.communicate(timeout=300)[0].decode()
    finally:
        cluster.thaw("slow1")
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 0, output[-3000:]
    assert "restarted" not in output, output[-3000:]
    moves = json.loads((tmp_path / "runs" / "digits" / "ended.json").read_text())["status"]["moves"]
    # Taken back at epoch ends, in place: both at once, or one after the other as their agents registered again.
    assert (moves[0]["reason"], moves[0]["in_place"], moves[0]["to_servers"]) == ("recovery", True, ["fast"]), moves
    assert moves[1:] and all(m["reason"] == "move" and m["in_place"] for m in moves[1:]), moves
    assert moves[1]["resumed_step"] is not None and len(moves[1]["to_servers"]) > 1, moves  # it happened
    assert moves[0]["steps_lost"] == 0 and moves[0]["resumed_step"] == moves[0]["stopped_step"], moves[0]
    loaded = load(config)
    final = checkpoint_of(loaded)
    history = final["progress"]["gbs_history"]
    reference, _ = reference_run(loaded, load_plan(loaded), steps=final["progress"]["step"], schedule=history)
    diffs = max_abs_diff(final["model"], reference.state_dict())
    assert max(diffs.values()) <= 1e-9, diffs
