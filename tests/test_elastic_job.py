"""The scheduler's state machine, driven directly with a fake clock (no processes, no HTTP)."""

from __future__ import annotations

from pathlib import Path

import pytest

from jabascli.elastic.job import Conflict, Scheduler
from jabascli.elastic.protocol import DeviceInfo, Heartbeat, Registration, StartCommand, StopCommand, TrainerExit
from jabascli.engine.layout import checkpoint_path
from jabascli.errors import InputError
from tests.elastic_support import load, write_config

DEVICES = DeviceInfo(backend="cpu", device_type="cpu", count=1, memory_bytes=1)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def scheduler(tmp_path: Path, **kwargs: object) -> tuple[Scheduler, Clock]:
    clock = Clock()
    return Scheduler(load(write_config(tmp_path, **kwargs)), clock), clock  # type: ignore[arg-type]


def register(s: Scheduler, rank: int) -> None:
    s.register(Registration(rank=rank, host="h", devices=DEVICES))


def commands(s: Scheduler, rank: int, **beat: object) -> list[StartCommand | StopCommand]:
    return list(s.heartbeat(rank, Heartbeat(**beat)).commands)  # type: ignore[arg-type]


def test_starts_once_the_allocation_registered_and_refuses_a_second_worker_of_a_rank(tmp_path: Path) -> None:
    s, _ = scheduler(tmp_path)
    assert s.state == "waiting"
    register(s, 1)
    assert s.state == "waiting"  # B is not in the allocation [A]
    register(s, 0)
    assert s.state == "running"
    [start] = commands(s, 0)
    assert isinstance(start, StartCommand)
    assert (start.ranks, start.world_size, start.resume) == ([0], 1, False)
    assert start.plan["assignments"][0]["server"] == "A"
    with pytest.raises(Conflict, match="already registered"):
        register(s, 0)
    with pytest.raises(InputError, match="rank 5 has no server"):
        register(s, 5)


def test_a_move_to_an_unknown_server_is_refused_and_leaves_the_job_alone(tmp_path: Path) -> None:
    s, _ = scheduler(tmp_path)
    register(s, 0)
    register(s, 1)
    commands(s, 0)
    with pytest.raises(InputError, match="unknown server 'C'"):
        s.move(["A", "C"])
    assert s.state == "running" and s.pending is None
    assert commands(s, 0) == []


def test_a_move_stops_at_the_epoch_end_then_starts_the_new_allocation_from_the_checkpoint(tmp_path: Path) -> None:
    s, _ = scheduler(tmp_path)
    register(s, 0)
    register(s, 1)
    commands(s, 0)
    s.move(["A", "B"])
    assert s.state == "moving"
    [stop] = commands(s, 0)
    assert isinstance(stop, StopCommand) and (stop.generation, stop.when) == (1, "epoch")
    checkpoint = checkpoint_path(s.loaded)
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_bytes(b"written by the trainers")
    done = {"generation": 1, "event": {"event": "done", "step": 10, "stopped": True, "results": []}}
    stopping = {"generation": 1, "event": {"event": "stopping", "step": 10, "time": 100.0}}
    [a] = commands(s, 0, events=[stopping, done], exits=[TrainerExit(generation=1, rank=0, code=0)])
    assert s.state == "running" and s.allocation == ["A", "B"]
    [b] = commands(s, 1)
    assert isinstance(a, StartCommand) and isinstance(b, StartCommand)
    assert (a.ranks, b.ranks, a.world_size, a.resume, a.master_port) == ([0], [1], 2, True, b.master_port)
    first = {"generation": 2, "event": {"event": "first_step", "step": 11, "time": 103.5}}
    commands(s, 0, events=[first])
    [move] = s.status().moves
    assert (move.from_servers, move.to_servers, move.stopped_step, move.downtime_s) == (["A"], ["A", "B"], 10, 3.5)


