"""An emulated cluster on this one host: N nodes, each a network namespace with its own address and a shaped link.

Every node is a Linux network namespace (``/var/run/netns/NAME``) with loopback up and one veth
whose other end hangs on a bridge in the host's namespace. The bridge has the address ``.1`` and
node ``i`` the address ``.(11+i)`` of one /24 of the benchmarking range 198.18.0.0/15 (RFC 2544,
never a private or public range): ``198.18.K.0/24``, where ``K`` is the first number whose bridge
``jbbrK`` could be created and whose ``198.18.K.`` no address of the host uses, so two clusters
(two pytest processes, say) never share a subnet or a name. The host reaches every node through
the bridge, as a login node where the scheduler runs would, and the nodes reach each other there;
a node has no route beyond the /24 (no default route, no NAT).

Links are shaped to each node's rate with a ``tbf`` qdisc in both directions: on the node's veth
inside its namespace (what it sends) and on the bridge-side veth (what it receives). The kernel of
the machine this was written on has ``tbf`` and ``htb`` but not ``netem``, so there is NO latency,
loss or jitter emulation: a node pair differs only in bandwidth, and a round trip is a local one
(tens of microseconds) plus what waits in the tbf queues. The bucket holds 4 ms of the rate (at
least 16 KiB) and the queue 500 ms of it (at least 4 MiB). Measured on that machine: a bulk TCP
transfer runs at 96-97% of the rate (97 Mbit/s at 100mbit, 19.2 at 20mbit), a gloo all-reduce of
three nodes takes what a ring at the rate predicts (16 MB at 100mbit: 1.81 s), and neither, nor two
senders into one receiver with BBR or CUBIC, drops a packet (``qdisc_stats`` shows the drops; the
tests check there are none).

On that machine ``net.bridge.bridge-nf-call-iptables`` is 1 (br_netfilter is loaded, so bridged
IPv4 frames pass through iptables' FORWARD chain), but no iptables table is loaded
(``/proc/net/ip_tables_names`` is empty) and nothing is dropped; this module changes no global
setting, and ``tests/test_cluster_fixture.py`` checks that traffic passes between nodes and host.

Names are short (an interface name has at most 15 characters): bridge ``jbbrK``, node ``i``'s
veth ``jbvK-i`` (in its namespace) and ``jbpK-i`` (on the bridge), namespace ``PREFIXK-NODE``
(``jb3-n0``). Processes run in a node with ``nsenter --net=/var/run/netns/NAME -- ARGV`` (not
``ip netns exec``, which remounts /sys and hides /sys/fs/cgroup); :meth:`EmulatedCluster.popen`
and :meth:`EmulatedCluster.run` do so, with an argv list and never a shell. A process that has
exited leaves :meth:`EmulatedCluster.pids_in` at once (a zombie has no namespace); one whose parent
is gone shows as ``<defunct>`` in ps until init reaps it (on that machine, within seconds).

In tests (root only; :func:`require_netns` skips otherwise)::

    from tests.cluster import NodeSpec, cluster_factory  # noqa: F401 (a fixture)

    def test_x(cluster_factory):  # noqa: F811
        cluster = cluster_factory([NodeSpec("a", "100mbit"), NodeSpec("b")])   # up, and down after the test
        server = cluster.popen(cluster.node("a"), [sys.executable, "-c", CODE])

or ``with EmulatedCluster(specs) as cluster:``. Faults for failure tests: :meth:`~EmulatedCluster.link_down`,
:meth:`~EmulatedCluster.kill_node`, :meth:`~EmulatedCluster.freeze`, :meth:`~EmulatedCluster.set_rate`.

As a tool for users (as root; only the standard library is needed, the project's virtualenv is not)::

    python3 tests/cluster.py up --nodes 3 --rate 1gbit [--rate-of n2=100mbit] [--name jb] [--sshd]
    python3 tests/cluster.py status
    python3 tests/cluster.py down [NAME]

``up`` prints each node's name, address and how to run a command in it, and keeps what ``down``
needs in ``/run/jabas-emulated-cluster/NAME.json`` (mode 0600). ``--sshd`` starts an sshd on port 22
of every node that accepts the keys of ``--authorized-keys`` (default ``~/.ssh/authorized_keys``).
``down`` ends every process in the nodes' namespaces (SIGTERM, then SIGKILL) and deletes the
namespaces, veths and bridge. A rate is a number and a unit of bits per second: ``bit``, ``kbit``,
``mbit``, ``gbit`` or ``tbit`` (decimal, as tc reads them), or ``none`` for an unshaped link.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

if TYPE_CHECKING:
    from tests.sshd import SshServer

NETNS_DIR = Path("/var/run/netns")
STATE_DIR = Path("/run/jabas-emulated-cluster")
NET = "198.18"
HOST_OCTET = 1
FIRST_NODE_OCTET = 11
MAX_NODES = 200
TOOLS = ("ip", "tc", "nsenter")
TERM_GRACE_S = 3.0
KILL_WAIT_S = 5.0
LINK_GONE_S = 30.0
"""How long a deleted interface may stay listed before teardown calls it left. The kernel removes a deleted
namespace's veth pairs, and the bridge they held, in a work queue of its own: under load that took over 5 s
(a full suite run saw jbp0-0, jbp0-1 and jbbr0 still listed after 5 s)."""

_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,31}")
_PREFIX = re.compile(r"[A-Za-z][A-Za-z_-]{0,11}")  # no digit, so PREFIX+K names one K only
_RATE = re.compile(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)", re.IGNORECASE)
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_TCP_LISTEN = "0A"


class ClusterError(RuntimeError):
    """A command that sets up or tears down the emulated cluster failed; the message says which and why."""


# --- rates and tbf ---------------------------------------------------------------------------------------------


def rate_bits(rate: str) -> int:
    """Bits per second of a tc-style rate (``100mbit``: 100_000_000); ValueError for anything else."""
    match = _RATE.fullmatch(rate.strip())
    if match is None:
        raise ValueError(f"rate {rate!r} is not a number followed by bit, kbit, mbit, gbit or tbit")
    bits = int(float(match.group(1)) * _RATE_UNITS[match.group(2).lower()])
    if bits < 8000:
        raise ValueError(f"rate {rate!r} is below 8kbit, too slow to carry a TCP handshake in time")
    return bits


def tbf_options(rate: str) -> list[str]:
    """tc's ``tbf`` options for ``rate``: a bucket of 4 ms of it (at least 16 KiB), a queue of 500 ms (at least 4 MiB).

    The bucket lets a burst of a few full-size segments through at once, as a real NIC would; the
    queue is deep enough that TCP at the rate (BBR or CUBIC, two senders into one receiver: measured)
    fills no more of it than it holds, so nothing is dropped, as a switch with deep buffers would
    drop nothing. The price is queueing delay under load: up to 500 ms, more below 67 Mbit/s where the
    4 MiB floor holds (1.7 s at 20mbit).
    """
    bits = rate_bits(rate)
    per_second = bits // 8
    burst = max(per_second // 250, 16 * 1024)
    limit = max(per_second // 2, 4 * 1024 * 1024)
    return ["rate", f"{bits}bit", "burst", str(burst), "limit", str(limit)]


# --- small wrappers around ip, tc and /proc ---------------------------------------------------------------------


def _command(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    if check and result.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result


def _ns_id(path: Path | str) -> tuple[int, int] | None:
    """(device, inode) of a network namespace file, or None when it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def pids_in_netns(ns: tuple[int, int]) -> list[int]:
    """Every live process whose network namespace is ``ns`` (a zombie has none, so it is not listed)."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and _ns_id(f"/proc/{entry.name}/ns/net") == ns:
            pids.append(int(entry.name))
    return sorted(pids)


def _argv(pid: int) -> list[str]:
    """The command line of ``pid`` (empty if it is gone, or for a moment while it execs)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return raw.decode(errors="replace").split("\0")[:-1] if raw else []


