"""Performance model: the fits reproduce the profiles, the formulas are the documented ones."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jabascli.errors import InputError
from jabascli.perfmodel import (
    Allocation,
    AllReduceFit,
    BucketTimes,
    CommModel,
    DeviceModel,
    GroupConfig,
    LinearFit,
    PerformanceModel,
    ServerSpec,
    VswCurve,
    breakdown,
    build_device_model,
    iteration_times,
    seed_ideal_ms,
)
from jabascli.profiles import (
    BucketProfile,
    CommMeta,
    CommProfile,
    CompProfile,
    MemoryProfile,
    ProfileSet,
    load_profile_set,
    ring_allreduce_ideal_ms,
)
from jabascli.solver import Solver

MIB = 2**20


def reference_profiles(root: Path) -> ProfileSet:
    return load_profile_set(
        root / "cluster_mem_profile_data",
        root / "cluster_comp_profile_data",
        root / "comm_profile_data",
        root / "bucket_profile_data",
    )


def spec(name: str, devices: int = 4, profile: str | None = None) -> ServerSpec:
    return ServerSpec(name, f"type-{profile or name}", devices, profile or name, 15.75e9, 12.5e9)


# Fits ------------------------------------------------------------------------

points = st.lists(
    st.tuples(st.integers(1, 12), st.floats(0.1, 1e3, allow_nan=False)),
    min_size=1,
    max_size=6,
    unique_by=lambda p: p[0],
)


@settings(max_examples=60, deadline=None)
@given(points)
def test_vsw_curve_reproduces_every_measured_point(pts: list[tuple[int, float]]) -> None:
    curve = VswCurve.through(pts)
    for v, t in pts:
        assert curve(v) == t


@settings(max_examples=60, deadline=None)
@given(points)
def test_vsw_curve_grows_when_the_measurements_do(pts: list[tuple[int, float]]) -> None:
    """Non-decreasing measurements give a non-decreasing, positive curve, also beyond them."""
    vs = sorted(v for v, _ in pts)
    ts = np.maximum.accumulate([t for _, t in sorted(pts)])
    curve = VswCurve.through(zip(vs, ts, strict=True))
    values = curve(np.arange(1, 2 * vs[-1] + 2))
    assert np.all(values > 0) and np.all(np.diff(values) >= -1e-9)


def test_vsw_curve_between_below_and_beyond_the_measurements() -> None:
    curve = VswCurve.through([(2, 10.0), (4, 16.0)])
    assert curve(3) == 13.0  # linear between measured points
    assert curve(1) == 5.0  # below: the line through the origin and the first point
    assert curve(6) == 22.0  # beyond: the last marginal cost (3 per VSW) continues
    one = VswCurve.through([(1, 7.0)])
    assert one(3) == 21.0  # one point: no concurrency gain assumed
    noisy = VswCurve.through([(1, 10.0), (2, 9.0)])
    assert noisy(4) == pytest.approx(9.0 + 2 * 4.5)  # non-positive slope: mean cost per VSW at the last point
    with pytest.raises(ValueError):
        VswCurve.through([])


def test_linear_fit() -> None:
    line = LinearFit.least_squares([1, 2, 3], [3, 5, 7])
    assert line.slope == pytest.approx(2) and line.intercept == pytest.approx(1)
    assert LinearFit.least_squares([2.0], [6.0]) == LinearFit(0.0, 3.0)


# Compute model on the reference data ------------------------------------------


def test_device_model_reproduces_the_reference_profile(reference_dir: Path) -> None:
    profiles = reference_profiles(reference_dir)
    v100 = build_device_model(profiles, "node0", 32)
    assert v100.device_type == "Tesla V100-PCIE-16GB" and v100.max_vsw == 3
    measured = profiles.comp_points("node0", 32)
    for n, p in measured.items():
        d, f, b = v100.phases(n)
        assert (d, f, b) == (p.data_time * 1e-3, p.fwd_time * 1e-3, p.bwd_time * 1e-3)
    # VSW 2 was not measured: half-way between 1 and 3.
    assert v100.forward(2) == pytest.approx((measured[1].fwd_time + measured[3].fwd_time) / 2 * 1e-3)
    every = [p for (s, _, _), p in profiles.comp.items() if s == "node0"]
    assert v100.update_s == pytest.approx(np.mean([p.update_time for p in every]) * 1e-3)
    # copy per extra replica: least squares through the origin over (LBS 32, 3 VSWs) and (LBS 64, 2 VSWs)
    c3, c2 = measured[3].copy_time, profiles.comp_points("node0", 64)[2].copy_time
    assert v100.copy_per_replica_s == pytest.approx((2 * c3 + 1 * c2) / (4 + 1) * 1e-3)
    assert v100.bn_sync_s == pytest.approx(6.29e-3)


def test_device_model_names_what_is_missing(reference_dir: Path) -> None:
    profiles = reference_profiles(reference_dir)
    with pytest.raises(InputError, match=r"LBS 160 cannot run on node0: no memory profile"):
        build_device_model(profiles, "node0", 160)
    model = PerformanceModel(profiles)
    assert model.lbs_values("node0") == [32, 64, 96, 128]
    assert model.lbs_values("node1") == [32, 64, 96, 128, 160]


# All-reduce ---------------------------------------------------------------------


def test_seed_abscissa_matches_the_seed_profiles(reference_dir: Path) -> None:
    """The seed wrote ideal_ms = 4 (N-1)/N * S / B: 1 MiB, 4 GPUs, 15.75 GB/s is its first intra line.

    Its inter profile matches 1 MiB on 8 GPUs at 7 GB/s, not the 12.5 GB/s of
    this cluster's config: the known flaw that the meta file fixes.
    """
    profiles = reference_profiles(reference_dir)
    assert seed_ideal_ms(MIB, 15.75e9, 4) == pytest.approx(profiles.comm["intra"].ideal_ms[0], rel=1e-12)
    assert seed_ideal_ms(MIB, 7e9, 8) == pytest.approx(profiles.comm["inter"].ideal_ms[0], rel=1e-12)
    assert seed_ideal_ms(MIB, 1e9, 1) == 0.0


def test_comm_model_on_seed_profiles_uses_the_config_bandwidth(reference_dir: Path) -> None:
    profiles = reference_profiles(reference_dir)
    comm = CommModel.from_profiles(profiles)
    intra = comm.fits["intra"]
    assert intra.bandwidth is None
    buckets = comm.buckets(4, 1, 15.75e9)
    sizes = profiles.bucket.bucket_size_distribution  # type: ignore[union-attr]
    expected = [max(0.0, float(intra.line(seed_ideal_ms(s * MIB, 15.75e9, 4)))) * 1e-3 for s in sizes]
    assert buckets.per_bucket_s == pytest.approx(expected, rel=1e-12)
    assert buckets.last_share == pytest.approx(sizes[-1] / sum(sizes))
    assert buckets.overlapped_s == pytest.approx(sum(expected[:-1]))
    assert buckets.last_s == pytest.approx(expected[-1])
    # More servers: the inter fit; one GPU: no all-reduce at all.
    assert comm.buckets(8, 2, 12.5e9).per_bucket_s[0] == pytest.approx(
        float(comm.fits["inter"].line(seed_ideal_ms(sizes[0] * MIB, 12.5e9, 8))) * 1e-3
    )
    assert comm.buckets(1, 1, 15.75e9).per_bucket_s == ()


def test_comm_model_with_meta_uses_the_recorded_bandwidth() -> None:
    bandwidth = 2e9
    ideal = [ring_allreduce_ideal_ms(s * MIB, bandwidth, 2) for s in (1, 10, 100)]
    profile = CommProfile(
        kind="inter",
        ideal_ms=ideal,
        measured_ms=[0.5 + 2 * x for x in ideal],
        meta=CommMeta(bandwidth=bandwidth, world_size=2),
    )
    fit = AllReduceFit.from_profile(profile)
    assert fit.bandwidth == bandwidth
    assert fit.line.slope == pytest.approx(2) and fit.line.intercept == pytest.approx(0.5)
    # The config's bandwidth (last argument) is not used: the profile knows its own.
    for config_bandwidth in (1e9, 100e9):
        expected = (0.5 + 2 * ring_allreduce_ideal_ms(25 * MIB, bandwidth, 6)) * 1e-3
        assert fit.time_s(25 * MIB, 6, config_bandwidth) == pytest.approx(expected)


def test_missing_comm_pieces_are_named(tmp_path: Path) -> None:
    no_buckets = CommModel({}, None, {"bucket": tmp_path / "b", "communication": tmp_path / "c"})
    assert no_buckets.buckets(1, 1, 1e9).last_share == 1.0  # one GPU needs neither
    with pytest.raises(InputError, match="no bucket profile"):
        no_buckets.buckets(2, 1, 1e9)
    no_inter = CommModel({}, (1.0, 2.0), {"communication": tmp_path / "c"})
    with pytest.raises(InputError, match=r"inter_comm_profile_data.txt.*no inter-node all-reduce profile"):
        no_inter.buckets(4, 2, 1e9)


# The iteration formula ----------------------------------------------------------


def toy_device(copy: float = 0.002, bn: float = 0.001) -> DeviceModel:
    return DeviceModel(
        server="s",
        device_type="toy",
        lbs=8,
        max_vsw=4,
        data=VswCurve.through([(1, 0.01), (2, 0.018)]),
        forward=VswCurve.through([(1, 0.03), (2, 0.05)]),
        backward=VswCurve.through([(1, 0.06), (2, 0.1)]),
        update_s=0.005,
        copy_per_replica_s=copy,
        bn_sync_s=bn,
    )


@pytest.mark.parametrize("overlapped", [0.02, 0.2])
def test_iteration_formula(overlapped: float) -> None:
    device = toy_device()
    buckets = BucketTimes((overlapped / 2, overlapped / 2, 0.004), last_share=0.25)
    b1 = float(device.phases(1)[2])  # the synchronising backward: replica 0's last micro-batch alone
    for v in (1, 2, 3):
        d, f, b = (float(x) for x in device.phases(v))
        for g in (0, 1, 5):
            exposed = max(b1, overlapped) - b1 + 0.004
            update = 0.005 + 0.002 * (v - 1)
            seq = (g + 1) * (d + f + b) + exposed + update + 0.001 * v
            ovl = seq - update + update * 0.25
            assert iteration_times(device, v, g, "sequential", buckets) == pytest.approx(seq, rel=1e-12)
            assert iteration_times(device, v, g, "overlap", buckets) == pytest.approx(ovl, rel=1e-12)
            # A GA micro-step adds data + forward + backward.
            step = iteration_times(device, v, g + 1, "overlap", buckets) - iteration_times(
                device, v, g, "overlap", buckets
            )
            assert step == pytest.approx(d + f + b, rel=1e-9)
            # The breakdown adds up to exactly what the solver tabulates.
            parts = breakdown(device, v, g, "overlap", buckets)
            assert parts.total_s == float(iteration_times(device, np.array([v]), np.array([g]), "overlap", buckets)[0])
            assert parts.compute_s == pytest.approx((g + 1) * (d + f + b))
    with pytest.raises(ValueError):
        iteration_times(device, 1, 0, "sideways", buckets)  # type: ignore[arg-type]


def test_engine_overhead_is_paid_once_per_iteration() -> None:
    plain, engine = toy_device(), replace(toy_device(), overhead_s=0.003)
    buckets = BucketTimes((0.01, 0.004), last_share=0.25)
    for ws in ("sequential", "overlap"):
        v, g = np.meshgrid(np.arange(1, 4), np.arange(0, 3))
        added = iteration_times(engine, v, g, ws, buckets) - iteration_times(plain, v, g, ws, buckets)
        assert added == pytest.approx(np.full(v.shape, 0.003), abs=1e-15)
        parts = breakdown(engine, 2, 1, ws, buckets)
        assert parts.overhead_s == 0.003
        assert parts.total_s == float(iteration_times(engine, np.array([2]), np.array([1]), ws, buckets)[0])


def test_a_measured_overlap_update_replaces_the_last_bucket_share() -> None:
    buckets = BucketTimes((0.01, 0.004), last_share=0.25)
    seed = toy_device()  # no measurement: the seed's (U + C (v - 1)) * share_last
    assert breakdown(seed, 3, 0, "overlap", buckets).update_s == pytest.approx((0.005 + 0.002 * 2) * 0.25)
    # Measured: the per-bucket steps cost more than a plain step (one CPU core, no concurrency to hide them in),
    # so overlap is slower than sequential here; the replicas' copy follows the last bucket in both.
    measured = replace(toy_device(), overlap_update_s=0.007)
    for v in (1, 3):
        overlap = breakdown(measured, v, 0, "overlap", buckets)
        sequential = breakdown(measured, v, 0, "sequential", buckets)
        assert overlap.update_s == pytest.approx(0.007 + 0.002 * (v - 1))
        assert sequential.update_s == pytest.approx(0.005 + 0.002 * (v - 1))
        assert overlap.total_s > sequential.total_s


def _comp(n: int, update: float, overhead: float, overlap: float | None) -> CompProfile:
    return CompProfile(
        model="m", gpu_type="t", lbs=8, num_models=n, total_time=10.0 * n, data_time=1.0 * n, fwd_time=3.0 * n,
        bwd_time=6.0 * n, update_time=update, copy_time=0.0, overhead_time=overhead, overlap_update_time=overlap,
    )  # fmt: skip


def test_overhead_and_overlap_update_are_averaged_over_the_device() -> None:
    memory = {("s", 8): MemoryProfile(gpu_type="t", total_memory=10**9, lbs=8, max_num_models=2)}
    comp = {("s", 8, 1): _comp(1, 0.5, 0.2, 0.6), ("s", 8, 2): _comp(2, 0.7, 0.4, 1.0)}
    device = build_device_model(ProfileSet(memory, comp, None), "s", 8)
    assert device.overhead_s == pytest.approx(0.3e-3) and device.overlap_update_s == pytest.approx(0.8e-3)
    comp = {k: p.model_copy(update={"overlap_update_time": None, "overhead_time": 0.0}) for k, p in comp.items()}
    seed_like = build_device_model(ProfileSet(memory, comp, None), "s", 8)
    assert seed_like.overhead_s == 0.0 and seed_like.overlap_update_s is None


def test_backward_hides_all_but_the_last_bucket() -> None:
    device = toy_device()
    b = float(device.backward(1))
    hidden = breakdown(device, 1, 0, "sequential", BucketTimes((b / 2, b / 2, 0.003), 0.5))
    assert hidden.exposed_comm_s == pytest.approx(0.003)
    longer = breakdown(device, 1, 0, "sequential", BucketTimes((b, b, 0.003), 0.5))
    assert longer.exposed_comm_s == pytest.approx(b + 0.003)


# The whole model ----------------------------------------------------------------


def test_predict_takes_the_slowest_group(reference_dir: Path) -> None:
    model = PerformanceModel(reference_profiles(reference_dir))
    v100, p100 = spec("node0"), spec("node1")
    groups = [GroupConfig(v100, 3, 2, 1), GroupConfig(v100, 1, 1, 0), GroupConfig(p100, 4, 1, 1)]
    prediction = model.predict(32, "overlap", groups)
    assert prediction.allocation == Allocation(8, 2, 12.5e9)
    assert prediction.gbs == 32 * (3 * 2 * 2 + 1 + 4 * 2)
    times = [g.time_s for g in prediction.groups]
    assert prediction.time_s == max(times) and times[0] > times[1]
    assert prediction.throughput == prediction.gbs / prediction.time_s
    one_server = model.predict(32, "overlap", [GroupConfig(v100, 4, 2, 1)])
    assert one_server.allocation == Allocation(4, 1, 15.75e9)
    with pytest.raises(ValueError):
        model.predict(32, "overlap", [GroupConfig(v100, 4, 0, 1)])


def test_predict_on_one_gpu_is_the_measured_iteration(reference_dir: Path) -> None:
    """No all-reduce on one GPU: the prediction is the profile's own total, up to the averaged update."""
    profiles = reference_profiles(reference_dir)
    model = PerformanceModel(profiles)
    single = spec("node1", devices=1)
    for n, p in profiles.comp_points("node1", 32).items():
        predicted = model.predict(32, "sequential", [GroupConfig(single, 1, n, 0)]).time_s
        device = model.device("node1", 32)
        measured = p.total_time * 1e-3 - (p.update_time + p.copy_time) * 1e-3
        modelled = device.update_s + device.copy_per_replica_s * (n - 1) + device.bn_sync_s * n
        assert predicted == pytest.approx(measured + modelled, rel=1e-9)


