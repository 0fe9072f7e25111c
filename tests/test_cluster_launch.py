"""The cluster launcher's parts that need no second machine: the agent's lifeline, addresses, bad input.

The whole path across emulated nodes (network namespaces, sshd per node) is in
tests/test_cluster_run.py.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomli_w

from jabascli.config import load_config
from jabascli.elastic.lifeline import LaunchOrder, passed_on, read_order
from jabascli.elastic.local import remote_servers, scheduler_address
from jabascli.errors import InputError
from jabascli.net import free_port, is_local

pytestmark = pytest.mark.xdist_group("nodes")  # one emulated cluster at a time under `make test`

REMOTE = "198.51.100.7"
"""TEST-NET-2 (RFC 5737): an address no interface here holds; nothing is ever sent to it."""


def _config(tmp_path: Path, hosts: list[str], scheduler: dict[str, object] | None = None) -> Path:
    servers = [{"name": f"s{i}", "host": host, "device_type": "cpu"} for i, host in enumerate(hosts)]
    config = {
        "job": {"name": "digits", "workload": "digits", "epochs": 1},
        "cluster": {"servers": servers},
        "scheduler": {"connect_timeout_s": 60.0, **(scheduler or {})},
        "storage": {"checkpoint_dir": str(tmp_path / "checkpoints"), "run_dir": str(tmp_path / "runs")},
    }
    path = tmp_path / "job.toml"
    path.write_bytes(tomli_w.dumps(config).encode())
    return path


def test_a_launch_order_parses_back_and_bad_ones_are_named() -> None:
    order = LaunchOrder(token="t" * 32, env={"OMP_NUM_THREADS": "1"})
    assert read_order(io.BytesIO(order.line() + b"more input")) == order
    for bad, says in (
        (b"not json\n", "not a launch order"),
        (b'{"token": "x", "shell": "rm -rf /"}\n', "not a launch order"),
        (b'{"token": ""}\n', "not a launch order"),
        (b'{"token": "abc"}', "expected one line of JSON"),  # no end of line: the launcher went away
    ):
        with pytest.raises(InputError, match=says) as caught:
            read_order(io.BytesIO(bad))
        assert caught.value.lines()[0].startswith("standard input: ")


def test_the_token_variable_is_never_passed_on() -> None:
    environ = {"JABAS_TOKEN": "secret", "JABAS_FAULT": "x", "OMP_NUM_THREADS": "1", "HOME": "/root", "PATH": "/bin"}
    assert passed_on(environ, "JABAS_TOKEN") == {"JABAS_FAULT": "x", "OMP_NUM_THREADS": "1"}


def test_this_machine_is_local_and_others_are_not() -> None:
    assert is_local("127.0.0.1") and is_local("localhost")
    assert not is_local(REMOTE)
    assert not is_local("no-such-host.invalid")


def test_the_scheduler_address_of_a_cluster(tmp_path: Path) -> None:
    here = load_config(_config(tmp_path, ["127.0.0.1", "127.0.0.1"]))
    assert remote_servers(here) == [] and scheduler_address(here, []) == "127.0.0.1"

    mixed = load_config(_config(tmp_path, ["127.0.0.1", REMOTE]))
    assert remote_servers(mixed) == [1]
    with pytest.raises(InputError, match=r"cluster.servers.s0.host: 127.0.0.1 cannot be reached from server 's1'"):
        scheduler_address(mixed, [1])

    pinned = load_config(_config(tmp_path, [REMOTE], {"address": "127.0.0.1"}))
    with pytest.raises(InputError, match=r"scheduler.address: 127.0.0.1 cannot be reached from server 's0'"):
        scheduler_address(pinned, [0])


def test_an_agent_ends_when_its_launcher_closes_its_standard_input(tmp_path: Path) -> None:
    """A real `jabas worker --stdin`, retrying a scheduler nobody runs: closing its stdin ends it at once."""
    config = _config(tmp_path, ["127.0.0.1"])
    argv = ["worker", "-c", str(config), "--rank", "0", "--scheduler", f"127.0.0.1:{free_port()}", "--stdin"]
    worker = subprocess.Popen(
        [sys.executable, "-m", "jabascli", *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert worker.stdin is not None and worker.stdout is not None
    worker.stdin.write(LaunchOrder(token="t" * 32).line())
    worker.stdin.flush()
    started = worker.stdout.readline().decode()
    assert f"pid {worker.pid}" in started, started
    time.sleep(0.5)
    assert worker.poll() is None, "it should still be retrying the scheduler (connect_timeout_s is 60 s)"
    worker.stdin.close()
    # Well before connect_timeout_s: it ended because its lifeline closed, not because it gave up.
    assert worker.wait(20) == 143


def test_a_worker_given_no_launch_order_says_so_in_one_line(tmp_path: Path) -> None:
    config = _config(tmp_path, ["127.0.0.1"])
    result = subprocess.run(
        [sys.executable, "-m", "jabascli", "worker", "-c", str(config), "--rank", "0", "--stdin"],
        input=b"{}\n",
        capture_output=True,
        timeout=60,
    )
    assert result.returncode == 2
    lines = result.stderr.decode().strip().splitlines()
    assert lines == ["error: standard input: not a launch order: token: Field required"], lines


def test_gloo_and_nccl_are_held_to_the_interface_towards_the_master(monkeypatch: pytest.MonkeyPatch) -> None:
    from jabascli.engine.distributed import bind_gloo_towards

    # Recorded by monkeypatch (empty counts as unset), so what bind_gloo_towards sets is undone after the test:
    # a GLOO_SOCKET_IFNAME left at lo reaches the trainers of later tests and binds them to loopback.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")  # the user's choice stands
    bind_gloo_towards("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    assert os.environ["NCCL_SOCKET_IFNAME"] == "ib0"
    monkeypatch.delenv("NCCL_SOCKET_IFNAME")
    bind_gloo_towards("127.0.0.1")
    assert os.environ["NCCL_SOCKET_IFNAME"] == "lo"
