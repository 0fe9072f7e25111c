"""The emulated cluster of tests/cluster.py: nodes as network namespaces on one bridge, shaped by tbf.

These tests bring real namespaces, veths and a bridge up on this host (root only; skipped
elsewhere, with the reason) and check what later tests rely on: each node has its own address
and reaches the others and the host; the listening-socket reader names the right pid and address;
the rate shapes both directions of a link and drops nothing; teardown leaves nothing behind, also
after a failed body or a failed up(); an sshd in a node runs commands in that node.
"""

from __future__ import annotations

import getpass
import ipaddress
import json
import os
import re
import socket
import stat
import subprocess
import sys
from pathlib import Path

import paramiko
import pytest

from tests.cluster import (
    ClusterError,
    EmulatedCluster,
    Node,
    NodeSpec,
    _probe,
    cluster_factory,  # noqa: F401 (a fixture: pytest finds it in this module)
    netns_unavailable_reason,
    rate_bits,
    require_netns,
    tbf_options,
)
from tests.sshd import require_sshd, write_key

pytestmark = pytest.mark.xdist_group("nodes")  # one emulated cluster at a time under `make test`

SCRIPT = Path(__file__).with_name("cluster.py")

# A server on ADDRESS (argv[1]) that prints its port, then tells every client what it saw.
SERVER = r"""
import socket, sys
with socket.create_server((sys.argv[1], 0)) as server:
    print(server.getsockname()[1], flush=True)
    while True:
        conn, peer = server.accept()
        with conn:
            conn.sendall(f"{sys.argv[1]} saw {peer[0]}".encode())
"""
# Connects to ADDRESS PORT [TIMEOUT_S] and prints its own address and what the server said.
CLIENT = r"""
import socket, sys
timeout = float(sys.argv[3]) if len(sys.argv) > 3 else 5.0
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=timeout) as conn:
    print(conn.getsockname()[0], conn.recv(200).decode())
"""
# Receives one connection to its end; prints the bytes and the seconds from the first byte to the last.
RECEIVER = r"""
import socket, sys, time
with socket.create_server((sys.argv[1], 0)) as server:
    print(server.getsockname()[1], flush=True)
    conn, _ = server.accept()
    received, start = 0, None
    while chunk := conn.recv(1 << 20):
        start = start or time.monotonic()
        received += len(chunk)
    print(received, time.monotonic() - start, flush=True)
"""
SENDER = r"""
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10) as conn:
    conn.sendall(bytes(int(sys.argv[3])))
"""
# Starts a grandchild in a session of its own that ignores SIGTERM, prints its pid, and sleeps.
SPAWNER = r"""
import subprocess, sys, time
child = subprocess.Popen(
    [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"],
    start_new_session=True,
)
time.sleep(0.3)  # the child ignores SIGTERM from here on
print(child.pid, flush=True)
time.sleep(120)
"""
SLEEPER = "import time; time.sleep(120)"
# Listens on every IPv4 address and on every IPv6 one, prints both ports, and sleeps.
WILDCARD_LISTENER = r"""
import socket, time
v4 = socket.create_server(("0.0.0.0", 0))
v6 = socket.create_server(("::", 0), family=socket.AF_INET6)
print(v4.getsockname()[1], v6.getsockname()[1], flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie has)."""
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return status[status.rindex(")") + 2] not in "ZX"


def _assert_nothing_left(cluster: EmulatedCluster) -> None:
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    bridges = subprocess.run(["ip", "link", "show", "type", "bridge"], capture_output=True, text=True, check=True)
    for node in cluster.nodes:
        assert not Path(node.netns_path).exists()
        assert not re.search(rf"^{re.escape(node.netns)}\b", namespaces, re.MULTILINE)
        assert not Path("/sys/class/net", node.peer).exists()
    assert not Path("/sys/class/net", cluster.bridge).exists()
    assert f"{cluster.bridge}:" not in bridges.stdout


