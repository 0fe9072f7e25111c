"""The fork server (jabascli/forkserver.py): a forked child starts as a fresh process would, and is watched
and ended as a subprocess.Popen is. A real server process with real forks; it preloads nothing here, so that
these tests do not pay for torch's import."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from jabascli.children import terminate
from jabascli.forkserver import DISABLE_ENV, ForkServer, Unavailable

CHILD = '''
import json, os, signal, sys, time

def report():
    """Tell what this process was started with, on the passed descriptor, then print to its output."""
    fd = int(os.environ["REPORT_FD"])
    facts = {
        "argv": sys.argv[1:],
        "cwd": os.getcwd(),
        "env": os.environ.get("ONLY_HERE"),
        "inherited": "NOT_PASSED" in os.environ,
        "session": os.getsid(0) == os.getpid(),
        "name": open("/proc/self/comm").read().strip(),
        "stdin": sys.stdin.read(),
        # What is open, less the descriptor of the listing itself (gone once listed).
        "open": {n: os.readlink("/dev/fd/" + n) for n in os.listdir("/dev/fd") if os.path.exists("/dev/fd/" + n)},
    }
    os.write(fd, json.dumps(facts).encode())
    os.close(fd)
    print("to the log")
    sys.exit(int(sys.argv[1]))

def sleep():
    time.sleep(60)

def ignore_term():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(60)
'''


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ForkServer]:
    (tmp_path / "childmod.py").write_text(CHILD)
    started = ForkServer(preload=())
    assert started.ready()
    yield started
    started.close()


def test_a_forked_child_starts_as_a_fresh_process_would(server: ForkServer, tmp_path: Path) -> None:
    os.environ["NOT_PASSED"] = "1"
    read_fd, write_fd = os.pipe()
    log = tmp_path / "child.log"
    try:
        with log.open("wb") as output:
            child = server.spawn(
                "childmod:report",
                ["3", "x y"],
                {"ONLY_HERE": "yes", "REPORT_FD": str(write_fd)},
                output.fileno(),
                (write_fd,),
                cwd=str(tmp_path),
                new_session=True,
                name="jabas-test",
            )
        os.close(write_fd)
        assert child.wait(timeout=60) == 3 and child.poll() == 3  # its exit code, as Popen's returncode
        facts = json.loads(os.read(read_fd, 65536))
    finally:
        os.environ.pop("NOT_PASSED")
        os.close(read_fd)
    assert facts["argv"] == ["3", "x y"] and facts["cwd"] == str(tmp_path)
    assert facts["env"] == "yes" and not facts["inherited"]  # the requester's environment, not the server's
    assert facts["session"] and facts["name"] == "jabas-test" and facts["stdin"] == ""
    # stdin from /dev/null, stdout and stderr to the log, the passed pipe at its number; what the server held
    # is /dev/null until its owner lets go of it (test_a_launcher_file_freed_in_a_child...).
    opened = facts["open"]
    assert {n: t for n, t in opened.items() if n not in {"0", "1", "2", str(write_fd)}}.keys() <= {
        n for n, t in opened.items() if t == "/dev/null"
    }, opened
    assert (
        opened["0"] == "/dev/null"
        and opened["1"] == opened["2"] == str(log)
        and opened[str(write_fd)].startswith("pipe:")
    )
    assert log.read_text() == "to the log\n"


def test_signals_reach_the_child_and_its_end_is_told_as_popen_tells_it(server: ForkServer, tmp_path: Path) -> None:
    children = [
        server.spawn("childmod:" + name, [], {}, 1, cwd=str(tmp_path)) for name in ("sleep", "ignore_term", "sleep")
    ]
    assert [c.poll() for c in children] == [None, None, None]
    with pytest.raises(subprocess.TimeoutExpired):
        children[0].wait(timeout=0.2)
    time.sleep(1)  # ignore_term has set its handler
    children[0].send_signal(signal.SIGTERM)
    assert children[0].wait(timeout=30) == -signal.SIGTERM
    terminate(children[1:])  # SIGTERM, then SIGKILL for the one that ignores it
    assert [c.returncode for c in children[1:]] == [-signal.SIGKILL, -signal.SIGTERM]


def test_the_children_die_with_the_server(server: ForkServer, tmp_path: Path) -> None:
    child = server.spawn("childmod:sleep", [], {}, 1, cwd=str(tmp_path))
    server.proc.kill()
    assert child.wait(timeout=30) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while _alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child.pid)  # killed by the kernel with its parent, not only said to be
    with pytest.raises(Unavailable):
        server.spawn("childmod:sleep", [], {}, 1, cwd=str(tmp_path))


def test_children_of_a_closed_server_are_told_as_killed(server: ForkServer, tmp_path: Path) -> None:
    """Closed before anyone read that it died (an agent dropping its dead warm server), the server's children
    are not left counted as running forever; one whose end the server reported keeps its code."""
    ended = server.spawn("childmod:report", ["5"], {"REPORT_FD": "1"}, 1, cwd=str(tmp_path))
    running = server.spawn("childmod:sleep", [], {}, 1, cwd=str(tmp_path))
    deadline = time.monotonic() + 30
    while _alive(ended.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)  # the server's report of that end is on its way, not read yet
    server.proc.kill()
    server.proc.wait()
    server.close()
    assert ended.poll() == 5 and running.poll() == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while _alive(running.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(running.pid)


def _alive(pid: int) -> bool:
    """Running, or stopped; not gone and not a zombie waiting to be reaped by its new parent."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_a_failed_preload_or_a_switched_off_server_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    failing = ForkServer(preload=("no_such_module_here",))
    with pytest.raises(Unavailable, match="ModuleNotFoundError"):
        failing.ready()
    assert not failing.alive()
    monkeypatch.setenv(DISABLE_ENV, "0")
    with pytest.raises(Unavailable):
        ForkServer(preload=())


