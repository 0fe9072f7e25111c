"""jabas sync end to end: real OpenSSH servers on loopback ports stand for a cluster.

Three sshd processes (``tests/sshd.py``) play node0, node1 and node2. Each has
its own port, host key and folder; its ``sync_root`` in the config points at
that folder, so ``profiles/local`` and ``profiles/all`` are different folders
on each "server" although they all live on this machine. The node running
``jabas sync`` works in a fourth folder, ``main``.
"""

from __future__ import annotations

import getpass
import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tomli_w
from typer.testing import CliRunner, Result

from jabascli.cli.app import app
from jabascli.config import load_config
from jabascli.sync import Moved, SyncEvent, SyncOptions, SyncReport, remote, sync_profiles
from tests.sshd import SshServer, require_sshd, write_key

USER = getpass.getuser()
LOCAL, GATHERED = "profiles/local", "profiles/all"


@dataclass(frozen=True)
class Keys:
    user: Path
    wrong: Path
    authorized: Path


@pytest.fixture(autouse=True)
def _no_ssh_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only the throw-away keys count; a developer's agent must not log the tests in.
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    folder = tmp_path_factory.mktemp("keys")
    public = write_key(folder / "id_user")
    write_key(folder / "id_wrong")
    (folder / "authorized_keys").write_text(public + "\n")
    return Keys(folder / "id_user", folder / "id_wrong", folder / "authorized_keys")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, keys: Keys) -> Iterator[list[SshServer]]:
    require_sshd()
    root = tmp_path_factory.mktemp("sshd")
    started: list[SshServer] = []
    try:
        for name in ("node0", "node1", "node2"):
            started.append(SshServer(name, root / name, keys.authorized).start())
        yield started
    finally:
        for server in started:
            server.stop()


