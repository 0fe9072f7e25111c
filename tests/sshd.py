"""Throw-away OpenSSH servers standing for the servers of a cluster: on loopback ports, or inside emulated nodes.

Each :class:`SshServer` is Debian's ``/usr/sbin/sshd`` with its own port, host
key, config and log in a folder of its own, accepting one throw-away user key
for the user running the tests. By default it listens on a free port of
127.0.0.1 (the sync tests); given ``netns_path``, it runs inside that network
namespace (a node of ``tests/cluster.py``) through ``nsenter --net=PATH``,
listening on the node's address, port 22 unless told otherwise.

``make test`` installs ``openssh-server`` when it is missing and the tests run
as root (as on CI); elsewhere, where sshd is missing or cannot start,
:func:`require_sshd` and :meth:`SshServer.start` skip the calling test with the
reason (``start(skip=False)`` raises :class:`SshdUnavailable` instead, for
``tests/cluster.py`` run as a script).

Only the standard library is imported at import time, so ``tests/cluster.py``
can use this module outside pytest and the project's virtualenv: pytest is
imported where a test is skipped, ``cryptography`` where a key is written (and
``ssh-keygen`` writes it where ``cryptography`` is missing).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import NoReturn

SSHD = Path("/usr/sbin/sshd")
SSH_KEYGEN = Path("/usr/bin/ssh-keygen")
PRIVSEP_DIR = Path("/run/sshd")
START_TIMEOUT_S = 10.0
SSH_PORT = 22


class SshdUnavailable(RuntimeError):
    """sshd is missing on this machine or could not be started; the message says which and why."""


def sshd_unavailable_reason() -> str | None:
    """Why sshd cannot run here (it is not installed), or None; creates sshd's privsep folder as root."""
    if not SSHD.is_file():
        return f"{SSHD} not found: install openssh-server (`make test` does so when run as root)"
    if os.geteuid() == 0:
        # sshd refuses to start without its privilege separation folder, which a fresh machine may lack.
        PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
    return None


def _skip(reason: str) -> NoReturn:
    import pytest

    pytest.skip(reason)


def require_sshd() -> None:
    """Skip the calling test when sshd is not installed."""
    reason = sshd_unavailable_reason()
    if reason is not None:
        _skip(reason)


def write_key(path: Path) -> str:
    """A new ed25519 private key at ``path`` (mode 0600), ``path.pub`` beside it; returns the public line."""
    try:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat
    except ImportError:
        return _write_key_with_ssh_keygen(path)
    key = Ed25519PrivateKey.generate()
    path.write_bytes(key.private_bytes(Encoding.PEM, PrivateFormat.OpenSSH, NoEncryption()))
    path.chmod(0o600)
    public = key.public_key().public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH).decode()
    path.with_name(path.name + ".pub").write_text(public + "\n")
    return public


def _write_key_with_ssh_keygen(path: Path) -> str:
    """:func:`write_key` without ``cryptography``; the public line has no comment, as there."""
    path.unlink(missing_ok=True)
    path.with_name(path.name + ".pub").unlink(missing_ok=True)
    subprocess.run(
        [str(SSH_KEYGEN), "-q", "-t", "ed25519", "-N", "", "-C", "", "-f", str(path)],
        check=True,
        capture_output=True,
    )
    path.chmod(0o600)
    public = " ".join(path.with_name(path.name + ".pub").read_text().split()[:2])
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
    """One sshd with its own folder (``root``) for host key, config, log and data.

    It listens on ``listen_address`` only (127.0.0.1 unless told otherwise). With ``netns_path``
    (``/var/run/netns/NAME``) it runs in that network namespace, and ``listen_address`` should be
    an address of that namespace; this host must reach it there (an emulated node's is reached
    through the cluster's bridge), since readiness is checked by connecting to it from here.
    """

    def __init__(
        self,
        name: str,
        root: Path,
        authorized_keys: Path,
        listen_address: str = "127.0.0.1",
        netns_path: Path | str | None = None,
    ) -> None:
        self.name = name
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.authorized_keys = authorized_keys
        self.listen_address = listen_address
        self.netns_path = Path(netns_path) if netns_path is not None else None
        self.host_public_key = write_key(root / "ssh_host_ed25519_key")
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> Path:
        return self.root / "sshd.log"

    @property
    def pid(self) -> int | None:
        """sshd's process id while it runs (nsenter execs sshd, so in a namespace it is sshd's too)."""
        return self.process.pid if self.process is not None else None

    def host_spec(self) -> str:
        """How ssh's known_hosts names this server: ``ADDR`` on port 22, ``[ADDR]:PORT`` on any other."""
        return self.listen_address if self.port == SSH_PORT else f"[{self.listen_address}]:{self.port}"

    def known_hosts_line(self) -> str:
        return f"{self.host_spec()} {self.host_public_key}\n"

    def command(self, config: Path) -> list[str]:
        """The argv that starts sshd in the foreground with ``config``, inside the namespace if there is one."""
        sshd = [str(SSHD), "-D", "-e", "-f", str(config)]
        return sshd if self.netns_path is None else ["nsenter", f"--net={self.netns_path}", "--", *sshd]

    def start(self, port: int | None = None, *, skip: bool = True) -> SshServer:
        """Start on ``port``: by default a free one of loopback (retried if another process takes it
        first), or 22 in a namespace. Where sshd cannot start, skip the calling test, or with
        ``skip=False`` raise :class:`SshdUnavailable`; either way nothing of it is left running."""
        reason = sshd_unavailable_reason()
        if reason is not None:
            self._unavailable(reason, skip)
        code: int | None = None
        for _ in range(5):
            self.port = port or self._default_port()
            config = self._write_config()
            with open(self.log, "ab") as log:
                self.process = subprocess.Popen(self.command(config), stdout=log, stderr=log, start_new_session=True)
            if self._wait_ready():
                return self
            code = self.process.poll()
            self.stop()
            retry = port is None and self.netns_path is None
            if not retry or "Address already in use" not in self.log.read_text(errors="replace"):
                break
        how = f"it exited with code {code}" if code is not None else f"it did not answer within {START_TIMEOUT_S:g} s"
        tail = " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-5:])
        self._unavailable(f"sshd could not be started on this machine: {how}{': ' + tail if tail else ''}", skip)

    @staticmethod
    def _unavailable(reason: str, skip: bool) -> NoReturn:
        if skip:
            _skip(reason)
        raise SshdUnavailable(reason)

    def _default_port(self) -> int:
        if self.netns_path is not None:
            return SSH_PORT
        from jabascli.net import free_port

        return free_port()

    def _write_config(self) -> Path:
        config = self.root / "sshd_config"
        config.write_text(
            f"Port {self.port}\n"
            f"ListenAddress {self.listen_address}\n"
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
        return config

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                return False
            try:
                with socket.create_connection((self.listen_address, self.port), timeout=1) as s:
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
