"""Faults on purpose (``JABAS_FAULT``) and what they do to a job: a lost or hung rank fails the others
within ``[scheduler] collective_timeout_s``, and the job restarted from its checkpoint ends exact."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import tomli_w
import tomllib

from jabascli.elastic.job import TERMINAL
from jabascli.engine.checkpoint import read_checkpoint
from jabascli.engine.faults import FAULT_ENV, Fault, FaultInjector, parse_faults
from jabascli.engine.launch import run_local
from jabascli.engine.layout import checkpoint_folder
from jabascli.engine.options import TrainOptions
from jabascli.engine.plan import load_plan
from jabascli.engine.reference import reference_run
from jabascli.errors import InputError
from jabascli.net import free_port
from tests.elastic_support import jabas, slow_down, start_scheduler, wait_status, write_config
from tests.engine_support import TRAINER_ENV, checkpoint_of, load, max_abs_diff, write_job
from tests.test_hybrid_exactness import write_config as hybrid_config

TWO = [(2, 1), (1, 0)]
LBS, GBS = 4, 20  # (VSW 2, GA 1) and (VSW 1, GA 0): 5 workers


def test_faults_parse_and_bad_ones_name_the_variable() -> None:
    assert parse_faults("1:5:kill, 0:2:hang") == [Fault(1, 5, "kill"), Fault(0, 2, "hang")]
    for bad in ("1:5", "1:0:exit", "x:5:exit", "1:5:explode", "1:5:exit:now"):
        with pytest.raises(InputError, match=f"environment: {FAULT_ENV}: '{bad}': expected RANK:STEP:KIND"):
            parse_faults(bad)


def test_a_fault_fires_once_per_job_on_its_rank_only(tmp_path: Path) -> None:
    mine = FaultInjector(parse_faults("1:3:exit,0:3:exit"), rank=1, folder=tmp_path / "faults")
    assert mine.faults == [Fault(1, 3, "exit")]
    assert mine._first_time(mine.faults[0]) and not mine._first_time(mine.faults[0])
    assert (tmp_path / "faults" / "rank1-step3-exit").is_file()


def _job(folder: Path, timeout_s: float) -> Path:
    path = write_job(folder, TWO, lbs=LBS, options={"samples": 6 * GBS + 3}, epochs=2)
    with path.open("a") as config:
        config.write(f"\n[scheduler]\ncollective_timeout_s = {timeout_s}\n")
    return path


@pytest.mark.parametrize("kind", ["hang", "kill"])
def test_a_lost_or_hung_rank_fails_the_job_in_bounded_time_and_a_restart_ends_exact(tmp_path: Path, kind: str) -> None:
    """Rank 1 hangs (or is SIGKILLed) as it begins step 5; rank 0 waits in step 5's all-reduce. It raises
    within the collective timeout, `jabas run --max-restarts 1` restarts both from step 4's checkpoint, and
    the job ends as one process that never failed."""
    loaded = load(_job(tmp_path, timeout_s=3.0))
    events: list[dict] = []
    began = time.monotonic()
    result = run_local(
        loaded,
        TrainOptions(checkpoint_every=2, metrics=False),
        events.append,
        {**TRAINER_ENV, FAULT_ENV: f"1:5:{kind}"},
        max_restarts=1,
    )
    [restart] = [e for e in events if e["event"] == "restart"]
    assert restart["resume"].endswith("checkpoint-4.pt"), restart
    assert [s["step"] for s in events if s["event"] == "start"] == [0, 4]
    assert result.done["step"] == 12 and not result.done["stopped"]
    assert time.monotonic() - began < 120  # a hang without the timeout would never end (pytest's limit: 600 s)
    reference, _ = reference_run(loaded, load_plan(loaded), steps=12)
    diffs = max_abs_diff(checkpoint_of(loaded)["model"], reference.state_dict())
    assert max(diffs.values()) <= 1e-9, diffs


def _elastic_job(folder: Path, fault: str, weight_sync: str) -> tuple[Path, list[subprocess.Popen[bytes]]]:
    """`jabas schedule` and an agent for each of A (rank 0) and B (rank 1), with ``JABAS_FAULT`` set: float64
    digits in 4 epochs, A 20x and B 40x slower than the CPU, checkpoints at epoch ends only."""
    settings = {"collective_timeout_s": 3.0, "heartbeat_interval_s": 0.1, "connect_timeout_s": 60.0}
    config = write_config(
        folder, record=True, available=["A", "B"], epochs=4, slowdown=(20.0, 40.0), scheduler=settings
    )
    data = tomllib.loads(config.read_text())
    data["job"]["weight_sync"] = weight_sync
    if weight_sync == "overlap":
        data["job"]["bucket_cap_mb"] = 0.004  # about 3 buckets of digits' float64 gradients: overlap interleaves
    config.write_bytes(tomli_w.dumps(data).encode())
    return config, _start(folder, config, fault)


def _start(folder: Path, config: Path, fault: str) -> list[subprocess.Popen[bytes]]:
    env = {FAULT_ENV: fault}
    processes = [start_scheduler(config, folder / "scheduler.log", env)]
    for rank in (0, 1):
        processes.append(jabas("worker", "-c", str(config), "--rank", str(rank), env=env, log=folder / f"w{rank}.log"))
    return processes


def _finish(folder: Path, config: Path, processes: list[subprocess.Popen[bytes]]) -> dict:
    """The job's last status, once it is over (every process ended)."""
    url = f"http://127.0.0.1:{load(config).config.scheduler.port}"
    try:
        status = wait_status(url, lambda s: s["state"] in TERMINAL, timeout=180)
        assert processes[0].wait(30) == 0, _logs(folder)
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
    return status


