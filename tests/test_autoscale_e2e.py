"""Automatic scaling end to end: the planner, not a person, moves a growing job onto both servers.

A real `jabas schedule` (with ``[scaling] enabled``) and one real `jabas worker` per
emulated server on loopback, as in tests/test_elastic_e2e.py. An adaptive digits job
starts on A, the cheaper server, alone; its GBS grows every adjustment point, and at an
epoch end the planner forecasts GBS large enough that A and B together are faster and
moves the job there.

The planner's cost model reads profiles. Measuring them here would take minutes, so the
test writes **synthetic** ones with the profiles package's writers: one VSW at LBS 16
takes 100 ms on A and 200 ms on B, and an all-reduce across the two servers costs
200 ms (within one, 5 ms). So A alone is faster at small GBS (no cross-server
all-reduce) and A+B at large GBS (half as much compute again). They say nothing about
how fast the emulated servers really are; only the decisions depend on them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import tomli_w
import tomllib

from jabascli.profiles import (
    BucketProfile,
    CommProfile,
    CompProfile,
    MemoryProfile,
    write_bucket_profile,
    write_comm_profile,
    write_comp_profile,
    write_memory_profile,
)
from tests.elastic_support import write_config
from tests.test_elastic_e2e import Cluster, _assert_equals_the_reference, _check_epochs

EPOCHS = 3
LBS = 16


def write_synthetic_profiles(root: Path) -> None:
    """Synthetic inputs (see the module doc): A twice as fast as B, a slow link between them."""
    for server, vsw_ms in (("A", 100.0), ("B", 200.0)):
        memory = MemoryProfile(gpu_type="cpu", total_memory=2_000_000_000, lbs=LBS, max_num_models=4)
        write_memory_profile(root / "cluster_mem_profile_data", server, memory)
        for n in (1, 2, 3, 4):
            t = vsw_ms * n
            comp = CompProfile(
                model="digits", gpu_type="cpu", lbs=LBS, num_models=n, total_time=t, data_time=0.0,
                fwd_time=t / 3, bwd_time=2 * t / 3, update_time=0.0, copy_time=0.0,
            )  # fmt: skip
            write_comp_profile(root / "cluster_comp_profile_data", server, comp)
    write_bucket_profile(root / "bucket_profile_data", BucketProfile(model="digits", bucket_size_distribution=[0.1]))
    for kind, latency_ms in (("intra", 5.0), ("inter", 200.0)):
        comm = CommProfile(kind=kind, ideal_ms=[0.1, 1.0], measured_ms=[latency_ms + 0.1, latency_ms + 1.0])
        write_comm_profile(root / "comm_profile_data", comm)


def autoscaled_config(folder: Path) -> Path:
    path = write_config(folder, available=["A"], epochs=EPOCHS, record=True, lbs=LBS, slowdown=(6.0, 10.0))
    config: dict[str, Any] = tomllib.loads(path.read_text())
    # Every adjustment point grows the GBS by half (the halves' cosine is always below 1.0).
    config["batching"] = {
        "metric": "similarity", "similarity_target": 1.0, "adjust_rate": 0.5, "adjust_interval": 4,
        "gbs_min": 32, "gbs_max": 512, "initial_gbs": 32,
    }  # fmt: skip
    # allocation_unit 1 = each server's one device: a planner's unit is a whole server.
    config["scaling"] = {"enabled": True, "objective": "time", "allocation_unit": 1, "move_downtime_s": 0.5}
    config["cluster"]["servers"][0]["price_per_hour"] = 1.0  # A: the cheaper one
    config["cluster"]["servers"][1]["price_per_hour"] = 2.0
    write_synthetic_profiles(folder / "profiles")
    config["profiles"] = {"dir": str(folder / "profiles")}
    path.write_bytes(tomli_w.dumps(config).encode())
    return path


@pytest.mark.slow
def test_a_growing_job_starts_on_the_cheaper_server_and_the_planner_moves_it_to_both(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, autoscaled_config(tmp_path))
    try:
        status = cluster.finish()
    finally:
        cluster.kill()

    assert status["state"] == "succeeded", cluster.logs()
    # Nobody called /v1/job/move: the one move is the planner's, from A to A+B.
    assert [(m["reason"], m["from_servers"], m["to_servers"]) for m in status["moves"]] == [
        ("move", ["A"], ["A", "B"])
    ], cluster.logs()
    epochs = status["epoch_history"]
    assert epochs[0]["servers"] == ["A"] and epochs[-1]["servers"] == ["A", "B"]
    history = [g for e in epochs for g in e["gbs_history"]]
    assert history[0] > 32 and history == sorted(history), history  # the GBS grew

    decisions = [json.loads(line) for line in (tmp_path / "runs" / "digits" / "scaling.jsonl").read_text().splitlines()]
    assert [d["epoch"] for d in decisions] == list(range(1, EPOCHS))  # every epoch end but the last
    moves = [d for d in decisions if d["move"]]
    assert len(moves) == 1 and moves[0]["servers"] == ["A", "B"] and moves[0]["current"] == {"A": 1}, decisions
    # The move followed that decision: every epoch before it ran on A, every epoch after the step
    # where A's trainer handed over (once B's new rank was ready) on A+B.
    move_epoch, stopped = moves[0]["epoch"], status["moves"][0]["stopped_step"]
    assert all(e["servers"] == ["A"] for e in epochs[:move_epoch]), epochs
    assert all(e["servers"] == ["A", "B"] for e in epochs if e["step"] > stopped), epochs
    for d in decisions:  # what the decision is made of, as jabas report reads it
        assert d["forecast"] and all(32 <= g <= 512 for g in d["forecast"]) and d["reason"]
        assert {c["gpus"] for c in d["candidates"]} <= {1, 2} and d["predicted"]["time_s"] > 0
    assert status["scaling"] == decisions[-1]
    _check_epochs(tmp_path, status, epochs=EPOCHS)
    # Through the growing GBS (and its LR factor) and the move, synchronous SGD at each iteration's GBS.
    _assert_equals_the_reference(tmp_path)