class Cluster:
    """The servers' folders, a config naming them, and test-owned known_hosts and ssh config."""

    def __init__(self, tmp: Path, servers: list[SshServer], keys: Keys, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tmp = tmp
        self.keys = keys
        self.servers = {s.name: s for s in servers}
        self.main = tmp / "main"
        self.main.mkdir()
        monkeypatch.chdir(self.main)
        self.known_hosts = tmp / "known_hosts"
        self.known_hosts.write_text("".join(s.known_hosts_line() for s in servers))
        self.ssh_config = tmp / "ssh_config"
        self.ssh_config.write_text("")
        self.entries: dict[str, dict[str, Any]] = {s.name: self.entry(s.name, s.port) for s in servers}

    def entry(self, name: str, port: int) -> dict[str, Any]:
        return {
            "name": name,
            "device_type": "cpu",
            "host": "127.0.0.1",
            "ssh_port": port,
            "ssh_user": USER,
            "ssh_key": str(self.keys.user),
            "sync_root": str(self.tmp / name),
        }

    def add(self, server: SshServer) -> None:
        self.servers[server.name] = server
        self.entries[server.name] = self.entry(server.name, server.port)
        with open(self.known_hosts, "a") as f:
            f.write(server.known_hosts_line())

    def local(self, name: str) -> Path:
        return self.tmp / name / LOCAL

    def gathered(self, name: str) -> Path:
        return self.tmp / name / GATHERED

    @property
    def here(self) -> Path:
        return self.main / GATHERED

    def config(self) -> Path:
        path = self.main / "jabas.toml"
        path.write_text(tomli_w.dumps({"cluster": {"servers": list(self.entries.values())}}))
        return path

    def sync(self, *, servers: list[str] | None = None, on_event: Any = None, **options: Any) -> SyncReport:
        loaded = load_config(self.config(), check_profiles=False)
        opts = SyncOptions(**{"known_hosts": self.known_hosts, "ssh_config": self.ssh_config, "timeout": 10, **options})
        return sync_profiles(loaded, LOCAL, GATHERED, servers=servers, options=opts, on_event=on_event)

    def cli(self, *args: str) -> Result:
        return CliRunner().invoke(
            app,
            ["sync", LOCAL, GATHERED, "-c", str(self.config()), *args],
            env={"JABAS_KNOWN_HOSTS": str(self.known_hosts), "JABAS_SSH_CONFIG": str(self.ssh_config)},
        )


@pytest.fixture
def cluster(tmp_path: Path, servers: list[SshServer], keys: Keys, monkeypatch: pytest.MonkeyPatch) -> Cluster:
    return Cluster(tmp_path, servers, keys, monkeypatch)


def put(folder: Path, rel: str, content: str | bytes) -> None:
    path = folder / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, str):
        content = content.encode()
    path.write_bytes(content)


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (hidden ones included, so that leftovers show)."""
    if not folder.exists():
        return {}
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def error_lines(result: Result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


def test_gather_and_broadcast_then_only_changes_move(cluster: Cluster) -> None:
    comm = "0.1,0.2\n0.4,0.5\n"
    put(cluster.local("node0"), "32/node0/resnet50_32_1_comp_profile.json", '{"fwd": 10.5}')
    put(cluster.local("node0"), "64/node0/resnet50_64_1_comp_profile.json", '{"fwd": 19.0}')
    put(cluster.local("node1"), "32/node1/resnet50_32_1_comp_profile.json", '{"fwd": 21.7}')
    put(cluster.local("node1"), "comm_profile_data/intra_comm_profile_data.txt", comm)
    put(cluster.local("node2"), "32/node2/resnet50_32_1_comp_profile.json", '{"fwd": 15.2}')
    put(cluster.local("node2"), "comm_profile_data/intra_comm_profile_data.txt", comm)  # same content: no conflict

    result = cluster.cli()
    assert result.exit_code == 0, result.output
    assert "Gathered into" in result.stdout
    union = {}
    for name in ("node0", "node1", "node2"):
        union |= tree(cluster.local(name))
    assert len(union) == 5
    assert tree(cluster.here) == union
    for name in ("node0", "node1", "node2"):
        assert tree(cluster.gathered(name)) == union, name

    again = cluster.sync()
    assert again.ok and again.moved == 0, again.to_dict()

    put(cluster.local("node1"), "32/node1/resnet50_32_1_comp_profile.json", '{"fwd": 20.9}')  # profiled again
    third = cluster.sync()
    assert third.ok, third.problems()
    changed = "32/node1/resnet50_32_1_comp_profile.json"
    assert {s.server: [m.path for m in s.fetched] for s in third.servers} == {
        "node0": [],
        "node1": [changed],
        "node2": [],
    }
    assert all([m.path for m in s.sent] == [changed] for s in third.servers)
    for name in ("node0", "node1", "node2"):
        assert tree(cluster.gathered(name))[changed] == b'{"fwd": 20.9}'


def test_dry_run_shows_what_would_move_and_moves_nothing(cluster: Cluster) -> None:
    put(cluster.local("node0"), "32/node0/a.json", "{}")
    for name in ("node1", "node2"):
        cluster.local(name).mkdir(parents=True)  # profiled nothing yet
    result = cluster.cli("--dry-run")
    assert result.exit_code == 0, result.output
    assert "What would move" in result.stdout and "32/node0/a.json" in result.stdout
    data = json.loads(cluster.cli("--dry-run", "--json").stdout)
    assert data["dry_run"] and data["ok"]
    by_name = {s["name"]: s for s in data["servers"]}
    assert by_name["node0"]["fetched"] == [{"path": "32/node0/a.json", "bytes": 2}]
    assert all(s["sent"] == [{"path": "32/node0/a.json", "bytes": 2}] for s in data["servers"])
    assert not cluster.here.exists()
    assert not any(cluster.gathered(name).exists() for name in ("node0", "node1", "node2"))


def test_a_conflict_is_reported_and_neither_version_is_copied(cluster: Cluster) -> None:
    put(cluster.local("node0"), "32/shared/p.json", '{"fwd": 1}')
    put(cluster.local("node1"), "32/shared/p.json", '{"fwd": 2}')
    put(cluster.local("node2"), "32/node2/p.json", '{"fwd": 3}')
    result = cluster.cli()
    assert result.exit_code == 1
    (line,) = error_lines(result)
    assert line.startswith("error: conflict: 32/shared/p.json differs between node0 (10 B, sha256 "), line
    assert "node1 (10 B, sha256 " in line and line.endswith("left out of the sync")
    assert tree(cluster.here) == {"32/node2/p.json": b'{"fwd": 3}'}
    for name in ("node0", "node1", "node2"):
        assert tree(cluster.gathered(name)) == {"32/node2/p.json": b'{"fwd": 3}'}, name


def test_unknown_host_keys_are_refused_unless_accepted_and_changed_ones_always(
    cluster: Cluster, servers: list[SshServer], tmp_path: Path
) -> None:
    node0, node1, node2 = servers
    cluster.known_hosts.write_text(node0.known_hosts_line() + node1.known_hosts_line())
    for name in ("node0", "node2"):
        put(cluster.local(name), f"32/{name}/a.json", name)
    cluster.local("node1").mkdir(parents=True)

    refused = cluster.sync()
    assert [s.server for s in refused.failed] == ["node2"]
    (message,) = refused.failed[0].errors
    assert f"unknown host key for [127.0.0.1]:{node2.port} (ssh-ed25519 SHA256:" in message
    assert "--accept-new-host-keys" in message
    assert not cluster.gathered("node2").exists()  # nothing was sent to it
    assert tree(cluster.gathered("node1")) == {"32/node0/a.json": b"node0"}  # the others still synced

    dry = cluster.sync(accept_new_host_keys=True, dry_run=True)
    assert dry.ok and any(n.startswith("would record its host key") for n in dry.servers[2].notes)
    assert node2.known_hosts_line() not in cluster.known_hosts.read_text()  # a dry run writes nothing

    accepted = cluster.sync(accept_new_host_keys=True)
    assert accepted.ok, accepted.problems()
    assert node2.known_hosts_line() in cluster.known_hosts.read_text()
    (note,) = accepted.servers[2].notes
    assert note.startswith("recorded its host key (ssh-ed25519 SHA256:") and note.endswith(f"in {cluster.known_hosts}")

    impostor = write_key(tmp_path / "impostor")
    cluster.known_hosts.write_text(
        f"[127.0.0.1]:{node0.port} {impostor}\n" + node1.known_hosts_line() + node2.known_hosts_line()
    )
    before = cluster.known_hosts.read_text()
    changed = cluster.sync(accept_new_host_keys=True)
    assert [s.server for s in changed.failed] == ["node0"]
    assert f"host key of [127.0.0.1]:{node0.port} does not match" in changed.failed[0].errors[0]
    assert cluster.known_hosts.read_text() == before

    # A key recorded as known but also marked @revoked is refused too.
    cluster.known_hosts.write_text(
        "".join(s.known_hosts_line() for s in servers) + f"@revoked * {node1.host_public_key}\n"
    )
    revoked = cluster.sync()
    assert [s.server for s in revoked.failed] == ["node1"]
    assert "is marked @revoked in" in revoked.failed[0].errors[0]


def test_a_wrong_key_is_a_clear_authentication_error_and_the_others_sync(cluster: Cluster) -> None:
    cluster.entries["node1"]["ssh_key"] = str(cluster.keys.wrong)
    for name in ("node0", "node1", "node2"):
        put(cluster.local(name), f"32/{name}/a.json", name)
    result = cluster.cli()
    assert result.exit_code == 1
    port = cluster.servers["node1"].port
    (line,) = error_lines(result)
    assert line.startswith(
        f"error: node1: authentication failed as {USER}@127.0.0.1:{port}: "
        f"the server accepted none of key {cluster.keys.wrong} (ssh-ed25519 SHA256:"
    ), line
    synced = {"32/node0/a.json": b"node0", "32/node2/a.json": b"node2"}
    assert tree(cluster.here) == tree(cluster.gathered("node0")) == tree(cluster.gathered("node2")) == synced
    assert not cluster.gathered("node1").exists()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bad_servers_get_one_line_each_and_the_rest_still_sync(cluster: Cluster) -> None:
    cluster.entries["ghost"] = cluster.entry("ghost", _closed_port())
    put(cluster.local("node0"), "32/node0/a.json", "a")
    # node1 has no LOCAL_DIR at all; node2's is not a profile folder.
    put(cluster.local("node2"), "notes.md", "my notes")
    result = cluster.cli()
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    lines = error_lines(result)
    assert len(lines) == 3, result.stderr
    assert lines[0] == f"error: node1: LOCAL_DIR {cluster.local('node1')} does not exist"
    assert lines[1].startswith(f"error: node2: LOCAL_DIR {cluster.local('node2')} is not a profile folder: notes.md")
    port = cluster.entries["ghost"]["ssh_port"]
    assert lines[2] == f"error: ghost: connection refused by 127.0.0.1:{port} (is an SSH server listening there?)"
    # Reachable servers still receive the merged folder, even those whose own folder failed.
    for name in ("node0", "node1", "node2"):
        assert tree(cluster.gathered(name)) == {"32/node0/a.json": b"a"}, name


def test_a_local_gathered_folder_that_is_not_a_profile_tree_is_bad_input(cluster: Cluster) -> None:
    put(cluster.here, "README.md", "not a profile")
    put(cluster.local("node0"), "32/node0/a.json", "a")
    result = cluster.cli()
    assert result.exit_code == 2
    (line,) = error_lines(result)
    assert line.startswith(f"error: GATHERED_DIR: GATHERED_DIR {cluster.here} is not a profile folder: README.md")
    assert not cluster.gathered("node0").exists()


def test_ssh_config_supplies_address_user_and_key(cluster: Cluster, servers: list[SshServer]) -> None:
    node0 = servers[0]
    cluster.ssh_config.write_text(
        f"Host gpu-a\n  HostName 127.0.0.1\n  Port {node0.port}\n  User {USER}\n"
        f"  IdentityFile {cluster.keys.user}\n  IdentitiesOnly yes\n"
    )
    cluster.entries = {
        "node0": {"name": "node0", "device_type": "cpu", "host": "gpu-a", "sync_root": str(cluster.tmp / "node0")}
    }
    put(cluster.local("node0"), "32/node0/a.json", "a")
    report = cluster.sync()
    assert report.ok, report.problems()
    assert report.servers[0].address == f"{USER}@127.0.0.1:{node0.port}"
    assert tree(cluster.gathered("node0")) == {"32/node0/a.json": b"a"}


def test_hashes_are_read_over_sftp_where_commands_cannot_run(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "HASH_COMMAND", "exit 127")
    put(cluster.local("node0"), "32/node0/a.json", "a")
    put(cluster.local("node1"), "32/node1/a.json", "b")
    first = cluster.sync(servers=["node0", "node1"])
    assert first.ok, first.problems()
    assert any("hashing by reading the files over SFTP" in note for note in first.servers[0].notes)
    assert cluster.sync(servers=["node0", "node1"]).moved == 0


@pytest.mark.parametrize("direction", ["send", "fetch"])
def test_a_connection_cut_mid_transfer_leaves_no_partial_file(
    cluster: Cluster, keys: Keys, tmp_path: Path, direction: str, request: pytest.FixtureRequest
) -> None:
    victim = SshServer("victim", tmp_path / "victim-sshd", keys.authorized).start()
    request.addfinalizer(victim.stop)
    cluster.add(victim)
    big = os.urandom(8 << 20)  # well beyond what SSH keeps in flight, so the cut lands mid-file
    if direction == "send":
        put(cluster.local("node0"), "32/node0/big.json", big)
        put(cluster.gathered("victim"), "32/node0/big.json", "the previous version")
        cluster.local("victim").mkdir(parents=True)
        landing, rel = cluster.gathered("victim"), "32/node0/big.json"
    else:
        put(cluster.local("victim"), "32/victim/big.json", big)
        cluster.local("node0").mkdir(parents=True)
        landing, rel = cluster.here, "32/victim/big.json"
    before = tree(landing)

    moved = 0

    def cut_after_the_first_chunks(event: SyncEvent) -> None:
        nonlocal moved
        if isinstance(event, Moved) and event.server == "victim" and event.direction == direction:
            moved += event.nbytes
            if moved >= 256 << 10:
                victim.kill()

    report = cluster.sync(servers=["node0", "victim"], on_event=cut_after_the_first_chunks)
    assert [s.server for s in report.failed] == ["victim"]
    (message,) = report.failed[0].errors
    verb = "sending" if direction == "send" else "fetching"
    assert message.startswith(f"connection lost while {verb} "), message
    assert message.endswith(rel)
    visible = {k: v for k, v in tree(landing).items() if not Path(k).name.startswith(".")}
    assert visible == {k: v for k, v in before.items() if not Path(k).name.startswith(".")}
    if direction == "fetch":
        assert tree(landing) == before  # the local write cleans up its temporary file too

    victim.start(port=victim.port)
    again = cluster.sync(servers=["node0", "victim"])
    assert again.ok, again.problems()
    assert tree(landing)[rel] == big
    assert not [k for k in tree(landing) if Path(k).name.startswith(".")], "leftover temporary files"


def test_a_server_that_stops_answering_is_given_up_after_the_timeout(
    cluster: Cluster, keys: Keys, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    victim = SshServer("victim", tmp_path / "victim-sshd", keys.authorized).start()
    request.addfinalizer(victim.stop)
    request.addfinalizer(victim.resume)
    cluster.add(victim)
    put(cluster.local("victim"), "32/victim/big.json", os.urandom(8 << 20))
    put(cluster.local("node0"), "32/node0/a.json", "a")

    def freeze_mid_fetch(event: SyncEvent) -> None:
        if isinstance(event, Moved) and event.server == "victim" and event.direction == "fetch":
            victim.freeze()

    report = cluster.sync(servers=["node0", "victim"], on_event=freeze_mid_fetch, timeout=2)
    assert [s.server for s in report.failed] == ["victim"]
    (message,) = report.failed[0].errors
    assert message.startswith("no answer from the server for 2 s while fetching "), message
    assert not (cluster.here / "32/victim/big.json").exists()
    assert tree(cluster.gathered("node0")) == {"32/node0/a.json": b"a"}


@pytest.mark.parametrize("direction", ["fetch", "send"])
def test_a_file_that_changes_while_it_moves_is_not_put_in_place(cluster: Cluster, direction: str) -> None:
    rel = "32/node0/big.json"
    source = cluster.local("node0") / rel if direction == "fetch" else cluster.here / rel
    put(cluster.local("node0"), rel, b"x" * (1 << 20))
    if direction == "send":
        put(cluster.here, rel, b"x" * (1 << 20))  # already gathered: only the send happens
    changed = False

    def append_once(event: SyncEvent) -> None:
        nonlocal changed
        if isinstance(event, Moved) and event.direction == direction and not changed:
            changed = True
            with open(source, "ab") as f:
                f.write(b"profiled again")

    report = cluster.sync(servers=["node0"], on_event=append_once)
    (message,) = report.failed[0].errors
    verb = "copied" if direction == "fetch" else "sent"
    assert message.endswith(f"changed while it was being {verb}; run jabas sync again"), message
    landing = cluster.here if direction == "fetch" else cluster.gathered("node0")
    assert tree(landing) == {}


def test_an_ssh_agent_key_logs_in_when_no_key_is_named(
    cluster: Cluster, keys: Keys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    agent, add = shutil.which("ssh-agent"), shutil.which("ssh-add")
    if not agent or not add:
        pytest.skip("ssh-agent and ssh-add (openssh-client) are not installed")
    socket_path = tmp_path / "agent.sock"
    process = subprocess.Popen([agent, "-D", "-a", str(socket_path)], stdout=subprocess.DEVNULL)
    request.addfinalizer(process.kill)
    for _ in range(100):
        if socket_path.exists():
            break
        time.sleep(0.05)
    env = {**os.environ, "SSH_AUTH_SOCK": str(socket_path)}
    subprocess.run([add, str(keys.user)], env=env, check=True, capture_output=True)
    monkeypatch.setenv("SSH_AUTH_SOCK", str(socket_path))
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ssh/id_* here: only the agent can log in
    del cluster.entries["node0"]["ssh_key"]
    put(cluster.local("node0"), "32/node0/a.json", "a")
    report = cluster.sync(servers=["node0"])
    assert report.ok, report.problems()
    assert tree(cluster.gathered("node0")) == {"32/node0/a.json": b"a"}