def _start_server(cluster: EmulatedCluster, node: Node, code: str) -> tuple[subprocess.Popen[str], int]:
    process = cluster.popen(node, [sys.executable, "-c", code, node.address], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    return process, int(process.stdout.readline())


def test_rates_and_tbf_options() -> None:
    assert rate_bits("1gbit") == 10**9
    assert rate_bits("2.5MBit") == 2_500_000
    for bad in ("1gb", "fast", "100", "1kbit"):
        with pytest.raises(ValueError):
            rate_bits(bad)
    assert tbf_options("1gbit") == ["rate", "1000000000bit", "burst", "500000", "limit", "62500000"]
    assert tbf_options("20mbit") == ["rate", "20000000bit", "burst", "16384", "limit", str(4 * 1024 * 1024)]
    with pytest.raises(ValueError):
        NodeSpec("a b")


def test_nodes_have_their_own_addresses_and_reach_each_other_and_the_host(cluster_factory) -> None:  # noqa: F811
    cluster = cluster_factory(3)
    a, b, c = cluster.nodes
    addresses = [a.address, b.address, c.address, cluster.host_address]
    assert len(set(addresses)) == 4
    subnet = ipaddress.ip_network(cluster.subnet)
    assert subnet.subnet_of(ipaddress.ip_network("198.18.0.0/15"))
    assert all(ipaddress.ip_address(address) in subnet for address in addresses)
    assert cluster.host_address.endswith(".1") and a.address.endswith(".11") and c.address.endswith(".13")

    server, port = _start_server(cluster, a, SERVER)
    seen_from_b = cluster.run(b, [sys.executable, "-c", CLIENT, a.address, str(port)], check=True).stdout.split()
    assert seen_from_b == [b.address, a.address, "saw", b.address]
    with socket.create_connection((a.address, port), timeout=5) as conn:
        assert conn.recv(200).decode() == f"{a.address} saw {cluster.host_address}"

    assert (server.pid, a.address, port) in cluster.listening_sockets(a)
    assert all(s.port != port for s in cluster.listening_sockets(b))
    assert server.pid in cluster.pids_in(a)
    assert server.pid not in cluster.pids_in(b) + cluster.pids_in(c)
    wildcard = cluster.popen(c, [sys.executable, "-c", WILDCARD_LISTENER], stdout=subprocess.PIPE, text=True)
    assert wildcard.stdout is not None
    v4, v6 = map(int, wildcard.stdout.readline().split())
    assert cluster.listening_sockets(c) == sorted(
        [(wildcard.pid, "0.0.0.0", v4), (wildcard.pid, "::", v6)], key=lambda s: (s[2], s[1])
    )

    # A node sees its loopback (up) and its veth, nothing of the host's interfaces.
    links = cluster.run(a, ["ip", "-o", "link", "show"], check=True).stdout
    assert sorted(line.split(":")[1].strip().split("@")[0] for line in links.splitlines()) == sorted(["lo", a.veth])
    assert "<LOOPBACK,UP," in links


def test_jabas_pids_are_told_apart(cluster_factory, tmp_path: Path) -> None:  # noqa: F811
    cluster = cluster_factory(1)
    node = cluster.nodes[0]
    other = cluster.popen(node, ["sleep", "120"])
    named_after_jabas = cluster.popen(node, [sys.executable, "-c", SLEEPER, "/run/jabas-emulated-cluster/sshd_config"])
    jabas = cluster.popen(node, [sys.executable, "-c", SLEEPER, "--as", "jabascli.worker"])
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "jabas").symlink_to("/bin/sleep")
    command = cluster.popen(node, [str(tmp_path / "bin" / "jabas"), "120"])
    assert cluster.pids_in(node) == sorted([other.pid, named_after_jabas.pid, jabas.pid, command.pid])
    assert cluster.jabas_pids_in(node) == sorted([jabas.pid, command.pid])


def _transfer_s(cluster: EmulatedCluster, sender: Node, receiver: Node, size: int) -> float:
    """Seconds a bulk TCP transfer of ``size`` bytes from ``sender`` to ``receiver`` takes, first byte to last."""
    process, port = _start_server(cluster, receiver, RECEIVER)
    cluster.run(sender, [sys.executable, "-c", SENDER, receiver.address, str(port), str(size)], check=True)
    out, _ = process.communicate(timeout=60)
    received, seconds = out.split()
    assert int(received) == size
    return float(seconds)


