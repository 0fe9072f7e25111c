"""``jabas simulate --trace`` and ``jabas report`` on its JSON, through the real CLI (issue #16).

A small synthetic trace (the builder of test_simulate_trace.py) always runs; the
public Sia traces in ../shared/reference/sia-traces run one small job when present.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from jabascli.cli.app import app
from jabascli.report.pareto import front
from tests.conftest import run_jabas
from tests.test_simulate_trace import LBS, SIA, _rows, _step, _write, write_synthetic_trace

WIDE = {"COLUMNS": "200"}
REQUESTED = ["fixed-100", "fixed-400", "ddp-all", "pollux", "jabas", "jabas-similarity", "oracle"]


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    return write_synthetic_trace(tmp_path / "toy")


def simulate(cli: CliRunner, *args: str):  # type: ignore[no-untyped-def]
    return cli.invoke(app, ["simulate", *args], env=WIDE)


def test_json_has_every_requested_policy(cli: CliRunner, trace: Path) -> None:
    result = simulate(cli, "--trace", str(trace), "--cluster", "aws:2", "--policies", ",".join(REQUESTED), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [p["policy"] for p in data["policies"]] == REQUESTED
    assert data["cluster"] == {"aws": 2} and data["trace"] == "toy"
    for p in data["policies"]:
        assert p["time_s"] > 0 and p["cost"] > 0 and p["gpu_hours"] > 0 and p["moves"] >= 0
        assert p["timeline"] and p["timeline"][0]["start_s"] == 0
        # two aws nodes of 4 GPUs: no policy uses more, and the job ends at the trace's end
        assert all(0 < sum(e["gpus"].values()) <= 8 for e in p["timeline"])
        assert p["progress"] == pytest.approx(3000.0)
    assert set(data["comparison"]) >= {"fastest_baseline", "time_ratio", "cost_ratio_vs_cheapest"}


def test_table_shows_each_policy_and_its_ratios(cli: CliRunner, trace: Path) -> None:
    result = simulate(cli, "--trace", str(trace), "--cluster", "aws:1", "--prices", "aws=2", "--target-metric", "0.6")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert "toy on aws:1, to metric 0.6" in result.stdout
    for name in ("fixed-100", "fixed-400", "ddp-all", "pollux", "jabas", "jabas-similarity", "oracle"):
        assert any(line.strip("│ ").startswith(name + " ") for line in lines), name
    assert "time / fastest" in result.stdout and "cost / cheapest" in result.stdout


def test_free_gpus_give_no_cost_ratio_instead_of_a_division_by_zero(cli: CliRunner, trace: Path) -> None:
    args = ["--trace", str(trace), "--cluster", "aws:1", "--policies", "fixed-100,jabas", "--prices", "aws=0"]
    result = simulate(cli, *args, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [p["cost"] for p in data["policies"]] == [0, 0]
    assert data["comparison"]["cost_ratio_vs_cheapest"] is None and data["comparison"]["time_ratio"] > 0
    table = simulate(cli, *args)
    assert table.exit_code == 0, table.output
    jabas_row = next(line for line in table.stdout.splitlines() if line.strip("│ ").startswith("jabas "))
    assert jabas_row.rstrip("│ ").endswith("-")


def _too_small(trace: Path) -> None:
    """Only two-node placements traced: one node has no measured configuration."""
    rows = _rows(trace / "placements-aws.csv")
    _write(trace / "placements-aws.csv", list(rows[0]), [list(r.values()) for r in rows if r["placement"] == "44"])
    _write(
        trace / "scalability-aws.csv",
        ["num_nodes", "num_replicas", "local_bsz", "step_time", "sync_time"],
        [[2, 8, b, *_step(2, 8, b)] for b in LBS],
    )


@pytest.mark.parametrize(
    ("case", "args", "expected"),
    [
        ("no placements", ["--cluster", "aws:1"], "placements-aws.csv"),
        ("no validation", ["--cluster", "aws:1"], "validation-<B>.csv: no validation runs found"),
        ("", ["--cluster", "aws:1,h100:2"], "cluster: unknown GPU type 'h100'"),
        ("", ["--cluster", "aws"], "'aws' is not TYPE:NODES"),
        ("", ["--cluster", "aws:1", "--target-metric", "0.99"], "target_metric: 0.99 is never reached"),
        ("too small", ["--cluster", "aws:1"], "cluster: too small for the trace"),
        ("", ["--cluster", "aws:1", "--policies", "greedy"], "unknown policy 'greedy'"),
        ("", ["--cluster", "aws:1", "--prices", "aws=-1"], "'aws=-1' is not TYPE=PRICE"),
        ("", ["--cluster", "aws:1", "--objective", "fast"], "objective: unknown objective 'fast'"),
        ("", [], "--cluster: needed with --trace"),
        ("", ["--cluster", "aws:1", "--trajectory", "flat:256"], "--trajectory: not used with --trace"),
        ("", ["--cluster", "aws:1", "-c", "jabas.toml"], "--config: not used with --trace"),
        ("no --trace", ["--cluster", "aws:1"], "--cluster: not used without --trace"),
        ("no --trace", [], "expected -c FILE --trajectory SPEC, or --trace DIR --cluster TYPE:NODES"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    cli: CliRunner, trace: Path, case: str, args: list[str], expected: str
) -> None:
    if case == "no placements":
        (trace / "placements-aws.csv").unlink()
    elif case == "no validation":
        for path in trace.glob("validation-*.csv"):
            path.unlink()
    elif case == "too small":
        _too_small(trace)
    result = simulate(cli, *([] if case == "no --trace" else ["--trace", str(trace)]), *args)
    assert result.exit_code == 2, result.output
    assert expected in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output


def test_report_plots_a_trace_simulation(cli: CliRunner, trace: Path, tmp_path: Path) -> None:
    result = simulate(cli, "--trace", str(trace), "--cluster", "aws:2", "--json")
    assert result.exit_code == 0, result.output
    sim = tmp_path / "sim.json"
    sim.write_text(result.stdout)
    out = tmp_path / "report"
    report = cli.invoke(app, ["report", str(sim), "--out", str(out)], env=WIDE)
    assert report.exit_code == 0, report.output
    adaptive = ["pollux", "jabas", "jabas-similarity", "oracle"]
    expected = {"gbs.png", "gpus.png", "progress.png", "time-cost.png", *(f"allocation-{p}.png" for p in adaptive)}
    assert {p.name for p in out.glob("*.png")} == expected
    page = (out / "index.html").read_text()
    for name in expected:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (out / name).stat().st_size > 1000
        assert f'src="{name}"' in page
    for policy in json.loads(result.stdout)["policies"]:
        assert f"<th>{policy['policy']}</th>" in page


def test_report_refuses_a_broken_timeline(cli: CliRunner, tmp_path: Path) -> None:
    sim = tmp_path / "sim.json"
    sim.write_text(json.dumps({"policies": [{"policy": "jabas", "time_s": 10, "timeline": [{"start_s": 0}]}]}))
    result = cli.invoke(app, ["report", str(sim)], env=WIDE)
    assert result.exit_code == 2, result.output
    assert "policies[0].timeline[0]: expected numbers 'start_s', 'progress' and 'gbs'" in result.stderr
    assert not (tmp_path / "sim-report").exists()


def test_sia_cifar10_on_a_small_cluster(tmp_path: Path) -> None:
    """What a user types, in a subprocess, on the public traces."""
    if not (SIA / "cifar10").is_dir():
        pytest.skip(f"Sia traces not found at {SIA} (they sit in ../shared/reference beside the repo)")
    done = run_jabas("simulate", "--trace", str(SIA / "cifar10"), "--cluster", "aws:1,rtx:1", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    names = [p["policy"] for p in data["policies"]]
    assert names == [f"fixed-{b}" for b in (128, 256, 512, 1024, 2048, 4096)] + [
        "ddp-all",
        "pollux",
        "jabas",
        "jabas-similarity",
        "oracle",
    ]
    assert all(p["time_s"] > 0 and p["epochs"] > 0 for p in data["policies"])


def test_time_cost_front_is_the_points_no_other_beats_in_both() -> None:
    points = {"a": (1.0, 5.0), "b": (2.0, 2.0), "c": (3.0, 3.0), "d": (4.0, 1.0), "e": (2.0, 6.0)}
    assert front(points) == ["a", "b", "d"]  # c is beaten by b, e by a; b and d each win on one axis


@pytest.mark.parametrize("objective", ["time", "cost", "no-dearer"])
def test_each_objective_prints_the_pareto_check(cli: CliRunner, trace: Path, objective: str) -> None:
    args = ["--trace", str(trace), "--cluster", "aws:2"]
    result = simulate(cli, *args, "--objective", objective)
    assert result.exit_code == 0, result.output
    data = json.loads(simulate(cli, *args, "--objective", objective, "--json").stdout)
    jabas = next(p for p in data["policies"] if p["policy"] == "jabas")
    beaten = [
        p["policy"]
        for p in data["policies"]
        if p["policy"].startswith(("fixed-", "ddp-all", "pollux"))
        and p["time_s"] < jabas["time_s"]
        and p["cost"] < jabas["cost"]
    ]
    assert data["dominated_by"] == beaten
    line = next(line for line in result.stdout.splitlines() if line.startswith(f"objective {objective}:"))
    assert ("no baseline is both sooner and cheaper" in line) == (not beaten)


def test_table_shows_no_cost_when_every_price_is_zero(cli: CliRunner, trace: Path) -> None:
    result = simulate(
        cli, "--trace", str(trace), "--cluster", "aws:1", "--prices", "aws=0", "--policies", "fixed,jabas"
    )
    assert result.exit_code == 0, result.output
    rows = [line for line in result.stdout.splitlines() if line.strip("│ ").startswith(("fixed-", "jabas"))]
    assert rows
    for row in rows:
        cells = [c.strip() for c in row.strip("│").split("│")]
        assert cells[2] == "-" and cells[-1] == "-", row  # cost, cost / cheapest
    assert "costs are not shown" in result.stderr
    priced = simulate(cli, "--trace", str(trace), "--cluster", "aws:1", "--prices", "aws=2", "--policies", "jabas")
    assert priced.exit_code == 0 and "costs are not shown" not in priced.stderr
