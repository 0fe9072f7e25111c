"""Per-rank plans: from the config or a plan file; every bad input names the file and the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from jabascli.cli.app import app
from jabascli.config import LoadedConfig, load_config
from jabascli.engine.plan import load_plan
from jabascli.errors import InputError
from tests.engine_support import write_job

CONFIG = """
[job]
name = "p"
workload = "digits"
lbs = 8
weight_sync = "{weight_sync}"

[[cluster.servers]]
name = "node0"
device_type = "Tesla V100-PCIE-16GB"
devices = 4
vsw = 2
ga = 1

[[cluster.servers]]
name = "node1"
device_type = "Tesla P100-PCIE-16GB"
devices = 2
emulate = {{ slowdown = 2.5, memory_bytes = 1000000000 }}

[storage]
run_dir = "runs"
checkpoint_dir = "checkpoints"
"""


def config(tmp_path: Path, weight_sync: str = "recommend") -> LoadedConfig:
    path = tmp_path / "jabas.toml"
    path.write_text(CONFIG.format(weight_sync=weight_sync))
    return load_config(path)


def plan_file(tmp_path: Path, **changes: Any) -> Path:
    plan: dict[str, Any] = {
        "gbs": 512,
        "lbs": 32,
        "weight_sync": "overlap",
        "iteration_time_s": 0.21,
        "throughput": 2438.1,
        "assignments": [
            {"server": "node0", "device_type": "Tesla V100-PCIE-16GB", "gpus": 4, "vsw": 3, "ga": 0},
            {"server": "node1", "device_type": "Tesla P100-PCIE-16GB", "gpus": 2, "vsw": 1, "ga": 1},
        ],
    }
    plan.update(changes)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    return path


def test_without_a_plan_file_ranks_come_from_the_servers_in_order(tmp_path: Path) -> None:
    plan = load_plan(config(tmp_path))
    assert [(r.rank, r.server, r.vsw, r.ga) for r in plan.ranks] == [(i, "node0", 2, 1) for i in range(4)] + [
        (4, "node1", 1, 0),
        (5, "node1", 1, 0),
    ]
    assert plan.workers == 4 * 4 + 2 and plan.gbs == 8 * 18
    assert [plan.worker_offset(r) for r in range(6)] == [0, 4, 8, 12, 16, 17]
    assert plan.ranks[4].emulated and plan.ranks[4].slowdown == 2.5 and not plan.ranks[0].emulated
    assert plan.describe() == "node0:4GPU,VSW:2,GA:1 node1:2GPU,VSW:1,GA:0"


def test_a_plan_file_numbers_ranks_by_walking_its_assignments(tmp_path: Path) -> None:
    plan = load_plan(config(tmp_path), plan_file(tmp_path))
    assert plan.lbs == 32 and plan.gbs == 512 and plan.world_size == 6
    assert [(r.server, r.vsw, r.ga) for r in plan.ranks] == [("node0", 3, 0)] * 4 + [("node1", 1, 1)] * 2
    assert plan.weight_sync == "overlap"
    assert plan.to_dict()["assignments"][1] == {
        "server": "node1",
        "device_type": "Tesla P100-PCIE-16GB",
        "gpus": 2,
        "vsw": 1,
        "ga": 1,
    }


def test_an_explicit_weight_sync_in_the_config_wins_over_the_plan_file(tmp_path: Path) -> None:
    assert load_plan(config(tmp_path, "sequential"), plan_file(tmp_path)).weight_sync == "sequential"
    assert load_plan(config(tmp_path, "recommend"), plan_file(tmp_path)).weight_sync == "overlap"


@pytest.mark.parametrize(
    ("changes", "field", "words"),
    [
        ({"lbs": 0}, "lbs", "expected an integer >= 1, got 0"),
        ({"gbs": 500}, "gbs", "is 500 but lbs * sum(gpus * vsw * (ga + 1)) = 32 * 16 = 512"),
        ({"weight_sync": "fast"}, "weight_sync", "sequential, overlap or recommend"),
        ({"assignments": []}, "assignments", "non-empty list"),
        ({"assignments": [{"server": "node0", "gpus": 1, "vsw": 0, "ga": 0}]}, "assignments[0].vsw", ">= 1, got 0"),
        ({"assignments": [{"server": "node0", "gpus": 1, "vsw": 1, "ga": -1}]}, "assignments[0].ga", ">= 0, got -1"),
        ({"assignments": [{"server": "node0", "gpus": 1, "vsw": True, "ga": 0}]}, "assignments[0].vsw", "integer"),
        ({"assignments": [{"server": "node9", "gpus": 1, "vsw": 1, "ga": 0}]}, "assignments[0].server", "node9"),
        (
            {"assignments": [{"server": "node1", "gpus": 2, "vsw": 1, "ga": 0}] * 2},
            "assignments[1].gpus",
            "names 4 devices of server 'node1', which has 2",
        ),
    ],
)
def test_a_bad_plan_file_is_an_input_error_naming_file_and_field(
    tmp_path: Path, changes: dict[str, Any], field: str, words: str
) -> None:
    path = plan_file(tmp_path, **changes)
    if "gbs" not in changes:
        path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "gbs"}))
    with pytest.raises(InputError) as err:
        load_plan(config(tmp_path), path)
    problem = err.value.problems[0]
    assert (Path(str(problem.file)), problem.field) == (path, field)
    assert words in problem.message


def test_a_plan_must_name_exactly_the_ranks_that_exist(tmp_path: Path) -> None:
    path = plan_file(tmp_path)
    plan = load_plan(config(tmp_path), path)
    plan.check_world_size(6)
    for world in (4, 8):
        with pytest.raises(InputError, match=f"the plan has 6 ranks .* but WORLD_SIZE is {world}") as err:
            plan.check_world_size(world)
        assert err.value.problems[0].field == "assignments"


def test_bad_plan_files_on_the_command_line_exit_2_before_anything_starts(tmp_path: Path) -> None:
    loaded = config(tmp_path)
    cli = CliRunner()
    bad = plan_file(tmp_path, gbs=100)
    result = cli.invoke(app, ["run", "-c", str(loaded.path), "--plan", str(bad)])
    assert result.exit_code == 2
    assert f"{bad}: gbs: is 100 but lbs * sum" in result.stderr and "Traceback" not in result.output
    assert not (tmp_path / "runs").exists() and not (tmp_path / "checkpoints").exists()

    (tmp_path / "broken.json").write_text("{")
    result = cli.invoke(app, ["run", "-c", str(loaded.path), "--plan", str(tmp_path / "broken.json")])
    assert result.exit_code == 2 and "invalid JSON" in result.stderr

    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    result = cli.invoke(app, ["train", "-c", str(loaded.path), "--plan", str(plan_file(tmp_path))], env=env)
    assert result.exit_code == 2 and "the plan has 6 ranks (one per GPU) but WORLD_SIZE is 2" in result.stderr


@pytest.mark.parametrize(("key", "value"), [("lbs", 0), ("vsw", 0)])
def test_a_zero_lbs_or_vsw_in_the_config_exits_2(tmp_path: Path, key: str, value: int) -> None:
    text = CONFIG.format(weight_sync="recommend")
    text = text.replace("lbs = 8", f"lbs = {value}") if key == "lbs" else text.replace("vsw = 2", f"vsw = {value}")
    path = tmp_path / "jabas.toml"
    path.write_text(text)
    result = CliRunner().invoke(app, ["run", "-c", str(path)])
    assert result.exit_code == 2
    assert ("job.lbs" if key == "lbs" else "cluster.servers[0].vsw") in result.stderr
    assert "greater than 0" in result.stderr


def test_a_gbs_larger_than_the_training_set_exits_2(tmp_path: Path) -> None:
    config = write_job(tmp_path, [(3, 0)], lbs=4, options={"samples": 10})
    result = CliRunner().invoke(app, ["train", "-c", str(config)])
    assert result.exit_code == 2, result.output
    assert f"{config}: job.lbs: GBS 12 is more than the 10 training samples" in result.stderr


def test_without_a_plan_file_the_config_is_named_when_ranks_do_not_match(tmp_path: Path) -> None:
    loaded = config(tmp_path)
    with pytest.raises(InputError) as err:
        load_plan(loaded).check_world_size(1)
    problem = err.value.problems[0]
    assert (problem.file, problem.field) == (str(loaded.path), "cluster.servers")
    assert "torchrun --nproc-per-node 6" in problem.message