def test_the_rate_shapes_what_a_node_sends_and_what_it_receives(cluster_factory) -> None:  # noqa: F811
    cluster = cluster_factory(2, rate="100mbit")
    a, b = cluster.nodes
    size = 3_000_000
    fast = _transfer_s(cluster, a, b, size)
    cluster.set_rate(a, "20mbit")
    slow_sender = _transfer_s(cluster, a, b, size)
    cluster.set_rate(a, "100mbit")
    cluster.set_rate(b, "20mbit")
    slow_receiver = _transfer_s(cluster, a, b, size)
    rates = {name: size * 8 / s / 1e6 for name, s in [("fast", fast), ("sender", slow_sender), ("rx", slow_receiver)]}
    print(f"Mbit/s at 100mbit, with the sender at 20mbit, with the receiver at 20mbit: {rates}")
    assert slow_sender > 3 * fast, rates
    assert slow_receiver > 3 * fast, rates
    for node in (a, b):
        for side, qdisc in cluster.qdisc_stats(node).items():
            assert qdisc["kind"] == "tbf"
            assert qdisc["drops"] == 0, (node.name, side, qdisc)
    assert cluster.qdisc_stats(a)["out"]["bytes"] >= 3 * size  # a's sends went through its tbf
    assert cluster.qdisc_stats(b)["in"]["bytes"] >= 3 * size  # and b's receipts through the bridge-side one
    cluster.set_rate(b, None)
    assert cluster.qdisc_stats(b)["in"]["kind"] != "tbf"


