"""Adaptive batching re-plans a hybrid job (`[parallel] plan = "auto"`) with the hybrid planner, exactly.

`jabas run`'s trainers (real gloo processes) train tiny GPT in float64 on a fast server and an emulated 3x slower
one, one device each, starting from the hybrid planner's plan for GBS 2. `[batching] metric = "similarity"` with
a target of 1.0 (the halves of a gradient never agree that well) grows the GBS at every measurement (every 2
iterations), to the next GBS of the planner's range 2, 4, 8: doubled twice. The hybrid profiles are written here
(not measured: `tests/test_hybrid_profile.py` measures them) so that the planner's choices are known: 4 blocks of
1 GB of parameters (16 GB with gradients and Adam) and 0.5 GB of activations a sample, devices of 17 GB. At GBS 2
and 4 no unsharded replica fits whole, and the fastest plan is 2 pipeline stages (1 block on the slow device, 3 on
the fast) running 2, then 4 micro-batches of 1 sample: a change in place. At GBS 8, two replicas of 2 samples a
micro-batch with the Adam state sharded (ZeRO-3) are predicted faster (0.804 s against 0.815 s): another layout,
through a DCP checkpoint (engine/relayout.py). The run stops at step 5 and `jabas run` resumes it from the plan
file's layout, which the planner's for GBS 8 replaces before the first iteration. Every parameter equals the
single-process reference following the same GBS history within 1e-9; the memory is the planner's only (the real
tiny GPT is what trains). Also: a relayout from plain IIDP to a sharded layout and back (decisions fixed by the
test), the planner's candidates and the rules that keep a plan out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import tomli_w
import tomllib

from jabascli.adaptive.batching import make_replanner
from jabascli.adaptive.checks import check_batching
from jabascli.adaptive.replan import Candidate, Replanner, in_layout_order, refused
from jabascli.config import load_config
from jabascli.engine.checkpoint import read_checkpoint
from jabascli.engine.launch import run_local
from jabascli.engine.layout import checkpoint_folder
from jabascli.engine.options import TrainOptions
from jabascli.engine.plan import load_plan
from jabascli.engine.reference import reference_run
from jabascli.hybrid.job import plan_for_run
from jabascli.profiles.hybrid import write_profiles
from jabascli.solver.autoplan import solve_for_run
from jabascli.solver.plan import write_plan
from tests.conftest import run_jabas
from tests.engine_support import TRAINER_ENV, load, max_abs_diff
from tests.test_hybrid_exactness import BASE_OPTIONS, WORKLOAD
from tests.test_hybrid_solve_cli import profiles

GB = 10**9


def write_job(folder: Path) -> Path:
    """The job, its hybrid profiles (the fast and slow devices as the config's types) and its starting plan."""
    base = profiles()
    names = {"cpu": "fast", "cpu-slow": "slow"}
    devices = {n: base.devices[p].model_copy(update={"device": n, "devices_per_server": 1}) for n, p in names.items()}
    network = base.network.model_copy(
        update={"intra": {n: base.network.intra[p] for n, p in names.items()}}
        | {"inter": {n: base.network.inter[p] for n, p in names.items()}}
    )
    write_profiles(folder / "profiles", base.model_copy(update={"devices": devices, "network": network}))
    options = {"base": "gpt", "optimizer": "adam", "synthetic_size": 43, **BASE_OPTIONS["gpt"]}
    config: dict[str, Any] = {
        "job": {"name": "replan", "workload": str(WORKLOAD), "epochs": 2, "seed": 3, "options": options},
        "batching": {
            "metric": "similarity",
            "similarity_target": 1.0,
            "adjust_rate": 0.5,
            "adjust_interval": 2,
            "gbs_min": 2,
            "gbs_max": 8,
            "initial_gbs": 2,
            "lr_scaling": "none",
        },
        "parallel": {"plan": "auto"},
        "profiles": {"dir": str(folder / "profiles")},
        "storage": {"checkpoint_dir": str(folder / "checkpoints"), "run_dir": str(folder / "runs")},
        "cluster": {
            "servers": [
                {"name": "fast", "device_type": "cpu", "memory_bytes": 17 * GB},
                {"name": "slow", "device_type": "cpu-slow", "emulate": {"slowdown": 3.0, "memory_bytes": 17 * GB}},
            ]
        },
    }
    path = folder / "job.toml"
    path.write_bytes(tomli_w.dumps(config).encode())
    plan = folder / "plan.json"
    write_plan(plan, plan_for_run(load_config(path), 2))  # what `jabas run` solves for the starting GBS
    config["job"]["plan"] = str(plan)
    path.write_bytes(tomli_w.dumps(config).encode())
    return path


def test_doubling_the_gbs_twice_replans_with_the_hybrid_planner_and_stays_exact(tmp_path: Path) -> None:
    loaded = load(write_job(tmp_path))
    start = load_plan(loaded)
    assert start.parallel is not None and start.parallel.pp == 2 and start.gbs == 2

    events: list[dict[str, Any]] = []
    run_local(loaded, TrainOptions(metrics=False, max_steps=5), events.append, TRAINER_ENV)
    # `jabas run` again resumes the checkpoint of step 5 (GBS 8) from the plan file's layout: the planner's layout
    # for GBS 8 is another, so the trainers go on under it from the first iteration.
    rerun = run_jabas("run", "-c", str(loaded.path))
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    saved = read_checkpoint(checkpoint_folder(loaded))
    history = saved["progress"]["gbs_history"]
    assert [(h["step"], h["gbs"], h["lbs"]) for h in history] == [(0, 2, 1), (2, 4, 1), (4, 8, 2)], history
    changes = [e for e in events if e["event"] == "adjustment" and e["changed"]]
    assert [(e["old_gbs"], e["new_gbs"], e["source"]) for e in changes] == [
        (2, 4, "hybrid planner"),
        (4, 8, "hybrid planner"),
    ]
    # GBS 4: the same 2 stages, 4 micro-batches (2 a rank) instead of 2, in place; GBS 8: another layout,
    # sharded replicas running 1 (slow) and 3 (fast) micro-batches of 2, after a relayout at step 4.
    assert [e["plan"] for e in changes] == [
        "slow:1GPU,VSW:1,GA:1 fast:1GPU,VSW:1,GA:1",
        "slow:1GPU,VSW:1,GA:0 fast:1GPU,VSW:1,GA:2",
    ]
    pipeline, sharded = "pp 2 (blocks 0-0 | 1-3, 1f1b)", "sharding full"
    starts = [(e["step"], e["layout"]) for e in events if e["event"] == "start"]
    assert starts == [(0, pipeline), (4, sharded)], starts
    assert [e["step"] for e in events if e["event"] == "relayout"] == [4]
    lines = rerun.stdout.splitlines()
    layouts = [line.rsplit("layout ", 1)[1] for line in lines if line.startswith("replan: 2 trainers")]
    replicas = ["1 replica of 2 micro-batches", "2 replicas of 1 and 3 micro-batches"]
    assert layouts == [f"{pipeline}, {replicas[0]}", f"{sharded}, {replicas[1]}"], rerun.stdout
    assert "step 5: GBS 8 runs under another layout: checkpointed, going on" in lines, rerun.stdout
    assert saved["plan"]["parallel"]["sharding"] == "full"

    steps = saved["progress"]["step"]
    assert steps >= 9
    reference, _ = reference_run(loaded, start, steps, history)
    diffs = max_abs_diff(saved["model"], reference.state_dict())
    assert max(diffs.values()) <= 1e-9, {k: v for k, v in diffs.items() if v > 1e-9}


def test_the_replanner_takes_the_planners_layout_for_the_broadcast_gbs() -> None:
    """Rank 0 broadcasts LBS and micro-batch counts; every rank takes the layout from its own candidates."""
    from jabascli.config.models import ParallelConfig
    from jabascli.engine.plan import RankPlan, TrainingPlan

    ranks = (RankPlan(0, "a", "cpu", 1, 0), RankPlan(1, "b", "cpu", 1, 0))
    piped = TrainingPlan(1, ranks, parallel=ParallelConfig(pp=2, stages=[(0, 0), (1, 3)]))
    sharded = TrainingPlan(2, ranks, parallel=ParallelConfig(sharding="full"))
    replanner = Replanner([Candidate(piped), Candidate(sharded)], 2, 4, piped, hybrid=True)
    assert replanner.source == "hybrid planner"
    assert replanner.layout_at(4, piped.parallel) == sharded.parallel
    assert replanner.layout_at(6, piped.parallel) == piped.parallel  # no plan of that GBS: kept
    chosen = replanner.plan_for(piped, 4, 1)
    assert chosen is not None and chosen.plan.parallel == sharded.parallel and chosen.plan.gbs == 4


def test_an_adaptive_auto_job_starts_from_the_planners_plan_for_initial_gbs(tmp_path: Path) -> None:
    """`jabas run` without a plan file solves the hybrid plan of `initial_gbs` (else `gbs_min`) for an adaptive job."""
    loaded = load_config(write_job(tmp_path))
    run = solve_for_run(loaded)
    assert run is not None and run.source == "[batching] initial_gbs"
    assert run.plan.gbs == 2 and run.plan.parallel is not None and run.plan.parallel.pp == 2
    loaded.config.batching.initial_gbs = None
    run = solve_for_run(loaded)
    assert run is not None and run.source == "[batching] gbs_min" and run.plan.gbs == 2


def test_a_hybrid_plan_is_a_candidate_only_where_every_rank_keeps_its_server_and_the_trainer_runs_it(
    tmp_path: Path,
) -> None:
    from jabascli.config.models import ParallelConfig
    from jabascli.engine.plan import RankPlan, TrainingPlan

    current = TrainingPlan(1, (RankPlan(0, "a", "cpu", 1, 0), RankPlan(1, "b", "slow", 1, 0)))
    swapped = (RankPlan(0, "b", "slow", 1, 0), RankPlan(1, "a", "cpu", 1, 2))
    piped = TrainingPlan(2, swapped, parallel=ParallelConfig(pp=2, stages=[(0, 0), (1, 3)]))
    assert in_layout_order(current, piped) is None  # rank 0 would run the stage placed on b
    replicas = TrainingPlan(2, swapped, parallel=ParallelConfig(sharding="full"))
    moved = in_layout_order(current, replicas)  # one replica a rank: the counts follow the servers
    assert moved is not None and [(r.server, r.ga) for r in moved.ranks] == [("a", 2), ("b", 0)]
    assert moved.parallel == replicas.parallel and moved.gbs == replicas.gbs
    fewer = TrainingPlan(2, swapped[1:], parallel=ParallelConfig())
    assert in_layout_order(current, fewer) is None  # b would be left without work
    tp = TrainingPlan(2, swapped, parallel=ParallelConfig(tp=2))
    assert in_layout_order(current, tp) is None  # ranks 0 and 1, one TP group, are on two servers

    loaded = load_config(write_job(tmp_path))
    assert not refused(loaded, ParallelConfig(pp=2)) and not refused(loaded, ParallelConfig(tp=2, sharding="full"))
    loaded.config.job.precision = "bf16"  # engine/parallel/runner.py: stages run in fp32
    assert refused(loaded, ParallelConfig(pp=2)) and not refused(loaded, ParallelConfig(tp=2, sharding="full"))


def test_goodput_takes_the_hybrid_planners_throughput_without_solver_profiles(tmp_path: Path) -> None:
    """`jabas run`'s check lets goodput re-plan a hybrid job: its throughput is the hybrid planner's prediction."""
    loaded = load_config(write_job(tmp_path))
    loaded.config.batching.metric = "goodput"
    plan = load_plan(loaded)
    check_batching(loaded, plan)  # no computation profiles, but hybrid ones
    replanner = make_replanner(loaded, plan, 43)
    assert replanner.source == "hybrid planner"
    rates = {c.plan.gbs: round(c.throughput or 0.0, 2) for c in replanner.candidates(plan)}
    assert rates == {2: round(2 / 0.2736, 2), 4: round(4 / 0.454, 2), 8: round(8 / 0.804, 2)}


def test_the_launcher_hands_its_hybrid_plans_to_the_trainers_which_solve_no_gbs_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each GBS of the range is solved once per run: a trainer takes the plans `jabas run`'s check solved."""
    import jabascli.hybrid.job as hybrid_job
    from jabascli.adaptive import hybrid_plans

    loaded = load_config(write_job(tmp_path))
    plan = load_plan(loaded)
    monkeypatch.setattr(hybrid_plans, "_solved", {})
    check_batching(loaded, plan)  # the launcher's check
    env = hybrid_plans.hand_off_plans(loaded, tmp_path / "runs" / "replan")
    assert list(env) == [hybrid_plans.PLANS_ENV] and Path(env[hybrid_plans.PLANS_ENV]).is_file()
    solved = {c.plan.gbs: (c.plan, c.throughput) for c in make_replanner(loaded, plan, 43).candidates(plan)}
    assert sorted(solved) == [2, 4, 8]

    # A trainer: a process of its own, nothing solved yet, the launcher's file named in its environment.
    monkeypatch.setattr(hybrid_plans, "_solved", {})
    monkeypatch.setattr(hybrid_plans, "_read", set())
    monkeypatch.setenv(hybrid_plans.PLANS_ENV, env[hybrid_plans.PLANS_ENV])

    def solve_again(*args: object, **kwargs: object) -> None:
        raise AssertionError("a trainer solved a GBS the launcher had solved")

    monkeypatch.setattr(hybrid_job, "solve", solve_again)
    check_batching(loaded, plan)  # the trainer's start check
    replanner = make_replanner(loaded, plan, 43)
    assert replanner.source == "hybrid planner"
    assert {c.plan.gbs: (c.plan, c.throughput) for c in replanner.candidates(plan)} == solved


def _plain_and_back(rank: int, world: int, port: int, config: str, out: str) -> None:
    """One rank of `run_trainer` whose adaptive decisions are fixed: sharded from step 3, plain again from step 6."""
    import dataclasses

    import torch

    from jabascli.adaptive.batching import AdaptiveBatching
    from jabascli.config.models import ParallelConfig
    from jabascli.engine.process import run_trainer

    torch.set_num_threads(1)
    changes = {3: (3, ParallelConfig(sharding="full")), 6: (2, None)}  # step: (LBS, layout)

    def decide(self: Any, step: int, plan: Any, where: object, report: object, busy: object = None) -> Any:
        if step not in changes:
            return None
        lbs, parallel = changes[step]
        return dataclasses.replace(plan, lbs=lbs, parallel=parallel)

    AdaptiveBatching.after_step = decide  # type: ignore[method-assign,assignment]
    environ = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)}
    environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    events: list[dict[str, Any]] = []
    run_trainer(load(Path(config)), TrainOptions(metrics=False), events.append, environ)
    if rank == 0:
        (Path(out) / "events.json").write_text(json.dumps(events))