def test_a_server_still_importing_is_not_ready_and_nobody_waits_for_it(tmp_path: Path) -> None:
    """A caller that cannot wait (an agent between heartbeats) can ask without waiting."""
    (tmp_path / "slow_import.py").write_text("import time\ntime.sleep(3)\n")
    server = ForkServer(preload=("slow_import",), env={**os.environ, "PYTHONPATH": str(tmp_path)})
    try:
        asked = time.monotonic()
        assert server.ready(0) is False and server.alive()
        assert time.monotonic() - asked < 1
        assert server.ready(60) is True
    finally:
        server.close()


LAUNCHER = """
import json, os, sys, threading, time
folder, threads = sys.argv[1], sys.argv[2]
sys.path.insert(0, folder)
import launchmod  # what this launcher imported before its server started
from jabascli.forkserver import ForkServer
if threads == "two":
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
kept_open = os.open(os.path.join(folder, "launcher-only"), os.O_WRONLY | os.O_CREAT)  # not for its server
server = ForkServer(preload=())
read_fd, write_fd = os.pipe()
with open(os.path.join(folder, "child.log"), "wb") as output:
    env = {"REPORT_FD": str(write_fd)}
    child = server.spawn("launchmod:report", [], env, output.fileno(), (write_fd,), cwd=folder)
os.close(write_fd)
facts = json.loads(os.read(read_fd, 65536))
assert child.wait(60) == 0
fds = f"/proc/{server.proc.pid}/fd"
server_fds = sorted(os.readlink(os.path.join(fds, n)).split(":")[0] for n in os.listdir(fds))
server_session = os.getsid(server.proc.pid) == server.proc.pid
server.close()
print(json.dumps({"child": facts, "server_fds": server_fds, "server_session": server_session}))
"""
LAUNCHMOD = """
import json, os
IMPORTED_IN = os.getpid()

def report():
    listing = os.listdir("/dev/fd")  # less the descriptor of the listing itself, gone once listed
    opened = {n: os.readlink("/dev/fd/" + n) for n in listing if os.path.exists("/dev/fd/" + n)}
    facts = {"inherited": IMPORTED_IN != os.getpid(), "open": opened, "report": os.environ["REPORT_FD"]}
    os.write(int(os.environ["REPORT_FD"]), json.dumps(facts).encode())

def talk():
    # A socket pair (at numbers the launcher's descriptors had, were they free), then the collector frees the
    # launcher's garbage, then a word over the pair.
    import gc, socket
    ours, theirs = socket.socketpair()
    gc.collect()
    try:
        ours.sendall(b"x")
        heard = theirs.recv(1).decode()
    except OSError as exc:
        heard = str(exc)
    os.write(int(os.environ["REPORT_FD"]), json.dumps({"heard": heard}).encode())
"""


@pytest.mark.parametrize("threads", ["one", "two"])
def test_a_one_threaded_launcher_forks_its_server_and_a_threaded_one_starts_it_fresh(
    tmp_path: Path, threads: str
) -> None:
    """Forked from a launcher running one Python thread, the server starts with what the launcher imported (its children
    inherit the module) and holds none of the launcher's descriptors; a launcher with a second Python thread (whose
    locks a fork would copy held) gets a fresh server, whose children import the module themselves."""
    import sys

    (tmp_path / "launchmod.py").write_text(LAUNCHMOD)
    result = subprocess.run(
        [sys.executable, "-c", LAUNCHER, str(tmp_path), threads], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    seen = json.loads(result.stdout)
    assert seen["child"]["inherited"] is (threads == "one")
    assert seen["server_session"]  # a terminal's Ctrl-C reaches the launcher alone, either way
    # /dev/null for 0, 1 and 2 and its socket: not the launcher's file "launcher-only" (nor anything else of it;
    # the numbers the launcher's descriptors had are /dev/null until their owners let go of them).
    assert seen["server_fds"].count("socket") == 1 and set(seen["server_fds"]) == {"/dev/null", "socket"}, seen
    child_fds = seen["child"]["open"]
    assert child_fds.pop(seen["child"]["report"]).startswith("pipe:"), seen
    assert child_fds.pop("1") == child_fds.pop("2") == str(tmp_path / "child.log"), seen
    assert set(child_fds.values()) == {"/dev/null"}, seen  # 0, and the numbers of what the server held


GARBAGE_LAUNCHER = """
import gc, json, os, sys
sys.path.insert(0, sys.argv[1])
from jabascli.forkserver import ForkServer
gc.disable()  # so that the cycle below is still garbage, not yet collected, when the server is forked


class Owner:
    pass


owner = Owner()
owner.cycle, owner.file = owner, open(os.devnull, "rb")
del owner
server = ForkServer(preload=())
read_fd, write_fd = os.pipe()
child = server.spawn("launchmod:talk", [], {"REPORT_FD": str(write_fd)}, 2, (write_fd,), cwd=sys.argv[1])
os.close(write_fd)
print(os.read(read_fd, 65536).decode())
assert child.wait(60) == 0
server.close()
"""


def test_a_launcher_file_freed_in_a_child_does_not_close_a_socket_the_child_opened(tmp_path: Path) -> None:
    """A forked heap holds the launcher's objects; one freed in the child (here uncollected garbage owning a file)
    closes its descriptor's number. The child's own sockets must not be at that number: a trainer's store
    connection cut this way fails its next rendezvous with a broken pipe."""
    import sys

    (tmp_path / "launchmod.py").write_text(LAUNCHMOD)
    result = subprocess.run(
        [sys.executable, "-c", GARBAGE_LAUNCHER, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout) == {"heard": "x"}