def test_without_root_no_cluster_is_tried(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert netns_unavailable_reason.__module__ == "tests.cluster"
    assert _probe() == "emulated nodes need root (network namespaces, veths, a bridge and tc)"


def test_down_leaves_nothing_even_when_the_body_raised() -> None:
    require_netns()
    cluster = EmulatedCluster([NodeSpec("a", "50mbit"), NodeSpec("b", None)], name_prefix="jbt")
    with pytest.raises(RuntimeError, match="the body failed"), cluster:
        a, b = cluster.nodes
        spawner = cluster.popen(a, [sys.executable, "-c", SPAWNER], stdout=subprocess.PIPE, text=True)
        assert spawner.stdout is not None
        orphan = int(spawner.stdout.readline())  # not our child, and it ignores SIGTERM
        frozen = cluster.popen(b, [sys.executable, "-c", SLEEPER])
        assert cluster.freeze(b) == [frozen.pid]
        assert set(cluster.pids_in(a)) == {spawner.pid, orphan}
        raise RuntimeError("the body failed")
    assert spawner.poll() is not None and frozen.poll() is not None
    assert not _alive(orphan)
    _assert_nothing_left(cluster)
    cluster.down()  # a second time: nothing to do, and nothing of another cluster is touched


def test_a_failed_up_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    require_netns()
    shape = EmulatedCluster._shape

    def shape_but_fail_on_the_second_node(self: EmulatedCluster, node: Node, rate: str | None) -> None:
        if node.index == 1:  # its namespace and veth pair exist by now
            raise ClusterError("injected failure")
        shape(self, node, rate)

    monkeypatch.setattr(EmulatedCluster, "_shape", shape_but_fail_on_the_second_node)
    cluster = EmulatedCluster([NodeSpec("a"), NodeSpec("b"), NodeSpec("c")])
    with pytest.raises(ClusterError, match="injected failure"):
        cluster.up()
    assert cluster.k is not None
    _assert_nothing_left(cluster)


def test_faults_cut_freeze_and_kill_a_node(cluster_factory) -> None:  # noqa: F811
    cluster = cluster_factory(2)
    a, b = cluster.nodes
    server, port = _start_server(cluster, a, SERVER)
    client = [sys.executable, "-c", CLIENT, a.address, str(port)]
    cluster.link_down(a)
    assert cluster.run(b, [*client, "1"], timeout=30).returncode != 0  # timed out or unreachable
    cluster.link_up(a)
    assert cluster.run(b, client, check=True).stdout.split()[0] == b.address
    cluster.freeze(a)
    with pytest.raises(socket.timeout), socket.create_connection((a.address, port), timeout=2) as conn:
        conn.settimeout(0.5)
        conn.recv(10)  # the kernel accepts for it, but the frozen server never answers
    cluster.thaw(a)
    assert cluster.kill_node(a) == [server.pid]
    assert server.wait(timeout=5) == -9
    assert cluster.pids_in(a) == []


def test_an_sshd_in_a_node_runs_commands_in_that_node(
    cluster_factory,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    require_sshd()
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)  # only the throw-away key may log in
    cluster = cluster_factory(2)
    a, b = cluster.nodes
    (tmp_path / "authorized_keys").write_text(write_key(tmp_path / "id_user") + "\n")
    on_22 = cluster.start_sshd(b, tmp_path / "authorized_keys")
    on_2222 = cluster.start_sshd(a, tmp_path / "authorized_keys", port=2222)
    assert on_22.known_hosts_line().startswith(f"{b.address} ssh-ed25519 ")
    assert on_2222.known_hosts_line().startswith(f"[{a.address}]:2222 ssh-ed25519 ")
    (tmp_path / "known_hosts").write_text(on_22.known_hosts_line() + on_2222.known_hosts_line())
    assert (on_22.pid, b.address, 22) in cluster.listening_sockets(b)
    assert [(s.ip, s.port) for s in cluster.listening_sockets(a)] == [(a.address, 2222)]

    for node, port in ((b, 22), (a, 2222)):
        client = paramiko.SSHClient()
        client.load_host_keys(str(tmp_path / "known_hosts"))
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
        key = str(tmp_path / "id_user")
        try:
            client.connect(
                node.address, port, getpass.getuser(), key_filename=key, look_for_keys=False, allow_agent=False
            )
            _, stdout, _ = client.exec_command("ip -o -4 addr show")
            output = stdout.read().decode()
            assert stdout.channel.recv_exit_status() == 0
        finally:
            client.close()
        shown = {line.split()[1]: line.split()[3] for line in output.splitlines()}
        assert shown == {"lo": "127.0.0.1/8", node.veth: f"{node.address}/24"}

    servers = [on_22.pid, on_2222.pid]
    cluster.down()
    assert not any(pid is not None and _alive(pid) for pid in servers)


def _script(*args: str) -> subprocess.CompletedProcess[str]:
    # -S: no site-packages, so the script runs on the standard library alone, as a user's python3 would.
    return subprocess.run([sys.executable, "-S", str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_the_script_brings_a_cluster_up_and_down() -> None:
    require_netns()
    up = _script("up", "--nodes", "2", "--rate-of", "n1=50mbit", "--name", "jbscript")
    assert up.returncode == 0, up.stderr
    name = re.search(r"^emulated cluster (jbscript\d+):", up.stdout, re.MULTILINE)
    assert name is not None, up.stdout
    state_file = Path(f"/run/jabas-emulated-cluster/{name[1]}.json")
    try:
        assert stat.S_IMODE(state_file.stat().st_mode) == 0o600
        state = json.loads(state_file.read_text())
        cluster = EmulatedCluster.from_state(state)
        for node in cluster.nodes:
            assert f"nsenter --net=/var/run/netns/{node.netns} -- CMD" in up.stdout
            assert Path(node.netns_path).exists()
        assert cluster.qdisc_stats("n1")["in"]["options"]["rate"] == 50_000_000 // 8  # bytes/s
        status = _script("status")
        assert f"{name[1]}: bridge {cluster.bridge} up" in status.stdout
        sleeper = subprocess.Popen(cluster.nodes[0].nsenter([sys.executable, "-c", SLEEPER]))
        assert _script("down", name[1]).returncode == 0
        assert sleeper.wait(timeout=5) != 0
        _assert_nothing_left(cluster)
        assert not state_file.exists()
    finally:
        if state_file.exists():
            _script("down", name[1])


def test_the_script_rejects_bad_input_in_one_line() -> None:
    for args in (["up", "--rate", "fast"], ["up", "--nodes", "2", "--rate-of", "n7=1mbit"], ["down", "jbnothing0"]):
        result = _script(*args)
        assert result.returncode == 2, (args, result)
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert result.stdout == ""
