"""A real Slurm over emulated nodes (tests/slurm.py), and jabas jobs submitted to it.

Root only, and where Slurm 22.05 and munge are installed (``make test`` installs them as root).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import tomli_w

from jabascli.elastic.slurm import (
    Allocation,
    Releaser,
    allocation,
    expand_hostlist,
    match_servers,
    scheduler_address,
)
from jabascli.engine.plan import load_plan
from jabascli.engine.reference import reference_run
from jabascli.errors import InputError
from tests.cluster import EmulatedCluster, NodeSpec, cluster_factory  # noqa: F401 (the fixture)
from tests.conftest import run_jabas
from tests.elastic_support import RECORDED_DIGITS, TRAINER_ENV, load, slow_down, used_samples
from tests.engine_support import checkpoint_of, max_abs_diff
from tests.slurm import SlurmCluster, SlurmNodeSpec, slurm_factory  # noqa: F401 (the fixture)

pytestmark = pytest.mark.xdist_group("nodes")  # one emulated cluster at a time under `make test`

NODES = [NodeSpec("n0", "1gbit"), NodeSpec("n1", "1gbit"), NodeSpec("n2", "200mbit")]
SLURM_NODES = [SlurmNodeSpec("n0", "fast", 1), SlurmNodeSpec("n1", "fast", 1), SlurmNodeSpec("n2", "slow", 1)]


def test_slurm_runs_tasks_in_each_nodes_namespace(cluster_factory, slurm_factory, tmp_path: Path) -> None:  # noqa: F811
    cluster: EmulatedCluster = cluster_factory(NODES)
    slurm: SlurmCluster = slurm_factory(cluster, SLURM_NODES)
    address = {node.name: node.address for node in cluster.nodes}

    assert slurm.states() == {"n0": "idle", "n1": "idle", "n2": "idle"}

    # One task per node, each in its node's namespace: it sees that node's address only.
    result = slurm.run(["srun", "-N3", "--label", "sh", "-c", 'echo "$SLURMD_NODENAME $(hostname -I)"'])
    seen = dict(line.split(": ", 1)[1].split() for line in result.stdout.splitlines())
    assert seen == address, result.stdout

    # A heterogeneous job: one component per feature, one step across both.
    show = ["sh", "-c", 'echo "$SLURM_PROCID $SLURMD_NODENAME $(hostname -I)"']
    result = slurm.run(["srun", "--constraint=fast", "-N1", ":", "--constraint=slow", "-N1", *show])
    lines = sorted(result.stdout.split("\n")[:-1])
    assert len(lines) == 2, result.stdout
    (rank0, fast, fast_ip), (rank1, slow, slow_ip) = (line.split() for line in lines)
    assert (rank0, rank1, slow, slow_ip) == ("0", "1", "n2", address["n2"]), result.stdout
    assert fast in ("n0", "n1") and fast_ip == address[fast], result.stdout

    # sbatch reads a quoted value with a space in an #SBATCH line (as jabas writes --output for such a folder).
    (tmp_path / "out dir").mkdir()
    script = tmp_path / "job.sh"
    script.write_text(f'#!/bin/sh\n#SBATCH --output="{tmp_path}/out dir/o-%j.out"\necho "$SLURMD_NODENAME"\n')
    job = slurm.run(["sbatch", "--parsable", str(script)]).stdout.strip()
    assert slurm.wait_queue_empty() == []
    assert (tmp_path / "out dir" / f"o-{job}.out").read_text() == "n0\n"


def test_release_idle_shrinks_a_plain_job_to_the_nodes_in_use(cluster_factory, slurm_factory, tmp_path: Path) -> None:  # noqa: F811
    cluster: EmulatedCluster = cluster_factory(NODES)
    slurm: SlurmCluster = slurm_factory(cluster, SLURM_NODES)
    job = slurm.run(["sbatch", "--parsable", "-N3", "-o", "/dev/null", "--wrap", "srun --no-kill sleep 60"]).stdout
    job = job.strip()
    deadline = time.monotonic() + 60
    while slurm.job_state(job) != "RUNNING":
        assert time.monotonic() < deadline, slurm.queue()
        time.sleep(0.2)
    loaded = load(_servers_config(tmp_path, names=["n0", "n1", "n2"]))
    where = Allocation(job, ["n0", "n1", "n2"], "n0", [["n0", "n1", "n2"]])
    releaser = Releaser(loaded, where, {"n0": 0, "n1": 1, "n2": 2}, slurm.env())
    running = SimpleNamespace(state="running", allocation=["n0", "n1"])  # what the scheduler's status says

    assert releaser.check(SimpleNamespace(state="moving", allocation=["n0", "n1"])) == []  # not while it moves
    assert releaser.check(running) == [
        f"gave back n2 (servers n2) to Slurm: scontrol update JobId={job} NodeList=n0,n1"
    ]
    shown = slurm.run(["scontrol", "show", "job", job]).stdout
    assert re.search(r"JobState=RUNNING .*?\n   NodeList=n\[0-1\]", shown, re.S), shown
    assert slurm.states()["n2"] == "idle"
    assert releaser.check(running) == []  # given back once


# -- jabas jobs submitted to it ----------------------------------------------------------------------------

N = 1438  # digits' training samples (sklearn's 1797, less the 20 % validation split)
EPOCHS = 2


def _config(folder: Path, cluster: EmulatedCluster, epochs: int = EPOCHS, release_idle: bool = False) -> Path:
    (folder / "samples").mkdir(parents=True, exist_ok=True)
    (folder / "recorded_digits.py").write_text(RECORDED_DIGITS)
    # device type, VSW, emulated slowdown (what must land while the job trains waits on samples/slow instead)
    shapes = {"n0": ("fast", 2, 20.0), "n1": ("fast", 2, 20.0), "n2": ("slow", 1, 60.0)}
    servers = [
        {
            "name": node.name,
            "host": node.address,
            "device_type": shapes[node.name][0],
            "vsw": shapes[node.name][1],
            "emulate": {"slowdown": shapes[node.name][2], "memory_bytes": 2_000_000_000},
        }
        for node in cluster.nodes
    ]
    config = {
        "job": {
            "name": "digits",
            "workload": str(folder / "recorded_digits.py"),
            "epochs": epochs,
            "lbs": 8,
            "options": {"lr": 0.05, "width": 4, "record": str(folder / "samples")},
        },
        "batching": {"metric": "fixed"},
        "cluster": {"servers": servers},
        "scheduler": {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 30.0, "connect_timeout_s": 30.0},
        "storage": {"checkpoint_dir": str(folder / "checkpoints"), "run_dir": str(folder / "runs")},
        "slurm": {"time": "10:00", "release_idle": release_idle},
    }
    path = folder / "job.toml"
    path.write_bytes(tomli_w.dumps(config).encode())
    return path


def _submit(slurm: SlurmCluster, config: Path, folder: Path) -> str:
    """`jabas slurm submit`, run on the host (the login node); the Slurm job's id."""
    result = slurm.run(
        [sys.executable, "-m", "jabascli", "slurm", "submit", "-c", str(config)], env=_env(slurm), cwd=folder
    )
    assert result.returncode == 0, result.stderr
    assert "#SBATCH hetjob" in result.stdout and "--constraint=slow" in result.stdout, result.stdout
    match = re.search(r"submitted Slurm job (\d+)", result.stderr)
    assert match, result.stderr
    return match.group(1)