def _slow_until_taken_back(folder: Path, config: Path) -> None:
    """From the recovery until B's joiner trains, each batch takes 0.1 s more: on a busy host the joiner's
    start-up could otherwise outlast the job, and the move back would land at its end, with nothing to train."""
    url = f"http://127.0.0.1:{load(config).config.scheduler.port}"
    over = TERMINAL
    wait_status(url, lambda s: bool(s["moves"]) or s["state"] in over, timeout=180)
    slow = slow_down(folder)
    try:
        wait_status(url, lambda s: _trains_again(s["moves"]) or s["state"] in over, timeout=180)
    finally:
        slow.unlink()


def _trains_again(moves: list[dict]) -> bool:
    return len(moves) > 1 and moves[1]["resumed_step"] is not None


def _logs(folder: Path) -> str:
    return "\n".join(f"== {p.name}\n{p.read_text()[-2500:]}" for p in sorted(folder.rglob("*.log")))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "weight_sync"), [("kill", "sequential"), ("hang", "overlap"), ("kill_mid_update", "overlap")]
)
def test_a_lost_or_hung_rank_is_recovered_in_place_without_a_checkpoint_and_ends_exact(
    tmp_path: Path, kind: str, weight_sync: str
) -> None:
    """Rank 1 (B) is SIGKILLed (or hangs) as it begins step 31 of an elastic job (epoch 0 ended at step 29,
    its checkpoint the newest). Rank 0 (A) sees its collective fail (at once, or after the 3 s collective
    timeout), the scheduler drops B and sends A the recovery order: the same process trains on alone from its
    memory at step 30, not from the checkpoint, B is taken back at a later epoch end as a move in place, and
    the job ends as one process that followed the same GBS history. Under either weight sync: with ``overlap``
    no bucket is updated from the failed iteration (each is updated once its own all-reduce succeeded), or,
    when B dies right after its first bucket update (``kill_mid_update``), A puts back the buckets it had
    updated from the interrupted step (engine/bucket_undo.py) and redoes it whole."""
    config, processes = _elastic_job(tmp_path, f"1:31:{kind}", weight_sync)
    _slow_until_taken_back(tmp_path, config)
    status = _finish(tmp_path, config, processes)
    moves = json.dumps(status["moves"], indent=1)
    assert status["state"] == "succeeded" and status["restarts"] == 0, moves + _logs(tmp_path)
    recovery, back = status["moves"]
    assert (recovery["reason"], recovery["in_place"], recovery["to_servers"]) == ("recovery", True, ["A"])
    assert recovery["stopped_step"] == recovery["resumed_step"] == 30 and recovery["steps_lost"] == 0, recovery
    assert 0 < recovery["recovered_s"] < 30, recovery
    assert (
        "rank 1 on B exited with code -9" in recovery["failure"]
        if kind.startswith("kill")
        else "collective" in recovery["failure"]
    )
    # B died after its first bucket update: A had applied it too (its all-reduce completed) and took it back.
    assert (recovery["updates_taken_back"] or 0) >= (1 if kind == "kill_mid_update" else 0), recovery
    assert (back["reason"], back["in_place"], back["to_servers"]) == ("move", True, ["A", "B"]), back
    # Rank 0 is the process it was before the failure (no trainer was started for generation 2): it read no
    # checkpoint, it went on from memory; B's rank came back as a joiner of generation 3.
    logs = tmp_path / "runs" / "digits" / "logs"
    assert not list(logs.glob("g2-*.log")), sorted(p.name for p in logs.glob("*.log"))
    assert "Traceback" not in (logs / "g1-rank0.log").read_text(), _logs(tmp_path)
    final = checkpoint_of(load(config))
    history = final["progress"]["gbs_history"]
    assert [h["gbs"] for h in history] == [48, 32, 48], history  # A+B, A alone from step 30, A+B again
    assert history[1]["step"] == 30 and final["progress"]["step"] > 30
    reference, _ = reference_run(
        load(config), load_plan(load(config)), steps=final["progress"]["step"], schedule=history
    )
    diffs = max_abs_diff(final["model"], reference.state_dict())
    assert max(diffs.values()) <= 1e-9, diffs


