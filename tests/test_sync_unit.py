"""jabas sync without SSH: profile-tree rules, merge plans, targets, messages."""

from __future__ import annotations

import hashlib
import socket
from pathlib import Path

import paramiko
import pytest
from paramiko.auth_strategy import AuthFailure
from paramiko.ssh_exception import BadHostKeyException, NoValidConnectionsError

from jabascli.config.models import ServerConfig
from jabascli.errors import InputError
from jabascli.ssh.connect import KnownHosts, RevokedHostKey, UnknownHostKey, _connect_problem, _OfferKeys
from jabascli.ssh.target import SshTarget, load_ssh_config, resolve_target
from jabascli.sync.plan import GATHERED, plan_gather, plan_push
from jabascli.sync.run import remote_folder, working_dir
from jabascli.sync.tree import FileInfo, NotAProfileTree, SyncError, local_manifest, path_fits


def info(text: str) -> FileInfo:
    data = text.encode()
    return FileInfo(len(data), hashlib.sha256(data).hexdigest())


# Profile trees ----------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "32/node0/resnet50_32_1_comp_profile.json",
        "128/node1/max_memory_profile_info.json",
        "32/node0/deeper/file.json",
        "intra_comm_profile_data.txt",
        "resnet50_bucket_size_profile.json",
        "cluster_comp_profile_data/32/node0/x.json",
        "cluster_mem_profile_data/64/node1/max_memory_profile_info.json",
        "comm_profile_data/inter_comm_profile_data.txt",
        "bucket_profile_data/vit_bucket_size_profile.json",
    ],
)
def test_profile_files_fit(path: str) -> None:
    assert path_fits(path)


@pytest.mark.parametrize(
    "path",
    [
        "README.md",
        "32/x.json",  # no server folder
        "0/node0/x.json",  # LBS must be positive
        "node0/32/x.json",
        "comm_profile_data/sub/x.txt",
        "comm_profile_data/x.py",
        "cluster_comp_profile_data/x.json",
        ".bashrc/32/node0/x",
    ],
)
def test_other_files_do_not_fit(path: str) -> None:
    assert not path_fits(path)


def test_local_manifest_hashes_profiles_and_skips_hidden_files(tmp_path: Path) -> None:
    (tmp_path / "32" / "node0").mkdir(parents=True)
    (tmp_path / "32" / "node0" / "a.json").write_text("{}")
    (tmp_path / "32" / "node0" / ".a.json.x1.jabas-tmp").write_text("{")
    (tmp_path / "32" / "node0" / "link.json").symlink_to(tmp_path / "32" / "node0" / "a.json")
    (tmp_path / "intra_comm_profile_data.txt").write_text("1,2\n")
    manifest, scan = local_manifest(tmp_path)
    assert manifest == {"32/node0/a.json": info("{}"), "intra_comm_profile_data.txt": info("1,2\n")}
    assert scan.skipped == ["32/node0/link.json"]
    assert scan.leftovers == ["32/node0/.a.json.x1.jabas-tmp"]


def test_a_folder_with_other_things_is_not_a_profile_tree(tmp_path: Path) -> None:
    (tmp_path / "32" / "node0").mkdir(parents=True)
    (tmp_path / "Documents").mkdir()
    with pytest.raises(NotAProfileTree, match="Documents/ does not belong there"):
        local_manifest(tmp_path, what="here")


def test_a_missing_folder_is_empty_and_a_file_is_refused(tmp_path: Path) -> None:
    manifest, scan = local_manifest(tmp_path / "absent")
    assert manifest == {} and scan.sizes == {}
    (tmp_path / "file").write_text("x")
    with pytest.raises(SyncError, match="not a folder"):
        local_manifest(tmp_path / "file")


# Plans ------------------------------------------------------------------------


def test_gather_fetches_each_new_file_once_and_keeps_what_is_there() -> None:
    a, b, old = info("a"), info("b"), info("old")
    sources = {
        "node0": {"32/node0/x.json": a, "comm_profile_data/intra.txt": b},
        "node1": {"32/node1/x.json": b, "comm_profile_data/intra.txt": b},
    }
    gathered = {"32/node1/x.json": b, "32/node9/x.json": old}
    plan = plan_gather(sources, gathered)
    assert [(f.server, f.path) for f in plan.fetches] == [
        ("node0", "32/node0/x.json"),
        ("node0", "comm_profile_data/intra.txt"),
    ]
    assert not plan.conflicts
    assert plan.merged == {**gathered, "32/node0/x.json": a, "comm_profile_data/intra.txt": b}


