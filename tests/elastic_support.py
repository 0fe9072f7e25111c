"""Shared by the elastic tests: job configs, a real scheduler server, real agent processes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import tomli_w
import tomllib
import uvicorn

from jabascli.config import LoadedConfig, load_config
from jabascli.elastic.job import Scheduler
from jabascli.elastic.service import create_app
from jabascli.net import free_port

TOKEN = "test-token-0123456789abcdef"

# Digits, with every training micro-batch's sample indices appended to a file per process: the
# tests count, across every trainer of every generation, how often each sample was used. In float64,
# so that a job's parameters can be compared with a single process's to 1e-9: in float32, the
# rounding of sums split differently over ranks grows over a few hundred iterations of this small
# net to as much as 0.02 on some runs, hiding what the comparison is for.
RECORDED_DIGITS = """
import os
import time

from jabascli.builtin_models import digits
from jabascli.builtin_models.digits import count_correct, loss, optimizer


def build_model(options):
    return digits.build_model(options).double()


class Recorded:
    def __init__(self, inner, folder):
        self.inner, self.folder = inner, folder

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        x, y = self.inner[i]
        return x.double(), y

    def __getitems__(self, indices):
        if self.folder is not None and os.path.exists(os.path.join(self.folder, "slow")):
            time.sleep(0.1)  # a test that must act while the job is under way slows it down
        if self.folder is not None:
            with open(os.path.join(self.folder, f"samples-{os.getpid()}.txt"), "a") as f:
                f.write(" ".join(map(str, indices)) + "\\n")
        return [self[i] for i in indices]


def train_dataset(options):
    return Recorded(digits.train_dataset(options), options["record"])


def val_dataset(options):
    return Recorded(digits.val_dataset(options), None)


def synthetic_batch(batch_size, options):
    x, y = digits.synthetic_batch(batch_size, options)
    return x.double(), y
"""
TRAINER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def slow_down(folder: Path) -> Path:
    """Each batch of RECORDED_DIGITS recording into ``folder/samples`` takes 0.1 s more until the file returned
    is removed: for a test that must act while the job is still under way, however busy the machine."""
    path = folder / "samples" / "slow"
    path.touch()
    return path


def write_config(
    folder: Path,
    *,
    available: list[str] | None = None,
    epochs: int = 2,
    port: int | None = None,
    scheduler: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
    record: bool = False,
    lbs: int = 16,
    slowdown: tuple[float, float] = (2.0, 3.0),
) -> Path:
    """Digits on two one-device emulated servers: A (VSW 2, 2x slower than the CPU) and B (VSW 1, 3x).

    The emulated slowdown sleeps rather than computes: epochs long enough to steer, on a busy machine.

    With ``record``, every training sample used is written down under ``folder/samples``.
    """
    workload, options = "digits", {"lr": 0.05, "width": 4, **(options or {})}
    if record:
        (folder / "samples").mkdir(parents=True, exist_ok=True)
        (folder / "recorded_digits.py").write_text(RECORDED_DIGITS)
        workload, options["record"] = str(folder / "recorded_digits.py"), str(folder / "samples")
    config = {
        "job": {"name": "digits", "workload": workload, "epochs": epochs, "lbs": lbs, "options": options},
        "batching": {"metric": "fixed"},
        "cluster": {
            "available_servers": available or ["A"],
            "servers": [
                {
                    "name": "A",
                    "device_type": "cpu",
                    "devices": 1,
                    "vsw": 2,
                    "emulate": {"slowdown": slowdown[0], "memory_bytes": 2_000_000_000},
                },
                {
                    "name": "B",
                    "device_type": "cpu",
                    "devices": 1,
                    "vsw": 1,
                    "emulate": {"slowdown": slowdown[1], "memory_bytes": 2_000_000_000},
                },
            ],
        },
        "scheduler": {
            "port": port or free_port(),
            "heartbeat_interval_s": 0.2,
            "heartbeat_timeout_s": 5.0,
            "connect_timeout_s": 5.0,
            **(scheduler or {}),
        },
        "storage": {"checkpoint_dir": str(folder / "checkpoints"), "run_dir": str(folder / "runs")},
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "job.toml"
    path.write_bytes(tomli_w.dumps(config).encode())
    return path


@contextmanager
def serving(
    loaded: LoadedConfig, token: str = TOKEN, clock: Callable[[], float] | None = None
) -> Iterator[tuple[str, Scheduler]]:
    """A real scheduler server on loopback, in a thread; yields its base URL and its state. ``clock``: the
    scheduler's (its timeouts), when not the real one."""
    scheduler = Scheduler(loaded) if clock is None else Scheduler(loaded, clock)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(scheduler, token), host="127.0.0.1", port=port, log_level="error")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", scheduler
    finally:
        server.should_exit = True
        thread.join(10)


