"""`jabas profile ...` end to end: real trials in child processes, files read back, bad input named."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from jabascli.cli.app import app
from jabascli.config import load_config
from jabascli.errors import RuntimeFailure
from jabascli.profiler.comp import vsw_points
from jabascli.profiler.memory import profile_memory, trial_bound
from jabascli.profiles import (
    MemoryProfile,
    load_profile_set,
    read_bucket_profile,
    read_comm_profile,
    read_memory_profiles,
    ring_allreduce_ideal_ms,
    write_memory_profile,
)
from jabascli.profiles.formats import CompProfile, read_comp_profile
from tests.conftest import WITH_SIGINT

BUDGET = 2_000_000  # bytes: digits fits a few VSWs at LBS 16 and none by LBS 64
EMULATED = f"""
[[cluster.servers]]
name = "emu"
device_type = "emulated-small"
intra_bandwidth = 2e9
emulate = {{ slowdown = 2.0, memory_bytes = {BUDGET} }}
"""

TINY_CNN = '''
"""A tiny CNN on random 3x16x16 images."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

NAME = "tinycnn"


def build_model(options):
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(16, 4),
    )


def train_dataset(options):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.rand(64, 3, 16, 16, generator=g), torch.randint(0, 4, (64,), generator=g))


def loss(output, target):
    return F.cross_entropy(output, target)


def optimizer(params, options):
    return torch.optim.Adam(params, lr=1e-3)


def synthetic_batch(batch_size, options):
    return torch.rand(batch_size, 3, 16, 16), torch.randint(0, 4, (batch_size,))