def test_a_newer_server_copy_replaces_the_gathered_one() -> None:
    plan = plan_gather({"node0": {"32/node0/x.json": info("new")}}, {"32/node0/x.json": info("old")})
    assert [f.path for f in plan.fetches] == ["32/node0/x.json"]
    assert plan.merged == {"32/node0/x.json": info("new")}


def test_different_versions_from_two_servers_conflict_and_stay_out() -> None:
    sources = {"node0": {"p.json": info("zero")}, "node1": {"p.json": info("one!")}, "node2": {}}
    plan = plan_gather(sources, {"p.json": info("old")})
    assert not plan.fetches
    assert [c.path for c in plan.conflicts] == ["p.json"]
    assert "p.json" not in plan.merged  # not even the old gathered copy is broadcast
    text = plan.conflicts[0].describe()
    assert "node0 (4 B, sha256 " in text and "node1 (4 B, sha256 " in text and "left out" in text


def test_a_file_here_and_a_folder_there_conflict() -> None:
    sources = {"node0": {"32/n/x": info("file")}, "node1": {"32/n/x/y": info("deeper")}}
    plan = plan_gather(sources, {})
    assert [c.path for c in plan.conflicts] == ["32/n/x"]
    assert plan.conflicts[0].versions == {"node0": info("file"), "node1": None}
    assert "node1 (a folder)" in plan.conflicts[0].describe()
    assert GATHERED not in plan.conflicts[0].versions


def test_push_sends_what_is_missing_or_different() -> None:
    merged = {"a": info("a"), "b": info("b"), "c": info("c")}
    assert plan_push(merged, {"a": info("a"), "b": info("B"), "d": info("d")}) == ["b", "c"]
    assert plan_push(merged, {"a": None, "b": info("b"), "c": info("c")}) == ["a"]
    assert plan_push(merged, merged) == []


# Targets and folders ----------------------------------------------------------


def server(**fields: object) -> ServerConfig:
    return ServerConfig.model_validate({"name": "node0", "device_type": "cpu", **fields})


def test_ssh_config_fills_what_the_server_entry_leaves_out(tmp_path: Path) -> None:
    key = tmp_path / "id_node"
    key.write_text("not read here")
    config = tmp_path / "ssh_config"
    config.write_text(
        f"Host gpu0\n  HostName 10.0.0.5\n  Port 2200\n  User alice\n  IdentityFile {key}\n"
        "  IdentityFile ~/.ssh/definitely-not-there\n  IdentitiesOnly yes\n  ConnectTimeout 7\n"
    )
    ssh = load_ssh_config(config)
    target = resolve_target(server(host="gpu0"), ssh)
    assert target == SshTarget(
        "node0", "10.0.0.5", 2200, "alice", (key,), allow_agent=False, default_keys=False, connect_timeout=7.0
    )
    explicit = resolve_target(server(host="gpu0", ssh_port=22, ssh_user="bob", sync_root="/srv/jabas"), ssh)
    assert (explicit.port, explicit.user, explicit.sync_root) == (22, "bob", "/srv/jabas")


def test_proxy_jump_is_refused_clearly(tmp_path: Path) -> None:
    config = tmp_path / "ssh_config"
    config.write_text("Host gpu0\n  ProxyJump bastion\n")
    with pytest.raises(SyncError, match="ProxyJump for gpu0, which jabas does not support"):
        resolve_target(server(host="gpu0"), load_ssh_config(config))


def test_a_named_ssh_config_must_exist(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="SSH config file not found"):
        load_ssh_config(tmp_path / "nope")


def test_remote_folders_resolve_like_the_seed_unless_a_sync_root_is_set() -> None:
    cwd = Path("/home/alice/jabas")
    assert remote_folder("profiles/local", None, cwd) == "/home/alice/jabas/profiles/local"
    assert remote_folder("profiles/local", "/data/jabas", cwd) == "/data/jabas/profiles/local"
    assert remote_folder("profiles/local", "~/jabas", cwd) == "~/jabas/profiles/local"
    assert remote_folder("/abs/local", "/data/jabas", cwd) == "/abs/local"


