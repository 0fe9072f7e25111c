"""The scheduler's state machine, driven directly with a fake clock (no processes, no HTTP)."""

from __future__ import annotations

from pathlib import Path

import pytest

from jabascli.elastic.job import Conflict, Scheduler
from jabascli.elastic.protocol import DeviceInfo, Heartbeat, Registration, StartCommand, StopCommand, TrainerExit
from jabascli.engine.checkpoint_store import CheckpointStore
from jabascli.engine.layout import checkpoint_folder
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


def running_on_a(tmp_path: Path) -> Scheduler:
    """A job running on A (its start taken), with B's worker registered too."""
    s, _ = scheduler(tmp_path)
    register(s, 0)
    register(s, 1)
    commands(s, 0)
    return s


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
    s = running_on_a(tmp_path)
    with pytest.raises(InputError, match="unknown server 'C'"):
        s.move(["A", "C"])
    assert s.state == "running" and s.pending is None
    assert commands(s, 0) == []


def test_a_move_stops_at_the_epoch_end_then_starts_the_new_allocation_from_the_checkpoint(tmp_path: Path) -> None:
    s, _ = scheduler(tmp_path, scheduler={"in_place_moves": False})  # every trainer restarts
    register(s, 0)
    register(s, 1)
    commands(s, 0)
    s.move(["A", "B"])
    assert s.state == "moving"
    [stop] = commands(s, 0)
    assert isinstance(stop, StopCommand) and (stop.generation, stop.when) == (1, "epoch")
    checkpoint = checkpoint_folder(s.loaded) / "checkpoint-10.pt"
    CheckpointStore(checkpoint.parent).write(b"written by the trainers", step=10, epoch=0)
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


def _event(tag: int, event: str, **fields: object) -> dict[str, object]:
    """A trainer event as its agent reports it: tagged with the generation the trainer belongs to."""
    return {"generation": tag, "event": {"event": event, **fields}}


def test_a_move_in_place_keeps_the_trainers_that_stay_and_starts_only_the_new_ranks(tmp_path: Path) -> None:
    s, _ = scheduler(tmp_path)
    register(s, 0)
    register(s, 1)
    [start] = commands(s, 0)
    s.move(["A", "B"])
    # The next generation exists at once: its joiner (B's rank) starts now, at the store rank 0 hosts.
    assert (s.state, s.generation.number if s.generation else None) == ("moving", 2)
    [joiner] = commands(s, 1)
    assert commands(s, 0) == []  # A trains on until the joiner is built and waits
    commands(s, 1, events=[_event(2, "ready", generation=2, rank=1)])
    [stop] = commands(s, 0)
    assert isinstance(stop, StopCommand) and (stop.generation, stop.when) == (1, "epoch")
    assert stop.handoff is not None and (stop.handoff.generation, stop.handoff.ranks) == (2, {"0": 0})
    assert stop.handoff.plan["assignments"][1]["server"] == "B"
    assert isinstance(joiner, StartCommand) and (joiner.generation, joiner.ranks, joiner.resume) == (2, [1], True)
    assert (joiner.master_addr, joiner.master_port) == (start.master_addr, start.master_port)
    # Rank 0 stops at the epoch end and carries on as generation 2's rank 0 (it does not exit).
    events = [_event(1, "stopping", step=10, time=100.0), _event(1, "done", step=10, stopped=True, results=[])]
    events += [_event(2, "handoff", generation=2, rank=0), _event(2, "first_step", step=11, started=100.25, time=101)]
    commands(s, 0, events=events)
    assert s.state == "running" and s.allocation == ["A", "B"] and s.retiring is None
    [move] = s.status().moves
    assert (move.in_place, move.stopped_step, move.downtime_s, move.first_iteration_s) == (True, 10, 0.25, 0.75)

    # Back to A: B's rank leaves (exits 0), A's rank 0 stays; nothing restarts.
    s.move(["A"], "now")
    [stop] = commands(s, 0)
    assert stop.handoff is not None and (stop.handoff.ranks, stop.handoff.world_size) == ({"0": 0}, 1)
    assert commands(s, 1)[0].kind == "stop"  # B's rank stops with the others, then leaves
    commands(s, 1, exits=[TrainerExit(generation=2, rank=1, code=0)])
    commands(s, 0, events=[_event(2, "stopping", step=20, time=200.0), _event(3, "first_step", step=21, time=201)])
    assert s.state == "running" and s.restarts == 0 and [m.in_place for m in s.status().moves] == [True, True]


