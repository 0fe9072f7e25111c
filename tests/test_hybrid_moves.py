"""Moves of a `[parallel]` job between allocations whose layouts differ, on a real scheduler and real agents.

Tiny GPT in float64 (tests/hybrid_workload.py) with ``sharding = "full"``: server A has two devices
(the job shards over both, one micro-batch each), server B one device running two micro-batches (the
same GBS). The job starts on A, is moved to A + B in place (sharded over 3 ranks, GBS doubled), then to
B (`POST /v1/job/move`, as `jabas job move` does): rank 0's server goes, so every rank of the new
generation restores from the DCP checkpoint, resharded from three ranks to one, and the job ends with
every parameter within 1e-9 of the single-process reference (engine/reference.py) that followed the
same GBS history.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import tomli_w
import tomllib

from jabascli.engine.checkpoint import read_checkpoint
from jabascli.engine.layout import checkpoint_folder
from jabascli.engine.plan import load_plan
from jabascli.engine.reference import reference_run
from jabascli.net import free_port
from tests.engine_support import load, max_abs_diff
from tests.test_elastic_e2e import Cluster
from tests.test_hybrid_exactness import LBS, write_config


def moving_job(folder: Path, parallel: dict[str, Any], slowdown: float) -> Path:
    """Servers A (2 devices, 1 micro-batch each) and B (1 device, 2 micro-batches): GBS ``2 LBS`` on either,
    6 iterations an epoch on either (3 on both), 3 epochs; emulated ``slowdown`` times slower (sleeps), so that
    a move lands mid-job."""
    path = write_config(folder, "gpt", "adam", [0], parallel, devices=2)
    config = tomllib.loads(path.read_text())
    emulate = {"slowdown": slowdown, "memory_bytes": 10**9}
    config["job"] |= {"name": "gpt", "epochs": 3}
    config["job"]["options"]["synthetic_size"] = 6 * 2 * LBS + 3
    config["cluster"] = {
        "available_servers": ["A"],
        "servers": [
            {"name": "A", "device_type": "cpu", "devices": 2, "ga": 0, "emulate": emulate},
            {"name": "B", "device_type": "cpu", "devices": 1, "ga": 1, "emulate": emulate},
        ],
    }
    config["scheduler"] = {
        "port": free_port(),
        "heartbeat_interval_s": 0.2,
        "heartbeat_timeout_s": 10.0,
        "connect_timeout_s": 10.0,
    }
    path.write_bytes(tomli_w.dumps(config).encode())
    return path


@pytest.mark.slow
def test_a_sharded_job_moved_in_place_then_to_a_server_of_one_device_equals_the_reference(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, moving_job(tmp_path, {"sharding": "full"}, slowdown=200.0))
    try:
        # A -> A + B at the first epoch end: rank 0's server stays, the trainers of A carry on in place
        # (engine/handoff.py) and rebuild their layout, now sharded over 3 ranks, from the checkpoint.
        cluster.wait(lambda s: s["state"] == "running" and len(s["workers"]) == 2)
        r = cluster.post("/v1/job/move", {"servers": ["A", "B"]})
        assert r.status_code == 200, r.text
        # A + B -> B mid-epoch: rank 0's server goes, every rank restarts from the DCP checkpoint on one device.
        cluster.wait(lambda s: s["generation"] == 2 and s["state"] == "running")
        r = cluster.post("/v1/job/move", {"servers": ["B"], "when": "now"})
        assert r.status_code == 200, r.text
        status = cluster.finish()
    finally:
        cluster.kill()
    assert status["state"] == "succeeded", cluster.logs()
    assert [(m["to_servers"], m["in_place"]) for m in status["moves"]] == [(["A", "B"], True), (["B"], False)]
    for move in status["moves"]:
        assert move["resumed_step"] == move["stopped_step"], move  # nothing repeated or skipped

    loaded = load(cluster.config)
    final = read_checkpoint(checkpoint_folder(loaded))
    history = final["progress"]["gbs_history"]
    assert [h["gbs"] for h in history][:2] == [2 * LBS, 4 * LBS], history
    reference, _ = reference_run(loaded, load_plan(loaded), steps=final["progress"]["step"], schedule=history)
    diffs = max_abs_diff(final["model"], reference.state_dict())
    assert max(diffs.values()) <= 1e-9, {k: v for k, v in diffs.items() if v > 1e-9}