'''


def make_job(tmp_path: Path, servers: str = EMULATED, workload: str = "digits") -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = tmp_path / "jabas.toml"
    config.write_text(f'[job]\nworkload = "{workload}"\n\n[profiles]\ndir = "profiles"\n{servers}')
    return config


def profile(cli: CliRunner, *args: str) -> object:
    return cli.invoke(app, ["profile", *args], env={"COLUMNS": "200"})


def folders(config: Path) -> dict[str, Path]:
    root = config.parent / "profiles"
    return {
        "memory": root / "cluster_mem_profile_data",
        "comp": root / "cluster_comp_profile_data",
        "comm": root / "comm_profile_data",
        "bucket": root / "bucket_profile_data",
    }


def check_memory_profile(profile: MemoryProfile, budget: int, cap: int) -> None:
    """Self-consistency of one memory profile and its trials."""
    trials = profile.trials or []
    assert 1 <= len(trials) <= trial_bound(profile.max_num_models)
    fitting = sorted((t.num_models, t.peak_bytes) for t in trials if t.fits)
    failing = [t for t in trials if not t.fits]
    assert fitting[-1][0] == profile.max_num_models
    peaks = [peak for _, peak in fitting]
    assert peaks == sorted(peaks), f"more VSWs took less memory: {fitting}"
    assert all(peak is not None and 0 < peak <= budget for peak in peaks)
    for t in failing:
        assert t.num_models > profile.max_num_models
        assert t.peak_bytes is not None and t.peak_bytes > budget and "budget" in (t.error or "")
    # The search stopped where the next count no longer fits (or at the cap it was given).
    assert profile.max_num_models == cap or any(t.num_models == profile.max_num_models + 1 for t in failing)


def test_digits_on_an_emulated_device(cli: CliRunner, tmp_path: Path) -> None:
    config = make_job(tmp_path)
    where = folders(config)
    result = profile(cli, "mem", "-c", str(config), "--lbs", "16", "--threads", "1", "--json")
    assert result.exit_code == 0, result.output
    run = json.loads(result.stdout)
    assert run["device_type"] == "emulated-small" and run["memory_bytes"] == BUDGET

    # The sweep grows the LBS by 16 and stops at the first LBS where not even 1 VSW fits.
    lbs_tried = [r["lbs"] for r in run["results"]]
    assert lbs_tried == list(range(16, 16 * len(lbs_tried) + 1, 16))
    last = run["results"][-1]
    assert last["max_num_models"] == 0 and last["path"] is None and len(last["trials"]) == 1
    assert last["trials"][0]["peak_bytes"] > BUDGET and run["stopped"].startswith("not even 1 VSW fits")

    profiles = read_memory_profiles(where["memory"])
    assert sorted(lbs for _, lbs in profiles) == lbs_tried[:-1] and len(profiles) >= 2
    cap = 64
    for lbs in lbs_tried[:-1]:
        mem = profiles[("emu", lbs)]
        assert mem.gpu_type == "emulated-small" and mem.total_memory == BUDGET
        check_memory_profile(mem, BUDGET, cap)
        cap = mem.max_num_models
    assert profiles[("emu", 16)].max_num_models >= 2
    # A larger LBS never takes less memory for the same VSW count.
    one_vsw = [next(t["peak_bytes"] for t in r["trials"] if t["num_models"] == 1) for r in run["results"]]
    assert one_vsw == sorted(one_vsw)

    result = profile(cli, "comp", "-c", str(config), "--warmup", "1", "--iters", "3", "--threads", "1", "--json")
    assert result.exit_code == 0, result.output
    measured = load_profile_set(where["memory"], where["comp"])  # also checks memory and computation agree
    expected = {(lbs, n) for (_, lbs), m in profiles.items() for n in vsw_points(m.max_num_models)}
    assert {(lbs, n) for (_, lbs, n) in measured.comp} == expected
    for comp in measured.comp.values():
        parts = comp.data_time + comp.fwd_time + comp.bwd_time + comp.update_time + comp.copy_time
        assert comp.model == "digits" and comp.total_time == pytest.approx(parts + comp.overhead_time)
        # The engine's step: on the CPU one replica runs the VSWs in turn, so there is nothing to copy.
        assert comp.vsw_strategy == "sequential" and comp.copy_time < 0.01 and comp.overhead_time > 0
        assert comp.fwd_time > 0 and comp.bwd_time > 0
        assert comp.slowdown == 2.0 and comp.timer == "perf_counter" and comp.iterations is not None
        assert comp.spread is not None and set(comp.spread) >= {"fwd_time", "total_time"}
        low, high = comp.spread["total_time"]
        assert low <= high

    result = profile(cli, "bucket", "-c", str(config))
    assert result.exit_code == 0, result.output
    assert read_bucket_profile(where["bucket"], "digits").bucket_size_distribution == [pytest.approx(9978 * 4 / 2**20)]

    result = profile(cli, "summary", str(config.parent / "profiles"))
    assert result.exit_code == 0, result.output
    assert "emulated-small" in result.output and "max" in result.output

    # Everything on disk is skipped on a second run: no trial, no measurement.
    again = profile(cli, "mem", "-c", str(config), "--lbs", "16", "--threads", "1", "--json")
    assert again.exit_code == 0, again.output
    rerun = json.loads(again.stdout)
    assert all(r["skipped"] for r in rerun["results"][:-1]) and rerun["results"][-1]["trials"] == last["trials"]
    again = profile(cli, "comp", "-c", str(config), "--json")
    assert again.exit_code == 0 and all(r["skipped"] for r in json.loads(again.stdout))

    # Profiles record how they were measured, and a job in another precision refuses them.
    for measured in [*profiles.values(), *load_profile_set(where["memory"], where["comp"]).comp.values()]:
        assert (measured.precision, measured.torch_version, measured.threads) == ("fp32", torch.__version__, 1)
    config.write_text(config.read_text().replace("[job]\n", '[job]\nprecision = "bf16"\n'))
    for command in (["profile", "mem", "-c", str(config), "--lbs", "16"], ["solve", "-c", str(config), "--gbs", "32"]):
        refused = cli.invoke(app, command)
        assert refused.exit_code == 2, refused.output
        assert "precision" in refused.stderr and "measured in fp32" in refused.stderr, refused.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a plain server is profiled on the GPU there")
def test_tiny_cnn_on_a_small_cpu_server(cli: CliRunner, tmp_path: Path) -> None:
    (tmp_path / "tiny_cnn.py").write_text(TINY_CNN)
    budget = 500_000  # two VSWs of the tiny CNN fit at LBS 8, three do not
    config = make_job(
        tmp_path,
        f'[[cluster.servers]]\nname = "box"\ndevice_type = "cpu"\nmemory_bytes = {budget}\n',
        workload="tiny_cnn.py",
    )
    where = folders(config)
    args = ["-c", str(config), "--lbs", "8", "--search", "static", "--threads", "1", "--json"]
    result = profile(cli, "mem", *args)
    assert result.exit_code == 0, result.output
    mem = read_memory_profiles(where["memory"])
    assert list(mem) == [("box", 8)]
    check_memory_profile(mem[("box", 8)], budget, 64)
    assert mem[("box", 8)].max_num_models == 2
    assert [t.num_models for t in mem[("box", 8)].trials or []] == [1, 2, 4, 3]

    result = profile(cli, "comp", "-c", str(config), "--warmup", "1", "--iters", "3", "--threads", "1")
    assert result.exit_code == 0, result.output
    comp = load_profile_set(where["memory"], where["comp"]).comp
    assert sorted(comp) == [("box", 8, 1), ("box", 8, 2)]
    assert comp[("box", 8, 1)].slowdown == 1.0 and comp[("box", 8, 2)].copy_time > 0
    assert (where["comp"] / "8" / "box" / "box_tinycnn_8_2_comp_profile.json").is_file()

    result = profile(cli, "bucket", "-c", str(config), "--bucket-cap-mb", "0.001")
    assert result.exit_code == 0, result.output
    buckets = read_bucket_profile(where["bucket"], "tinycnn")
    params = (3 * 8 * 9 + 8 + 8 * 16 * 9 + 16 + 16 * 4 + 4) * 4 / 2**20
    assert buckets.bucket_cap_mb == pytest.approx(0.001, rel=1e-3) and len(buckets.bucket_size_distribution) > 1
    assert sum(buckets.bucket_size_distribution) == pytest.approx(params)


def test_comm_on_two_gloo_processes_can_be_fitted(cli: CliRunner, tmp_path: Path) -> None:
    config = make_job(tmp_path)
    sizes = "0.0625,0.25,1,2"
    result = profile(cli, "comm", "-c", str(config), "--sizes", sizes, "--nprocs", "2", "--reps", "10")
    assert result.exit_code == 0, result.output
    comm = read_comm_profile(folders(config)["comm"], "intra")
    assert comm is not None and comm.meta is not None
    assert (comm.meta.world_size, comm.meta.bandwidth, comm.meta.backend) == (2, 2e9, "gloo")
    assert comm.meta.sizes_bytes == [int(float(s) * 2**20) for s in sizes.split(",")]
    assert comm.ideal_ms == [pytest.approx(ring_allreduce_ideal_ms(s, 2e9, 2)) for s in comm.meta.sizes_bytes]
    assert all(b > a for a, b in zip(comm.ideal_ms, comm.ideal_ms[1:], strict=False))
    assert all(m > 0 and np.isfinite(m) for m in comm.measured_ms)
    # What the performance model does with it: measured = a * ideal + b.
    slope, intercept = np.polyfit(comm.ideal_ms, comm.measured_ms, 1)
    assert np.isfinite(slope) and np.isfinite(intercept)
    # Measured again only with --force.
    again = profile(cli, "comm", "-c", str(config), "--sizes", sizes, "--json")
    assert again.exit_code == 0 and json.loads(again.stdout)["skipped"] is True


def test_ctrl_c_leaves_only_complete_files(cli: CliRunner, tmp_path: Path) -> None:
    config = make_job(tmp_path)
    where = folders(config)
    write_memory_profile(
        where["memory"], "emu", MemoryProfile(gpu_type="emulated-small", total_memory=BUDGET, lbs=8, max_num_models=2)
    )
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("JABAS_DEBUG", None)
    command = [sys.executable, "-c", WITH_SIGINT, "profile", "comp", "-c", str(config)]
    proc = subprocess.Popen(
        [*command, "--warmup", "1", "--iters", "300", "--threads", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 240
        while not list(where["comp"].rglob("*.json")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, "the run ended before it could be interrupted"
        proc.send_signal(signal.SIGINT)  # while the second configuration is being measured
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130 and "interrupted" in stderr, stderr
    files = sorted(p.name for p in where["comp"].rglob("*") if p.is_file())
    assert files == ["emu_digits_8_1_comp_profile.json"], files  # no temporary or partial file
    first = load_profile_set(where["memory"], where["comp"]).comp[("emu", 8, 1)]

    # Running again keeps what is complete and measures the rest.
    result = profile(cli, "comp", "-c", str(config), "--warmup", "0", "--iters", "2", "--threads", "1", "--json")
    assert result.exit_code == 0, result.output
    runs = {r["num_models"]: r for r in json.loads(result.stdout)}
    assert sorted(runs) == [1, 2] and runs[1]["skipped"] and not runs[2]["skipped"]
    assert runs[1]["total_time"] == first.total_time


# Bad input ----------------------------------------------------------------------


def test_bad_input_is_named_with_exit_code_2(cli: CliRunner, tmp_path: Path) -> None:
    config = make_job(tmp_path)

    def fails(*args: str) -> str:
        result = profile(cli, *args)
        assert result.exit_code == 2, result.output
        assert "Traceback" not in result.output
        return result.output

    assert "--lbs: must be positive" in fails("mem", "-c", str(config), "--lbs", "0")
    assert "--search" in fails("mem", "-c", str(config), "--search", "sideways")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert "not writable" in fails("mem", "-c", str(config), "--out", str(blocker / "mem"))
    assert "no server named 'nope'" in fails("mem", "-c", str(config), "--server", "nope")

    incomplete = tmp_path / "incomplete.py"
    incomplete.write_text("def build_model(options):\n    return None\n")
    job = make_job(tmp_path / "w", workload=str(incomplete))
    out = fails("mem", "-c", str(job))
    assert str(incomplete) in out and "does not define" in out

    # Computation needs this server's memory profile, readable.
    assert "run `jabas profile mem` first" in fails("comp", "-c", str(config))
    mem = folders(config)["memory"]
    write_memory_profile(mem, "other", MemoryProfile(gpu_type="x", total_memory=1, lbs=8, max_num_models=1))
    assert "no memory profile for server 'emu' (it has profiles for other)" in fails("comp", "-c", str(config))
    bad = mem / "16" / "emu" / "max_memory_profile_info.json"
    bad.parent.mkdir(parents=True)
    bad.write_text("{not json")
    out = fails("comp", "-c", str(config))
    assert str(bad) in out and "invalid JSON" in out
    assert str(bad) in fails("summary", str(config.parent / "profiles"))

    assert "at least 2 processes" in fails("comm", "-c", str(config), "--nprocs", "1")
    assert "needs all three" in fails("comm", "-c", str(config), "--rank", "0")
    assert "--sizes" in fails("comm", "-c", str(config), "--sizes", "8:1")
    assert "--bucket-cap-mb" in fails("bucket", "-c", str(config), "--bucket-cap-mb", "0")
    assert "no profiles here" in fails("summary", str(tmp_path / "w"))


BROKEN = """
import os, signal, time
import torch
from torch import nn

NAME = "broken"


class Broken(nn.Linear):
    def forward(self, x):
        if os.environ.get("BROKEN_HOW") == "segfault":
            os.kill(os.getpid(), signal.SIGSEGV)
        if os.environ.get("BROKEN_HOW") == "hang":
            time.sleep(600)
        raise ValueError("boom: this model cannot run")


def build_model(options):
    return Broken(4, 2)


def train_dataset(options):
    return []


def loss(output, target):
    return output.sum()


def optimizer(params, options):
    return torch.optim.SGD(params, lr=0.1)


def synthetic_batch(batch_size, options):
    return torch.rand(batch_size, 4), torch.rand(batch_size, 2)
"""


@pytest.mark.parametrize("how", ["exception", "segfault"])
def test_a_crashing_trial_is_not_counted_as_out_of_memory(
    cli: CliRunner, tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "broken.py").write_text(BROKEN)
    config = make_job(tmp_path, workload="broken.py")
    monkeypatch.setenv("BROKEN_HOW", how)
    result = profile(cli, "mem", "-c", str(config), "--lbs", "4", "--search", "static", "--threads", "1")
    assert result.exit_code == 1, result.output
    assert "crashed (not counted as out of memory)" in result.output
    expected = "ValueError: boom: this model cannot run" if how == "exception" else "killed by SIGSEGV"
    assert expected in result.output
    assert not folders(config)["memory"].exists() or not list(folders(config)["memory"].rglob("*.json"))


def test_a_hanging_trial_times_out_and_the_next_one_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "broken.py").write_text(BROKEN)
    monkeypatch.setenv("BROKEN_HOW", "hang")
    loaded = load_config(make_job(tmp_path / "hang", workload=str(tmp_path / "broken.py")), check_profiles=False)
    with pytest.raises(RuntimeFailure, match="timed out and was killed"):
        profile_memory(loaded, lbs=4, search="static", threads=1, trial_timeout=3)
    # The process that starts trials is not poisoned by the one it had to kill.
    loaded = load_config(make_job(tmp_path / "fine"), check_profiles=False)
    run = profile_memory(loaded, lbs=4, search="static", max_vsw=1, threads=1)
    assert [r.max_num_models for r in run.results] == [1]


def test_inter_node_comm_between_two_local_nodes(tmp_path: Path) -> None:
    import socket
    import threading

    from jabascli.profiler.comm import profile_comm

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    loaded = load_config(make_job(tmp_path), check_profiles=False)
    outcome: dict[int, object] = {}

    def node(rank: int) -> None:
        try:
            outcome[rank] = profile_comm(
                loaded,
                out=tmp_path / f"node{rank}",
                sizes="0.25,1",
                nprocs=1,
                rank=rank,
                world=2,
                master=f"127.0.0.1:{port}",
                reps=5,
                rendezvous_timeout=120,
            )
        except Exception as exc:  # reported below
            outcome[rank] = exc

    threads = [threading.Thread(target=node, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    profiles = [read_comm_profile(tmp_path / f"node{rank}", "inter") for rank in (0, 1)]
    assert all(p is not None for p in profiles), outcome
    first, second = profiles
    assert first is not None and first.meta is not None and second is not None
    assert (first.meta.world_size, first.meta.bandwidth) == (2, 12.5e9)  # the server's inter_bandwidth
    assert first.ideal_ms == second.ideal_ms and first.measured_ms == second.measured_ms  # every node agrees
    assert read_comm_profile(tmp_path / "node0", "intra") is None


def test_profile_all_measures_short_points_in_several_processes(tmp_path: Path) -> None:
    """A point shorter than the threshold is measured in `repeats` processes; the run of median total is kept."""
    from jabascli.profiler.comp import PointBudget, profile_comp

    (tmp_path / "tiny_cnn.py").write_text(TINY_CNN)
    config = make_job(tmp_path, '[[cluster.servers]]\nname = "box"\ndevice_type = "cpu"\n', workload="tiny_cnn.py")
    loaded = load_config(config, check_profiles=False)
    profile_memory(loaded, lbs_values=[4], max_vsw=1, threads=1)
    short = profile_comp(loaded, iters=5, warmup=1, threads=1, budget=PointBudget(0.0, repeats=3, repeat_below_ms=1e6))
    [point] = short.results
    totals = point.profile.run_totals
    assert totals is not None and len(totals) == 3
    assert point.profile.total_time == sorted(totals)[1]  # the median run, not a mix of runs
    assert read_comp_profile(point.path).run_totals == totals  # written, and parses back
    long = profile_comp(
        loaded, iters=5, warmup=1, threads=1, force=True, budget=PointBudget(0.0, repeats=3, repeat_below_ms=1e-6)
    )
    assert long.results[0].profile.run_totals is None  # above the threshold: one process


def test_a_vsw_point_is_short_by_its_time_per_vsw() -> None:
    """VSW 5 at 75 ms runs 15 ms per VSW: measured in as many processes as the 15 ms single-VSW point,
    since whether VSWs pay is the ratio of the two (one draw against a median made VSWs "pay"). An
    emulated device's point is short by the CPU's work before the slowdown, which a draw is part of."""
    from jabascli.profiler.comp import PointBudget

    def point(n: int, total: float, slowdown: float | None = None) -> CompProfile:
        times = {"data_time": 0.0, "fwd_time": total / 2, "bwd_time": total / 2, "update_time": 0.0, "copy_time": 0.0}
        return CompProfile(model="m", gpu_type="cpu", lbs=8, num_models=n, total_time=total, slowdown=slowdown, **times)

    budget = PointBudget(repeats=3, repeat_below_ms=50.0)
    assert budget.runs(point(1, 15.0), on_gpu=False) == 3
    assert budget.runs(point(5, 75.0), on_gpu=False) == 3
    assert budget.runs(point(1, 75.0), on_gpu=False) == 1
    assert budget.runs(point(2, 120.0), on_gpu=False) == 1  # 60 ms per VSW
    assert budget.runs(point(1, 90.0, slowdown=3.0), on_gpu=False) == 3  # an emulated device: 30 ms of CPU work
    assert budget.runs(point(1, 180.0, slowdown=3.0), on_gpu=False) == 1
    assert budget.runs(point(1, 15.0), on_gpu=True) == 1  # a GPU measures each point once, after a cooldown


def test_profile_all_budget_bounds_each_point(tmp_path: Path) -> None:
    """With no seconds to spend, each point measures the fewest iterations, and `overlap` once per device."""
    from jabascli.profiler.comp import PointBudget, profile_comp
    from jabascli.profiler.trial import MIN_TIMED_ITERS

    (tmp_path / "tiny_cnn.py").write_text(TINY_CNN)
    config = make_job(tmp_path, '[[cluster.servers]]\nname = "box"\ndevice_type = "cpu"\n', workload="tiny_cnn.py")
    loaded = load_config(config, check_profiles=False)
    profile_memory(loaded, lbs_values=[4, 8], max_vsw=2, threads=1)
    budget = PointBudget(seconds=0.0, overlap_once=True)
    run = profile_comp(loaded, iters=50, warmup=1, threads=1, budget=budget)
    points = [(r.lbs, r.num_models) for r in run.results]
    assert points == [(4, 1), (4, 2), (8, 1), (8, 2)]
    assert all(r.profile.iterations == MIN_TIMED_ITERS for r in run.results)  # not the 50 asked for
    assert [r.profile.overlap_update_time is not None for r in run.results] == [True, False, False, False]