def test_a_stop_during_a_move_in_place_stops_the_old_generation_and_the_waiting_joiner(tmp_path: Path) -> None:
    s = running_on_a(tmp_path)
    s.move(["A", "B"], "now")
    commands(s, 1)  # the joiner's start
    s.stop("now")
    [stop] = commands(s, 0)
    [kill] = commands(s, 1)
    assert isinstance(stop, StopCommand) and (stop.generation, stop.when, stop.handoff) == (1, "now", None)
    assert isinstance(kill, StopCommand) and (kill.generation, kill.when) == (2, "kill")
    commands(s, 1, exits=[TrainerExit(generation=2, rank=1, code=-15)])
    assert s.state == "stopping"
    commands(s, 0, exits=[TrainerExit(generation=1, rank=0, code=0)])  # A's rank stopped and exited
    assert s.state == "stopped"


def test_a_move_that_drops_rank_0s_server_restarts_every_trainer(tmp_path: Path) -> None:
    s = running_on_a(tmp_path)
    s.move(["B"], "now")
    [stop] = commands(s, 0)
    assert isinstance(stop, StopCommand) and stop.handoff is None and s.generation and s.generation.number == 1
    assert commands(s, 1) == []  # B starts only once A's trainers exited


def test_a_survivor_that_dies_during_a_move_in_place_restarts_the_job(tmp_path: Path) -> None:
    s = running_on_a(tmp_path)
    s.move(["A", "B"], "now")
    commands(s, 1, events=[_event(2, "ready", generation=2, rank=1)])
    commands(s, 0), commands(s, 1)
    # Rank 0 crashes before it handed over: it counts as generation 2's rank 0 too, and both are stopped.
    commands(s, 0, exits=[TrainerExit(generation=1, rank=0, code=-9)])
    assert s.state == "restarting"
    [kill] = commands(s, 1)
    assert isinstance(kill, StopCommand) and (kill.generation, kill.when) == (2, "kill")
    [start_a] = commands(s, 1, exits=[TrainerExit(generation=2, rank=1, code=-15)])
    assert s.state == "running" and s.restarts == 1 and s.retiring is None
    assert isinstance(start_a, StartCommand) and start_a.generation == 3


def test_a_crash_restarts_from_the_checkpoint_at_most_max_restarts_times(tmp_path: Path) -> None:
    s, _ = scheduler(tmp_path, available=["A", "B"], scheduler={"max_restarts": 1, "recover_in_place": False})
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
    s, clock = scheduler(tmp_path, available=["A", "B"], scheduler={"recover_in_place": False})
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
    assert commands(s, 0, events=[{"generation": 1, "event": epoch}]) == []
    assert seen == [[32]] and s.state == "moving" and s.allocation == ["A", "B"]  # in place: A's rank stays
    commands(s, 1, events=[_event(2, "ready", generation=2, rank=1)])  # B's new rank is built and waits
    [stop] = commands(s, 0)
    assert isinstance(stop, StopCommand) and stop.when == "now" and stop.handoff is not None


def test_a_new_scheduler_resumes_from_the_checkpoint_only_when_asked(tmp_path: Path) -> None:
    loaded = load(write_config(tmp_path))
    CheckpointStore(checkpoint_folder(loaded)).write(b"left by an earlier scheduler", step=10, epoch=0)
    for resume in (False, True):
        s = Scheduler(loaded, resume=resume)
        register(s, 0)
        [start] = commands(s, 0)
        assert isinstance(start, StartCommand) and start.resume is resume


