"""The plan file: the exact JSON shape the trainer reads, round trips, and every bad field named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jabascli.errors import InputError
from jabascli.solver import Assignment, Plan, read_plan, write_plan

PLAN = Plan(
    gbs=448,
    lbs=32,
    weight_sync="overlap",
    iteration_time_s=0.21,
    throughput=2438.1,
    assignments=(
        Assignment("node0", "Tesla V100-PCIE-16GB", 3, 3, 0, 0.21),
        Assignment("node0", "Tesla V100-PCIE-16GB", 1, 1, 0, 0.11),
        Assignment("node1", "Tesla P100-PCIE-16GB", 4, 1, 0),
    ),
)


def test_shape_and_round_trip(tmp_path: Path) -> None:
    data = PLAN.to_dict()
    assert list(data) == ["gbs", "lbs", "weight_sync", "iteration_time_s", "throughput", "assignments"]
    assert data["assignments"][0] == {
        "server": "node0",
        "device_type": "Tesla V100-PCIE-16GB",
        "gpus": 3,
        "vsw": 3,
        "ga": 0,
        "iteration_time_s": 0.21,
    }
    assert "iteration_time_s" not in data["assignments"][2]
    path = write_plan(tmp_path / "sub" / "plan.json", PLAN)
    assert json.loads(path.read_text()) == data
    assert read_plan(path) == PLAN
    assert not [p for p in path.parent.iterdir() if p.name != "plan.json"]  # no temporary file left behind


def test_ranks_and_seed_form() -> None:
    assert PLAN.gpus == 8 and PLAN.workers == 14 and PLAN.servers() == ["node0", "node1"]
    ranks = PLAN.ranks()
    assert len(ranks) == 8 and ranks[0] is ranks[2] is PLAN.assignments[0]
    assert ranks[3] is PLAN.assignments[1] and ranks[7] is PLAN.assignments[2]
    assert PLAN.seed_form() == "node0:3GPU,VSW:3,GA:0 node0:1GPU,VSW:1,GA:0 node1:4GPU,VSW:1,GA:0"


def test_unknown_keys_are_ignored() -> None:
    data = PLAN.to_dict() | {"model": "resnet50"}
    data["assignments"][0]["note"] = "fast"
    assert Plan.from_dict(data) == PLAN


@pytest.mark.parametrize(
    ("change", "field", "message"),
    [
        ({"gbs": 500}, "gbs", "is 500 but lbs * sum(gpus * vsw * (ga + 1)) = 32 * 14 = 448"),
        ({"lbs": 0}, "lbs", "expected an integer >= 1, got 0"),
        ({"weight_sync": "fast"}, "weight_sync", "expected sequential, overlap or recommend"),
        ({"throughput": "a lot"}, "throughput", "expected a positive number"),
        ({"assignments": []}, "assignments", "expected a non-empty list"),
        ({"assignments": [{"server": "node0", "device_type": "x", "gpus": 1, "vsw": 0, "ga": 0}]}, "vsw", ">= 1"),
        ({"assignments": [{"server": "", "device_type": "x", "gpus": 1, "vsw": 1, "ga": -1}]}, "ga", ">= 0"),
        ({"assignments": [3]}, "assignments[0]", "expected an object"),
    ],
)
def test_bad_plans_name_the_field(tmp_path: Path, change: dict, field: str, message: str) -> None:  # type: ignore[type-arg]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(PLAN.to_dict() | change))
    with pytest.raises(InputError) as info:
        read_plan(path)
    lines = info.value.lines()
    assert any(str(path) in line and field in line and message in line for line in lines), lines


def test_unreadable_plans(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="plan file not found"):
        read_plan(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(InputError, match="invalid JSON"):
        read_plan(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(InputError, match="expected a JSON object"):
        read_plan(tmp_path / "list.json")
