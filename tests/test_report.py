"""`jabas report` on a real run folder made here (digits, one epoch), a run still being written, and a simulation."""

from __future__ import annotations

import csv
import json
import math
import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from jabascli.autoscale.allocation import AllocationSpace, Choice
from jabascli.autoscale.decide import append_decision, decide
from jabascli.autoscale.planner import Objective
from jabascli.autoscale.setup import ScalingSetup
from jabascli.cli.app import app
from jabascli.perfmodel import ServerSpec
from tests.conftest import run_jabas

JOB = """
[job]
name = "rep"
workload = "digits"
epochs = 1
lbs = 64
options = { lr = 0.05 }

[batching]
metric = "fixed"

[[cluster.servers]]
name = "cpu0"
device_type = "cpu"
devices = 1

[storage]
run_dir = "runs"
checkpoint_dir = "checkpoints"
"""
RUN_PNGS = {"loss.png", "accuracy.png", "gbs.png", "lr.png", "throughput.png"}


# The tests that read the trained run share one worker under `make test`, so that it is trained once.
SHARED_RUN = pytest.mark.xdist_group("report-run")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Digits trained for one short epoch by the real `jabas run`, once for the module; tests read it only."""
    folder = tmp_path_factory.mktemp("report")
    (folder / "jabas.toml").write_text(JOB)
    result = run_jabas("run", "-c", "jabas.toml", cwd=folder)
    assert result.returncode == 0, result.stdout + result.stderr
    return folder / "runs" / "rep"


@pytest.fixture
def run_folder(trained_run: Path, tmp_path: Path) -> Path:
    """This test's own copy of the trained run folder, which it may add to (decisions, a report, ended.json)."""
    return Path(shutil.copytree(trained_run, tmp_path / "rep"))


class LinearCostModel:
    """Iteration time proportional to GBS / GPUs, for the decisions logged below."""

    def __init__(self, space: AllocationSpace) -> None:
        self.space = space

    def iteration_time(self, choice: Choice, gbs: int) -> float:
        return 0.001 * gbs / self.space.gpus(choice) + 0.05 * (len(self.space.used(choice)) - 1)


def log_two_decisions(run: Path) -> list[dict]:  # type: ignore[type-arg]
    servers = [ServerSpec("a", "x", 2, "a", 1e9, 1e9), ServerSpec("b", "y", 2, "b", 1e9, 1e9)]
    space = AllocationSpace(servers, 1, {"a": 1.0, "b": 1.0})
    setup = ScalingSetup(space, LinearCostModel(space), Objective("time"))  # type: ignore[arg-type]
    common = dict(setup=setup, dataset_size=10_000, adjust_interval=10, gbs_min=32, gbs_max=4096, gbs_step=32)
    first = decide([64.0, 64.0], None, epoch=0, **common)  # type: ignore[arg-type]
    second = decide([64.0, 128.0, 256.0, 512.0], first["choice"], epoch=1, **common)  # type: ignore[arg-type]
    for record in (first, second):
        append_decision(run, record)
    return [first, second]


def report(cli: CliRunner, *args: str):  # type: ignore[no-untyped-def]
    return cli.invoke(app, ["report", *args], env={"COLUMNS": "200"})