def test_a_crash_restarts_from_the_checkpoint_at_most_max_restarts_times(tmp_path: Path) -> None:
    s, _ = scheduler(tmp_path, available=["A", "B"], scheduler={"max_restarts": 1})
    register(s, 0)
    register(s, 1)
    commands(s, 0), commands(s, 1)
    commands(s, 1, exits=[TrainerExit(generation=1, rank=1, code=-9, log_tail="boom")])
    assert s.state == "restarting" and "code -9" in s.message
    [kill] = commands(s, 0)
    assert isinstance(kill, StopCommand) and kill.when == "kill"
    commands(s, 0, exits=[TrainerExit(generation=1, rank=0, code=1)])
    assert s.state == "running" and s.restarts == 1 and s.allocation == ["A", "B"]
    commands(s, 0), commands(s, 1)
    commands(s, 0, exits=[TrainerExit(generation=2, rank=0, code=1), TrainerExit(generation=2, rank=1, code=1)])
    commands(s, 1, exits=[TrainerExit(generation=2, rank=1, code=1)])
    assert s.state == "failed" and "gave up after 1 restarts" in s.message


def test_a_silent_worker_is_declared_lost_and_the_job_restarts_on_the_others(tmp_path: Path) -> None:
    s, clock = scheduler(tmp_path, available=["A", "B"])
    register(s, 0)
    register(s, 1)
    commands(s, 0), commands(s, 1)
    clock.now = 3.0
    commands(s, 0)
    clock.now = 6.0  # B silent for 6 s > 5 s
    s.check_heartbeats()
    assert s.state == "restarting"
    [kill, start] = commands(s, 0, exits=[TrainerExit(generation=1, rank=0, code=-15)])
    assert s.state == "running" and s.allocation == ["A"]
    assert isinstance(kill, StopCommand) and kill.when == "kill"
    assert isinstance(start, StartCommand) and start.world_size == 1
    with pytest.raises(Conflict, match="not registered"):
        commands(s, 1)
    register(s, 1)  # a lost worker may come back


def test_a_move_keeps_the_gbs_with_the_solvers_plan_when_profiles_exist(tmp_path: Path, reference_dir: Path) -> None:
    from jabascli.elastic.job import plan_for

    config = tmp_path / "jabas.toml"
    profiles = "".join(
        f'{key} = "{reference_dir / folder}"\n'
        for key, folder in (
            ("memory", "cluster_mem_profile_data"),
            ("computation", "cluster_comp_profile_data"),
            ("communication", "comm_profile_data"),
            ("bucket", "bucket_profile_data"),
        )
    )
    servers = "".join(
        f'[[cluster.servers]]\nname = "{name}"\ndevice_type = "{kind}"\ndevices = 4\n\n'
        for name, kind in (("node0", "Tesla V100-PCIE-16GB"), ("node1", "Tesla P100-PCIE-16GB"))
    )
    config.write_text(f'[job]\nworkload = "resnet50"\nlbs = 32\n\n[profiles]\n{profiles}\n{servers}')
    loaded = load(config)
    for servers_ in (["node0", "node1"], ["node1"]):
        plan, source = plan_for(loaded, servers_, gbs=512)
        assert plan.gbs == 512 and source == "solver plan at GBS 512"
        assert {r.server for r in plan.ranks} <= set(servers_)
    plan, source = plan_for(loaded, ["node1"], gbs=7)  # no plan reaches it: the configured VSW/GA
    assert plan.gbs == 32 * 4 and source.startswith("configured VSW/GA")


def test_a_planner_is_consulted_at_every_epoch_end_and_its_move_is_made(tmp_path: Path) -> None:
    seen: list[list[int | None]] = []

    def planner(status):  # type: ignore[no-untyped-def]
        seen.append([e.gbs for e in status.epoch_history])
        return (["A", "B"], "now") if len(status.epoch_history) == 1 else None

    clock = Clock()
    s = Scheduler(load(write_config(tmp_path, epochs=3)), clock, planner)
    register(s, 0)
    register(s, 1)
    commands(s, 0)
    epoch = {"event": "epoch", "epoch": 0, "step": 44, "train_loss": 0.7, "samples_per_s": 1.0, "time_s": 1.0}
    [stop] = commands(s, 0, events=[{"generation": 1, "event": epoch}])
    assert seen == [[32]] and s.state == "moving" and s.pending == ["A", "B"]
    assert isinstance(stop, StopCommand) and stop.when == "now"


def test_a_new_scheduler_resumes_from_the_checkpoint_only_when_asked(tmp_path: Path) -> None:
    loaded = load(write_config(tmp_path))
    checkpoint = checkpoint_path(loaded)
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_bytes(b"left by an earlier scheduler")
    for resume in (False, True):
        s = Scheduler(loaded, resume=resume)
        register(s, 0)
        [start] = commands(s, 0)
        assert isinstance(start, StartCommand) and start.resume is resume
