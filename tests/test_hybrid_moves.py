"""Moves of a `[parallel]` job between allocations whose layouts differ, on a real scheduler and real agents.

A `[parallel] plan = "auto"` job (tests/test_hybrid_elastic_plan.py's servers and hybrid profiles) trains tiny
GPT in float64 (tests/hybrid_workload.py) under the hybrid planner's plan of each allocation
(elastic/job.py:plan_for): two pipeline stages on fast + slow, moved in place (`POST /v1/job/move`, as
`jabas job move` does) to fast + big (stage 1 changes server), then by restart to big alone, where the planner
puts one whole replica. A move to fast alone, where no plan fits, is refused with HTTP 422 naming it. Every
rank of each new generation restores from the DCP checkpoint under its own layout, and the job ends with every
parameter within 1e-9 of the single-process reference (engine/reference.py) that followed its GBS history.
(Sharding through a move in place, 2 -> 3 -> 1 ranks, passed the same way in commit 6169216; one slow test is
kept.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomli_w
import tomllib

from jabascli.elastic.job import plan_for
from jabascli.engine.checkpoint import read_checkpoint
from jabascli.engine.layout import checkpoint_folder
from jabascli.engine.reference import reference_run
from jabascli.net import free_port
from tests.engine_support import load, max_abs_diff
from tests.test_elastic_e2e import Cluster
from tests.test_hybrid_elastic_plan import GBS, auto_job
from tests.test_hybrid_exactness import BASE_OPTIONS, WORKLOAD


def auto_moving_job(folder: Path, slowdown: float) -> Path:
    """tests/test_hybrid_elastic_plan.py's `plan = "auto"` job (fast + slow, 11 GB each for the planner: two
    pipeline stages; big, 40 GB: one), training tiny GPT in float64 for 2 epochs of 10 iterations, every
    server emulated ``slowdown`` times slower (sleeps) so that the moves land mid-job."""
    path = auto_job(folder)
    config = tomllib.loads(path.read_text())
    options = {"base": "gpt", "optimizer": "adam", **BASE_OPTIONS["gpt"], "synthetic_size": 10 * GBS}
    config["job"] |= {"workload": str(WORKLOAD), "epochs": 2, "seed": 3, "options": options}
    for server in config["cluster"]["servers"]:
        budget = server.pop("memory_bytes", None) or server["emulate"]["memory_bytes"]
        server["emulate"] = {"slowdown": slowdown, "memory_bytes": budget}
    config["scheduler"] = {"port": free_port(), "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 10.0}
    path.write_bytes(tomli_w.dumps(config).encode())
    return path


@pytest.mark.slow
def test_an_auto_planned_job_takes_the_planners_layout_on_each_allocation_and_equals_the_reference(
    tmp_path: Path,
) -> None:
    cluster = Cluster(tmp_path, auto_moving_job(tmp_path, slowdown=30.0), servers=3)
    loaded = load(cluster.config)
    layouts = {tuple(servers): plan_for(loaded, servers, GBS)[0].parallel for servers in (["fast", "slow"], ["big"])}
    assert [p.pp if p else 1 for p in layouts.values()] == [2, 1]  # the layouts differ
    try:
        cluster.wait(lambda s: s["state"] == "running" and len(s["workers"]) == 3)
        r = cluster.post("/v1/job/move", {"servers": ["fast"]})  # no plan fits one 11 GB device
        assert r.status_code == 422 and "fits servers fast" in r.text, r.text
        # fast + slow -> fast + big at the first epoch end: rank 0 (fast, stage 0) stays and carries on in place
        # (engine/handoff.py); stage 1 goes from slow to big, which restores it from the DCP checkpoint.
        r = cluster.post("/v1/job/move", {"servers": ["fast", "big"]})
        assert r.status_code == 200, r.text
        cluster.wait(lambda s: s["generation"] == 2 and s["state"] == "running")
        # -> big mid-epoch: rank 0's server goes, every rank restarts from the checkpoint, as one whole replica.
        r = cluster.post("/v1/job/move", {"servers": ["big"], "when": "now"})
        assert r.status_code == 200, r.text
        status = cluster.finish()
    finally:
        cluster.kill()
    assert status["state"] == "succeeded", cluster.logs()
    assert [(m["to_servers"], m["in_place"]) for m in status["moves"]] == [(["fast", "big"], True), (["big"], False)]
    for move in status["moves"]:
        assert move["resumed_step"] == move["stopped_step"], move  # nothing repeated or skipped
    # What each generation's trainers were started with (the plan files their agents wrote): the planner's layouts.
    started: dict[str, set[int]] = {}
    for path in (tmp_path / "runs" / "auto" / "elastic").glob("worker*/plan-g*.json"):
        started.setdefault(path.name, set()).add(json.loads(path.read_text())["parallel"]["pp"])
    assert started == {"plan-g1.json": {2}, "plan-g2.json": {2}, "plan-g3.json": {1}}, started

    final = read_checkpoint(checkpoint_folder(loaded))
    history = final["progress"]["gbs_history"]
    assert {h["gbs"] for h in history} == {GBS} and final["progress"]["step"] == 20, history
    reference, _ = reference_run(loaded, plan_for(loaded, ["fast", "slow"], GBS)[0], steps=20, schedule=history)
    diffs = max_abs_diff(final["model"], reference.state_dict())
    assert max(diffs.values()) <= 1e-9, {k: v for k, v in diffs.items() if v > 1e-9}
