"""Every server pulls its weight: which servers a plan uses, and which LBS values the profiles cover.

On the seed's reference profiles (ResNet-50, V100 and P100 servers); the
slowing server is a P100 server behind a slow link (its inter-node all-reduce
then costs more than its share of the work saves).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from jabascli.cli.app import app
from jabascli.config import load_config
from jabascli.config.models import ServerConfig
from jabascli.errors import InputError
from jabascli.profiler.lbsplan import balanced_lbs, device_speeds, lbs_plan, split_efficiency
from jabascli.solver.autoplan import solve_for_run
from jabascli.solver.choice import choose_plan
from tests.test_solver_cli import server, toml_config

WIDE = {"COLUMNS": "200"}


def slow_link_config(tmp_path: Path, reference: Path, inter_bandwidth: float = 1e6) -> Path:
    slow = server("slow", "Tesla P100-PCIE-16GB") + f"inter_bandwidth = {inter_bandwidth}\n\n"
    return toml_config(tmp_path, reference, server("fast", "Tesla V100-PCIE-16GB") + slow)


def test_a_slowing_server_is_left_out_and_said_so(cli: CliRunner, reference_dir: Path, tmp_path: Path) -> None:
    config = slow_link_config(tmp_path, reference_dir)
    loaded = load_config(config)
    everyone = choose_plan(loaded, 256, "all").plan
    choice = choose_plan(loaded, 256)  # auto, the default
    assert {a.server for a in everyone.assignments} == {"fast", "slow"}
    assert {a.server for a in choice.plan.assignments} == {"fast"} and choice.left_out == ("slow",)
    assert choice.plan.iteration_time_s < everyone.iteration_time_s
    with_ms, without_ms = everyone.iteration_time_s * 1e3, choice.plan.iteration_time_s * 1e3
    assert with_ms >= 100 and without_ms >= 100  # shown to the millisecond (below 100 ms, to a tenth)
    assert choice.line() == f"slow left out: {with_ms:.0f} ms with it, {without_ms:.0f} ms without"

    result = cli.invoke(app, ["solve", "-c", str(config), "--gbs", "256"], env=WIDE)
    assert result.exit_code == 0, result.output
    assert "slow left out:" in result.stdout and "--servers all keeps every server" in result.stdout
    assert "fast:4GPU" in result.stdout and "slow:" not in result.stdout.split("left out")[0]
    kept = cli.invoke(app, ["solve", "-c", str(config), "--gbs", "256", "--servers", "all"], env=WIDE)
    assert kept.exit_code == 0, kept.output
    assert "slow:4GPU" in kept.stdout and "left out" not in kept.stdout


def test_a_server_that_helps_is_kept(reference_dir: Path, tmp_path: Path) -> None:
    loaded = load_config(slow_link_config(tmp_path, reference_dir, inter_bandwidth=12.5e9))
    choice = choose_plan(loaded, 512)
    assert {a.server for a in choice.plan.assignments} == {"fast", "slow"}
    assert choice.left_out == () and choice.line() is None


def test_run_solves_with_the_same_rule(reference_dir: Path, tmp_path: Path) -> None:
    loaded = load_config(slow_link_config(tmp_path, reference_dir))
    auto = solve_for_run(loaded, 256)
    assert auto is not None and auto.choice is not None and auto.choice.left_out == ("slow",)
    every = solve_for_run(loaded, 256, servers="all")
    assert every is not None and {a.server for a in every.plan.assignments} == {"fast", "slow"}
    with pytest.raises(InputError, match="a plan file names its servers already"):
        solve_for_run(loaded, None, has_plan_file=True, servers="fast")


def test_run_refuses_servers_beside_a_plan_file(cli: CliRunner, reference_dir: Path, tmp_path: Path) -> None:
    config = slow_link_config(tmp_path, reference_dir)
    result = cli.invoke(app, ["run", "-c", str(config), "--plan", str(tmp_path / "p.json"), "--servers", "fast"])
    assert result.exit_code == 2 and "--servers" in result.stderr and "Traceback" not in result.output


def cpu(name: str, slowdown: float | None = None, devices: int = 1) -> ServerConfig:
    emulate = None if slowdown is None else {"slowdown": slowdown, "memory_bytes": 10**9}
    device_type = "cpu" if slowdown is None else f"cpu-{name}"
    return ServerConfig.model_validate(
        {"name": name, "device_type": device_type, "devices": devices, "emulate": emulate}
    )


def best_split_efficiency(gbs: int, lbs: int, speeds: list[float]) -> float:
    """Ideal over achieved time of the best integer split of ``gbs / lbs`` workers (one device each)."""
    workers = gbs // lbs
    fast, slow = speeds
    ideal = workers / (fast + slow)
    achieved = min(max(w / fast, (workers - w) / slow) for w in range(1, workers))
    return ideal / achieved


@pytest.mark.parametrize("slowdown", [1.5, 3.0])
def test_profile_plan_holds_the_lbs_balanced_splits_need(slowdown: float) -> None:
    speeds = device_speeds([cpu("fast"), cpu("slow", slowdown)])
    assert speeds == [1.0, 1 / slowdown]
    plan = lbs_plan(64, 256, speeds)
    assert plan == sorted(plan) and plan[-1] == 256 and all(b & (b - 1) == 0 for b in plan)
    for gbs in (64, 96, 128, 192, 256):
        # An LBS of the plan splits this GBS with the slow device holding at least one worker,
        # within a tenth of the perfect balance (rounding to whole workers is what is left).
        best = max(best_split_efficiency(gbs, b, speeds) for b in plan if gbs % b == 0 and gbs // b >= 2)
        assert best >= 0.9, (gbs, plan)
        assert best == pytest.approx(max(split_efficiency(gbs // b, speeds) for b in plan if gbs % b == 0))
    if slowdown == 3.0:  # the case: fast 3 workers and slow 1 at LBS 16 (GBS 64), 64 (GBS 256)
        assert plan == [16, 32, 64, 128, 256]
        assert best_split_efficiency(64, 16, speeds) == 1.0 and best_split_efficiency(256, 64, speeds) == 1.0
    else:  # LBS 16 splits GBS 64 as 3 + 1 or 2 + 2 workers (0.8 of the balance); LBS 8 as 5 + 3 (0.96)
        assert plan == [8, 16, 32, 64, 128, 256]


def test_balanced_lbs_counts_every_device() -> None:
    # Two fast devices and one 3x slower: 7 shares; GBS 224 puts one worker of LBS 32 on the slow one.
    assert balanced_lbs(224, device_speeds([cpu("fast", devices=2), cpu("slow", 3.0)])) == 32
    assert balanced_lbs(8, [1.0, 0.1]) == 1  # never below one sample
    assert lbs_plan(256, 64, [1.0]) == [32, 64]  # a GBS range given upside down still plans the bound
    assert lbs_plan(1024, 4096, [1.0] * 4)[0] == 32  # never above 32: GBS steps of 32 stay reachable


def test_too_many_allocations_for_auto_fall_back_to_every_server(
    cli: CliRunner, reference_dir: Path, tmp_path: Path
) -> None:
    """Seven server types of 4 GPUs are 5^7 - 1 allocations: more than auto compares, so the default uses all."""
    servers = "".join(
        server(f"n{i}", "Tesla V100-PCIE-16GB") + f"inter_bandwidth = {(i + 1) * 1e9}\n\n" for i in range(7)
    )
    config = toml_config(tmp_path, reference_dir, servers)
    choice = choose_plan(load_config(config), 896)
    assert choice.plan.gpus == 28 and choice.left_out == ()
    refused = cli.invoke(app, ["solve", "-c", str(config), "--gbs", "896", "--servers", "auto"], env=WIDE)
    assert refused.exit_code == 2 and "candidate allocations" in refused.stderr