def _env(slurm: SlurmCluster) -> dict[str, str]:
    env = slurm.env(TRAINER_ENV)
    env.pop("JABAS_TOKEN", None)
    return env


def _wait_done(slurm: SlurmCluster, job_id: str, folder: Path, timeout: float = 300) -> str:
    """Wait until the job has left squeue; its final state (COMPLETED, CANCELLED, FAILED ...)."""
    deadline = time.monotonic() + timeout
    while slurm.queue():
        assert time.monotonic() < deadline, _output(folder, job_id)
        time.sleep(0.2)
    return slurm.job_state(job_id)


def _output(folder: Path, job_id: str) -> str:
    path = folder / "runs" / "digits" / "slurm" / f"slurm-{job_id}.out"
    return path.read_text()[-4000:] if path.exists() else f"(no {path})"


def _exact(config: Path, folder: Path) -> None:
    """Every sample used once per epoch, and the parameters equal one process of the same GBS history."""
    loaded = load(config)
    final = checkpoint_of(loaded)
    history = final["progress"]["gbs_history"]
    assert final["progress"]["epoch"] == EPOCHS
    counts = used_samples(folder, N, EPOCHS)
    for epoch in range(EPOCHS):
        assert max(counts[epoch].values()) == 1, f"epoch {epoch}: a sample was used twice"
        sizes = [h["gbs"] for h in history if h["epoch"] == epoch] or [
            [h for h in history if h["epoch"] < epoch][-1]["gbs"]
        ]
        if len(sizes) == 1:
            assert sum(counts[epoch].values()) == N - N % sizes[0], (epoch, history)
        else:  # the GBS changed within the epoch (a move): what is left at its end, less than one GBS, is dropped
            assert N - max(sizes) < sum(counts[epoch].values()) <= N, (epoch, history)
    reference, _ = reference_run(loaded, load_plan(loaded), steps=final["progress"]["step"], schedule=history)
    diffs = max_abs_diff(final["model"], reference.state_dict())
    assert max(diffs.values()) <= 1e-9, diffs