def test_bucket_profile_with_no_bytes_is_refused(reference_dir: Path) -> None:
    profiles = reference_profiles(reference_dir)
    profiles.bucket = BucketProfile(model="resnet50", bucket_size_distribution=[0.0])
    with pytest.raises(InputError, match="no gradient bytes"):
        PerformanceModel(profiles)


# Balanced plans (issue #13) -------------------------------------------------------


def test_a_synchronised_rank_waits_for_the_slowest_rank_of_each_iteration() -> None:
    memory = {("s", 8): MemoryProfile(gpu_type="t", total_memory=10**9, lbs=8, max_num_models=2)}
    comp = {
        ("s", 8, n): _comp(n, 0.5, 0.2, None).model_copy(update={"spread": {"total_time": [9.0 * n, 9.0 * n + iqr]}})
        for n, iqr in ((1, 1.349), (2, 2.698))
    }
    device = build_device_model(ProfileSet(memory, comp, None), "s", 8)
    sigma = {1: 1e-3, 2: 2e-3}  # IQR / 1.349, in seconds
    together, alone = BucketTimes((0.001,), 1.0), BucketTimes((), 1.0)
    for v in (1, 2):
        for g in (0, 3):
            wait = breakdown(device, v, g, "sequential", together).sync_wait_s
            assert wait == pytest.approx(sigma[v] * np.sqrt(g + 1) / np.sqrt(np.pi))
            assert breakdown(device, v, g, "sequential", alone).sync_wait_s == 0.0  # nobody to wait for
            table = iteration_times(device, np.array([v]), np.array([g]), "sequential", together)
            assert breakdown(device, v, g, "sequential", together).total_s == float(table[0])
    seed_like = {k: p.model_copy(update={"spread": None}) for k, p in comp.items()}
    assert build_device_model(ProfileSet(memory, seed_like, None), "s", 8).spread is None