def test_a_lost_rank_is_recovered_in_place_and_its_server_taken_back_at_the_epoch_end(tmp_path: Path) -> None:
    """Rank 1 (B) dies: A's trainer gets the recovery order (no restart, no start on A), B's stragglers are
    stopped; once A's first iteration after it is reported, B (alive) is taken back by a move at the epoch end."""
    s, _ = scheduler(tmp_path, available=["A", "B"])
    register(s, 0)
    register(s, 1)
    commands(s, 0), commands(s, 1)
    commands(s, 0, events=[_event(1, "start", step=0, epoch=0, gbs=48), _event(1, "step", step=6, loss=2.0)])
    commands(s, 1, exits=[TrainerExit(generation=1, rank=1, code=-9)])
    assert s.state == "running"  # rank 0 has a second to report its failed collective (or fail too)
    [order] = commands(s, 0, events=[_event(1, "peer_lost", rank=0, step=7, time=100.0, in_place=True)])
    assert isinstance(order, StopCommand) and (order.generation, order.when) == (1, "recover")
    assert order.handoff is not None and (order.handoff.generation, order.handoff.ranks) == (2, {"0": 0})
    assert s.state == "moving" and s.restarts == 0 and s.allocation == ["A"]
    [kill] = commands(s, 1)  # anything of generation 1 left on B
    assert isinstance(kill, StopCommand) and (kill.generation, kill.when) == (1, "kill")
    started = [_event(2, "start", step=7, epoch=0, gbs=32), _event(2, "first_step", step=8, started=101.0, time=101.5)]
    commands(s, 0, events=started)
    record = s.moves[0]
    assert (record.reason, record.in_place, record.stopped_step, record.resumed_step) == ("recovery", True, 7, 7)
    assert (record.steps_lost, record.recovered_s, record.failed_at) == (0, 1.5, 100.0)
    # B is registered: the job moves back onto it at the next epoch end, in place (a joiner on B).
    assert s.state == "moving" and s.allocation == ["A", "B"] and s.moves[1].reason == "move"
    [start] = commands(s, 1)
    assert isinstance(start, StartCommand) and (start.generation, start.ranks, start.resume) == (3, [1], True)


def test_a_lost_rank_is_named_as_the_cause_when_a_survivors_report_came_first(tmp_path: Path) -> None:
    """On a busy host the survivor's failed collective can reach the scheduler before the dead rank's exit:
    the recovery still names the exit, the cause, not the symptom."""
    s, _ = scheduler(tmp_path, available=["A", "B"])
    register(s, 0)
    register(s, 1)
    commands(s, 0), commands(s, 1)
    commands(s, 0, events=[_event(1, "peer_lost", rank=0, step=7, time=100.0, in_place=True)])
    assert s.state == "running"  # B has a second to exit or report
    commands(s, 1, exits=[TrainerExit(generation=1, rank=1, code=-9)])
    assert s.state == "moving" and s.allocation == ["A"]
    assert "rank 1 on B exited with code -9" in s.moves[0].failure, s.moves[0].failure


def test_a_hung_rank_is_the_one_that_did_not_report_and_a_lost_rank_0_restarts(tmp_path: Path) -> None:
    s, clock = scheduler(tmp_path, available=["A", "B"])
    register(s, 0)
    register(s, 1)
    commands(s, 0), commands(s, 1)
    commands(s, 0, events=[_event(1, "peer_lost", rank=0, step=3, time=50.0, in_place=True)])
    assert s.state == "running"  # B may still say its collective failed too
    clock.now = 2.0
    commands(s, 1)
    s.check_heartbeats()
    assert s.state == "moving" and s.allocation == ["A"] and "rank 0's collective failed" in s.moves[0].failure
    # Rank 0 lost: its store is gone with it; the job restarts from the checkpoint, and says why.
    s, clock = scheduler(tmp_path / "again", available=["A", "B"])
    register(s, 0)
    register(s, 1)
    commands(s, 0), commands(s, 1)
    commands(s, 0, exits=[TrainerExit(generation=1, rank=0, code=-9)])
    clock.now += 2.0  # rank 1 never reports: decided without it
    s.check_heartbeats()
    assert s.state == "restarting" and "rank 0 was lost, and with it the job's store" in s.message