@pytest.mark.slow
def test_slurm_submit_scancel_checkpoints_then_release_idle_gives_a_het_component_back_and_it_trains_exactly(
    cluster_factory,  # noqa: F811
    slurm_factory,  # noqa: F811
    tmp_path: Path,
) -> None:
    """One job config (with ``release_idle``) submitted twice to the same Slurm: most of a job's time on two busy
    cores is its start-up (the scheduler, three agents and their trainers each import torch), so the scancel and
    the give-back share the jobs and the exactness check.

    1. Submitted, then cancelled under way: the trainers stop after the same iteration and checkpoint.
    2. Submitted again: it continues from that checkpoint; a move off n2 (the slow component) gives that component
       back to Slurm while the job trains on to the end, where every sample was used once per epoch and the
       parameters equal one process of the same GBS history.
    """
    cluster: EmulatedCluster = cluster_factory(NODES)
    slurm: SlurmCluster = slurm_factory(cluster, SLURM_NODES)
    config = _config(tmp_path, cluster, release_idle=True)
    slow = slow_down(tmp_path)  # until n2 is given back: the scancel and the move land while it trains

    # 1. Submitted, then cancelled under way: the trainers stop after the same iteration and checkpoint.
    first = _submit(slurm, config, tmp_path)
    deadline = time.monotonic() + 180
    while _step(tmp_path) < 1:
        assert slurm.queue(), _output(tmp_path, first)
        assert time.monotonic() < deadline, _output(tmp_path, first)
        time.sleep(0.2)
    # `jabas job status` (a process of its own, seconds on a busy host) before the step that counts, so that
    # the scancel lands while the job trains.
    status = _job_status(config)
    assert status.returncode == 0 and "digits" in status.stdout and "n0, n1, n2" in status.stdout, status
    while (step := _step(tmp_path)) < 3:
        assert time.monotonic() < deadline, _output(tmp_path, first)
        time.sleep(0.2)
    slurm.run(["scancel", first])
    assert _wait_done(slurm, first, tmp_path) == "CANCELLED", _output(tmp_path, first)
    assert cluster.jabas_left() == {}, _output(tmp_path, first)
    stopped = checkpoint_of(load(config))["progress"]
    assert stopped["step"] >= step and stopped["epoch"] < EPOCHS, (stopped, _output(tmp_path, first))
    assert "stopped" in _output(tmp_path, first), _output(tmp_path, first)

    # 2. Submitted again: it continues from that checkpoint.
    second = _submit(slurm, config, tmp_path)
    deadline = time.monotonic() + 180
    while _step(tmp_path) < stopped["step"] + 3:
        assert slurm.queue(), _output(tmp_path, second)
        assert time.monotonic() < deadline, _output(tmp_path, second)
        time.sleep(0.2)
    # It moves off n2 (the slow component, 1) while it trains (the scheduler's API, as `jabas job move --now` calls
    # it, without the CLI's start-up): its component is given back while the job trains on.
    moved = _api(tmp_path, "POST", "/v1/job/move", {"servers": ["n0", "n1"], "when": "now"})
    assert moved.status_code == 200, moved.text
    deadline = time.monotonic() + 120
    while (queue := slurm.queue()) != [f"{second}+0 RUNNING"] or slurm.states()["n2"] != "idle":
        assert time.monotonic() < deadline, (queue, slurm.states(), _output(tmp_path, second))
        time.sleep(0.2)
    shown = slurm.run(["scontrol", "show", "job", second]).stdout
    assert re.search(r"HetJobOffset=0 .*?JobState=RUNNING .*?\n   NodeList=n\[0-1\]", shown, re.S), shown
    assert re.search(r"HetJobOffset=1 .*?JobState=CANCELLED", shown, re.S), shown
    slow.unlink()  # the rest at full speed

    assert _wait_done(slurm, second, tmp_path) == "COMPLETED", _output(tmp_path, second)
    assert slurm.queue() == []
    assert cluster.jabas_left() == {}, _output(tmp_path, second)
    output = _output(tmp_path, second)
    assert "resuming from its checkpoint" in output, output
    assert "restart" not in output, output  # no stale stop request
    assert f"gave back n2 (servers n2) to Slurm: scancel {second}+1" in output and "succeeded" in output, output
    _exact(config, tmp_path)


def _api(folder: Path, method: str, route: str, body: dict[str, object] | None = None) -> httpx.Response:
    """A request to the running job's scheduler, found as `jabas job` finds it (its run folder's scheduler.json)."""
    steering = json.loads((folder / "runs" / "digits" / "scheduler.json").read_text())
    token = Path(steering["token_file"]).read_text().strip()
    headers = {"Authorization": f"Bearer {token}"}
    return httpx.request(method, f"http://{steering['address']}{route}", headers=headers, json=body, timeout=5)