def test_an_allreduce_after_a_wait_costs_the_measured_wake_up_on_the_last_bucket() -> None:
    ideal = [ring_allreduce_ideal_ms(s * MIB, 1e9, 2) for s in (0.03, 0.06, 0.12)]
    measured = [0.1 + x for x in ideal]
    meta = CommMeta(
        bandwidth=1e9, world_size=2, after_wait_ms=[m + d for m, d in zip(measured, (0.6, 0.7, 0.9), strict=True)]
    )
    fit = AllReduceFit.from_profile(CommProfile(kind="inter", ideal_ms=ideal, measured_ms=measured, meta=meta))
    assert fit.wake_s == pytest.approx(0.7e-3)
    without = CommMeta(bandwidth=1e9, world_size=2)
    plain = AllReduceFit.from_profile(CommProfile(kind="inter", ideal_ms=ideal, measured_ms=measured, meta=without))
    assert plain.wake_s == 0.0  # not measured (seed profiles): nothing added
    woken = CommModel({"inter": fit}, (0.05, 0.05), {}).buckets(2, 2, 1e9)
    asleep = CommModel({"inter": plain}, (0.05, 0.05), {}).buckets(2, 2, 1e9)
    assert woken.per_bucket_s[0] == asleep.per_bucket_s[0]
    assert woken.last_s == pytest.approx(asleep.last_s + 0.7e-3)


