"""The hybrid cost model's formulas on hand-computed cases, and the Sailor import on the published files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from jabascli.cli.app import app
from jabascli.errors import InputError
from jabascli.hybrid.costmodel import CostModel
from jabascli.hybrid.plan import Placement, Plan, Replica
from jabascli.profiles.hybrid import (
    BandwidthFit,
    BlockInfo,
    DeviceTimes,
    HybridProfiles,
    ModelBlocks,
    Network,
    ShardedTimes,
    read_profiles,
    write_profiles,
)
from jabascli.profiles.hybrid_import import import_profiles, import_sailor, read_sailor_plan
from tests.conftest import REFERENCE

SAILOR = REFERENCE / "planners" / "sailor"  # eth-easl/sailor sosp25_ae, MIT (its NOTICE.md)


def two_block_profiles() -> HybridProfiles:
    """Two blocks of 1 GB parameters, 0.5 GB activations and 1e8 B output per sample; a fast and a slow device."""
    blocks = [BlockInfo(name=str(i), params_bytes={1: 1e9}, act_bytes={1: 5e8}, boundary_bytes=1e8) for i in range(2)]
    model = ModelBlocks(model="m", blocks=blocks, optimizer_bytes_per_param_byte=2.0)
    fast = DeviceTimes(device="fast", memory_bytes=40e9, devices_per_server=1, times={1: {1: [(1.0, 2.0, 0.1)] * 2}})
    slow = DeviceTimes(device="slow", memory_bytes=40e9, devices_per_server=1, times={1: {1: [(3.0, 6.0, 0.3)] * 2}})
    one_gb = {1: BandwidthFit(coeffs=[1.0])}  # 1 GB/s whatever the size
    net = Network(intra={"fast": one_gb, "slow": one_gb}, inter={"fast": one_gb, "slow": one_gb})
    return HybridProfiles(blocks=model, devices={"fast": fast, "slow": slow}, network=net)


def test_pipeline_bubble_transfers_sync_and_update_by_hand() -> None:
    model = CostModel(two_block_profiles())
    stages = (Placement("fast", 1, "a"), Placement("slow", 1, "b"))
    plan = Plan(mbs=1, bounds=(0, 1, 2), replicas=(Replica(stages, 4), Replica(stages, 4)))
    pred = model.predict(plan)
    # stage steps: fast 1 + 2 = 3 s, slow 3 + 6 = 9 s, each plus 1e8 B sent or received at 1 GB/s = 0.1 s;
    # T_r = (3.1 + 9.1) + (4 - 1) * 9.1 = 39.5 s.
    assert pred.pipeline_s == pytest.approx((39.5, 39.5))
    # each stage: ring all-reduce of 1 GB over 2 replicas on different servers: 2 * 1/2 * 1 GB / 1 GB/s = 1 s
    assert pred.sync_s == pytest.approx(1.0)
    assert pred.update_s == pytest.approx(0.3)
    assert pred.iteration_s == pytest.approx(40.8)
    # memory: 1 GB params * (2 + 0 framework) + 2 GB Adam = 4 GB, plus activations of min(M, S - s) micro-batches
    assert pred.peak_bytes[0] == pytest.approx((4e9 + 2 * 5e8, 4e9 + 1 * 5e8))


def test_checkpointing_sharding_and_gpipe_memory_by_hand() -> None:
    model = CostModel(two_block_profiles())
    place = (Placement("fast", 1, "a"),)
    plan = Plan(mbs=1, bounds=(0, 2), replicas=(Replica(place, 3),), checkpoint=frozenset({0}), schedule="gpipe")
    pred = model.predict(plan)
    # compute: (1 + 2) * 2 + recompute of block 0's forward (1 s) = 7 s per micro-batch, 3 of them; no sync
    assert pred.iteration_s == pytest.approx(3 * 7.0 + 0.2)
    # GPipe keeps 3 micro-batches: block 0 keeps its 1e8 B output, block 1 its 5e8 B; and one block is recomputed
    # at a time, whichever micro-batch it belongs to: 5e8 B once
    assert pred.peak_bytes[0][0] == pytest.approx(2e9 * 2 + 4e9 + 3 * (1e8 + 5e8) + 5e8)
    two = (Replica(place, 1), Replica((Placement("fast", 1, "b"),), 1))
    sharded = model.predict(Plan(mbs=1, bounds=(0, 2), replicas=two, sharding="full"))
    assert sharded.peak_bytes[0][0] == pytest.approx(2e9 * 2 + 4e9 / 2 + 1e9)


def test_faster_replicas_with_more_microbatches_finish_together() -> None:
    model = CostModel(two_block_profiles())
    fast, slow = Placement("fast", 1, "a"), Placement("slow", 1, "b")
    even = model.predict(Plan(1, (0, 2), (Replica((fast,), 4), Replica((slow,), 4))))
    iidp = model.predict(Plan(1, (0, 2), (Replica((fast,), 6), Replica((slow,), 2))))
    assert even.pipeline_s == pytest.approx((24.0, 72.0))
    assert iidp.pipeline_s == pytest.approx((36.0, 36.0))
    assert iidp.iteration_s < even.iteration_s


def with_sharded_rows(profiles: HybridProfiles) -> HybridProfiles:
    """The two-block profiles plus measured sharded rows: on "fast" each block's first forward pays a 0.5 s gather
    (1.5 against 1.2 s), its last backward a 0.25 s reduce-scatter (2.5 against 2.25 s), the update on the shards
    0.4 s; on "slow" everything 3x."""
    rows = {
        "fast": [ShardedTimes(fwd_first=1.7, fwd=1.2, bwd=2.25, bwd_last=2.5, update=0.4)] * 2,
        "slow": [ShardedTimes(fwd_first=5.1, fwd=3.6, bwd=6.75, bwd_last=7.5, update=0.4)] * 2,
    }
    devices = {d: dev.model_copy(update={"sharded": {1: rows[d]}}) for d, dev in profiles.devices.items()}
    return profiles.model_copy(update={"devices": devices})


def test_sharded_plan_priced_from_measured_rows_by_hand() -> None:
    plain = CostModel(two_block_profiles())
    model = CostModel(with_sharded_rows(two_block_profiles()))
    fast, slow = Placement("fast", 1, "a"), Placement("slow", 1, "b")
    # unequal counts (3 + 1): gathered once in the first forward, reduce-scattered once in the last backward
    plan = Plan(1, (0, 2), (Replica((fast,), 3), Replica((slow,), 1)), checkpoint=frozenset({1}), sharding="full")
    pred = model.predict(plan)
    # The gathers and reduce-scatters pair up unit by unit, so both replicas go at the slow one's pace there.
    # First forward: max(1.7, 5.1) per block = 10.2 s. Fast: c = 2 * (1.2 + 2.25) + 1.2 (block 1 recomputed)
    # = 8.1 s, so its last backward starts at 10.2 + 2 * 8.1 = 26.4 s, the slow one's at 10.2 s. Block 1 (last
    # backward + recompute): fast 2.5 + 1.2, slow 7.5 + 3.6: max(26.4 + 3.7, 10.2 + 11.1) = 30.1 s; block 0 at
    # the slow one's 7.5 s: both end at 37.6 s.
    assert pred.pipeline_s == pytest.approx((37.6, 37.6))
    assert pred.sync_s == 0.0  # the collectives are inside the measured rows
    assert pred.update_s == pytest.approx(0.8)  # u' of both blocks, on the shards
    assert pred.iteration_s == pytest.approx(37.6 + 0.8)
    # memory is priced as before
    assert pred.peak_bytes == plain.predict(plan).peak_bytes
    # equal counts (2 + 2): ZeRO-3 proper, a gather each forward and each backward: E = 2 * 2 * 1.0 + 0.5 = 4.5 s
    equal = model.predict(Plan(1, (0, 2), (Replica((fast,), 2), Replica((fast,), 2)), sharding="full"))
    assert equal.pipeline_s == pytest.approx((2 * 6.9 + 4.5, 2 * 6.9 + 4.5))
    # without rows at the plan's micro-batch size, or unsharded, today's pricing
    unsharded = Plan(1, (0, 2), (Replica((fast,), 3), Replica((slow,), 1)))
    assert model.predict(unsharded) == plain.predict(unsharded)
    assert not model.measured_sharded(Plan(2, (0, 2), plan.replicas, sharding="full"))


def test_profiles_round_trip(tmp_path: Path) -> None:
    profiles = two_block_profiles()
    write_profiles(tmp_path, profiles)
    back = read_profiles(tmp_path, "m")
    assert back == profiles


def test_missing_tp_degree_is_one_line_input_error() -> None:
    model = CostModel(two_block_profiles())
    with pytest.raises(InputError, match="TP degree 2"):
        model.predict(Plan(1, (0, 2), (Replica((Placement("fast", 2, "a"),), 1),)))


def test_wrong_folder_is_input_error(tmp_path: Path) -> None:
    (tmp_path / "llm_info.json").write_text("{}")
    with pytest.raises(InputError, match="not a Sailor folder"):
        import_sailor(tmp_path)
    with pytest.raises(InputError, match="not a folder"):
        import_sailor(tmp_path / "nope")


@pytest.fixture(scope="module")
def sailor() -> dict[str, HybridProfiles]:
    if not SAILOR.is_dir():
        pytest.skip(f"Sailor reference not found at {SAILOR} (it sits in ../shared/reference beside the repo)")
    return import_sailor(SAILOR)


def test_sailor_import_keeps_the_published_numbers(sailor: dict[str, HybridProfiles]) -> None:
    raw = json.loads((SAILOR / "sailor/Planner/simulations/profiles_tmp.json").read_text())
    opt = sailor["OPT-350"]
    assert opt.num_blocks == 26
    assert opt.devices["RTX-3090"].times[2][8][1] == tuple(raw["OPT-350"]["RTX-3090"]["2"]["8"]["1"])
    assert opt.devices["RTX-2080"].memory_bytes == 11811160064
    assert opt.blocks.blocks[1].params_bytes[1] == 50384896


def test_sailor_plan_reads_measurements(sailor: dict[str, HybridProfiles]) -> None:
    path = SAILOR / "sailor/Planner/simulations/validation/mit/N4/plan_config_N4_D2.json"
    model, plan, real_s, real_mem = read_sailor_plan(path, {m: p.num_blocks for m, p in sailor.items()})
    assert model == "OPT-350" and plan.bounds == (0, 12, 26) and plan.gbs == 256
    assert [p.device for p in plan.replicas[0].stages] == ["RTX-3090", "Titan-RTX"]
    assert (real_s, real_mem) == (66.06712, 6818889728)
    assert CostModel(sailor[model]).predict(plan).fits


def test_profile_import_cli_writes_what_reads_back(cli: CliRunner, tmp_path: Path) -> None:
    if not SAILOR.is_dir():
        pytest.skip(f"Sailor reference not found at {SAILOR}")
    result = cli.invoke(app, ["profile", "import", "--from", "sailor", str(SAILOR), "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    back = read_profiles(tmp_path, "OPT-350")
    assert back == import_sailor(SAILOR)["OPT-350"]


def test_profile_import_cli_wrong_folder_is_one_line_exit_2(cli: CliRunner, tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    result = cli.invoke(app, ["profile", "import", "--from", "sailor", str(tmp_path / "in"), "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert result.output.strip().count("\n") == 0 and "not a Sailor folder" in result.output
    assert not (tmp_path / "hybrid").exists()


GALVATRON = REFERENCE / "planners" / "galvatron" / "dev_opt@28ce6a38" / "galvatron"  # PKU-DAIR, Apache-2.0


def test_galvatron_import_keeps_the_published_numbers() -> None:
    if not GALVATRON.is_dir():
        pytest.skip(f"Galvatron reference not found at {GALVATRON}")
    vit = import_profiles("galvatron", GALVATRON)["vit_hf/hidden2560_head32"]
    mem = json.loads((GALVATRON / "models/vit_hf/configs/memory_profiling_bf16_hidden2560_head32.json").read_text())
    comp = json.loads(
        (GALVATRON / "models/vit_hf/configs/computation_profiling_bf16_hidden2560_head32.json").read_text()
    )
    layer = vit.blocks.blocks[1]
    assert layer.params_bytes[1] == mem["layertype_0"]["197"]["parameter_size"] * 2**20
    assert layer.act_bytes[2] == mem["layertype_0"]["197"]["tp_activation_per_bsz_dict"]["2"] * 2**20
    forward = vit.devices["A100-40"].times[4][1][1][0]
    assert forward == pytest.approx(4 * comp["layertype_0_bsz8_seq197"] / 1e3)
    assert vit.devices["A100-40"].times[4][1][1][1] == pytest.approx(2 * forward)
    with pytest.raises(InputError, match="not a Galvatron folder"):
        import_profiles("galvatron", SAILOR)
