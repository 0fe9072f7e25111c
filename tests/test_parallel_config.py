"""The [parallel] section: bad layouts are one line each naming the field, exit 2; none is as before."""

from __future__ import annotations

from pathlib import Path

import pytest

from jabascli.config import load_config
from jabascli.engine.parallel.layout import resolve_layout
from jabascli.errors import InputError
from jabascli.workload import load_workload
from tests.conftest import run_jabas

CLUSTER = """
[job]
workload = "gpt"
lbs = 4

[[cluster.servers]]
name = "fast"
device_type = "cpu"
devices = 4

[[cluster.servers]]
name = "slow"
device_type = "slow"
devices = 2
emulate = { slowdown = 3.0, memory_bytes = 100000000 }
"""


def write(tmp_path: Path, parallel: str) -> Path:
    path = tmp_path / "jabas.toml"
    path.write_text(CLUSTER + parallel)
    return path


def problems(tmp_path: Path, parallel: str) -> list[str]:
    with pytest.raises(InputError) as info:
        load_config(write(tmp_path, parallel))
    return info.value.lines()


def test_without_parallel_section_nothing_changes(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "")).config.parallel is None


def test_good_layout_loads(tmp_path: Path) -> None:
    text = (
        '[parallel]\ntp = 2\npp = 3\nstages = [[0, 5], [6, 9], [10, 11]]\nsharding = "grads"\ncheckpointing = [0, 2]\n'
    )
    parallel = load_config(write(tmp_path, text)).config.parallel
    assert parallel is not None
    assert (parallel.tp, parallel.pp, parallel.stages, parallel.checkpointing) == (
        2,
        3,
        [(0, 5), (6, 9), (10, 11)],
        [0, 2],
    )


@pytest.mark.parametrize(
    ("parallel", "field", "words"),
    [
        ("tp = 3", "parallel.tp", "does not divide server 'fast'"),
        ("tp = 4", "parallel.tp", "would span servers: server 'slow' has 2 devices"),
        ("pp = 4", "parallel.pp", "does not divide the job's 6 devices"),
        ("pp = 2\nstages = [[0, 3], [3, 5]]", "parallel.stages[1]", "overlaps"),
        ("pp = 2\nstages = [[0, 3], [5, 7]]", "parallel.stages[1]", "leaves blocks 4-4 out"),
        ("pp = 2\nstages = [[1, 3], [4, 7]]", "parallel.stages[0]", "leaves blocks 0-0 out"),
        ("pp = 2\nstages = [[0, 3]]", "parallel.stages", "1 stage ranges for pp = 2"),
        ("layers = [{ blocks = [2, 1] }]", "parallel.layers[0].blocks", "first block is after the last"),
        ('sharding = "zero"', "parallel.sharding", ""),
        ("tpp = 2", "parallel.tpp", ""),
    ],
)
def test_bad_layout_is_one_line_naming_the_field(tmp_path: Path, parallel: str, field: str, words: str) -> None:
    lines = problems(tmp_path, "[parallel]\n" + parallel + "\n")
    assert len(lines) == 1, lines
    assert f": {field}: " in lines[0] and words in lines[0], lines


def test_cli_exits_2_with_one_line(tmp_path: Path) -> None:
    result = run_jabas("validate", "-c", str(write(tmp_path, "[parallel]\ntp = 4\n")))
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "parallel.tp" in lines[0] and "Traceback" not in result.stderr, result.stderr


def one_server(tmp_path: Path, workload: str, devices: int, parallel: str) -> Path:
    path = tmp_path / "train.toml"
    path.write_text(
        f'[job]\nworkload = "{workload}"\nlbs = 4\noptions = {{ variant = "tiny" }}\n'
        f'[[cluster.servers]]\nname = "a"\ndevice_type = "cpu"\ndevices = {devices}\n'
        f'[storage]\ncheckpoint_dir = "{tmp_path}/ck"\nrun_dir = "{tmp_path}/runs"\n[parallel]\n{parallel}\n'
    )
    return path


@pytest.mark.parametrize(
    ("workload", "devices", "parallel", "words"),
    [
        ("digits", 2, "tp = 2", "parallel.tp: workload 'digits' declares no blocks (and no TP plan)"),
        ("gpt", 1, "pp = 1\nstages = [[0, 2]]", "parallel.stages: leaves blocks 3-3 out of every stage"),
        ("gpt", 1, "checkpointing = [4]", "parallel.checkpointing: block 4 is past the model's 4 blocks"),
    ],
)
def test_train_refuses_what_the_workload_or_runtime_cannot_honour(
    tmp_path: Path, workload: str, devices: int, parallel: str, words: str
) -> None:
    """Nothing is trained and no checkpoint written: one line, exit 2 (`jabas run` starts one trainer per device)."""
    result = run_jabas("run" if devices > 1 else "train", "-c", str(one_server(tmp_path, workload, devices, parallel)))
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and words in lines[0], result.stderr
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize(
    ("parallel", "field", "words"),
    [
        ("tp = 2\nlayers = [{ blocks = [0, 1], tp = 4 }]", "parallel.layers[0].tp", "tp = 1 or the replica's tp = 2"),
        (
            'sharding = "full"\nlayers = [{ blocks = [0, 1], sharding = "grads" }]',
            "parallel.layers[0].sharding",
            'not built yet: "grads" with "full" elsewhere',
        ),
        (
            'pp = 2\nlayers = [{ blocks = [0, 1], sharding = "full" }]',
            "parallel.layers[0].sharding",
            "per-block sharding is not built yet with pipeline stages (pp = 2)",
        ),
    ],
)
def test_layers_the_runtime_cannot_honour_are_one_line_naming_the_entry(
    tmp_path: Path, parallel: str, field: str, words: str
) -> None:
    loaded = load_config(one_server(tmp_path, "gpt", 4, parallel))
    workload = load_workload("gpt", {"variant": "tiny"})
    with pytest.raises(InputError) as info:
        resolve_layout(loaded, workload, 4)
    lines = info.value.lines()
    assert len(lines) == 1 and f": {field}: " in lines[0] and words in lines[0], lines


def test_layers_resolve_to_each_blocks_strategy(tmp_path: Path) -> None:
    """Blocks no entry names follow [parallel]'s keys; the outside of the blocks follows [parallel] sharding."""
    text = 'tp = 2\ncheckpointing = [0]\nlayers = [{ blocks = [2, 3], tp = 2, sharding = "full" }]'
    layout = resolve_layout(load_config(one_server(tmp_path, "gpt", 4, text)), load_workload("gpt", {}), 4)
    assert layout is not None
    assert (layout.sharding, layout.unsharded, layout.outside_unsharded) == ("full", (0, 1), True)
    assert (layout.checkpointed, layout.tp_whole) == ((0,), ())
