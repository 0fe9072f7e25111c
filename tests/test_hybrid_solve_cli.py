"""`jabas solve --hybrid`: the plan from hybrid profiles on a job's servers, the plan file the runtime reads (its
``parallel`` section and every rank's micro-batches), the GBS range, and bad input (one line, exit 2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from jabascli.cli.app import app
from jabascli.config import load_config
from jabascli.config.models import ParallelConfig
from jabascli.engine.plan import load_plan
from jabascli.errors import InputError
from jabascli.hybrid.job import range_values
from jabascli.profiles.hybrid import (
    BandwidthFit,
    BlockInfo,
    DeviceTimes,
    HybridProfiles,
    ModelBlocks,
    Network,
    read_profiles,
    write_profiles,
)
from jabascli.solver import read_plan

GB = 1e9
WIDE = {"COLUMNS": "200"}


def profiles(n_blocks: int = 4, tps: tuple[int, ...] = (1, 2)) -> HybridProfiles:
    """``n_blocks`` blocks of 1 GB of parameters (Adam: 4 GB a block in all) and 0.5 GB of activations a sample;
    ``slow`` takes 3x ``fast``'s time; TP 2 halves the bytes and takes 65% of the time."""
    blocks = [
        BlockInfo(
            name=f"b{i}",
            params_bytes={t: GB / t for t in tps},
            act_bytes={t: 0.5 * GB / t for t in tps},
            boundary_bytes=0.01 * GB,
        )
        for i in range(n_blocks)
    ]
    model = ModelBlocks(model="toy", blocks=blocks, optimizer_bytes_per_param_byte=2.0)
    devices = {}
    for name, speed in (("fast", 1.0), ("slow", 3.0)):
        scale = {t: speed * (1.0 if t == 1 else 1.3 / t) for t in tps}
        times = {b: {t: [(0.01 * b * scale[t], 0.02 * b * scale[t], 0.001)] * n_blocks for t in tps} for b in (1, 2)}
        devices[name] = DeviceTimes(device=name, memory_bytes=80 * GB, devices_per_server=2, times=times)
    intra = {d: {1: BandwidthFit(coeffs=[100.0]), 2: BandwidthFit(coeffs=[100.0])} for d in devices}
    inter = {d: {1: BandwidthFit(coeffs=[50.0]), 2: BandwidthFit(coeffs=[50.0])} for d in devices}
    return HybridProfiles(blocks=model, devices=devices, network=Network(intra=intra, inter=inter))


def job(tmp_path: Path, memory_gb: float | None = None, extra: str = "") -> Path:
    """A job on one fast and one slow server of 2 devices each, its hybrid profiles under profiles/."""
    write_profiles(tmp_path / "profiles", profiles())
    budget = f"memory_bytes = {int(memory_gb * GB)}\n" if memory_gb is not None else ""
    config = tmp_path / "jabas.toml"
    config.write_text(
        '[job]\nworkload = "gpt"\n\n'
        + "".join(
            f'[[cluster.servers]]\nname = "{name}"\ndevice_type = "{name}"\ndevices = 2\n{budget}\n'
            for name in ("fast", "slow")
        )
        + extra
    )
    return config


def invoke(cli: CliRunner, *args: str):  # type: ignore[no-untyped-def]
    return cli.invoke(app, ["solve", "--hybrid", *args], env=WIDE)


