"""From a config to a tuned run: `jabas profile all`, then `jabas run` solving its own plan.

Real profilers (child processes, gloo all-reduces over loopback) and real
trainers; timings are printed by the commands, never asserted.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from jabascli.cli.app import app
from jabascli.config import load_config
from jabascli.devices import trainer_threads
from jabascli.profiler.suite import comm_sizes, inter_commands
from jabascli.profiles import CompProfile, load_profile_set, read_comm_profile
from jabascli.profiles.conditions import Conditions, differences, server_note
from jabascli.solver.plan import read_plan

CONFIG = """\
[job]
name = "tiny"
workload = "digits"
epochs = 1
lbs = 16
options = {{ width = 8 }}

[batching]
metric = "fixed"
initial_gbs = 64

[profiles]
dir = "{root}/profiles"

[[cluster.servers]]
name = "fast"
device_type = "cpu"
host = "{fast_host}"
devices = 1

[[cluster.servers]]
name = "slow"
device_type = "cpu-slow"
devices = 1
emulate = {{ slowdown = 2.0, memory_bytes = {slow_memory} }}

[storage]
run_dir = "{root}/runs"
checkpoint_dir = "{root}/checkpoints"
"""


def write_config(root: Path, fast_host: str = "127.0.0.1", slow_memory: int = 50_000_000) -> Path:
    path = root / "jabas.toml"
    path.write_text(CONFIG.format(root=root, fast_host=fast_host, slow_memory=slow_memory), encoding="utf-8")
    return path


@pytest.mark.slow
def test_profile_all_then_run_with_no_plan_file(
    cli: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    config = write_config(tmp_path)
    profiled = cli.invoke(app, ["profile", "all", "-c", str(config), "--lbs", "32", "--iters", "3", "--json"])
    assert profiled.exit_code == 0, profiled.output
    report = json.loads(profiled.stdout)
    assert [s["name"] for s in report["stages"]] == [
        "bucket", "mem fast", "comp fast", "mem slow", "comp slow", "intra", "inter",
    ]  # fmt: skip
    assert all(s["ok"] for s in report["stages"]) and report["gbs_max"] == 64

    dirs = load_config(config).profile_dirs()
    profiles = load_profile_set(dirs.memory, dirs.computation, dirs.communication, dirs.bucket)
    # No LBS above GBS 64 and no VSW count above 64 / LBS: nothing the solver could choose was left out.
    assert {lbs for _, lbs in profiles.memory} == {32, 64}
    for (_, lbs), memory in profiles.memory.items():
        assert 1 <= memory.max_num_models <= 64 // lbs
    # Measured as `jabas run` runs the trainers here: two trainers share the cores.
    for (server, _, _), comp in profiles.comp.items():
        assert comp.threads == trainer_threads(2)
        assert comp.device == ("emulated" if server == "slow" else "cpu")
        assert comp.torch_version == torch.__version__ and comp.precision == "fp32"
    inter = read_comm_profile(dirs.communication, "inter")
    assert inter is not None and inter.meta is not None and inter.meta.world_size == 2
    assert read_comm_profile(dirs.communication, "intra") is not None

    # Run again: everything is on disk, nothing is measured.
    again = cli.invoke(app, ["profile", "all", "-c", str(config), "--lbs", "32", "--json"])
    assert again.exit_code == 0, again.output
    details = {s["name"]: s["detail"] for s in json.loads(again.stdout)["stages"]}
    assert "(0 measured now)" in details["comp fast"] and "(0 measured now)" in details["comp slow"]
    assert all("(on disk)" in details[name] for name in ("bucket", "intra", "inter"))

    # The solver follows the profiles: in a plan file for a GBS above the profiled one, a server measured at
    # least twice as fast at LBS 32 gets more of the samples, as more workers or a larger LBS of its own (the
    # emulated server is twice as slow, but a profile taken beside other tests can measure anything: checked is
    # the solver's use of them, not the host's timing), and `jabas run --plan` trains every step at its GBS.
    plan_file = tmp_path / "plan.json"
    solved = cli.invoke(app, ["solve", "-c", str(config), "--gbs", "96", "--servers", "all", "--out", str(plan_file)])
    assert solved.exit_code == 0, solved.output
    plan = read_plan(plan_file)
    samples = {a.server: a.samples(plan.lbs) for a in plan.assignments}
    assert plan.gbs == 96 == sum(samples.values()) and min(samples.values()) >= 1, samples
    ms = {server: profiles.comp[(server, 32, 1)].total_time for server in samples}
    if len(ms) == 2 and max(ms.values()) >= 2 * min(ms.values()):
        faster, slower = sorted(ms, key=ms.__getitem__)
        assert samples[faster] > samples[slower], (samples, ms)
    trained = cli.invoke(app, ["run", "-c", str(config), "--plan", str(plan_file), "--max-steps", "4", "--fresh"])
    assert trained.exit_code == 0, trained.output
    steps = list(csv.DictReader((tmp_path / "runs" / "tiny" / "steps.csv").open()))
    assert steps and {int(row["gbs"]) for row in steps} == {96} and int(steps[-1]["step"]) == 4

    # A plan that leaves a server out still runs as profiled: the fast trainer alone keeps the threads
    # it was profiled with, not both servers' cores (the README's two-server flow).
    alone = cli.invoke(app, ["run", "-c", str(config), "--servers", "fast", "--max-steps", "2", "--fresh"])
    assert alone.exit_code == 0, alone.output
    assert {a.server for a in read_plan(tmp_path / "runs" / "tiny" / "plan.json").assignments} == {"fast"}
    assert "runs otherwise than it was profiled" not in alone.output

    # jabas run with no plan file solves the plan for [batching] initial_gbs, trains it, and compares.
    monkeypatch.setenv("OMP_NUM_THREADS", str(trainer_threads(2) + 1))  # trainers now run otherwise than profiled
    ran = cli.invoke(app, ["run", "-c", str(config), "--max-steps", "12", "--fresh"])
    assert ran.exit_code == 0, ran.output
    assert "plan solved for GBS 64 ([batching] initial_gbs)" in ran.output
    assert "predicted" in ran.output and "measured" in ran.output and "ms per iteration" in ran.output
    assert "runs otherwise than it was profiled" in ran.output and "threads" in ran.output
    plan = read_plan(tmp_path / "runs" / "tiny" / "plan.json")
    assert plan.gbs == 64 and {a.server for a in plan.assignments} <= {"fast", "slow"}
    log = (tmp_path / "runs" / "tiny" / "logs" / "rank0.log").read_text(encoding="utf-8")
    assert log.count("runs otherwise than it was profiled") == 1

    # A server whose profile fails does not stop the others; the failure is named, exit 1.
    config.write_text(config.read_text().replace("memory_bytes = 50000000", "memory_bytes = 40000000"))
    failed = cli.invoke(app, ["profile", "all", "-c", str(config), "--lbs", "32"])
    assert failed.exit_code == 1, failed.output
    assert "mem slow failed" in failed.stderr and "40,000,000" in failed.stderr
    assert "comp fast" in failed.output and "inter" in failed.output


def test_servers_elsewhere_are_named_with_what_to_run(cli: CliRunner, tmp_path: Path) -> None:
    config = write_config(tmp_path, fast_host="10.9.8.7")
    result = cli.invoke(app, ["profile", "all", "-c", str(config)])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "fast (10.9.8.7)" in lines[0] and "--server NAME" in lines[0]
    assert not (tmp_path / "profiles").exists()


def test_inter_node_commands_and_message_sizes(tmp_path: Path) -> None:
    loaded = load_config(write_config(tmp_path, fast_host="10.9.8.7"), check_profiles=False)
    commands = inter_commands(loaded, port=29510)
    assert [c.split("--rank ")[1].split()[0] for c in commands] == ["0", "1"]
    assert all("--world 2 --master 10.9.8.7:29510" in c for c in commands)
    assert "--server slow" in commands[1]
    assert comm_sizes([0.25, 1.0]) == "0.125:2.5"


def test_missing_conditions_are_unknown_and_differences_are_named() -> None:
    times = dict(total_time=1, data_time=0, fwd_time=0.5, bwd_time=0.5, update_time=0, copy_time=0)
    seed = CompProfile(model="m", gpu_type="V100", lbs=32, num_models=1, **times)  # the seed's files: no conditions
    running = Conditions("cpu", 1.0, 1, "fp32", torch.__version__)
    assert Conditions.of_profile(seed) is None
    assert "conditions unknown" in (server_note("a", [seed], running) or "")
    measured = seed.model_copy(update=dict(device="cpu", threads=2, torch_version=torch.__version__, precision="fp32"))
    assert differences(Conditions.of_profile(measured), running) == ["threads 2 (profiled) vs 1 (running)"]  # type: ignore[arg-type]
    assert server_note("a", [measured.model_copy(update={"threads": 1})], running) is None
    on_gpu = Conditions("cuda", 1.0, 8, "fp32", torch.__version__)
    assert differences(on_gpu, Conditions("cuda", 1.0, 1, "fp32", torch.__version__)) == []  # threads: CPU only


def test_a_stage_names_itself_once_in_a_note() -> None:
    """`profile all`'s lines: "intra: 0.0625 MB in ..." from the profiler, not "intra: intra: ..."."""
    from jabascli.profiler.common import Reporter, ShareReporter

    class Lines(Reporter):
        def __init__(self) -> None:
            self.lines: list[str] = []

        def note(self, message: str) -> None:
            self.lines.append(message)

    outer = Lines()
    stage = ShareReporter(outer, 0.0, 1.0, 1.0, "intra: ")  # as profile_all reports a stage
    stage.note("intra: 0.0625 MB in 0.294 ms")
    stage.note("port in use")
    assert outer.lines == ["intra: 0.0625 MB in 0.294 ms", "intra: port in use"]
