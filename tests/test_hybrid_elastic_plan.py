"""The scheduler's plans of a `[parallel] plan = "auto"` job come from the hybrid planner, for the servers at hand.

Driven directly (no processes, as tests/test_elastic_job.py), on the hybrid profiles of
tests/test_hybrid_autoplan_run.py (4 blocks of 1 GB of parameters, 16 GB with gradients and Adam): on
``fast`` + ``slow`` (11 GB each) only two pipeline stages fit; ``big`` (40 GB, the fast device type) holds
the whole model; ``fast`` alone holds no plan, and a move there is refused in one line naming it. (The
auto-scaler's pricing of such a job: tests/test_autoscale_hybrid.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tomli_w
import tomllib

from jabascli.config import load_config
from jabascli.elastic.job import Scheduler, plan_for
from jabascli.elastic.protocol import DeviceInfo, Heartbeat, Registration, StartCommand, StopCommand, TrainerExit
from jabascli.engine.checkpoint_store import CheckpointStore
from jabascli.engine.layout import checkpoint_folder
from jabascli.errors import InputError
from tests.test_hybrid_autoplan_run import GBS, write_job

DEVICES = DeviceInfo(backend="cpu", device_type="cpu", count=1, memory_bytes=1)


def auto_job(folder: Path) -> Path:
    """tests/test_hybrid_autoplan_run.py's job, on ``fast`` and ``slow``, with a third server ``big``."""
    path = write_job(folder)
    config = tomllib.loads(path.read_text())
    config["cluster"]["available_servers"] = ["fast", "slow"]
    config["cluster"]["servers"].append({"name": "big", "device_type": "cpu", "memory_bytes": 40_000_000_000})
    path.write_bytes(tomli_w.dumps(config).encode())
    return path


def test_the_hybrid_plan_follows_the_servers_and_none_fitting_is_refused_naming_them(tmp_path: Path) -> None:
    loaded = load_config(auto_job(tmp_path))
    both, source = plan_for(loaded, ["fast", "slow"], GBS)
    assert both.parallel is not None and both.parallel.pp == 2 and both.gbs == GBS
    assert sorted(r.server for r in both.ranks) == ["fast", "slow"] and "hybrid plan at GBS 8" in source
    big, _ = plan_for(loaded, ["big"], GBS)
    assert big.parallel is not None and big.parallel.pp == 1 and big.gbs == GBS
    assert [r.server for r in big.ranks] == ["big"]
    with pytest.raises(InputError) as refused:
        plan_for(loaded, ["fast"], GBS)
    [line] = refused.value.lines()
    assert "no hybrid plan for GBS 8 fits servers fast: " in line


def commands(s: Scheduler, rank: int, **beat: object) -> list[StartCommand | StopCommand]:
    return list(s.heartbeat(rank, Heartbeat(**beat)).commands)  # type: ignore[arg-type]


def test_a_moved_auto_job_gets_the_planners_layout_for_its_new_servers(tmp_path: Path) -> None:
    s = Scheduler(load_config(auto_job(tmp_path)), lambda: 0.0)
    for rank in (0, 1, 2):
        s.register(Registration(rank=rank, host="h", devices=DEVICES))
    [start] = commands(s, 0)  # generation 1 on fast + slow, at [batching] initial_gbs
    assert isinstance(start, StartCommand) and start.plan["parallel"]["pp"] == 2 and s.progress.gbs == GBS

    with pytest.raises(InputError, match="fits servers fast: "):
        s.move(["fast"])
    assert (s.state, s.allocation, s.pending) == ("running", ["fast", "slow"], None)  # left alone

    s.move(["big"])  # rank 0's server goes: every rank restarts, from the checkpoint
    [stop] = commands(s, 0)
    assert isinstance(stop, StopCommand)
    CheckpointStore(checkpoint_folder(s.loaded)).write(b"written by the trainers", step=5, epoch=0)
    done = {"generation": 1, "event": {"event": "done", "step": 5, "stopped": True, "results": []}}
    commands(s, 0, events=[done], exits=[TrainerExit(generation=1, rank=0, code=0)])
    commands(s, 1, exits=[TrainerExit(generation=1, rank=1, code=0)])
    [moved] = commands(s, 2)
    assert isinstance(moved, StartCommand) and moved.resume and moved.world_size == 1
    assert moved.plan["parallel"]["pp"] == 1 and s.progress.gbs == GBS  # the GBS kept, the layout the planner's for big
    assert "hybrid plan at GBS 8" in s.message
