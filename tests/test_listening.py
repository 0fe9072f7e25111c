"""On one machine nothing of a job listens beyond loopback: no trainer, store, gloo socket or scheduler.

Reads what the job's processes (the launcher and all its descendants, found by
parent pid) have open from /proc, so that other programs on this machine do
not count; Linux only.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.engine_support import write_job

pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads sockets from Linux's /proc")


def _descendants(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, parent in parents.items() if parent in frontier]
        tree += frontier
    return tree


def _listening(pids: list[int]) -> set[tuple[str, int, int]]:
    """(address, port, pid) of every TCP socket in LISTEN state that one of ``pids`` holds.

    A process or descriptor that goes away meanwhile is passed over (OSError).
    """
    inodes: dict[str, int] = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes[target[8:-1]] = pid
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                hex_address, hex_port = local.split(":")
                raw = bytes.fromhex(hex_address)
                # /proc prints each 32-bit word in host (little-endian) order
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.add((str(ipaddress.ip_address(words)), int(hex_port, 16), inodes[inode]))
    return found


def _sockets_while_training(config: Path, *flags: str, wait_for: int) -> set[tuple[str, int, int]]:
    """Start ``jabas run``, and once at least ``wait_for`` sockets listen, every listening socket of the job."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "jabascli", "run", "-c", str(config), *flags],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline, seen = time.monotonic() + 120, set()
        while time.monotonic() < deadline and proc.poll() is None:
            seen |= _listening(_descendants(proc.pid))
            if len(seen) >= wait_for:
                time.sleep(1.0)  # and whatever opens a little later
                return seen | _listening(_descendants(proc.pid))
            time.sleep(0.2)
        raise AssertionError(f"saw {sorted(seen)} only; jabas run: {proc.poll()} {proc.stderr}")
    finally:
        for pid in reversed(_descendants(proc.pid)):
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
        proc.wait(30)


def _loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def test_a_local_run_listens_on_loopback_only(tmp_path: Path) -> None:
    config = write_job(tmp_path, [(1, 0), (1, 0)], options={"samples": 400, "sleep": 0.2}, epochs=50)
    # rank 0's store, and each rank's gloo listener: nothing may be on 0.0.0.0, :: or another interface
    sockets = _sockets_while_training(config, wait_for=3)
    assert sockets and all(_loopback(address) for address, _, _ in sockets), sorted(sockets)


@pytest.mark.slow
def test_an_elastic_run_listens_on_loopback_only(tmp_path: Path) -> None:
    config = write_job(tmp_path, [(1, 0), (1, 0)], options={"samples": 400, "sleep": 0.2}, epochs=50)
    # the scheduler's API, the trainers' store and gloo listeners
    sockets = _sockets_while_training(config, "--elastic", wait_for=4)
    assert sockets and all(_loopback(address) for address, _, _ in sockets), sorted(sockets)