def _signal(pids: Sequence[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _address(hex_address: str, family: socket.AddressFamily) -> tuple[str, int]:
    """(ip, port) of a ``/proc/net/tcp`` address: each 32-bit word of the ip is printed in host byte order."""
    hex_ip, hex_port = hex_address.split(":")
    words = [int(hex_ip[i : i + 8], 16) for i in range(0, len(hex_ip), 8)]
    packed = b"".join(word.to_bytes(4, sys.byteorder) for word in words)
    return socket.inet_ntop(family, packed), int(hex_port, 16)


def _listening(table: str, family: socket.AddressFamily) -> dict[int, tuple[str, int]]:
    """Socket inode -> (ip, port) of each listening socket in the text of ``/proc/net/tcp`` or ``tcp6``."""
    found = {}
    for line in table.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 9 and fields[3] == _TCP_LISTEN:
            found[int(fields[9])] = _address(fields[1], family)
    return found


def _socket_owners(pids: Sequence[int]) -> dict[int, list[int]]:
    """Socket inode -> the pids (of ``pids``) holding a descriptor of it."""
    owners: dict[int, list[int]] = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.scandir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(fd.path)
                    if target.startswith("socket:["):
                        owners.setdefault(int(target[8:-1]), []).append(pid)
    return {inode: sorted(set(holders)) for inode, holders in owners.items()}


# --- availability ----------------------------------------------------------------------------------------------

_unavailable: list[str | None] = []  # the cached answer of netns_unavailable_reason, once known


def netns_unavailable_reason() -> str | None:
    """Why emulated nodes cannot be made here, in one line, or None. The probe (a namespace with a veth
    and a tbf qdisc, removed at once) runs once per process and its answer is kept."""
    if not _unavailable:
        _unavailable.append(_probe())
    return _unavailable[0]


def _probe() -> str | None:
    if os.geteuid() != 0:
        return "emulated nodes need root (network namespaces, veths, a bridge and tc)"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"emulated nodes need {', '.join(missing)} (iproute2, util-linux), not found on PATH"
    name = f"jbprobe{os.getpid()}"
    steps = [
        ["ip", "netns", "add", name],
        ["ip", "-n", name, "link", "add", "jbprobea", "type", "veth", "peer", "name", "jbprobeb"],
        ["tc", "-n", name, "qdisc", "add", "dev", "jbprobea", "root", "tbf", *tbf_options("1mbit")],
    ]
    try:
        for argv in steps:
            result = _command(argv, check=False)
            if result.returncode != 0:
                return f"emulated nodes unavailable: `{' '.join(argv)}` failed: {result.stderr.strip()}"
    finally:
        _command(["ip", "netns", "del", name], check=False)
    return None


def require_netns() -> None:
    """Skip the calling test, with the reason, where emulated nodes cannot be made."""
    reason = netns_unavailable_reason()
    if reason is not None:
        import pytest

        pytest.skip(reason)


# --- the cluster -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeSpec:
    """A node to emulate: its name (letters, digits, ``_.-``) and its link's rate (None: unshaped)."""

    name: str
    rate: str | None = "1gbit"

    def __post_init__(self) -> None:
        if not _NODE_NAME.fullmatch(self.name):
            raise ValueError(f"node name {self.name!r}: 1-32 letters, digits, '_', '.' or '-', not starting with one")
        if self.rate is not None:
            rate_bits(self.rate)


@dataclass
class Node:
    """One emulated node: ``netns`` is its namespace's name, ``veth`` its interface (inside the namespace),
    ``peer`` that interface's other end on the bridge, ``rate`` its link's current rate."""

    name: str
    index: int
    address: str
    netns: str
    veth: str
    peer: str
    rate: str | None

    @property
    def netns_path(self) -> str:
        return str(NETNS_DIR / self.netns)

    def nsenter(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run in this node's network namespace (and nothing else of the host changed)."""
        if isinstance(argv, str):
            raise TypeError("argv must be a list of arguments, not a string (no shell is involved)")
        return ["nsenter", f"--net={self.netns_path}", "--", *argv]


def _runs_jabas(argv: Sequence[str]) -> bool:
    """Whether a command line runs jabas: it names the ``jabascli`` package anywhere (``python -m jabascli``,
    ``python -c "from jabascli... import main"``, a trainer module), or its program (or the script a python
    runs) is a ``jabas`` command. A path that merely contains "jabas" (an sshd whose config folder is
    ``/run/jabas-emulated-cluster/...``) does not count."""
    return any("jabascli" in arg for arg in argv) or any(Path(arg).name == "jabas" for arg in argv[:2])


class ListeningSocket(NamedTuple):
    """A TCP socket listening in a node: the pid holding it (None if no process of the node does), ip and port."""

    pid: int | None
    ip: str
    port: int


class EmulatedCluster:
    """N emulated nodes on one bridge (see the module's docstring); a context manager for up() and down()."""

    def __init__(self, nodes: Sequence[NodeSpec], name_prefix: str | None = None) -> None:
        if not 1 <= len(nodes) <= MAX_NODES:
            raise ValueError(f"an emulated cluster has 1 to {MAX_NODES} nodes, not {len(nodes)}")
        names = [spec.name for spec in nodes]
        if len(set(names)) != len(names):
            raise ValueError(f"node names repeat: {names}")
        prefix = name_prefix or "jb"
        if not _PREFIX.fullmatch(prefix):
            raise ValueError(f"name prefix {prefix!r}: 1-12 letters, '_' or '-', starting with a letter")
        self.specs = list(nodes)
        self.prefix = prefix
        self.k: int | None = None  # the third octet of 198.18.K.0/24, once the bridge jbbrK is ours
        self.nodes: list[Node] = []
        self.ns_ids: dict[str, tuple[int, int]] = {}  # node name -> its namespace's (device, inode)
        self.recorded_pids: dict[str, list[int]] = {}  # node name -> pids started there (from a state file)
        self._processes: list[subprocess.Popen[Any]] = []
        self._sshd: list[SshServer] = []
        self._temporary: list[Path] = []
        self._torn_down = False  # down() found nothing left: K may be another cluster's now

    # names and addresses

    @property
    def name(self) -> str:
        if self.k is None:
            raise ClusterError("the cluster has no name before up()")
        return f"{self.prefix}{self.k}"

    @property
    def bridge(self) -> str:
        return f"jbbr{self.k}"

    @property
    def host_address(self) -> str:
        """The bridge's address: how the nodes reach this host."""
        return f"{NET}.{self.k}.{HOST_OCTET}"

    @property
    def subnet(self) -> str:
        return f"{NET}.{self.k}.0/24"

    def node(self, name: str) -> Node:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(f"no node {name!r} in {[n.name for n in self.nodes]}")

    def _resolve(self, node: Node | str) -> Node:
        return self.node(node) if isinstance(node, str) else node

    # up and down

    def __enter__(self) -> EmulatedCluster:
        return self.up()

    def __exit__(self, *_: object) -> None:
        self.down()

    def up(self) -> EmulatedCluster:
        """Make the bridge, then each node's namespace, veth pair, addresses and tbf qdiscs; on any
        failure, tear down what was made and raise."""
        if self.k is not None:
            raise ClusterError(f"cluster {self.name} was brought up already (an EmulatedCluster is brought up once)")
        self._torn_down = False
        try:
            self._claim_subnet()
            _command(["ip", "addr", "add", f"{self.host_address}/24", "dev", self.bridge])
            _command(["ip", "link", "set", self.bridge, "up"])
            for node in self.nodes:
                self._add_node(node)
        except BaseException:
            self.down()
            raise
        return self

    def _claim_subnet(self) -> None:
        """Take the first K whose bridge name is free (creating it is the atomic claim), whose subnet no
        address of this host uses, and whose namespace names no namespace has; then name the nodes."""
        used = _command(["ip", "-o", "-4", "addr", "show"]).stdout
        for k in range(256):
            if f" {NET}.{k}." in used or any((NETNS_DIR / f"{self.prefix}{k}-{s.name}").exists() for s in self.specs):
                continue
            result = _command(["ip", "link", "add", f"jbbr{k}", "type", "bridge"], check=False)
            if result.returncode == 0:
                self.k = k
                self.nodes = [self._node(i, spec) for i, spec in enumerate(self.specs)]
                return
            if "exists" not in result.stderr:
                raise ClusterError(f"`ip link add jbbr{k} type bridge` failed: {result.stderr.strip()}")
        raise ClusterError(f"no free subnet {NET}.K.0/24 (K = 0..255) for an emulated cluster")

    def _node(self, i: int, spec: NodeSpec) -> Node:
        return Node(
            name=spec.name,
            index=i,
            address=f"{NET}.{self.k}.{FIRST_NODE_OCTET + i}",
            netns=f"{self.name}-{spec.name}",
            veth=f"jbv{self.k}-{i}",
            peer=f"jbp{self.k}-{i}",
            rate=spec.rate,
        )

    def _add_node(self, node: Node) -> None:
        _command(["ip", "netns", "add", node.netns])
        ns_id = _ns_id(node.netns_path)
        assert ns_id is not None
        self.ns_ids[node.name] = ns_id
        _command(["ip", "link", "add", node.peer, "type", "veth", "peer", "name", node.veth, "netns", node.netns])
        _command(["ip", "link", "set", node.peer, "master", self.bridge, "up"])
        _command(["ip", "-n", node.netns, "link", "set", "lo", "up"])
        _command(["ip", "-n", node.netns, "addr", "add", f"{node.address}/24", "dev", node.veth])
        _command(["ip", "-n", node.netns, "link", "set", node.veth, "up"])
        self._shape(node, node.rate)

    def down(self) -> None:
        """Stop the sshds, end every process in the nodes (SIGTERM, then SIGKILL), delete the veths, the
        namespaces and the bridge. Safe after a failed up() and when called again; raises ClusterError,
        after doing all it can, if something of the cluster is still there."""
        if self._torn_down:
            return
        for server in self._sshd:
            with contextlib.suppress(Exception):
                server.stop()
        self._sshd.clear()
        survivors = {node.name: self._end_processes(node) for node in self.nodes}
        for process in self._processes:  # all ended above, unless one never entered its namespace
            if process.poll() is None:
                process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=KILL_WAIT_S)
        self._processes.clear()
        for node in self.nodes:
            _command(["ip", "link", "del", node.peer], check=False)
            _command(["ip", "netns", "del", node.netns], check=False)
        if self.k is not None:
            _command(["ip", "link", "del", self.bridge], check=False)
        for folder in self._temporary:
            shutil.rmtree(folder, ignore_errors=True)
        self._temporary.clear()
        self._check_gone(survivors)
        self._torn_down = True

    def _check_gone(self, survivors: dict[str, list[int]]) -> None:
        left = [f"processes {pids} in {name}" for name, pids in survivors.items() if pids]
        left += [f"namespace {n.netns}" for n in self.nodes if Path(n.netns_path).exists()]
        links = [n.peer for n in self.nodes] + ([self.bridge] if self.k is not None else [])
        # A deleted interface can stay listed a moment on a busy host (the kernel frees it after `ip` returns).
        deadline = time.monotonic() + LINK_GONE_S
        while any(Path("/sys/class/net", link).exists() for link in links) and time.monotonic() < deadline:
            time.sleep(0.1)
        left += [f"interface {link}" for link in links if Path("/sys/class/net", link).exists()]
        if left:
            raise ClusterError(f"emulated cluster not fully torn down: {'; '.join(left)} left")

    def _end_processes(self, node: Node) -> list[int]:
        """SIGTERM (and SIGCONT, for a frozen one) every process in ``node``, SIGKILL those left after
        TERM_GRACE_S; returns those still there after that."""
        pids = self.pids_in(node)
        if not pids:
            return []
        _signal(pids, signal.SIGTERM)
        _signal(pids, signal.SIGCONT)
        if not self._wait_empty(node, TERM_GRACE_S):
            _signal(self.pids_in(node), signal.SIGKILL)
            self._wait_empty(node, KILL_WAIT_S)
        return self.pids_in(node)

    def _wait_empty(self, node: Node, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.pids_in(node):
            if time.monotonic() > deadline:
                return False
            for process in self._processes:
                process.poll()  # reap our own children as they exit
            time.sleep(0.02)
        return True

    # shaping

    def _shape(self, node: Node, rate: str | None) -> None:
        """A tbf of ``rate`` on both ends of the node's link (what it sends, what it receives), or none."""
        for tc, dev in ((["tc", "-n", node.netns], node.veth), (["tc"], node.peer)):
            if rate is None:
                _command([*tc, "qdisc", "del", "dev", dev, "root"], check=False)  # no root qdisc: nothing to do
            else:
                _command([*tc, "qdisc", "replace", "dev", dev, "root", "tbf", *tbf_options(rate)])

    def set_rate(self, node: Node | str, rate: str | None) -> None:
        """Shape ``node``'s link to ``rate`` from now on (None: unshaped), both directions."""
        node = self._resolve(node)
        if rate is not None:
            rate_bits(rate)
        self._shape(node, rate)
        node.rate = rate

    def qdisc_stats(self, node: Node | str) -> dict[str, dict[str, Any]]:
        """tc's statistics of the root qdisc of ``node``'s link: ``"out"`` (what it sends, in its namespace)
        and ``"in"`` (what it receives, on the bridge side); each has ``kind``, ``bytes``, ``packets``,
        ``drops``, ``overlimits`` and ``backlog``."""
        node = self._resolve(node)
        stats = {}
        for side, tc, dev in (("out", ["tc", "-n", node.netns], node.veth), ("in", ["tc"], node.peer)):
            qdiscs = json.loads(_command([*tc, "-s", "-j", "qdisc", "show", "dev", dev]).stdout)
            stats[side] = next(q for q in qdiscs if q.get("root"))
        return stats

    # processes

    def popen(self, node: Node | str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` in ``node``'s network namespace (``nsenter --net=... -- argv``); nsenter execs it,
        so the Popen's pid is the program's. Returns once the program runs in the namespace (nsenter has
        entered it and exec'd ``argv``) or has exited, so pids_in, jabas_pids_in, kill_node and freeze see
        it at once. It is ended by down() if still running."""
        node = self._resolve(node)
        if kwargs.get("shell"):
            raise ValueError("no shell: pass an argv list")
        process = subprocess.Popen(node.nsenter(argv), **kwargs)
        self._processes.append(process)
        self._wait_started(process, node, is_nsenter=Path(argv[0]).name == "nsenter")
        return process

    @staticmethod
    def _wait_started(process: subprocess.Popen[Any], node: Node, is_nsenter: bool, timeout_s: float = 10.0) -> None:
        """Wait until ``process`` is in ``node``'s namespace and no longer nsenter: its command line is its own
        (not empty, as it is for a moment during exec, and not nsenter's)."""
        ns = _ns_id(node.netns_path)
        deadline = time.monotonic() + timeout_s
        while process.poll() is None:
            if _ns_id(f"/proc/{process.pid}/ns/net") == ns:
                argv = _argv(process.pid)
                if is_nsenter or (argv and argv[0] != "nsenter"):
                    return
            if time.monotonic() > deadline:
                raise ClusterError(f"pid {process.pid} did not start in {node.netns} within {timeout_s:g} s")
            time.sleep(0.001)

    def run(
        self, node: Node | str, argv: Sequence[str], *, timeout: float | None = 60, check: bool = False, **kwargs: Any
    ) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` in ``node``'s network namespace to its end; output is captured as text unless told otherwise."""
        node = self._resolve(node)
        if kwargs.get("shell"):
            raise ValueError("no shell: pass an argv list")
        if "stdout" not in kwargs and "stderr" not in kwargs:
            kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(node.nsenter(argv), timeout=timeout, check=check, **kwargs)

    def pids_in(self, node: Node | str) -> list[int]:
        """Every live process in ``node``'s network namespace, found by its namespace's inode. Where the
        namespace's name is gone but it lives on, the recorded pids (of a state file) still in it."""
        node = self._resolve(node)
        ns = _ns_id(node.netns_path)
        if ns is not None:
            return pids_in_netns(ns)
        recorded = self.ns_ids.get(node.name)
        if recorded is None:
            return []
        return [pid for pid in self.recorded_pids.get(node.name, []) if _ns_id(f"/proc/{pid}/ns/net") == recorded]

    def jabas_pids_in(self, node: Node | str) -> list[int]:
        """The processes in ``node`` that run jabas (see _runs_jabas: ``python -m jabascli...``, a ``jabas``
        command; not an sshd whose config folder happens to be named after jabas)."""
        return [pid for pid in self.pids_in(node) if _runs_jabas(_argv(pid))]

    def jabas_left(self, timeout: float = 30.0) -> dict[str, list[str]]:
        """The jabas processes still in a node after up to ``timeout`` s (``"PID ARGV"`` by node; none: {})."""
        deadline = time.monotonic() + timeout
        while True:
            left = {node.name: self.jabas_pids_in(node) for node in self.nodes}
            if not any(left.values()) or time.monotonic() > deadline:
                return {name: [f"{pid} {' '.join(_argv(pid))}" for pid in pids] for name, pids in left.items() if pids}
            time.sleep(0.2)

    def listening_sockets(self, node: Node | str) -> list[ListeningSocket]:
        """The TCP sockets listening in ``node``'s namespace (IPv4 and IPv6), with the pids holding them.

        The tables are read by ``cat /proc/net/tcp`` run in the namespace; owners are matched through
        the socket inodes in ``/proc/PID/fd`` of the namespace's processes."""
        node = self._resolve(node)
        tables: dict[int, tuple[str, int]] = {}
        for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
            result = self.run(node, ["cat", f"/proc/net/{name}"])
            if result.returncode == 0:
                tables.update(_listening(result.stdout, family))
        owners = _socket_owners(self.pids_in(node))
        found = [
            ListeningSocket(pid, ip, port) for inode, (ip, port) in tables.items() for pid in owners.get(inode, [None])
        ]
        return sorted(found, key=lambda s: (s.port, s.ip, s.pid or 0))

    # faults

    def link_down(self, node: Node | str) -> None:
        """Cut ``node``'s cable: its bridge-side veth goes down, so its own veth loses carrier; both directions drop."""
        _command(["ip", "link", "set", self._resolve(node).peer, "down"])

    def link_up(self, node: Node | str) -> None:
        """Plug ``node``'s cable back in (its tbf qdiscs, rate included, are as they were)."""
        _command(["ip", "link", "set", self._resolve(node).peer, "up"])

    def kill_node(self, node: Node | str) -> list[int]:
        """SIGKILL every process in ``node``, as a power cut would; returns their pids."""
        pids = self.pids_in(node)
        _signal(pids, signal.SIGKILL)
        return pids

    def freeze(self, node: Node | str) -> list[int]:
        """SIGSTOP every process in ``node`` (a hung machine: connections stay open, nothing answers)."""
        pids = self.pids_in(node)
        _signal(pids, signal.SIGSTOP)
        return pids

    def thaw(self, node: Node | str) -> list[int]:
        """SIGCONT every process in ``node``."""
        pids = self.pids_in(node)
        _signal(pids, signal.SIGCONT)
        return pids

    # sshd

    def start_sshd(
        self, node: Node | str, authorized_keys: Path, *, root: Path | None = None, port: int = 22, skip: bool = True
    ) -> SshServer:
        """An sshd in ``node`` on ``node.address:port`` accepting ``authorized_keys``, its files in ``root``
        (default: a temporary folder removed by down()); stopped by down(). Where sshd cannot start,
        the calling test is skipped (``skip=False``: SshdUnavailable is raised)."""
        node = self._resolve(node)
        if root is None:
            root = Path(tempfile.mkdtemp(prefix=f"jbsshd-{node.netns}-"))
            self._temporary.append(root)
        server = _ssh_server_class()(node.name, root, authorized_keys, node.address, node.netns_path)
        self._sshd.append(server)
        return server.start(port, skip=skip)

    # a state file, for the command line

    def start_sshds(self, folder: Path, nodes: Sequence[Node | str] | None = None) -> tuple[Path, Path]:
        """An sshd on port 22 of every node (or of ``nodes``) that lets in a new key; its files in ``folder``:
        (the private key, a known_hosts file naming each node's host key)."""
        key = folder / "id_ed25519"
        (folder / "authorized_keys").write_text(_write_key(key) + "\n")
        servers = [self.start_sshd(node, folder / "authorized_keys") for node in (nodes or self.nodes)]
        known_hosts = folder / "known_hosts"
        known_hosts.write_text("".join(s.known_hosts_line() for s in servers))
        return key, known_hosts

    def state(self) -> dict[str, Any]:
        """What ``down`` needs to tear this cluster down from another process (JSON-able)."""
        return {
            "name": self.name,
            "prefix": self.prefix,
            "k": self.k,
            "bridge": self.bridge,
            "host_address": self.host_address,
            "nodes": [
                {
                    "name": n.name,
                    "rate": n.rate,
                    "address": n.address,
                    "netns": n.netns,
                    "veth": n.veth,
                    "peer": n.peer,
                    "ns_id": list(self.ns_ids.get(n.name, ())),
                    "pids": self.pids_in(n),
                }
                for n in self.nodes
            ],
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> EmulatedCluster:
        """The cluster a state file describes, as up() left it, ready for down() or status."""
        cluster = cls([NodeSpec(n["name"], n["rate"]) for n in state["nodes"]], name_prefix=state["prefix"])
        cluster.k = int(state["k"])
        cluster.nodes = [cluster._node(i, spec) for i, spec in enumerate(cluster.specs)]
        for entry in state["nodes"]:
            if len(entry.get("ns_id", ())) == 2:
                cluster.ns_ids[entry["name"]] = (int(entry["ns_id"][0]), int(entry["ns_id"][1]))
            cluster.recorded_pids[entry["name"]] = [int(pid) for pid in entry.get("pids", [])]
        return cluster


def _ssh_server_class() -> type[SshServer]:
    """tests/sshd.py's SshServer, imported only when an sshd is wanted (as a package module or a script)."""
    if __package__:
        from .sshd import SshServer
    else:  # run as a script: tests/ is sys.path[0]
        from sshd import SshServer  # type: ignore[no-redef]
    return SshServer


def _write_key(path: Path) -> str:
    """tests/sshd.py's write_key (imported as :func:`_ssh_server_class` imports the server)."""
    if __package__:
        from .sshd import write_key
    else:
        from sshd import write_key  # type: ignore[no-redef]
    return write_key(path)


# --- the pytest fixture ----------------------------------------------------------------------------------------


def _cluster_factory() -> Iterator[Callable[..., EmulatedCluster]]:
    """Fixture ``cluster_factory``: ``cluster_factory(nodes=2, rate="1gbit")`` (nodes: a count, named n0, n1, ...,
    or NodeSpecs) brings a cluster up and returns it; every cluster made is torn down after the test.
    Skips where emulated nodes cannot be made (see require_netns)."""
    require_netns()
    made: list[EmulatedCluster] = []

    def make(nodes: int | Sequence[NodeSpec] = 2, rate: str | None = "1gbit") -> EmulatedCluster:
        specs = [NodeSpec(f"n{i}", rate) for i in range(nodes)] if isinstance(nodes, int) else list(nodes)
        cluster = EmulatedCluster(specs)
        made.append(cluster)
        return cluster.up()

    try:
        yield make
    finally:
        errors = []
        for cluster in reversed(made):
            try:
                cluster.down()
            except ClusterError as error:
                errors.append(str(error))
        if errors:
            raise ClusterError("; ".join(errors))


def __getattr__(name: str) -> Any:
    """``from tests.cluster import cluster_factory`` gives the pytest fixture; pytest is imported only then,
    so this module needs nothing but the standard library when run as a script."""
    if name == "cluster_factory":
        import pytest

        fixture = pytest.fixture(_cluster_factory, name="cluster_factory")
        globals()[name] = fixture
        return fixture
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- the command line ------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


class _BadInput(Exception):
    """Bad input on the command line: one line, exit code 2."""


def _parse_rate(text: str) -> str | None:
    if text.lower() == "none":
        return None
    try:
        rate_bits(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _specs(count: int, rate: str | None, rate_of: Sequence[str]) -> list[NodeSpec]:
    rates: dict[str, str | None] = {f"n{i}": rate for i in range(count)}
    for item in rate_of:
        name, sep, value = item.partition("=")
        if not sep or name not in rates:
            raise _BadInput(f"--rate-of {item!r}: expected NODE=RATE with NODE one of n0..n{count - 1}")
        try:
            rates[name] = _parse_rate(value)
        except argparse.ArgumentTypeError as error:
            raise _BadInput(f"--rate-of {item!r}: {error}") from None
    return [NodeSpec(name, node_rate) for name, node_rate in rates.items()]


def _state_path(name: str) -> Path:
    return STATE_DIR / f"{name}.json"


def _write_state(cluster: EmulatedCluster) -> Path:
    STATE_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = _state_path(cluster.name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(cluster.state(), f, indent=2)
    return path


def _cmd_up(args: argparse.Namespace) -> int:
    if args.nodes < 1 or args.nodes > MAX_NODES:
        raise _BadInput(f"--nodes {args.nodes}: 1 to {MAX_NODES}")
    specs = _specs(args.nodes, args.rate, args.rate_of)
    if args.name is not None and not _PREFIX.fullmatch(args.name):
        raise _BadInput(f"--name {args.name!r}: 1-12 letters, '_' or '-', starting with a letter (K is appended)")
    keys = Path(args.authorized_keys).expanduser()
    if args.sshd and not keys.is_file():
        raise _BadInput(f"--sshd: no authorized keys file {keys} (give one with --authorized-keys)")
    reason = netns_unavailable_reason()
    if reason is not None:
        raise ClusterError(reason)
    cluster = EmulatedCluster(specs, name_prefix=args.name)
    try:
        cluster.up()
        known_hosts = _start_sshds(cluster, keys) if args.sshd else None
        state = _write_state(cluster)
    except BaseException:
        if cluster.k is not None:
            shutil.rmtree(STATE_DIR / cluster.name, ignore_errors=True)
        cluster.down()
        raise
    _print_up(cluster, state, known_hosts)
    return 0


def _start_sshds(cluster: EmulatedCluster, authorized_keys: Path) -> Path:
    """An sshd on port 22 of every node, files in STATE_DIR/NAME/; returns the known_hosts file naming them all."""
    folder = STATE_DIR / cluster.name
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    lines = []
    for node in cluster.nodes:
        server = cluster.start_sshd(node, authorized_keys, root=folder / f"sshd-{node.name}", skip=False)
        lines.append(server.known_hosts_line())
    known_hosts = folder / "known_hosts"
    known_hosts.write_text("".join(lines))
    return known_hosts


def _print_up(cluster: EmulatedCluster, state: Path, known_hosts: Path | None) -> None:
    print(f"emulated cluster {cluster.name}: bridge {cluster.bridge}, this host {cluster.host_address}/24")
    for node in cluster.nodes:
        rate = node.rate or "unshaped"
        print(f"  {node.name:<8} {node.address:<15} {rate:<9} nsenter --net={node.netns_path} -- CMD")
        if known_hosts is not None:
            print(f"  {'':<8} ssh -o UserKnownHostsFile={known_hosts} root@{node.address}")
    print(f"state: {state}")
    print(f"tear down: python3 {Path(__file__).resolve()} down {cluster.name}")


def _state_names() -> list[str]:
    return sorted(p.stem for p in STATE_DIR.glob("*.json")) if STATE_DIR.is_dir() else []


def _load_state(name: str) -> EmulatedCluster:
    path = _state_path(name)
    if not path.is_file():
        raise _BadInput(f"no emulated cluster {name!r} ({path} not found; `status` lists them)")
    return EmulatedCluster.from_state(json.loads(path.read_text()))


def _cmd_down(args: argparse.Namespace) -> int:
    names = _state_names()
    if args.name is None and len(names) != 1:
        raise _BadInput(f"name the cluster to tear down: {', '.join(names)}" if names else "no emulated cluster is up")
    name = args.name or names[0]
    cluster = _load_state(name)
    cluster.down()
    shutil.rmtree(STATE_DIR / name, ignore_errors=True)
    _state_path(name).unlink(missing_ok=True)
    print(f"emulated cluster {name} torn down")
    return 0


def _cmd_status(_: argparse.Namespace) -> int:
    names = _state_names()
    if not names:
        print("no emulated cluster is up")
    for name in names:
        cluster = _load_state(name)
        bridge = "up" if Path("/sys/class/net", cluster.bridge).exists() else "MISSING"
        print(f"{name}: bridge {cluster.bridge} {bridge}, this host {cluster.host_address}")
        for node in cluster.nodes:
            here = "namespace present" if Path(node.netns_path).exists() else "namespace MISSING"
            processes = len(cluster.pids_in(node))
            print(f"  {node.name:<8} {node.address:<15} {node.rate or 'unshaped':<9} {here}, {processes} processes")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tests/cluster.py", description="An emulated cluster: nodes as network namespaces.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    up = commands.add_parser("up", help="make a cluster and print its nodes")
    up.add_argument("--nodes", type=int, default=2, help="how many nodes (n0, n1, ...; default 2)")
    up.add_argument("--rate", type=_parse_rate, default="1gbit", help="every node's rate (default 1gbit; none)")
    up.add_argument("--rate-of", action="append", default=[], metavar="NODE=RATE", help="one node's rate")
    up.add_argument("--name", help="name prefix (default jb; the subnet's K is appended)")
    up.add_argument("--sshd", action="store_true", help="start an sshd on port 22 of every node")
    up.add_argument("--authorized-keys", default="~/.ssh/authorized_keys", help="keys the sshds accept")
    down = commands.add_parser("down", help="tear a cluster down (the only one, if no name is given)")
    down.add_argument("name", nargs="?")
    commands.add_parser("status", help="list the clusters that are up")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    command = {"up": _cmd_up, "down": _cmd_down, "status": _cmd_status}[args.command]
    try:
        return command(args)
    except _BadInput as error:
        print(f"tests/cluster.py: error: {error}", file=sys.stderr)
        return 2
    except (ClusterError, OSError, RuntimeError) as error:
        print(f"tests/cluster.py: {error}".replace("\n", " "), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
