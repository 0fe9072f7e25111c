"""Throw-away OpenSSH servers on loopback ports, standing for the servers of a cluster.

Each :class:`SshServer` is Debian's ``/usr/sbin/sshd`` with its own port, host
key, config and log in a folder of its own, accepting one throw-away user key
for the user running the tests. ``make test`` installs ``openssh-server`` when
it is missing and the tests run as root (as on CI); elsewhere, where sshd is
missing or cannot start, :func:`require_sshd` and :meth:`SshServer.start` skip
the calling test with the reason.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from jabascli.net import free_port

SSHD = Path("/usr/sbin/sshd")
PRIVSEP_DIR = Path("/run/sshd")
START_TIMEOUT_S = 10.0


def require_sshd() -> None:
    if not SSHD.is_file():
        pytest.skip(f"{SSHD} not found: install openssh-server (`make test` does so when run as root)")
    if os.geteuid() == 0:
        # sshd refuses to start without its privilege separation folder, which a fresh machine may lack.
        PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)


def write_key(path: Path) -> str:
    """A new ed25519 private key at ``path`` (mode 0600), ``path.pub`` beside it; returns the public line."""
    key = Ed25519PrivateKey.generate()
    path.write_bytes(key.private_bytes(Encoding.PEM, PrivateFormat.OpenSSH, NoEncryption()))
    path.chmod(0o600)
    public = key.public_key().public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH).decode()
    path.with_name(path.name + ".pub").write_text(public + "\n")
    return public


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (sshd's per-connection children start sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (entry / "stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class SshServer:
    """One sshd on 127.0.0.1, with its own folder (``root``) for host key, config, log and data."""

    def __init__(self, name: str, root: Path, authorized_keys: Path) -> None:
        self.name = name
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.authorized_keys = authorized_keys
        self.host_public_key = write_key(root / "ssh_host_ed25519_key")
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> Path:
        return self.root / "sshd.log"

    def known_hosts_line(self) -> str:
        return f"[127.0.0.1]:{self.port} {self.host_public_key}\n"

    def start(self, port: int | None = None) -> SshServer:
        """Start on ``port`` (default: a free one; retried if another process takes it first)."""
        require_sshd()
        for _ in range(5):
            self.port = port or free_port()
            config = self.root / "sshd_config"
            config.write_text(
                f"Port {self.port}\n"
                "ListenAddress 127.0.0.1\n"
                f"HostKey {self.root / 'ssh_host_ed25519_key'}\n"
                f"PidFile {self.root / 'sshd.pid'}\n"
                f"AuthorizedKeysFile {self.authorized_keys}\n"
                "PubkeyAuthentication yes\n"
                "PasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\n"
                "PermitRootLogin prohibit-password\n"
                "StrictModes no\n"
                "UsePAM no\n"
                "UseDNS no\n"
                "Subsystem sftp internal-sftp\n"
            )
            with open(self.log, "ab") as log:
                self.process = subprocess.Popen(
                    [str(SSHD), "-D", "-e", "-f", str(config)], stdout=log, stderr=log, start_new_session=True
                )
            if self._wait_ready():
                return self
            assert self.process is not None
            code = self.process.poll()
            self.stop()
            if port is not None or "Address already in use" not in self.log.read_text(errors="replace"):
                break
        how = f"it exited with code {code}" if code is not None else f"it did not answer within {START_TIMEOUT_S:g} s"
        tail = " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-5:])
        pytest.skip(f"sshd could not be started on this machine: {how}{': ' + tail if tail else ''}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    if s.recv(4).startswith(b"SSH-"):
                        return True
            except OSError:
                time.sleep(0.05)
        return False

    def kill(self) -> None:
        """Stop the server and every session it is serving at once, as a crash or power cut would."""
        if self.process is None:
            return
        for pid in [*_descendants(self.process.pid), self.process.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait(timeout=10)
        self.process = None

    def freeze(self) -> None:
        """Stop the sessions it is serving without closing them, like a hung machine or a lost network."""
        assert self.process is not None
        for pid in _descendants(self.process.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.process is not None:
            for pid in _descendants(self.process.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.process is None:
            return
        sessions = _descendants(self.process.pid)
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)
        for pid in sessions:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        self.process = None