def test_plain_iidp_when_the_model_fits(cli: CliRunner, tmp_path: Path) -> None:
    config = job(tmp_path)
    out = tmp_path / "plan.json"
    result = invoke(cli, "-c", str(config), "--gbs", "16", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "plain IIDP" in result.stdout and "stages" in result.stdout
    plan = read_plan(out)
    assert plan.parallel == ParallelConfig(tp=1, pp=1, stages=[(0, 3)])
    # The fast server's two ranks run 3x the slow's micro-batches (IIDP), 16 samples in all.
    per_server = {a.server: a.workers for a in plan.assignments}
    assert per_server == {"fast": 12, "slow": 4}
    assert plan.gbs == plan.lbs * plan.workers == 16


def test_memory_budget_forces_a_hybrid_layout_the_runtime_reads(cli: CliRunner, tmp_path: Path) -> None:
    # 4 blocks x 4 GB of parameters, gradients and Adam state: a whole replica needs 16 GB; the budget is 11 GB.
    config = job(tmp_path, memory_gb=11)
    out = tmp_path / "plan.json"
    result = invoke(cli, "-c", str(config), "--gbs", "16", "--json", "--out", str(out))
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert json.loads(out.read_text()) == document
    assert document["predicted"]["layout"] == "hybrid"
    assert max(max(row) for row in document["predicted"]["peak_bytes"]) <= 11 * GB
    plan = read_plan(out)
    assert plan.parallel is not None and plan.parallel.tp * plan.parallel.pp > 1
    # The runtime's plan: one rank per device named, every rank of a replica with its share of micro-batches.
    training = load_plan(load_config(config), out)
    assert training.parallel == plan.parallel
    assert training.gbs == 16 and training.world_size == sum(a.gpus for a in plan.assignments)
    assert training.world_size % (plan.parallel.tp * plan.parallel.pp) == 0


def test_table_names_stages_blocks_and_memory(cli: CliRunner, tmp_path: Path) -> None:
    result = invoke(cli, "-c", str(job(tmp_path, memory_gb=11)), "--gbs", "16")
    assert result.exit_code == 0, result.output
    for text in ("stage", "blocks", "device type", "peak/device", "budget", "micro-batches each", "11.00 GB"):
        assert text in result.stdout
    assert "s per iteration predicted" in result.stdout


def test_range_plans_every_doubling(cli: CliRunner, tmp_path: Path) -> None:
    assert range_values(256, 32768) == [256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
    assert range_values(4, 20) == [4, 8, 16, 20]
    result = invoke(cli, "-c", str(job(tmp_path)), "--range", "4:32", "--json")
    assert result.exit_code == 0, result.output
    plans = json.loads(result.stdout)["plans"]
    assert [p["gbs"] for p in plans] == [4, 8, 16, 32]
    assert all(p["gbs"] == p["lbs"] * sum(a["gpus"] * (a["ga"] + 1) for a in p["assignments"]) for p in plans)


def test_resolve_layout_takes_the_plans_parallel(tmp_path: Path) -> None:
    from jabascli.engine.parallel.layout import resolve_layout
    from jabascli.workload import load_workload

    loaded = load_config(job(tmp_path))
    workload = load_workload("gpt")
    assert resolve_layout(loaded, workload, 4) is None  # no [parallel] in the config
    layout = resolve_layout(loaded, workload, 4, ParallelConfig(checkpointing=[1, 2]))
    assert layout is not None and layout.checkpointed == (1, 2)


def _one_line(result) -> str:  # type: ignore[no-untyped-def]
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_missing_block_is_named(cli: CliRunner, tmp_path: Path) -> None:
    config = job(tmp_path)
    path = tmp_path / "profiles" / "hybrid" / "toy" / "device-slow.json"
    data = json.loads(path.read_text())
    data["times"]["2"]["1"].pop()
    path.write_text(json.dumps(data))
    line = _one_line(invoke(cli, "-c", str(config), "--gbs", "16"))
    assert "device-slow.json" in line and "times.2.1" in line and "3 blocks" in line and "has 4" in line


def test_missing_tp_degree_is_named(cli: CliRunner, tmp_path: Path) -> None:
    config = job(tmp_path)
    line = _one_line(invoke(cli, "-c", str(config), "--gbs", "16", "--tp", "4"))
    assert "device-fast.json" in line and "no block times at TP degree 4 (have [1, 2])" in line


def test_device_type_without_profile_is_named(cli: CliRunner, tmp_path: Path) -> None:
    config = job(tmp_path, extra='[[cluster.servers]]\nname = "new"\ndevice_type = "H100"\n')
    line = _one_line(invoke(cli, "-c", str(config), "--gbs", "16"))
    assert "device-H100.json" in line and "server new" in line


def test_memory_budget_no_plan_fits(cli: CliRunner, tmp_path: Path) -> None:
    # The least a device holds: one block (1 GB) in a 4-stage pipeline, its gradient and Adam state (4 GB in all,
    # one replica: nothing to shard over) and 4 micro-batches in flight of its input (0.01 GB) and its recompute
    # (0.5 GB), every block checkpointed: 4.51 GB.
    line = _one_line(invoke(cli, "-c", str(job(tmp_path, memory_gb=1)), "--gbs", "16"))
    assert "no plan fits the devices' memory at GBS 16" in line
    assert (
        "the smallest footprint found needs 4.51 GB on a slow device (every block checkpointed), which has 1.00 GB"
        in line
    )


def test_imported_folder_in_the_wrong_format(cli: CliRunner, tmp_path: Path) -> None:
    config = job(tmp_path)
    (tmp_path / "profiles" / "hybrid" / "toy" / "blocks.json").write_text('{"format": "jabas-hybrid-blocks/1"}')
    line = _one_line(invoke(cli, "-c", str(config), "--gbs", "16"))
    assert "blocks.json" in line and "model" in line
    wrong = tmp_path / "not-sailor"
    wrong.mkdir()
    (wrong / "README").write_text("nothing")
    result = cli.invoke(app, ["profile", "import", "--from", "sailor", str(wrong), "--out", str(tmp_path / "x")])
    assert "not a Sailor folder: no llm_info.json under it" in _one_line(result)
    assert not (tmp_path / "x").exists()


def test_hybrid_options_need_hybrid(cli: CliRunner, tmp_path: Path) -> None:
    result = cli.invoke(app, ["solve", "-c", str(job(tmp_path)), "--gbs", "16", "--tp", "2"], env=WIDE)
    assert "--tp: goes with --hybrid" in _one_line(result)
    result = invoke(cli, "-c", str(job(tmp_path)), "--gbs", "16", "--servers", "all")
    assert "--servers: not used with --hybrid" in _one_line(result)


@pytest.mark.parametrize("model", [None, "toy"])
def test_profiles_parse_back(tmp_path: Path, model: str | None) -> None:
    write_profiles(tmp_path, profiles())
    assert read_profiles(tmp_path, model or "toy") == profiles()


def test_a_plan_the_runtime_cannot_deal_is_refused(cli: CliRunner, tmp_path: Path) -> None:
    # One micro-batch cannot be dealt to the two ranks of a TP group: each rank runs one at least.
    line = _one_line(invoke(cli, "-c", str(job(tmp_path)), "--gbs", "1", "--tp", "2"))
    assert "no plan at GBS 1 gives every device of a replica one micro-batch at least" in line
    result = invoke(cli, "-c", str(job(tmp_path)), "--gbs", "1", "--json")  # TP 1: one replica, one device
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["assignments"] == [
        {"server": "fast", "device_type": "fast", "gpus": 1, "vsw": 1, "ga": 0, "iteration_time_s": pytest.approx(0.12)}
    ]


def test_jabas_run_solves_the_hybrid_plan_when_asked(tmp_path: Path) -> None:
    from jabascli.solver.autoplan import solve_for_run

    config = job(tmp_path, memory_gb=11, extra='[parallel]\nplan = "auto"\n')
    solved = solve_for_run(load_config(config), 16)
    assert solved is not None and solved.source == "--gbs"
    assert solved.plan.parallel is not None and solved.plan.parallel.tp * solved.plan.parallel.pp > 1
    assert solved.plan.gbs == 16
    with pytest.raises(InputError, match="the hybrid search picks the servers"):
        solve_for_run(load_config(config), 16, servers="all")
    shutil.rmtree(tmp_path / "profiles")
    with pytest.raises(
        InputError, match=r'no hybrid profiles for \[parallel\] plan = "auto": run `jabas profile hybrid'
    ):
        solve_for_run(load_config(config), 16)


def test_auto_layout_needs_a_plan(tmp_path: Path) -> None:
    from jabascli.engine.parallel.layout import resolve_layout
    from jabascli.workload import load_workload

    loaded = load_config(job(tmp_path, extra='[parallel]\nplan = "auto"\n'))
    with pytest.raises(InputError, match=r'parallel\.plan: "auto" takes the layout from a hybrid plan file'):
        resolve_layout(loaded, load_workload("gpt"), 4)
    layout = resolve_layout(loaded, load_workload("gpt"), 4, ParallelConfig(checkpointing=[3]))
    assert layout is not None and layout.checkpointed == (3,)