def jabas(*args: str, env: dict[str, str] | None = None, log: Path | None = None) -> subprocess.Popen[bytes]:
    """A real `jabas` process (the scheduler or an agent), its output in ``log``."""
    out = log.open("wb") if log is not None else subprocess.DEVNULL
    full_env = {**os.environ, **TRAINER_ENV, "JABAS_TOKEN": TOKEN, **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "jabascli", *args], env=full_env, stdout=out, stderr=subprocess.STDOUT
    )


def start_scheduler(
    config: Path, log: Path, env: dict[str, str] | None = None, tries: int = 3
) -> subprocess.Popen[bytes]:
    """``jabas schedule -c config``, once it listens. The config's port was free when the test chose it, but
    another process (the other xdist worker's) can take it before the scheduler binds it (seen once under
    `make test`: every agent then waited 60 s for a scheduler that had exited); the scheduler is then started
    again on another free port, written into the config before any agent reads it."""
    for attempt in range(tries):
        proc = jabas("schedule", "-c", str(config), env=env, log=log)
        url = f"http://127.0.0.1:{load_config(config).config.scheduler.port}/v1/job"
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                httpx.get(url, headers=auth(), timeout=2)
                return proc
            except httpx.TransportError:
                time.sleep(0.05)
        if proc.poll() is None or attempt == tries - 1 or "in use" not in log.read_text():
            return proc  # alive (the caller's waits time out with its log), or a failure of another kind
        data = tomllib.loads(config.read_text())
        data["scheduler"]["port"] = free_port()
        config.write_bytes(tomli_w.dumps(data).encode())
    raise AssertionError("unreachable")


def wait_status(url: str, until: Any, timeout: float = 120.0) -> dict[str, Any]:
    """Poll GET /v1/job until ``until(status)`` holds; the last status."""
    deadline = time.monotonic() + timeout
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            status = httpx.get(f"{url}/v1/job", headers=auth(), timeout=5).json()
        except httpx.TransportError:
            status = {}
        if status and until(status):
            return status
        time.sleep(0.1)
    raise AssertionError(f"timed out; last status: {status}")


def used_samples(folder: Path, dataset_size: int, epochs: int, seed: int = 0) -> list[dict[int, int]]:
    """Per epoch, how many times each sample was trained on, from the recorded micro-batches.

    A micro-batch is a run of consecutive entries of its epoch's permutation (engine/sampler.py);
    which epoch is found by matching it against each epoch's permutation.
    """
    from jabascli.engine.sampler import IIDPSampler

    sampler = IIDPSampler(dataset_size, seed)
    perms = [sampler.permutation(e) for e in range(epochs)]
    where = [{v: i for i, v in enumerate(p)} for p in perms]
    counts: list[dict[int, int]] = [{} for _ in range(epochs)]
    for path in sorted((folder / "samples").glob("samples-*.txt")):
        for line in path.read_text().splitlines():
            chunk = [int(v) for v in line.split()]
            epochs_matching = [
                e for e in range(epochs) if perms[e][where[e][chunk[0]] : where[e][chunk[0]] + len(chunk)] == chunk
            ]
            assert len(epochs_matching) == 1, f"micro-batch {chunk[:4]}... matches epochs {epochs_matching}"
            for v in chunk:
                counts[epochs_matching[0]][v] = counts[epochs_matching[0]].get(v, 0) + 1
    return counts


def auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def load(path: Path) -> LoadedConfig:
    return load_config(path)
