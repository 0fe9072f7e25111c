"""Moves in place (engine/handoff.py): real trainer processes hand the job over from 2 ranks to 3 and
back to 2, each time keeping some processes, starting one and letting one go, and the job ends
with the parameters of one process that never moved. The 3-rank plan is uneven (each rank its own
LBS, as the solver offers for a move where that is faster): the process that never moved is fed
its micro-batches while it runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from jabascli.engine.layout import checkpoint_folder
from jabascli.engine.plan import read_plan_file
from jabascli.engine.reference import reference_run
from jabascli.engine.trainer_env import CONTROL_FILE_ENV, GENERATION_ENV
from jabascli.net import free_port
from tests.engine_support import TRAINER_ENV, checkpoint_of, load, max_abs_diff, write_job

LBS = 4
STEPS_PER_EPOCH = 6
EPOCHS = 4
GBS = LBS * 7
# Three one-device servers; every plan has the same GBS, split differently: (server, VSW, GA[, own LBS]).
SERVERS = [{"name": f"s{i}", "device_type": "cpu", "devices": 1} for i in range(3)]
Ranks = list[tuple[Any, ...]]
TWO: Ranks = [("s0", 3, 1), ("s1", 1, 0)]
THREE: Ranks = [("s0", 1, 0, 12), ("s1", 1, 1, 5), ("s2", 2, 0, 3)]  # 12 + 2 x 5 + 2 x 3 = GBS, uneven
THREE_SIZES = [12, 5, 5, 3, 3]  # its micro-batches in worker order: what the reference must be fed
LAST: Ranks = [("s0", 2, 1), ("s2", 1, 2)]  # s1 left; s2's process is rank 1 now


def _plan(ranks: Ranks) -> dict[str, Any]:
    assignments = [
        {"server": s, "device_type": "cpu", "gpus": 1, "vsw": v, "ga": g, **({"lbs": own[0]} if own else {})}
        for s, v, g, *own in ranks
    ]
    smallest = min(a.get("lbs", LBS) for a in assignments)
    return {"gbs": GBS, "lbs": smallest, "weight_sync": "sequential", "assignments": assignments}


def _request(generation: int, ranks: Ranks, kept: dict[int, int]) -> str:
    handoff = {"generation": generation, "world_size": len(ranks), "plan": _plan(ranks)}
    return json.dumps({"when": "epoch", "handoff": {**handoff, "ranks": {str(k): v for k, v in kept.items()}}})


@pytest.mark.slow
def test_trainers_hand_the_job_over_in_place_and_it_ends_as_one_process_that_never_moved(tmp_path: Path) -> None:
    options = {"samples": STEPS_PER_EPOCH * GBS + 3, "sleep": 0.004}  # epochs of ~0.2 s or more
    config = write_job(tmp_path, [(3, 1), (1, 0)], lbs=LBS, options=options, epochs=EPOCHS, servers=SERVERS)
    loaded = load(config)
    plans = {}
    for name, ranks in (("two", TWO), ("three", THREE)):
        plans[name] = tmp_path / f"{name}.json"
        plans[name].write_text(json.dumps(_plan(ranks)))
    control = tmp_path / "control"
    control.write_text(_request(2, THREE, {0: 0, 1: 1}))  # at the first epoch end: to s0, s1, s2
    port = free_port()

    def trainer(rank: int, world: int, generation: int, plan: Path, *extra: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, **TRAINER_ENV, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0"}
        env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), GENERATION_ENV: str(generation)})
        if rank == 0:
            env[CONTROL_FILE_ENV] = str(control)
        args = [sys.executable, "-m", "jabascli", "train", "-c", str(config), "--plan", str(plan), "--no-metrics"]
        log = (tmp_path / f"g{generation}-rank{rank}.log").open("wb")
        return subprocess.Popen([*args, *extra], env=env, stdout=log, stderr=subprocess.STDOUT)

    procs = [trainer(0, 2, 1, plans["two"]), trainer(1, 2, 1, plans["two"])]
    # The joiner starts ahead and waits for generation 2 to open; it resumes from the checkpoint of the stop.
    procs.append(trainer(2, 3, 2, plans["three"], "--resume", str(checkpoint_folder(loaded))))
    try:
        deadline = time.monotonic() + 120
        while not control.with_name("control.taken").exists():  # the first handoff took the request
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), _logs(tmp_path)
            time.sleep(0.005)
        control.write_text(_request(3, LAST, {0: 0, 2: 1}))  # at the next epoch end: s1's process leaves
        codes = [p.wait(120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0, 0, 0], _logs(tmp_path)

    saved = checkpoint_of(loaded)
    assert saved["progress"]["epoch"] == EPOCHS
    history = saved["progress"]["gbs_history"]
    plans_seen = [h["plan"] for h in history]
    assert [p.count("GPU") for p in plans_seen] == [2, 3, 2], plans_seen  # both handoffs happened
    assert plans_seen[-1].startswith("s0") and "s2" in plans_seen[-1] and "s1" not in plans_seen[-1]
    assert [h.get("sizes") for h in history] == [None, THREE_SIZES, None]  # only the uneven plan has sizes
    # The reference follows the recorded history: even micro-batches of LBS, then THREE_SIZES, then even again.
    reference, _ = reference_run(
        loaded, read_plan_file(plans["two"], loaded), steps=EPOCHS * STEPS_PER_EPOCH, schedule=history
    )
    diffs = max_abs_diff(saved["model"], reference.state_dict())
    assert max(diffs.values()) <= 1e-9, diffs


def _logs(folder: Path) -> str:
    return "\n".join(f"== {p.name}\n{p.read_text()[-2000:]}" for p in sorted(folder.glob("g*-rank*.log")))