@pytest.mark.slow
def test_a_sharded_layout_that_loses_a_shard_restarts_from_the_newest_checkpoint_and_ends_exact(
    tmp_path: Path,
) -> None:
    """Tiny GPT in float64 sharded (FSDP2) over s0 and s1, one replica: rank 1 is SIGKILLed as it begins step 5.
    No survivor holds its shards, so the scheduler restarts both ranks from the newest checkpoint (step 4, every
    rank's DCP shards) and says why; the job ends as one process that never failed."""
    config = hybrid_config(tmp_path, "gpt", "adam", [1, 1], {"sharding": "full"})
    data = tomllib.loads(config.read_text())
    data["scheduler"] = {"port": free_port(), "heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 5.0}
    data["scheduler"] |= {"connect_timeout_s": 5.0, "collective_timeout_s": 3.0, "checkpoint_every": 2}
    config.write_bytes(tomli_w.dumps(data).encode())
    status = _finish(tmp_path, config, _start(tmp_path, config, "1:5:kill"))
    assert status["state"] == "succeeded" and status["restarts"] == 1, _logs(tmp_path)
    [restart] = status["moves"]
    assert restart["reason"] == "restart" and "no survivor holds every shard" in restart["failure"], restart
    assert restart["resumed_step"] == 4, restart
    loaded = load(config)
    final = read_checkpoint(checkpoint_folder(loaded))
    history = final["progress"]["gbs_history"]
    reference, _ = reference_run(loaded, load_plan(loaded), steps=final["progress"]["step"], schedule=history)
    diffs = max_abs_diff(final["model"], reference.state_dict())
    assert max(diffs.values()) <= 1e-9, {k: v for k, v in diffs.items() if v > 1e-9}


def _agreement_rank(rank: int, port: int, out: str) -> None:
    """Two survivors with the same state, then rank 1's parameter nudged by 1e-12 (as a lost update would)."""
    import os

    import torch
    import torch.distributed as dist

    from jabascli.engine.checkpoint import Progress
    from jabascli.engine.recovery import check_agreement
    from jabascli.errors import RuntimeFailure

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3, dtype=torch.float64)).sum().backward()
    optimizer.step()
    trainer = type("Survivor", (), {"model": model, "optimizer": optimizer, "progress": Progress(step=1)})()
    check_agreement(trainer, torch.device("cpu"))  # the same state: no error
    with torch.no_grad():
        if rank == 1:
            model.bias[0] += 1e-12
    try:
        check_agreement(trainer, torch.device("cpu"))
        seen = "agreed"
    except RuntimeFailure as exc:
        seen = str(exc)
    with open(f"{out}-{rank}", "w") as f:
        f.write(seen)
    dist.barrier()  # both are done with the group: one leaving it while the other still reads aborted that one
    dist.destroy_process_group()


def test_survivors_check_they_hold_the_same_state_before_training_on(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    out = tmp_path / "seen"
    mp.spawn(_agreement_rank, args=(free_port(), str(out)), nprocs=2)
    for rank in (0, 1):  # both ranks see it, so both stop
        seen = Path(f"{out}-{rank}").read_text()
        assert "the survivors of a lost peer disagree on where training stands" in seen, seen


def _late_rank(rank: int, port: int, generation: int | None, out: str) -> None:
    """Rank 1 comes 2.5 s late to a group whose collective timeout is 1 s; then one all-reduce."""
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from jabascli.engine.distributed import DistEnv, init_process_group, wait_for_generation

    env = DistEnv(rank, 2, rank, "127.0.0.1", port, generation)
    if rank == 1:
        time.sleep(2.5)
    wait_for_generation(env)
    init_process_group(env, torch.device("cpu"), timedelta(seconds=1))
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    Path(f"{out}-{rank}").write_text(str(total.item()))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("generation", [None, 1])
def test_a_rank_slower_to_start_than_the_collective_timeout_still_forms_the_group(
    tmp_path: Path, generation: int | None
) -> None:
    """The collective timeout is for a peer lost in training: a rank still importing torch on a busy host (a
    restart's) joins as long as the store waits, with a plain rendezvous and with an elastic generation's."""
    import torch.multiprocessing as mp

    out = tmp_path / "sum"
    mp.spawn(_late_rank, args=(free_port(), generation, str(out)), nprocs=2)
    assert [Path(f"{out}-{rank}").read_text() for rank in (0, 1)] == ["3.0", "3.0"]