# Messages ---------------------------------------------------------------------

TARGET = SshTarget("node0", "10.0.0.5", 2200, "alice")


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (NoValidConnectionsError({("10.0.0.5", 2200): ConnectionRefusedError()}), "connection refused by 10.0.0.5"),
        (socket.gaierror(-2, "Name or service not known"), "cannot resolve the host name '10.0.0.5'"),
        (TimeoutError(), "no answer from 10.0.0.5:2200 within 3 s"),
        (OSError(113, "No route to host"), "cannot connect to 10.0.0.5:2200: No route to host"),
        (paramiko.SSHException("Error reading SSH protocol banner"), "did not answer as an SSH server"),
    ],
)
def test_connection_failures_read_as_one_clear_line(exc: BaseException, expected: str, tmp_path: Path) -> None:
    message = _connect_problem(exc, TARGET, KnownHosts(tmp_path / "kh"), 3)
    assert expected in message and "\n" not in message


def test_host_key_messages_say_what_to_do(tmp_path: Path) -> None:
    known = KnownHosts(tmp_path / "kh")
    key, other = paramiko.ECDSAKey.generate(), paramiko.ECDSAKey.generate()
    unknown = _connect_problem(UnknownHostKey("[10.0.0.5]:2200", key), TARGET, known, 3)
    assert key.fingerprint in unknown and "--accept-new-host-keys" in unknown
    changed = _connect_problem(BadHostKeyException("10.0.0.5", key, other), TARGET, known, 3)
    assert "does not match" in changed and f"ssh-keygen -R '[10.0.0.5]:2200' -f {tmp_path / 'kh'}" in changed


def test_recording_a_host_key_appends_and_keeps_the_file(tmp_path: Path) -> None:
    path = tmp_path / "ssh" / "known_hosts"
    known = KnownHosts(path, accept_new=True)
    key = paramiko.ECDSAKey.generate()
    known.record("[127.0.0.1]:2200", key)
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    path.write_text(path.read_text() + "# a comment, without a final newline")
    known.record("[127.0.0.1]:2201", key)
    lines = path.read_text().splitlines()
    assert lines[1] == "# a comment, without a final newline"
    assert lines[0].startswith("[127.0.0.1]:2200 ecdsa-sha2-nistp256 ")
    assert lines[2].startswith("[127.0.0.1]:2201 ecdsa-sha2-nistp256 ")


def test_known_hosts_lines_paramiko_cannot_use_are_skipped_not_fatal(tmp_path: Path) -> None:
    key = paramiko.ECDSAKey.generate()
    line = f"{key.get_name()} {key.get_base64()}"
    path = tmp_path / "known_hosts"
    path.write_text(
        "# comment\n"
        f"@cert-authority *.example.com {line}\n"
        f"@revoked * {line}\n"
        "damaged.example.com ssh-ed25519 not!base64\n"
        "short line\n"
        f"[127.0.0.1]:2200 {line}\n"
    )
    known = KnownHosts(path)
    assert [e.hostnames for e in known.entries] == [["[127.0.0.1]:2200"]]
    assert known.revoked == {line}
    with pytest.raises(RevokedHostKey):
        known.check_not_revoked(key)


def test_the_working_folder_keeps_the_name_the_shell_gives_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    monkeypatch.chdir(real)
    monkeypatch.setenv("PWD", str(tmp_path / "link"))
    assert working_dir() == tmp_path / "link"
    monkeypatch.setenv("PWD", str(tmp_path))  # stale: names another folder
    assert working_dir() == real


def test_keys_that_cannot_be_used_are_named_in_the_authentication_error(tmp_path: Path) -> None:
    public = tmp_path / "id_ed25519.pub"
    public.write_text("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C4okWi0dh2l9GKJl me\n")
    target = SshTarget("node0", "10.0.0.5", 22, "alice", (public,), allow_agent=False, default_keys=False)
    offer = _OfferKeys(target, KnownHosts(tmp_path / "kh"))
    assert list(offer.get_sources()) == []
    message = offer.failure(AuthFailure(result=[]))
    assert message.startswith("authentication failed as alice@10.0.0.5:22: no key to offer")
    assert f"{public} is not a private key jabas can read" in message