def check_pngs_and_index(folder: Path, expected: set[str]) -> str:
    written = {p.name for p in folder.glob("*.png")}
    assert written == expected
    for name in expected:
        data = (folder / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000
    index = (folder / "index.html").read_text()
    assert set(re.findall(r'src="([^"]+)"', index)) == expected
    assert set(re.findall(r'href="([^"]+)"', index)) == expected
    return index


@SHARED_RUN
def test_report_of_a_finished_run_with_scaling_decisions(cli: CliRunner, run_folder: Path) -> None:
    records = log_two_decisions(run_folder)
    assert records[0]["choice"] and records[1]["forecast"][0] > 512  # the growth is forecast, not mean-reverted
    assert {"forecast", "candidates", "choice", "reason", "predicted"} <= set(records[1])
    result = report(cli, str(run_folder))
    assert result.exit_code == 0, result.output
    index = check_pngs_and_index(run_folder / "report", RUN_PNGS | {"allocation.png"})
    epochs = list(csv.DictReader((run_folder / "epochs.csv").open()))
    assert len(epochs) == 1
    assert f"{float(epochs[-1]['val_accuracy']):.4f}" in index
    assert "<th>epochs finished</th><td>1</td>" in index
    assert "2 (" in index  # two scaling decisions


@SHARED_RUN
def test_report_of_a_run_still_being_written(cli: CliRunner, run_folder: Path, tmp_path: Path) -> None:
    """Half-written last lines (a trainer mid-write) are skipped; a run without epochs yet still plots."""
    live = tmp_path / "live"
    live.mkdir()
    steps = (run_folder / "steps.csv").read_text().splitlines()
    assert len(steps) >= 2  # a header and at least one logged step
    # Every logged row whole, then a row cut in the middle, as a trainer leaves it mid-write (the run may have
    # logged a single row, so the cut row is an extra copy of the last rather than the last itself).
    (live / "steps.csv").write_text("\n".join(steps) + "\n" + steps[-1][: len(steps[-1]) // 2])
    (live / "epochs.csv").write_text((run_folder / "epochs.csv").read_text().splitlines()[0] + "\n")
    (live / "scaling.jsonl").write_text('{"epoch": 0, "choice": {"a": 2}}\n{"epoch": 1, "cho')
    result = report(cli, str(live), "--out", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    index = check_pngs_and_index(tmp_path / "out", RUN_PNGS | {"allocation.png"})
    assert "<th>epochs finished</th><td>0</td>" in index


def test_report_of_a_simulation(cli: CliRunner, reference_dir: Path, tmp_path: Path) -> None:
    from tests.test_autoscale_simulate import config_with

    config = config_with(tmp_path, reference_dir)
    args = ["simulate", "-c", str(config), "--trajectory", "grow:256:2048", "--epochs", "4", "--dataset-size", "50000"]
    result = cli.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    sim = tmp_path / "sim.json"
    sim.write_text(result.stdout)
    result = report(cli, str(sim))
    assert result.exit_code == 0, result.output
    index = check_pngs_and_index(
        tmp_path / "sim-report", {"allocation.png", "gbs.png", "time.png", "cost.png", "trajectory.png"}
    )
    for policy in json.loads(sim.read_text())["policies"]:
        assert f"<th>{policy['policy']}</th><td>{_as_read(policy['time_s'])}" in index
        assert math.isfinite(policy["time_s"])


def _as_read(seconds: float) -> str:
    """How a report must show a duration: seconds under 2 minutes, minutes under 2 hours, else hours."""
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.2f} h"


def _trace_sim(path: Path, cost: float) -> Path:
    """A trace simulation as `jabas simulate --trace --json` writes it: two adaptive policies on two GPU types."""
    timeline = [
        {"start_s": 0.0, "progress": 0.0, "gbs": 64, "gpus": {"aws": 2, "rtx": 1}},
        {"start_s": 20.0, "progress": 0.5, "gbs": 128, "gpus": {"rtx": 2}},
    ]
    policies = [
        {"policy": "pollux", "time_s": 45.0, "cost": cost, "gpu_hours": 0.03, "moves": 1, "timeline": timeline},
        {"policy": "jabas", "time_s": 45.0, "cost": cost, "gpu_hours": 0.03, "moves": 1,
         "timeline": [{**timeline[1], "start_s": 0.0}, {**timeline[0], "start_s": 30.0}]},
        {"policy": "fixed-64", "time_s": 5400.0, "cost": cost, "gpu_hours": 2.0, "moves": 0,
         "timeline": [timeline[0]]},
    ]  # fmt: skip
    path.write_text(json.dumps({"trace": "cifar10", "cluster": {"aws": 2, "rtx": 2}, "policies": policies}))
    return path


def test_a_trace_report_reads_short_times_names_missing_costs_and_keeps_gpu_colours(
    cli: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from jabascli.report import plots

    drawn: list[tuple[list[str], dict]] = []
    real = plots.stacked_allocation

    def spy(path, title, xlabel, xs, by_server, end=None, colours=None):  # type: ignore[no-untyped-def]
        drawn.append((list(by_server), dict(colours or {})))
        return real(path, title, xlabel, xs, by_server, end, colours)

    monkeypatch.setattr(plots, "stacked_allocation", spy)
    result = report(cli, str(_trace_sim(tmp_path / "sim.json", cost=0.0)), "--out", str(tmp_path / "free"))
    assert result.exit_code == 0, result.output
    index = (tmp_path / "free" / "index.html").read_text()
    assert "<th>pollux</th><td>45.0 s, cost n/a" in index and "<th>fixed-64</th><td>90.0 min" in index
    assert "0.00 h" not in index and "cost 0.00" not in index
    assert "not available: no server has price_per_hour" in index
    # Every allocation plot gives a GPU type the same colour, whichever types it shows and in whatever order.
    assert len(drawn) == 2 and drawn[0][0] != drawn[1][0]
    colour = {}
    for types, colours in drawn:
        for gpu_type in types:
            assert colour.setdefault(gpu_type, colours[gpu_type]) == colours[gpu_type]
    assert colour["aws"] != colour["rtx"]
    priced = report(cli, str(_trace_sim(tmp_path / "priced.json", cost=1.5)), "--out", str(tmp_path / "priced"))
    assert priced.exit_code == 0 and "cost 1.50" in (tmp_path / "priced" / "index.html").read_text()


def test_coinciding_series_are_each_labelled_and_styled() -> None:
    from jabascli.report.plots import coincident

    same = ([0.0, 1.0], [2.0, 2.0])
    labels = coincident([("jabas", *same), ("pollux", [0.0, 1.0], [3.0, 3.0]), ("oracle", *same)])
    assert [label for label, _ in labels] == ["jabas", "pollux", "oracle (= jabas)"]
    assert labels[0][1] != labels[2][1]  # another line style and marker: neither hides the other


def test_gbs_and_lr_are_drawn_from_their_exact_change_steps(tmp_path: Path) -> None:
    from jabascli.report.build import setting_series
    from jabascli.report.sources import read_source

    run = tmp_path / "run"
    run.mkdir()
    rows = [f"{step},0,{step},{64 if step <= 60 else 128},1.0,10,0.1,0.01" for step in range(5, 75, 5)]
    (run / "steps.csv").write_text("time,epoch,step,gbs,loss,samples_per_s,lr,iteration_s\n" + "\n".join(rows))
    (run / "changes.csv").write_text("step,gbs,lr\n1,64,0.1\n61,128,0.2\n")  # the change took effect at step 61
    xs, gbs = setting_series(read_source(run), "gbs")  # type: ignore[arg-type]
    assert (xs, gbs) == ([1.0, 61.0, 70.0], [64.0, 128.0, 128.0])  # not at 65, the next logged row
    xs, lr = setting_series(read_source(run), "lr")  # type: ignore[arg-type]
    assert lr == [0.1, 0.2, 0.2]
    # A second attempt resumed from step 50's checkpoint: its rows replace the first attempt's from there on.
    with (run / "changes.csv").open("a") as f:
        f.write("51,64,0.1\n66,256,0.4\n")
    xs, gbs = setting_series(read_source(run), "gbs")  # type: ignore[arg-type]
    assert (xs, gbs) == ([1.0, 51.0, 66.0, 70.0], [64.0, 64.0, 256.0, 256.0])


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "is not a run folder with metrics"),
        ('{"policies": []}', "expected the JSON that `jabas simulate --json` prints"),
        ("not json", "sim.json"),
    ],
)
def test_bad_input_exits_2(cli: CliRunner, tmp_path: Path, content: str | None, expected: str) -> None:
    if content is None:
        target = tmp_path / "empty-run"
        target.mkdir()
    else:
        target = tmp_path / "sim.json"
        target.write_text(content)
    result = report(cli, str(target))
    assert result.exit_code == 2, result.output
    assert expected in result.stderr and "Traceback" not in result.output


@SHARED_RUN
def test_a_runs_failures_are_summed_up_from_its_ended_record(cli: CliRunner, run_folder: Path) -> None:
    moves = [
        {
            "reason": "recovery",
            "failure": "trainer rank 1 on B exited with code -9",
            "steps_lost": 0,
            "recovered_s": 0.2,
        },
        {"reason": "restart", "failure": "rank 0 was lost", "steps_lost": 3, "recovered_s": 1.5},
        {"reason": "move", "failure": None},
    ]
    (run_folder / "ended.json").write_text(json.dumps({"status": {"moves": moves}}))
    result = report(cli, str(run_folder))
    assert result.exit_code == 0, result.output
    index = (run_folder / "report" / "index.html").read_text()
    assert (
        "<th>failures</th><td>2 (1 recovered in place, 3 completed steps lost, next iteration at most 1.50 s after)"
        in index
    )
