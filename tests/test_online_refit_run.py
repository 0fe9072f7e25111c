"""An adaptive job refits its performance model from the iterations it times, during the run, and plans with it.

Two real trainer processes (gloo) train the tiny float64 workload with profiles that are deliberately far too slow
(30 ms per micro-step, where the tiny model takes well under a millisecond), so the truth the refit must move
towards is known: much faster than the profile.
"""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path
from typing import Any

import pytest
import tomli_w
import tomllib

from jabascli.engine.launch import run_local
from jabascli.engine.options import TrainOptions
from jabascli.engine.plan import load_plan
from jabascli.engine.reference import reference_run
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
from jabascli.profiles.refit import read_refit
from jabascli.solver.online import job_refit
from tests.engine_support import TRAINER_ENV, checkpoint_of, load, max_abs_diff, write_job


def _profiles(root: Path) -> None:
    """Both servers: one VSW fits at LBS 4, each micro-step profiled at 30 ms."""
    for server in ("s0", "s1"):
        memory = MemoryProfile(gpu_type="cpu", total_memory=10**10, lbs=4, max_num_models=1)
        write_memory_profile(root / "memory", server, memory)
        comp = CompProfile(
            model="tiny", gpu_type="cpu", lbs=4, num_models=1, total_time=30.0, data_time=3.0, fwd_time=9.0,
            bwd_time=15.0, update_time=3.0, copy_time=0.0,
        )  # fmt: skip
        write_comp_profile(root / "computation", server, comp)
    write_bucket_profile(root / "bucket", BucketProfile(model="tiny", bucket_size_distribution=[0.001]))
    write_comm_profile(root / "comm", CommProfile(kind="inter", ideal_ms=[0.1, 1.0], measured_ms=[0.2, 1.1]))


def _digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*.*")}


def test_an_adaptive_run_refits_from_the_iterations_it_times_and_plans_on_the_refit_exactly(tmp_path: Path) -> None:
    """GBS 16 on two servers (the solver's plan: LBS 4, GA 1 on each), decisions every 4 iterations for 3 epochs
    of 256 samples (48 iterations). Rank 0 times 3 iterations per decision window (not the measurement one, not
    a plan's first), so it refits at steps 16 and 32 (and 48): each a new generation in the run folder, the
    profiles untouched, the model moved from the profile towards what was measured, and the decision
    after a refit predicts the plan as the refit model does. Training stays synchronous SGD at the GBS history:
    the parameters equal the one-process reference within 1e-9."""
    profiles = tmp_path / "profiles"
    _profiles(profiles)
    before = _digests(profiles)
    batching = {"metric": "similarity", "gbs_min": 16, "gbs_max": 16, "adjust_interval": 4}
    options = {"samples": 256, "learnable": True, "dropout": 0.0}
    config = write_job(tmp_path, [(1, 0), (1, 0)], lbs=4, epochs=3, options=options, batching=batching)
    data = tomllib.loads(config.read_text())
    data["profiles"] = {
        "memory": str(profiles / "memory"),
        "computation": str(profiles / "computation"),
        "communication": str(profiles / "comm"),
        "bucket": str(profiles / "bucket"),
    }
    config.write_bytes(tomli_w.dumps(data).encode())
    loaded = load(config)

    events: list[dict[str, Any]] = []
    result = run_local(loaded, TrainOptions(bucket_cap_mb=0.0005, metrics=False), events.append, TRAINER_ENV)
    assert not result.done["stopped"] and result.done["step"] == 48

    adjustments = [e for e in events if e["event"] == "adjustment"]
    assert {e["source"] for e in adjustments} == {"solver"}
    refits = [(e["step"], e["refit"]) for e in adjustments if "refit" in e]
    assert [step for step, _ in refits][:2] == [16, 32], refits
    plan = {"lbs": 4, "assignments": [("s0", 1, 1, 1), ("s1", 1, 1, 1)]}
    for n, (_, refit) in enumerate(refits, start=1):
        record = read_refit(Path(refit["path"]))
        assert record.generation == refit["generation"] == n and len(record.observations) == n
        observed = record.observations[-1]
        trained = (observed.lbs, [(a.server, a.gpus, a.vsw, a.ga) for a in observed.assignments])
        assert trained == (plan["lbs"], plan["assignments"])
        assert observed.iterations >= 10 and observed.measured_s == refit["measured_s"]
        # Each server's busy time rode along with the iterations it timed: a part of each iteration.
        assert all(0 < (a.busy_s or 0) < 1.05 * observed.measured_s for a in observed.assignments), observed
        assert observed.predicted_s == refit["predicted_before_s"]
        # Towards the measurement, not past it; by how much depends on the host's load (a busy host's measurement
        # weighs as the profile: tests/test_perfmodel_online.py). Once earlier refits brought the model near the
        # measurement, the next measurement may lie on either side of what it predicts.
        low, high = sorted((observed.measured_s, refit["predicted_before_s"]))
        assert low <= refit["predicted_after_s"] <= high, refit
        assert max(record.compute.values()) < 1.0, record.compute
    # Each decision after a refit plans with it: the same plan is predicted as that refit predicted it.
    for (_, first), (_, second) in itertools.pairwise(refits):
        assert second["predicted_before_s"] == pytest.approx(first["predicted_after_s"], rel=1e-9)
    assert refits[0][1]["predicted_before_s"] == pytest.approx(2 * 0.030, rel=0.05)  # the profile's two micro-steps
    assert refits[0][1]["measured_s"] < refits[0][1]["predicted_after_s"] < refits[0][1]["predicted_before_s"]
    assert _digests(profiles) == before
    in_use = job_refit(loaded)  # the next run of the job starts from the newest
    assert in_use is not None and in_use.record.generation == len(refits)

    final = checkpoint_of(loaded)
    history = final["progress"]["gbs_history"]
    assert [h["gbs"] for h in history] == [16], history
    reference, _ = reference_run(loaded, load_plan(loaded), steps=final["progress"]["step"], schedule=history)
    diffs = max_abs_diff(final["model"], reference.state_dict())
    assert max(diffs.values()) <= 1e-9, {k: v for k, v in diffs.items() if v > 1e-9}