def _step(folder: Path) -> int:
    """The running job's step from its scheduler (-1: no scheduler yet)."""
    try:
        answer = _api(folder, "GET", "/v1/job")
        return int(answer.json()["step"]) if answer.status_code == 200 else -1
    except (OSError, ValueError, KeyError, httpx.TransportError):
        return -1


def _job_status(config: Path) -> subprocess.CompletedProcess[str]:
    """`jabas job status -c CONFIG` on the host, with nothing but the config and the shared run folder."""
    env = {k: v for k, v in os.environ.items() if k != "JABAS_TOKEN"}
    return subprocess.run(
        [sys.executable, "-m", "jabascli", "job", "status", "-c", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


# -- without Slurm: Slurm's environment read, nodes matched, the script written ------------------------------


def _servers_config(folder: Path, names: tuple[str, ...] | list[str] = ("a1", "a2", "b1"), **slurm: object) -> Path:
    servers = [
        {"name": names[0], "host": "10.0.0.1", "device_type": "v100", "devices": 4},
        {"name": names[1], "host": "10.0.0.2", "device_type": "v100", "devices": 4},
        {"name": names[2], "host": "gpu-b1", "device_type": "p100", "devices": 2},
    ]
    path = folder / "job.toml"
    config = {"job": {"name": "my job", "workload": "digits"}, "cluster": {"servers": servers}, "slurm": slurm}
    path.write_bytes(tomli_w.dumps(config).encode())
    return path


def test_hostlists_expand_as_slurm_writes_them() -> None:
    assert expand_hostlist("n[0-2]") == ["n0", "n1", "n2"]
    assert expand_hostlist("gpu[08-10,12],login") == ["gpu08", "gpu09", "gpu10", "gpu12", "login"]
    assert expand_hostlist("r[1-2]-n[1-2]") == ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]
    with pytest.raises(InputError):
        expand_hostlist("n[0-")


def test_allocation_spans_every_het_component_and_matches_servers(tmp_path: Path) -> None:
    loaded = load(_servers_config(tmp_path))
    env = {
        "SLURM_JOB_ID": "7",
        "SLURM_HET_SIZE": "2",
        "SLURM_JOB_NODELIST": "a[1-2]",  # the batch script's: its own component only
        "SLURM_JOB_NODELIST_HET_GROUP_0": "a[1-2]",
        "SLURM_JOB_NODELIST_HET_GROUP_1": "node-b",
        "SLURMD_NODENAME": "a1",
    }
    where = allocation(env)
    assert (where.job_id, where.nodes, where.first, where.node) == ("7", ["a1", "a2", "node-b"], "a1", "a1")
    # a1, a2 by name; node-b by its NodeAddr, which is b1's host
    assert match_servers(loaded, where.nodes, lambda names: {"node-b": "gpu-b1"}) == {"a1": 0, "a2": 1, "node-b": 2}
    assert scheduler_address(loaded, where) == "10.0.0.1:40000"
    with pytest.raises(InputError, match="Slurm node other is no server"):
        match_servers(loaded, ["a1", "other"], lambda names: {})
    with pytest.raises(InputError, match="SLURM_JOB_ID"):
        allocation({})


def test_submit_dry_run_writes_one_component_per_device_type(tmp_path: Path) -> None:
    config = _servers_config(tmp_path, partition="gpu", time="2:00:00", select="gres", options=["--qos=high"])
    result = run_jabas("slurm", "submit", "-c", str(config), "--dry-run")
    assert result.returncode == 0, result.stderr
    script = (tmp_path / "runs" / "my job" / "slurm" / "my job.sbatch").read_text()
    assert result.stdout == script
    sbatch = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert sbatch[1] == f'#SBATCH --output="{tmp_path}/runs/my job/slurm/slurm-%j.out"'  # sbatch reads quotes
    assert sbatch[2:] == [
        "#SBATCH --nodes=2 --ntasks-per-node=1 --exclusive --gres=gpu:v100:4 --partition=gpu --time=2:00:00 --qos=high",
        "#SBATCH hetjob",
        "#SBATCH --nodes=1 --ntasks-per-node=1 --exclusive --gres=gpu:p100:2 --partition=gpu --time=2:00:00 --qos=high",
    ]
    assert "srun --het-group=0,1 --ntasks-per-node=1" in script and "slurm schedule" in script
    assert "JABAS_TOKEN" not in script and 'token "$folder/token"' in script
    assert "not submitted" in result.stderr

    bad = _servers_config(tmp_path, options=["--qos=high\n#SBATCH --x"])
    result = run_jabas("slurm", "submit", "-c", str(bad), "--dry-run")
    assert result.returncode == 2 and "slurm.options" in result.stderr, result.stderr


def test_worker_outside_slurm_needs_a_rank(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = subprocess.run(
        [sys.executable, "-m", "jabascli", "worker", "-c", str(_servers_config(tmp_path))],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 2 and "--rank" in result.stderr, result.stderr
