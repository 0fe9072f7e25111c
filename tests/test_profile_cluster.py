"""`jabas profile all` on an emulated cluster of two nodes, each a network namespace with its own address,
a shaped link and its own sshd: every server is profiled on its node over SSH, then the all-reduce between
the nodes, then (``--hybrid``) the link between them for the hybrid planner, with nothing typed on any node.

Digits on a plain CPU server and an emulated 2x slower one, one LBS (``--lbs 32 --gbs-max 32``) so that
each server is one memory trial and one computation point. The hybrid profiles the link is written into are
Sailor's published ones (``jabas profile import``, under a second), or where that reference is not beside the
repo, the collectives ``jabas profile hybrid`` measures on loopback. Runs as root only (network namespaces), and
where sshd is installed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomli_w

from jabascli.atomic import atomic_write_json
from jabascli.config import load_config
from jabascli.profiler.comm import profile_hosts
from jabascli.profiler.common import Reporter
from jabascli.profiler.link import link_on_disk
from jabascli.profiles import load_profile_set
from tests.cluster import EmulatedCluster, NodeSpec, cluster_factory  # noqa: F401 (the fixture)
from tests.conftest import WITH_SIGINT
from tests.elastic_support import TRAINER_ENV
from tests.sshd import require_sshd

pytestmark = pytest.mark.xdist_group("nodes")  # one emulated cluster at a time under `make test`

SAILOR = Path(__file__).resolve().parents[2] / "shared" / "reference" / "planners" / "sailor"


def _config(folder: Path, servers: list[tuple[str, str]], key: Path) -> Path:
    """A digits job on ``servers`` ((name, host) pairs; the second and later emulated 2x slower)."""
    entries = []
    for i, (name, host) in enumerate(servers):
        entry = {"name": name, "host": host, "device_type": "cpu" if i == 0 else f"cpu-slow{i}"}
        if i > 0:
            entry["emulate"] = {"slowdown": 2.0, "memory_bytes": 2_000_000_000}
        entries.append({**entry, "ssh_user": "root", "ssh_key": str(key)})
    config = {
        "job": {"name": "digits", "workload": "digits", "epochs": 1, "lbs": 32, "options": {"width": 8}},
        "batching": {"metric": "fixed", "initial_gbs": 64},
        "profiles": {"dir": str(folder / "profiles")},
        "cluster": {"servers": entries},
        "storage": {"checkpoint_dir": str(folder / "checkpoints"), "run_dir": str(folder / "runs")},
    }
    path = folder / "job.toml"
    path.write_bytes(tomli_w.dumps(config).encode())
    return path


def _jabas(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **TRAINER_ENV, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "jabascli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def _hybrid_network(root: Path, cwd: Path) -> Path:
    """``<root>/hybrid/network.json`` as one machine's hybrid profiles leave it, made in seconds."""
    if SAILOR.is_dir():
        imported = _jabas(["profile", "import", "--from", "sailor", str(SAILOR), "--out", str(root)], cwd, 60)
        assert imported.returncode == 0, imported.stdout + imported.stderr
    else:
        from jabascli.profiler.hybrid import _collectives

        network, _ = _collectives(["cpu", "cpu-slow1"], Reporter())
        atomic_write_json(root / "hybrid" / "network.json", network.model_dump(mode="json"))
    return root / "hybrid" / "network.json"


@pytest.mark.slow
def test_profile_all_profiles_each_server_on_its_node_and_the_link_between(
    cluster_factory,  # noqa: F811
    tmp_path: Path,
) -> None:
    require_sshd()
    cluster: EmulatedCluster = cluster_factory([NodeSpec("fast", "1gbit"), NodeSpec("slow", "1gbit")])
    key, known_hosts = cluster.start_sshds(tmp_path)
    fast, slow = cluster.nodes
    ssh = ["--known-hosts", str(known_hosts)]

    # A server no node answers for: one line naming it, exit 1, and nothing measured or written.
    unreachable = f"{fast.address.rsplit('.', 1)[0]}.250"
    config = _config(tmp_path, [("fast", fast.address), ("slow", slow.address), ("gone", unreachable)], key)
    result = _jabas(["profile", "all", "-c", str(config), *ssh], tmp_path, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1, result.stdout + result.stderr
    assert len(lines) == 1 and "'gone'" in lines[0] and unreachable in lines[0], lines
    assert not (tmp_path / "profiles").exists()
    assert cluster.jabas_left(20) == {}

    # Ctrl-C while a node profiles: exit 130, no jabas process left on any node, no partial file.
    config = _config(tmp_path, [("fast", fast.address), ("slow", slow.address)], key)
    network = _hybrid_network(tmp_path / "profiles", tmp_path)
    args = ["profile", "all", "-c", str(config), "--lbs", "32", "--gbs-max", "32", "--iters", "5", "--hybrid", *ssh]
    launcher = subprocess.Popen(
        [sys.executable, "-c", WITH_SIGINT, *args],  # Ctrl-C reaches it even where pytest ignores SIGINT
        cwd=tmp_path,
        env={**os.environ, **TRAINER_ENV},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while len(cluster.jabas_pids_in(fast)) < 2:  # the profiler and a measuring process of its own
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[0][-3000:]
            time.sleep(0.1)
        launcher.send_signal(signal.SIGINT)
        output = launcher.communicate(timeout=60)[0]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 130, output[-3000:]
    assert cluster.jabas_left(20) == {}, output[-3000:]
    assert not list((tmp_path / "profiles").rglob("*.tmp")), output[-3000:]
    assert link_on_disk(network) is None  # still the one machine's

    result = _jabas(args, tmp_path, timeout=400)  # measures what the interrupted run left out
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "[fast]" in output and "[slow]" in output, output[-4000:]  # each node's progress, with its name
    assert cluster.jabas_left(20) == {}, output[-4000:]

    dirs = load_config(config).profile_dirs()
    profiles = load_profile_set(dirs.memory, dirs.computation, dirs.communication, dirs.bucket)
    assert profiles.servers() == ["fast", "slow"]
    assert {server for server, _ in profiles.memory} == {server for server, _, _ in profiles.comp} == {"fast", "slow"}
    assert {p.gpu_type for p in profiles.comp.values()} == {"cpu", "cpu-slow1"}
    assert {p.device for p in profiles.comp.values()} == {"cpu", "emulated"}
    inter = profiles.comm["inter"]
    assert inter.meta is not None and inter.meta.world_size == 2
    assert profile_hosts(inter) == [fast.address, slow.address]  # measured between the nodes, not on loopback
    assert len(inter.measured_ms) >= 2 and all(ms > 0 for ms in inter.measured_ms)

    # The last stage measured the link between the nodes into the hybrid profiles (`jabas profile link`).
    link = link_on_disk(network)
    assert link is not None and link.hosts == [fast.address, slow.address], output[-4000:]
    assert link.sizes >= 2 and all(r.link == "inter" and r.seconds > 0 for r in link.rows)
    assert {r.collective for r in link.rows} == {"all_reduce", "all_gather", "reduce_scatter", "send"}
    stage = rf"link fast-slow\W+ok\W+{link.sizes} sizes, {link.gbps:.2g} GB/s between {fast.address} and {slow.address}"
    assert re.search(stage, output), output[-4000:]