def _timed(lbs: int, n: int, per_vsw_ms: float) -> CompProfile:
    return CompProfile(
        model="m", gpu_type="t", lbs=lbs, num_models=n, total_time=n * per_vsw_ms + 1.0, data_time=0.1 * n * per_vsw_ms,
        fwd_time=0.3 * n * per_vsw_ms, bwd_time=0.6 * n * per_vsw_ms, update_time=1.0, copy_time=0.0,
    )  # fmt: skip


def test_vsws_are_given_only_where_they_pay() -> None:
    """VSWs as slow as GA (the CPU's, run in turn) are never chosen; streams that overlap are."""
    memory = {("s", b): MemoryProfile(gpu_type="t", total_memory=10**9, lbs=b, max_num_models=4) for b in (8, 16, 32)}
    in_turn = {("s", 8, 1): _timed(8, 1, 10.0), ("s", 8, 4): _timed(8, 4, 9.8), ("s", 16, 1): _timed(16, 1, 20.0)}
    model = PerformanceModel(ProfileSet(memory, in_turn, None))
    assert model.device("s", 8).max_vsw == 1 and model.device("s", 8).fits_vsw == 4  # 2% faster: noise
    assert model.device("s", 16).max_vsw == 1  # larger LBS: what the sweep at LBS 8 told
    overlapping = {**in_turn, ("s", 8, 4): _timed(8, 4, 6.0)}
    model = PerformanceModel(ProfileSet(memory, overlapping, None))
    assert model.device("s", 8).max_vsw == 4 and model.device("s", 16).max_vsw == 4
    only_one = {("s", 8, 1): _timed(8, 1, 10.0)}  # never shown to pay: GA
    assert PerformanceModel(ProfileSet(memory, only_one, None)).device("s", 8).max_vsw == 1
    server = ServerSpec("s", "t", 1, "s", 1e9, 1e9)
    plan = Solver(PerformanceModel(ProfileSet(memory, in_turn, None)), [server]).solve(32)
    assert [(a.vsw, a.ga) for a in plan.assignments] in ([(1, 3)], [(1, 1)])
