"""`jabas simulate`: trajectories, the policies' accounting, the JSON shape, and bad input (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from jabascli.autoscale.simulate import POLICIES, synthetic_trajectory, trajectory_from_spec
from jabascli.autoscale.trajectory import epoch_segments
from jabascli.cli.app import app
from jabascli.config import load_config
from jabascli.engine.metrics import MetricsWriter
from jabascli.errors import InputError
from jabascli.solver import solver_from_config
from tests.test_solver_cli import server, toml_config

WIDE = {"COLUMNS": "200"}
V100, P100 = "Tesla V100-PCIE-16GB", "Tesla P100-PCIE-16GB"
REFERENCE_SERVERS = server("node0", V100).replace("devices = 4\n", "devices = 4\ntflops = 14.13\n") + server(
    "node1", P100
).replace("devices = 4\n", "devices = 4\ntflops = 9.52\n")


def config_with(tmp_path: Path, reference: Path, extra: str = "", servers: str = REFERENCE_SERVERS) -> Path:
    path = toml_config(tmp_path, reference, servers)
    path.write_text(path.read_text() + "[batching]\ngbs_min = 256\ngbs_max = 32768\nadjust_interval = 50\n\n" + extra)
    return path


def simulate(cli: CliRunner, config: Path, *args: str):  # type: ignore[no-untyped-def]
    return cli.invoke(app, ["simulate", "-c", str(config), *args], env=WIDE)


# Trajectories ----------------------------------------------------------------------------------


def test_synthetic_trajectories_reach_their_ends_geometrically() -> None:
    grow = synthetic_trajectory("grow:256:8192", epochs=10, dataset_size=100_000, adjust_interval=20, lo=256, hi=32768)
    assert grow.values[0] == 256 and grow.values[-1] == 8192
    ratios = [b / a for a, b in zip(grow.values, grow.values[1:], strict=False) if b < 8192]
    assert max(ratios) / min(ratios) < 1.05  # one ratio (up to rounding)
    shrink = synthetic_trajectory(
        "shrink:8192:256", epochs=10, dataset_size=100_000, adjust_interval=20, lo=256, hi=32768
    )
    assert shrink.values[0] == 8192 and shrink.values[-1] == 256 and list(shrink.values) == sorted(shrink.values)[::-1]
    assert synthetic_trajectory("flat:999", epochs=3, dataset_size=10, adjust_interval=5, lo=1, hi=2000).values == (
        999,
    )


def test_a_run_folder_and_a_csv_give_the_gbs_per_adjustment_point(tmp_path: Path) -> None:
    """The run folder's steps.csv is written by the engine's own MetricsWriter."""
    run = tmp_path / "runs" / "job"
    writer = MetricsWriter(run, tensorboard=False)
    for step, gbs in ((1, 64), (3, 64), (10, 128), (15, 128), (20, 256), (31, 256)):
        writer.step(epoch=0, step=step, gbs=gbs, loss=1.0, samples_per_s=100.0, lr=0.1)
    writer.close()
    from_run = trajectory_from_spec(str(run), epochs=1, dataset_size=1000, adjust_interval=10, lo=1, hi=4096)
    assert from_run.values == (64, 128, 256, 256)  # GBS at steps 0, 10, 20, 30
    csv = tmp_path / "t.csv"
    csv.write_text("step,gbs\n0,512\n5,1024\n")
    # The GBS in effect at every multiple of adjust_interval up to the last logged step.
    every_2 = trajectory_from_spec(str(csv), epochs=1, dataset_size=1, adjust_interval=2, lo=1, hi=4096)
    assert every_2.values == (512, 512, 512)
    every_5 = trajectory_from_spec(str(csv), epochs=1, dataset_size=1, adjust_interval=5, lo=1, hi=4096)
    assert every_5.values == (512, 1024)


# The simulation ----------------------------------------------------------------------------------


def test_policies_json_and_accounting(cli: CliRunner, reference_dir: Path, tmp_path: Path) -> None:
    config = config_with(tmp_path, reference_dir)
    result = simulate(
        cli, config, "--trajectory", "grow:256:4096", "--epochs", "6", "--dataset-size", "100000", "--json"
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    rows = {p["policy"]: p for p in out["policies"]}
    assert list(rows) == list(POLICIES)
    for p in rows.values():
        assert {"policy", "time_s", "cost", "gpu_hours", "moves"} <= set(p)
        assert p["gpu_hours"] == pytest.approx(sum(e["time_s"] * e["gpus"] for e in p["epochs"]) / 3600)
    # `all`, recomputed here from the solver's plans for the whole cluster, epoch by epoch.
    solver = solver_from_config(load_config(config))
    values, point, expected = out["trajectory"]["gbs"], 0, 0.0
    for _ in range(6):
        segments = epoch_segments(values[point:] or values[-1:], 100_000, 50)
        expected += sum(s.iterations * solver.solve(s.gbs).iteration_time_s for s in segments)
        point += len(segments)
    assert rows["all"]["time_s"] == pytest.approx(expected, rel=1e-12)
    price = 4 * 3.06 + 4 * 3.06 * 9.52 / 14.13  # the seed's rule: no server has a price
    assert rows["all"]["cost"] == pytest.approx(expected / 3600 * price, rel=1e-12)
    assert out["seed_prices"] is True
    # Objective time: nothing fixed beats the best fixed allocation, and hindsight helps the oracle.
    assert rows["best-fixed"]["time_s"] <= rows["all"]["time_s"] * (1 + 1e-12)


def test_cost_objective_table(cli: CliRunner, reference_dir: Path, tmp_path: Path) -> None:
    config = config_with(tmp_path, reference_dir, '[scaling]\nobjective = "cost"\n')
    result = simulate(cli, config, "--trajectory", "grow:256:4096", "--epochs", "6", "--dataset-size", "100000")
    assert result.exit_code == 0, result.output
    for text in ("policy", "time (h)", "cost", "GPU-hours", "moves", "all", "best-fixed", "jabas", "oracle"):
        assert text in result.stdout
    assert "the seed's rule, 3.06 $ per GPU-hour x TFLOPS / 14.13" in result.stderr
    out = json.loads(
        simulate(
            cli, config, "--trajectory", "grow:256:4096", "--epochs", "6", "--dataset-size", "100000", "--json"
        ).stdout
    )
    rows = {p["policy"]: p for p in out["policies"]}
    assert rows["best-fixed"]["cost"] <= rows["all"]["cost"]
    assert rows["jabas"]["cost"] < rows["all"]["cost"]


def test_a_cluster_without_prices_shows_no_cost(cli: CliRunner, reference_dir: Path, tmp_path: Path) -> None:
    """No price_per_hour and no tflops: the table says "-", not a cost of 0.00."""
    config = config_with(tmp_path, reference_dir, servers=server("node0", V100) + server("node1", P100))
    result = simulate(cli, config, "--trajectory", "grow:256:4096", "--epochs", "3", "--dataset-size", "100000")
    assert result.exit_code == 0, result.output
    rows = [line for line in result.stdout.splitlines() if line.strip("│ ").startswith(POLICIES)]
    assert len(rows) == len(POLICIES)
    for row in rows:
        cells = [c.strip() for c in row.strip("│").split("│")]
        assert cells[2] == "-", row
    assert "0.00" not in result.stdout
    assert "costs are not shown" in result.stderr and "seed's rule" not in result.stderr
    # priced (the seed's rule from tflops), the same cluster shows its costs
    (tmp_path / "priced").mkdir()
    priced = simulate(
        cli,
        config_with(tmp_path / "priced", reference_dir),
        "--trajectory",
        "grow:256:4096",
        "--epochs",
        "3",
        "--dataset-size",
        "100000",
    )
    assert priced.exit_code == 0, priced.output
    assert "costs are not shown" not in priced.stderr


# Bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("trajectory", "extra", "expected"),
    [
        ("grow:256:99999", "", "GBS 99999 in 'grow:256:99999' is outside the bounds 256..32768"),
        ("grow:1024:512", "", "grow goes from low to high"),
        ("sideways:3", "", "expected a run folder, a CSV file, grow:LO:HI, shrink:HI:LO or flat:G"),
        ("{bad_csv}", "", "line 3: expected integer step and gbs, got '9', 'many'"),
        ("{no_header}", "", "expected a CSV header with 'step' and 'gbs' columns"),
        ("{empty_run}", "", "is not a run folder with metrics: no steps.csv in it"),
        ("flat:2048", "[scaling]\nbudget_per_epoch = 0.0001\n", "no allocation meets budget_per_epoch 0.0001"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    cli: CliRunner, reference_dir: Path, tmp_path: Path, trajectory: str, extra: str, expected: str
) -> None:
    (tmp_path / "bad.csv").write_text("step,gbs\n0,256\n9,many\n")
    (tmp_path / "noheader.csv").write_text("0,256\n")
    (tmp_path / "run").mkdir()
    spec = trajectory.format(
        bad_csv=tmp_path / "bad.csv", no_header=tmp_path / "noheader.csv", empty_run=tmp_path / "run"
    )
    result = simulate(cli, config_with(tmp_path, reference_dir, extra), "--trajectory", spec, "--dataset-size", "1000")
    assert result.exit_code == 2, result.output
    assert expected in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output


def test_error_lines_keep_their_brackets(cli: CliRunner) -> None:
    """A message naming a config section in brackets is printed as written, not read as Rich markup."""
    import typer

    from jabascli.cli.common import cli_command

    @cli_command
    def fails() -> None:
        raise InputError.at(None, "[scaling] budget_per_epoch", "no allocation meets it")

    one = typer.Typer()
    one.command()(fails)
    result = cli.invoke(one, [])
    assert result.exit_code == 2
    assert "error: [scaling] budget_per_epoch: no allocation meets it" in result.stderr


def test_cost_objective_without_any_price_or_tflops(cli: CliRunner, reference_dir: Path, tmp_path: Path) -> None:
    servers = server("node0", V100) + server("node1", P100)  # neither price_per_hour nor tflops
    config = config_with(tmp_path, reference_dir, '[scaling]\nobjective = "cost"\n', servers=servers)
    result = simulate(cli, config, "--trajectory", "flat:2048", "--dataset-size", "1000")
    assert result.exit_code == 2, result.output
    assert "scaling.objective: 'cost' needs prices: set price_per_hour" in result.stderr


def test_servers_without_profiles_and_no_dataset_size(cli: CliRunner, reference_dir: Path, tmp_path: Path) -> None:
    config = config_with(tmp_path, reference_dir, servers=REFERENCE_SERVERS + server("gpu9", "A100"))
    result = simulate(cli, config, "--trajectory", "flat:2048", "--dataset-size", "1000")
    assert result.exit_code == 2 and "no profiles for server 'gpu9' (A100)" in result.stderr
    result = simulate(cli, config_with(tmp_path, reference_dir), "--trajectory", "flat:2048")
    assert result.exit_code == 2 and "give --dataset-size N" in result.stderr
    with pytest.raises(InputError, match="expected a positive number of epochs"):
        from jabascli.autoscale.simulate import simulation_from_config

        simulation_from_config(load_config(config), "flat:2048", epochs=0, dataset_size=10)


def test_autoscale_and_report_do_not_import_torch() -> None:
    """`jabas simulate` and `jabas report` start fast and run where torch is not installed."""
    import subprocess
    import sys

    code = (
        "import sys, pkgutil, importlib, jabascli.autoscale, jabascli.report\n"
        "for pkg in (jabascli.autoscale, jabascli.report):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        importlib.import_module(m.name)\n"
        "import jabascli.cli.simulate, jabascli.cli.report\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_dataset_size_defaults_to_the_workloads_training_set(tmp_path: Path) -> None:
    from jabascli.autoscale.simulate import dataset_size_of
    from jabascli.workload import load_workload

    config = tmp_path / "jabas.toml"
    config.write_text('[job]\nworkload = "digits"\n')
    expected = len(load_workload("digits").train_dataset())
    assert 1000 < expected < 1797  # scikit-learn's digits, less the validation split
    assert dataset_size_of(load_config(config)) == expected