def test_a_relayout_between_plain_iidp_and_a_sharded_layout_both_ways_equals_the_reference(tmp_path: Path) -> None:
    """`run_trainer`'s relayout from plain IIDP (rank 0 alone writes the checkpoint) to `sharding = "full"` (DCP)
    and back, mid-epoch, with LBS changes (2 -> 3 -> 2), on 2 gloo ranks running 3 and 1 micro-batches."""
    import os

    import torch.multiprocessing as mp

    from jabascli.net import free_port
    from tests.test_hybrid_exactness import write_config

    path = write_config(tmp_path, "gpt", "adam", [2, 0], {"sharding": "full"})
    config = tomllib.loads(path.read_text())
    del config["parallel"]  # plain IIDP to start with
    config["batching"] = {"metric": "similarity", "adjust_interval": 1, "lr_scaling": "none"}
    path.write_bytes(tomli_w.dumps(config).encode())
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_plain_and_back, args=(2, free_port(), str(path), str(tmp_path)), nprocs=2)

    events = json.loads((tmp_path / "events.json").read_text())
    starts = [(e["step"], e["layout"]) for e in events if e["event"] == "start"]
    assert starts == [(0, None), (3, "sharding full"), (6, None)], starts
    loaded = load(path)
    saved = read_checkpoint(checkpoint_folder(loaded))
    history = saved["progress"]["gbs_history"]
    assert [(h["step"], h["lbs"]) for h in history] == [(0, 2), (3, 3), (6, 2)], history
    steps = saved["progress"]["step"]
    assert steps >= 10
    reference, _ = reference_run(loaded, load_plan(loaded), steps, history)
    diffs = max_abs_diff(saved["model"], reference.state_dict())
    assert max(diffs.values()) <= 1e-9, {k: v for k, v in diffs.items() if v > 1e-9}
