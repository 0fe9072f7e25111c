"""`jabas solve`: the table, the JSON plan, the plan file, the range table, and bad input (exit 2)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from jabascli.cli.app import app
from jabascli.errors import InputError
from jabascli.solver import read_plan
from tests.conftest import run_jabas

WIDE = {"COLUMNS": "200"}


def invoke(cli: CliRunner, *args: str):  # type: ignore[no-untyped-def]
    return cli.invoke(app, ["solve", *args], env=WIDE)


def toml_config(tmp_path: Path, reference: Path, servers: str) -> Path:
    """A jabas.toml over the reference profiles, with the given [[cluster.servers]] entries."""
    config = tmp_path / "jabas.toml"
    config.write_text(
        "[profiles]\n"
        f'memory = "{reference / "cluster_mem_profile_data"}"\n'
        f'computation = "{reference / "cluster_comp_profile_data"}"\n'
        f'communication = "{reference / "comm_profile_data"}"\n'
        f'bucket = "{reference / "bucket_profile_data"}"\n\n' + servers
    )
    return config


def server(name: str, device: str, devices: int = 4) -> str:
    return f'[[cluster.servers]]\nname = "{name}"\ndevice_type = "{device}"\ndevices = {devices}\n\n'


def test_table_totals_and_seed_form(cli: CliRunner, reference_dir: Path) -> None:
    result = invoke(cli, "-c", str(reference_dir / "config.json"), "--gbs", "512")
    assert result.exit_code == 0, result.output
    out = result.stdout
    for text in ("Plan for GBS 512", "node0", "Tesla V100-PCIE-16GB", "node1", "predicted ms/iteration"):
        assert text in out
    assert "GBS 512 = LBS 32 x 16 workers on 8 GPUs, weight sync overlap:" in out and "samples/s" in out
    assert "node0:4GPU,VSW:3,GA:0 node1:4GPU,VSW:1,GA:0" in out


def test_json_is_only_the_plan(cli: CliRunner, reference_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    args = ("-c", str(reference_dir / "config.json"), "--gbs", "128", "--servers", "auto", "--json", "--out", str(out))
    result = invoke(cli, *args)
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert list(plan) == ["gbs", "lbs", "weight_sync", "iteration_time_s", "throughput", "assignments"]
    assert (plan["gbs"], plan["lbs"], plan["weight_sync"]) == (128, 32, "overlap")
    [only] = plan["assignments"]
    assert {k: only[k] for k in ("server", "device_type", "gpus", "vsw", "ga")} == {
        "server": "node0",
        "device_type": "Tesla V100-PCIE-16GB",
        "gpus": 4,
        "vsw": 1,
        "ga": 0,
    }
    assert plan["throughput"] == pytest.approx(128 / plan["iteration_time_s"])
    assert read_plan(out).to_dict() == plan


def test_range_table_and_json(cli: CliRunner, reference_dir: Path) -> None:
    config = str(reference_dir / "config.json")
    result = invoke(cli, "-c", config, "--range", "250:1000", "--json")
    assert result.exit_code == 0, result.output
    plans = json.loads(result.stdout)["plans"]
    assert [p["gbs"] for p in plans] == list(range(256, 1000, 32))
    table = invoke(cli, "-c", config, "--range", "256:512", "--weight-sync", "sequential")
    assert table.exit_code == 0, table.output
    assert "Best plan per GBS in 256..512 (9 feasible)" in table.stdout and "sequential" in table.stdout
    assert "node0:4GPU,VSW:3,GA:0 node1:4GPU,VSW:1,GA:0" in table.stdout  # not cut short


def test_explicit_servers_and_weight_sync(cli: CliRunner, reference_dir: Path) -> None:
    result = invoke(cli, "-c", str(reference_dir / "config.json"), "--gbs", "256", "--servers", "node1", "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert {a["server"] for a in plan["assignments"]} == {"node1"}


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--gbs", "0"], "the global batch size must be a positive integer, got 0"),
        (["--gbs", "-64"], "the global batch size must be a positive integer, got -64"),
        (["--gbs", "100"], "LBS 32: 100 is not a multiple of 32"),
        (["--gbs", "128", "--servers", "all"], "LBS 32: only 4 workers for 8 GPUs"),
        (["--range", "10"], "expected LO:HI with two integers"),
        (["--range", "64:32"], "expected 0 < LO <= HI"),
        (["--range", "1:31"], "no plan reaches any GBS in 1..31"),
        (["--gbs", "256", "--range", "1:2"], "give exactly one of --gbs N and --range LO:HI"),
        ([], "give exactly one of --gbs N and --range LO:HI"),
        (["--range", "256:512", "--out", "p.json"], "writes one plan"),
        (["--gbs", "256", "--servers", "node7"], "unknown server(s) node7 (known: node0, node1)"),
        (["--gbs", "256", "--servers", ","], "expected 'auto' or a comma-separated list"),
        (["--gbs", "256", "--weight-sync", "fast"], "expected recommend, sequential or overlap, got 'fast'"),
    ],
)
def test_bad_options_exit_2(cli: CliRunner, reference_dir: Path, args: list[str], expected: str) -> None:
    result = invoke(cli, "-c", str(reference_dir / "config.json"), *args)
    assert result.exit_code == 2, result.output
    assert expected in result.stderr
    assert "Traceback" not in result.output


def test_unreachable_gbs_says_why_for_every_lbs(reference_dir: Path) -> None:
    """Through the real command: each LBS tried, and why it failed."""
    result = run_jabas("solve", "-c", str(reference_dir / "config.json"), "--gbs", "160", "--servers", "all")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "no plan reaches GBS 160; LBS tried: 32, 64, 96, 128, 160" in result.stderr
    assert "LBS 32: only 5 workers for 8 GPUs" in result.stderr
    assert "LBS 64: 160 is not a multiple of 64" in result.stderr
    assert "LBS 160: not profiled on node0 (Tesla V100-PCIE-16GB)" in result.stderr
    assert "Traceback" not in result.stderr


def test_server_without_profiles_is_named(cli: CliRunner, reference_dir: Path, tmp_path: Path) -> None:
    config = toml_config(tmp_path, reference_dir, server("node0", "Tesla V100-PCIE-16GB") + server("gpu9", "A100"))
    result = invoke(cli, "-c", str(config), "--gbs", "512")
    assert result.exit_code == 2, result.output
    assert "no profiles for server 'gpu9' (A100)" in result.stderr
    assert str(reference_dir / "cluster_mem_profile_data") in result.stderr


def test_server_of_a_profiled_type_borrows_its_profiles(cli: CliRunner, reference_dir: Path, tmp_path: Path) -> None:
    servers = server("node0", "Tesla V100-PCIE-16GB") + server("twin", "Tesla V100-PCIE-16GB", 2)
    result = invoke(cli, "-c", str(toml_config(tmp_path, reference_dir, servers)), "--gbs", "192", "--json")
    assert result.exit_code == 0, result.output
    assert sum(a["gpus"] for a in json.loads(result.stdout)["assignments"]) == 6


def test_profiles_that_disagree(cli: CliRunner, seed_quickstart: Path) -> None:
    comp = (
        seed_quickstart
        / "quickstart"
        / "cluster_comp_profile_data"
        / "32"
        / "node1"
        / "resnet50_32_1_comp_profile.json"
    )
    data = json.loads(comp.read_text())
    comp.write_text(json.dumps(data | {"model": "vit"}))
    result = invoke(cli, "-c", str(seed_quickstart / "quickstart" / "config.json"), "--gbs", "512")
    assert result.exit_code == 2, result.output
    assert "profiles disagree on the model: resnet50, vit" in result.stderr


def test_missing_profile_folder(cli: CliRunner, seed_quickstart: Path) -> None:
    shutil.rmtree(seed_quickstart / "quickstart" / "cluster_comp_profile_data")
    result = invoke(cli, "-c", str(seed_quickstart / "quickstart" / "config.json"), "--gbs", "512")
    assert result.exit_code == 2, result.output
    assert "cluster_comp_profile_data" in result.stderr


def test_solve_does_not_import_torch(reference_dir: Path) -> None:
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from jabascli.cli.app import app\n"
        f"r = CliRunner().invoke(app, ['solve', '-c', {str(reference_dir / 'config.json')!r}, '--gbs', '512'])\n"
        "assert r.exit_code == 0, r.output\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_allocation_units(cli: CliRunner, reference_dir: Path, tmp_path: Path) -> None:
    servers = server("node0", "Tesla V100-PCIE-16GB") + server("node1", "Tesla P100-PCIE-16GB")
    config = toml_config(tmp_path, reference_dir, "[scaling]\nallocation_unit = 2\n\n" + servers)
    result = invoke(cli, "-c", str(config), "--gbs", "576", "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert all(a["gpus"] % 2 == 0 for a in plan["assignments"])
    # 288 = 9 workers of LBS 32: no IIDP plan splits them into units of 2 GPUs ...
    odd = invoke(cli, "-c", str(config), "--gbs", "288", "--kind", "iidp")
    assert odd.exit_code == 2
    assert "LBS 32: 9 workers cannot be split into allocation units of 2 GPUs" in odd.stderr
    # ... but an uneven plan (one micro-batch per GPU, of its own size) does, still in units of 2 GPUs.
    uneven = invoke(cli, "-c", str(config), "--gbs", "288", "--json")
    assert uneven.exit_code == 0, uneven.output
    plan = json.loads(uneven.stdout)
    assert all(a["gpus"] % 2 == 0 and "lbs" in a for a in plan["assignments"])
    assert sum(a["gpus"] * (a["ga"] + 1) * a["lbs"] for a in plan["assignments"]) == 288


def test_predict_any_plan(reference_dir: Path) -> None:
    from jabascli.config import load_config
    from jabascli.solver import Assignment, Plan, solver_from_config

    solver = solver_from_config(load_config(reference_dir / "config.json"))
    measured = Plan(
        256, 32, "sequential", 1.0, 1.0, (Assignment("node0", "V100", 4, 1, 0), Assignment("node1", "P100", 4, 1, 0))
    )
    prediction = solver.predict(measured)
    assert prediction.gbs == 256 and prediction.time_s > solver.solve(256).iteration_time_s  # overlap is faster
    with pytest.raises(InputError, match="unknown server"):
        solver.predict(Plan(32, 32, "overlap", 1.0, 1.0, (Assignment("gpu9", "A100", 1, 1, 0),)))
