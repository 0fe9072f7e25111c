"""The hybrid planner sees the link between servers: profiles that differ only in their ``inter`` link give plans
that differ where they should, and the cost model prices every cross-server transfer on that link.

Synthetic profiles (no processes) for the planner and the cost model; the link measurement itself
(``measure_link``) runs its two real processes on loopback.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from jabascli.cli.app import app
from jabascli.config import load_config
from jabascli.hybrid.costmodel import CostModel
from jabascli.hybrid.plan import Placement, Plan, Replica
from jabascli.hybrid.search import Choice, ServerGroup, search
from jabascli.net import free_port
from jabascli.profiler.common import Reporter, ShareReporter
from jabascli.profiler.hybrid import MeasuredLink, link_network, measure_link, write_link
from jabascli.profiler.link import link_on_disk, link_source
from jabascli.profiler.remote_link import link_stage
from jabascli.profiles.hybrid import (
    BandwidthFit,
    BlockInfo,
    CollectiveTime,
    DeviceTimes,
    HybridProfiles,
    ModelBlocks,
    Network,
    ShardedTimes,
    read_profiles,
    write_profiles,
)

GB = 1e9
FAST = 10 * GB  # the inter link as fast as the links within a server
SLOW = 1e7  # 10 MB/s
LATENCY = 1e-4
SIZES = (1e3, 1e4, 1e5, 1e6, 4e6, 1e7, 1e8, 1e9)
"""Measured sizes; 4e6 B is what a stage boundary carries at micro-batch size 4."""


def link_rows(link: str, bandwidth: float) -> list[CollectiveTime]:
    """What two processes would measure on a link of ``bandwidth`` bytes/s and a latency of 0.1 ms: a ring
    all-reduce of S bytes moves S each way, an all-gather or reduce-scatter S/2, a send S."""
    rows = []
    for size in SIZES:
        moved = {"all_reduce": size, "all_gather": size / 2, "reduce_scatter": size / 2, "send": size}
        for name, nbytes in moved.items():
            seconds = LATENCY + nbytes / bandwidth
            rows.append(CollectiveTime(collective=name, devices=2, link=link, size_bytes=size, seconds=seconds))  # type: ignore[arg-type]
    return rows


def profiles(inter: float) -> HybridProfiles:
    """Four blocks of 100 MB parameters (400 MB with Adam, a device holds 1 GB: two blocks with their
    activations), 1 MB of output a sample; two device types alike, "a" and "b", one server of 2 devices each;
    within a server 10 GB/s, between them ``inter`` bytes/s. Only the ``inter`` link differs between calls."""
    blocks = [BlockInfo(name=str(i), params_bytes={1: 1e8}, act_bytes={1: 2e7}, boundary_bytes=1e6) for i in range(4)]
    model = ModelBlocks(model="m", blocks=blocks)
    rows = [(0.01, 0.02, 0.001)] * 4
    devices = {
        d: DeviceTimes(device=d, memory_bytes=1.0e9, devices_per_server=2, times={4: {1: rows}}) for d in ("a", "b")
    }
    fit = {2: BandwidthFit(coeffs=[10.0])}
    loopback = Network(
        source="synthetic",
        intra={d: fit for d in devices},
        inter={d: fit for d in devices},
        collectives=link_rows("intra", 10 * GB) + link_rows("inter", 10 * GB),
    )
    return HybridProfiles(blocks=model, devices=devices, network=link_network(loopback, link_rows("inter", inter), "x"))


SERVERS = [ServerGroup("a", 1), ServerGroup("b", 1)]


def servers_of(choice: Choice) -> set[str]:
    return {p.server for rep in choice.plan.replicas for p in rep.stages}


def test_plans_follow_the_link() -> None:
    fast_model, slow_model = CostModel(profiles(FAST)), CostModel(profiles(SLOW))
    on_fast = search(fast_model, SERVERS, 32, deal=True)
    on_slow = search(slow_model, SERVERS, 32, deal=True)
    # fast link: all four devices, the pipeline's stages on both servers (the activations cross the link)
    assert servers_of(on_fast) == {"a-0", "b-0"}, on_fast.plan.describe()
    assert on_fast.plan.num_stages == 4
    # slow link: one server's two devices, nothing crosses the link
    assert len(servers_of(on_slow)) == 1, on_slow.plan.describe()
    assert on_slow.plan.num_stages == 2
    # each link's plan is the faster one on its link, by that link's cost model
    assert fast_model.predict(on_fast.plan).iteration_s < fast_model.predict(on_slow.plan).iteration_s
    assert slow_model.predict(on_slow.plan).iteration_s < slow_model.predict(on_fast.plan).iteration_s
    # a plan within one server costs the same on either link
    assert fast_model.predict(on_slow.plan) == slow_model.predict(on_slow.plan)


def test_predicted_iteration_prices_the_cross_server_sends_on_the_link() -> None:
    a, b = Placement("a", 1, "a-0"), Placement("b", 1, "b-0")
    plan = Plan(mbs=4, bounds=(0, 1, 2, 3, 4), replicas=(Replica((a, a, b, b), 8),))
    fast, slow = CostModel(profiles(FAST)).predict(plan), CostModel(profiles(SLOW)).predict(plan)
    # stage steps: 0.03 s compute, plus 4 MB sent or received per neighbour: intra 1e-4 + 4e6 / 1e10 s; the
    # stages 1 and 2 send over the link instead
    intra = LATENCY + 4e6 / (10 * GB)

    def pipeline(link: float) -> float:
        steps = [0.03 + intra, 0.03 + intra + link, 0.03 + link + intra, 0.03 + intra]
        return sum(steps) + 7 * max(steps)

    assert fast.pipeline_s == pytest.approx((pipeline(LATENCY + 4e6 / FAST),))
    assert slow.pipeline_s == pytest.approx((pipeline(LATENCY + 4e6 / SLOW),))
    # the link is in two stages' steps once each and in the slowest step's 7 repeats
    assert slow.iteration_s - fast.iteration_s == pytest.approx(9 * (4e6 / SLOW - 4e6 / FAST))
    assert (fast.sync_s, fast.update_s) == (slow.sync_s, slow.update_s)


def test_gradient_sync_across_servers_follows_the_link_fit() -> None:
    a, b = Placement("a", 1, "a-0"), Placement("b", 1, "b-0")
    plan = Plan(mbs=4, bounds=(0, 2, 4), replicas=(Replica((a, a), 8), Replica((b, b), 8)))
    fast, slow = CostModel(profiles(FAST)).predict(plan), CostModel(profiles(SLOW)).predict(plan)
    assert fast.pipeline_s == slow.pipeline_s  # each replica on one server
    # a ring all-reduce of a stage's 200 MB over the two servers: 2 (2 - 1) / 2 * 2e8 / bandwidth; the fit is
    # the measured all-reduces' bus bandwidth, a quadratic in log size over latency-bound small sizes too: within
    # 10% of the link's
    assert slow.sync_s == pytest.approx(2e8 / SLOW, rel=0.1)
    assert fast.sync_s == pytest.approx(2e8 / FAST, rel=0.1)


def test_sharded_collectives_across_servers_cost_the_link() -> None:
    """Measured sharded rows come from two processes of one machine: across a slower link each block's gather and
    reduce-scatter take what the link measures beyond what loopback did."""
    rows = [ShardedTimes(fwd_first=0.02, fwd=0.01, bwd=0.02, bwd_last=0.03, update=0.001)] * 4

    def sharded(inter: float) -> CostModel:
        base = profiles(inter)
        devices = {d: dev.model_copy(update={"sharded": {4: rows}}) for d, dev in base.devices.items()}
        return CostModel(base.model_copy(update={"devices": devices}))

    a, b, a2 = Placement("a", 1, "a-0"), Placement("b", 1, "b-0"), Placement("a", 1, "a-0")
    across = Plan(4, (0, 4), (Replica((a,), 3), Replica((b,), 1)), sharding="full")
    within = Plan(4, (0, 4), (Replica((a,), 3), Replica((a2,), 1)), sharding="full")
    fast, slow = sharded(FAST), sharded(SLOW)
    assert fast.predict(within) == slow.predict(within)
    # per block one all-gather and one reduce-scatter of its 100 MB: 5e7 B each way on either link
    extra = 4 * 2 * (5e7 / SLOW - 5e7 / (10 * GB))
    assert slow.predict(across).iteration_s - fast.predict(across).iteration_s == pytest.approx(extra)
    # equal counts: ZeRO-3 proper gathers in every forward and backward, 2 M of them
    equal = Plan(4, (0, 4), (Replica((a,), 2), Replica((b,), 2)), sharding="full")
    extra = 4 * (2 * 2 + 1) * (5e7 / SLOW - 5e7 / (10 * GB))
    assert slow.predict(equal).iteration_s - fast.predict(equal).iteration_s == pytest.approx(extra)


def test_write_link_replaces_the_inter_link_only(tmp_path: Path) -> None:
    write_profiles(tmp_path, profiles(FAST))
    write_link(tmp_path, link_rows("inter", SLOW), "two nodes at 10 MB/s")
    read = read_profiles(tmp_path, "m").network
    assert read.intra == profiles(FAST).network.intra
    assert sorted(r.seconds for r in read.collectives if r.link == "inter") == sorted(
        r.seconds for r in link_rows("inter", SLOW)
    )
    assert sorted(r.seconds for r in read.collectives if r.link == "intra") == sorted(
        r.seconds for r in link_rows("intra", 10 * GB)
    )
    assert read.measured_seconds("send", "inter", 4e6) == pytest.approx(LATENCY + 4e6 / SLOW)
    assert read.fit("inter", "a", 1).bandwidth(1e8) == pytest.approx(SLOW, rel=0.05)
    assert read.source == "synthetic; inter: two nodes at 10 MB/s"


def test_measure_link_runs_one_rank_each_and_both_see_the_same_rows() -> None:
    port = free_port()
    found: dict[int, MeasuredLink] = {}
    failed: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            found[r] = measure_link(r, "127.0.0.1", port, sizes_bytes=(1024, 65536), timeout_s=120)
        except BaseException as exc:  # handed to the test's thread
            failed.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert not failed, failed
    assert found[0] == found[1]  # each row the slower rank's median, MAX-reduced over both
    assert {(r.collective, r.size_bytes) for r in found[0].rows} == {
        (c, s) for c in ("all_reduce", "all_gather", "reduce_scatter", "send") for s in (1024.0, 65536.0)
    }
    assert all(r.link == "inter" and r.devices == 2 and r.seconds > 0 for r in found[0].rows)
    assert found[0].hosts == ["127.0.0.1", "127.0.0.1"]  # each rank's address towards the master


def test_link_on_disk_is_what_profile_link_wrote(tmp_path: Path) -> None:
    write_profiles(tmp_path, profiles(FAST))
    path = tmp_path / "hybrid" / "network.json"
    assert link_on_disk(path) is None  # loopback's, or another's: measured again
    write_link(tmp_path, link_rows("inter", SLOW), link_source(["10.0.0.1", "10.0.0.2"]))
    found = link_on_disk(path)
    assert found is not None and found.hosts == ["10.0.0.1", "10.0.0.2"]
    assert sorted(r.seconds for r in found.rows) == sorted(r.seconds for r in link_rows("inter", SLOW))
    assert found.sizes == len(SIZES)
    assert found.gbps == pytest.approx(read_profiles(tmp_path, "m").network.fit("inter", "a", 1).cap / GB)


def two_nodes(folder: Path) -> Path:
    """A job on servers ``a`` and ``b`` of two other machines (TEST-NET-1 addresses: nobody answers there)."""
    config = folder / "jabas.toml"
    servers = "".join(
        f'\n[[cluster.servers]]\nname = "{name}"\ndevice_type = "cpu"\nhost = "{host}"\n'
        for name, host in (("a", "192.0.2.1"), ("b", "192.0.2.2"))
    )
    config.write_text(f'[job]\nworkload = "digits"\n\n[profiles]\ndir = "profiles"\n{servers}')
    return config


def test_profile_link_and_profile_all_hybrid_need_the_network_profile(cli: CliRunner, tmp_path: Path) -> None:
    """Without ``hybrid/network.json`` (``jabas profile hybrid`` writes it): exit 2, one line saying what to run,
    before anything is measured or any node is connected to."""
    config = two_nodes(tmp_path)
    missing = tmp_path / "profiles" / "hybrid" / "network.json"
    for args in (["link", "--rank", "0", "--master", "127.0.0.1:29599"], ["all", "--hybrid"]):
        began = time.monotonic()
        result = cli.invoke(app, ["profile", *args, "-c", str(config)], env={"COLUMNS": "300"})
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1, result.output
        assert str(missing) in lines[0] and f"run `jabas profile hybrid -c {config}` first" in lines[0], lines
        assert time.monotonic() - began < 5
    assert not (tmp_path / "profiles").exists()
    result = cli.invoke(app, ["profile", "link", "-c", str(config), "--rank", "2", "--master", "127.0.0.1:29599"])
    assert result.exit_code == 2 and "--rank" in result.output, result.output


def test_the_cluster_keeps_a_link_measured_before(tmp_path: Path) -> None:
    """``jabas profile all --hybrid`` on a cluster measures no link that ``jabas profile link`` wrote already."""
    loaded = load_config(two_nodes(tmp_path), check_profiles=False)
    write_profiles(tmp_path / "profiles", profiles(FAST))
    write_link(tmp_path / "profiles", link_rows("inter", SLOW), link_source(["192.0.2.1", "192.0.2.2"]))
    reporter = ShareReporter(Reporter(), 0.0, 1.0, 1.0, "")
    stage = link_stage(loaded, loaded.config.available(), {}, False, free_port(), reporter)
    assert stage.ok and stage.name == "link a-b", stage
    gbps = read_profiles(tmp_path / "profiles", "m").network.fit("inter", "a", 1).cap / GB
    assert stage.detail == f"{len(SIZES)} sizes, {gbps:.2g} GB/s between 192.0.2.1 and 192.0.2.2 (on disk)"
