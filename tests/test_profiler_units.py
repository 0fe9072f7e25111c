"""Profiler building blocks, in this process: search, statistics, memory tracking, the step, buckets."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from jabascli.config import load_config
from jabascli.devices import NodeDevices
from jabascli.engine.distributed import DistEnv, init_process_group
from jabascli.errors import InputError
from jabascli.memtrack import BudgetExceeded, TensorMemoryTracker
from jabascli.profiler.bucket import ddp_bucket_sizes
from jabascli.profiler.comm import parse_sizes
from jabascli.profiler.common import ensure_writable, resolve_target
from jabascli.profiler.comp import vsw_points
from jabascli.profiler.memory import search_max_vsw, trial_bound
from jabascli.profiler.step import EngineStep, VswStep
from jabascli.profiler.summary import summarize_profiles
from jabascli.profiler.trial import median_is_stable, percentile
from jabascli.profiles import load_profile_set, read_bucket_profile, read_comm_profile
from jabascli.workload import load_workload

# A ResNet-50 as torchvision builds it, to compare bucket profiles with the seed's measurement.
RESNET50 = """
import torch
import torch.nn.functional as F
from torch import nn

NAME = "resnet50"


class Bottleneck(nn.Module):
    def __init__(self, cin, mid, stride):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv2, self.bn2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv3, self.bn3 = nn.Conv2d(mid, 4 * mid, 1, bias=False), nn.BatchNorm2d(4 * mid)
        self.down = None
        if stride != 1 or cin != 4 * mid:
            self.down = nn.Sequential(nn.Conv2d(cin, 4 * mid, 1, stride, bias=False), nn.BatchNorm2d(4 * mid))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet50(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64)
        blocks, cin = [], 64
        for mid, count, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(count):
                blocks.append(Bottleneck(cin, mid, stride if i == 0 else 1))
                cin = 4 * mid
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(2048, 1000)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.layers(x), 1), 1))


def build_model(options):
    return ResNet50()


def train_dataset(options):
    raise NotImplementedError


def loss(output, target):
    return F.cross_entropy(output, target)


def optimizer(params, options):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def synthetic_batch(batch_size, options):
    return torch.rand(batch_size, 3, 32, 32), torch.randint(0, 1000, (batch_size,))
"""


@pytest.fixture
def one_thread():  # type: ignore[no-untyped-def]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# The VSW search ------------------------------------------------------------


@pytest.mark.parametrize("cap", [1, 2, 5, 64])
def test_search_finds_the_largest_count_within_the_trial_bound(cap: int) -> None:
    for true_max in range(0, 80):
        tried: list[int] = []

        def fits(n: int, true_max: int = true_max, tried: list[int] = tried) -> bool:
            tried.append(n)
            return n <= true_max

        found = search_max_vsw(fits, cap)
        assert found == min(true_max, cap)
        assert len(tried) == len(set(tried)), f"a count was tried twice: {tried}"
        assert all(1 <= n <= cap for n in tried)
        assert len(tried) <= trial_bound(found), (true_max, cap, tried)
        if found >= 1:
            assert len(tried) <= 2 * math.log2(found) + 2


def test_search_with_no_room_runs_no_trial() -> None:
    assert search_max_vsw(lambda n: pytest.fail("no trial expected"), 0) == 0


def test_vsw_points_and_sizes() -> None:
    assert [vsw_points(m) for m in (0, 1, 2, 3, 4, 64)] == [[], [1], [1, 2], [1, 2, 3], [1, 2, 4], [1, 32, 64]]
    assert parse_sizes("1:150") == [1, 2, 4, 8, 16, 32, 64, 128, 150]
    assert parse_sizes("4,0.25,1,1") == [0.25, 1, 4]
    for bad in ("4:1", "1", "a:b", "0,1", "1:2:3", "-1:4"):
        with pytest.raises(InputError):
            parse_sizes(bad)


def test_statistics() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 25) == 2.0
    assert median_is_stable([10.0, 10.1, 9.9, 10.0, 10.05, 9.95], 0.05)
    assert not median_is_stable([10.0, 10.0, 10.0, 20.0, 20.0, 20.0], 0.05)
    assert not median_is_stable([1.0, 1.0], 0.05)


# Memory tracking and the step -----------------------------------------------


def test_tracker_counts_storages_once_and_sees_them_freed() -> None:
    tracker = TensorMemoryTracker()
    with tracker:
        a = torch.zeros(1000)  # 4000 bytes
        view = a[:10]
        b = a * 2
        assert tracker.live == 8000
        del b
        assert tracker.live == 4000
        del view
        assert tracker.live == 4000  # the view held a's storage, counted once
    assert tracker.peak == 8000
    del a
    assert tracker.live == 0


def test_tracker_raises_as_a_device_would_when_over_budget() -> None:
    tracker = TensorMemoryTracker(budget=10_000)
    with pytest.raises(BudgetExceeded), tracker:
        keep = [torch.zeros(1000) for _ in range(3)]
        del keep
    assert tracker.exceeded is not None and tracker.exceeded.live > 10_000


class _Linear:
    """A workload-like object: a linear model on fixed batches."""

    name = "linear"
    collate = None

    def build_model(self) -> nn.Module:
        return nn.Linear(4, 2)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output, target)

    def optimizer(self, params: object) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.1)  # type: ignore[arg-type]

    def synthetic_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(batch_size, 4), torch.randn(batch_size, 2)


def test_step_applies_the_mean_gradient_and_keeps_replicas_equal() -> None:
    workload = _Linear()
    torch.manual_seed(1)
    batches = [workload.synthetic_batch(3) for _ in range(3)]
    step = VswStep(workload, 3, 3, batches=iter(batches))  # type: ignore[arg-type]
    start = [p.detach().clone() for p in step.replicas[0].parameters()]

    reference = nn.Linear(4, 2)
    with torch.no_grad():
        for p, q in zip(reference.parameters(), start, strict=True):
            p.copy_(q)
    grads = []
    for x, y in batches:
        reference.zero_grad()
        workload.loss(reference(x), y).backward()
        grads.append([p.grad.clone() for p in reference.parameters()])  # type: ignore[union-attr]
    mean = [sum(g[i] for g in grads) / 3 for i in range(2)]

    times = step.run()
    for replica in step.replicas:
        for p, p0, g in zip(replica.parameters(), start, mean, strict=True):
            assert torch.allclose(p, p0 - 0.1 * g, atol=1e-6)
            assert p.grad is None
    assert min(times.data, times.fwd, times.bwd, times.copy, times.update) >= 0
    assert times.total == pytest.approx(times.data + times.fwd + times.bwd + times.copy + times.update)


@pytest.mark.usefixtures("one_thread")
def test_one_vsw_has_no_copy_time_and_memory_grows_with_vsws() -> None:
    digits = load_workload("digits")
    assert VswStep(digits, 8, 1).run().copy == 0.0
    peaks = []
    for n in (1, 2, 3):
        tracker = TensorMemoryTracker()
        with tracker:
            step = VswStep(digits, 8, n)
            for _ in range(2):
                step.run()
        peaks.append(tracker.peak)
    assert peaks[0] < peaks[1] < peaks[2]
    params = sum(p.numel() * p.element_size() for p in digits.build_model().parameters())
    assert peaks[1] - peaks[0] > 2 * params  # each replica brings its weights, gradients and activations


@pytest.fixture
def one_process_group():  # type: ignore[no-untyped-def]
    import gc

    import torch.distributed as dist

    init_process_group(DistEnv(0, 1, 0, None, None), torch.device("cpu"))
    yield
    gc.collect()  # free DDP before its group
    dist.destroy_process_group()


@pytest.mark.usefixtures("one_thread", "one_process_group")
@pytest.mark.parametrize("weight_sync", ["sequential", "overlap"])
def test_the_engine_step_trains_and_reports_the_engines_phases(weight_sync: str) -> None:
    digits = load_workload("digits")
    # 3 VSWs of LBS 512 need more samples than the 1,437 digits: drawn with replacement.
    step = EngineStep(digits, 512, 3, "cpu", weight_sync=weight_sync)
    assert step.vsw_strategy == "sequential"  # on the CPU, one replica runs the VSWs in turn
    before = [p.detach().clone() for p in step.trainer.model.parameters()]
    times = [step.run() for _ in range(3)]
    assert any(not torch.equal(p, q) for p, q in zip(step.trainer.model.parameters(), before, strict=True))
    for t in times:
        assert min(t.data, t.fwd, t.bwd, t.update, t.overhead) >= 0 and t.fwd > 0 and t.bwd > 0 and t.overhead > 0
        assert t.copy < 0.05  # one replica: nothing to copy
        assert (t.update > 0) == (weight_sync == "sequential")  # with overlap the hook steps each bucket
        assert t.total == pytest.approx(t.data + t.fwd + t.bwd + t.copy + t.update + t.overhead)
    assert math.isfinite(step.last_loss)


# Targets and folders ----------------------------------------------------------


def _config(tmp_path: Path, servers: str) -> Path:
    path = tmp_path / "jabas.toml"
    path.write_text(f'[job]\nworkload = "digits"\n{servers}')
    return path


def test_targets_for_each_kind_of_server(tmp_path: Path) -> None:
    path = _config(
        tmp_path,
        '[[cluster.servers]]\nname = "gpu"\ndevice_type = "V100"\nmemory_bytes = 8000000000\n'
        '[[cluster.servers]]\nname = "cpu"\ndevice_type = "cpu"\ndevices = 2\n'
        '[[cluster.servers]]\nname = "emu"\ndevice_type = "fake-P100"\n'
        "emulate = { slowdown = 3.0, memory_bytes = 1000000 }\n",
    )
    loaded = load_config(path)
    gpu_node = NodeDevices("cuda", "V100", 4, 16_000_000_000, "nvml")
    cpu_node = NodeDevices("cpu", "cpu", 1, 64_000_000_000, "cpu")
    gpu = resolve_target(loaded, None, devices=gpu_node)
    assert (gpu.kind, gpu.memory_bytes, gpu.slowdown, gpu.threads) == ("cuda", 8_000_000_000, 1.0, None)
    cpu = resolve_target(loaded, "cpu", devices=cpu_node)
    assert (cpu.kind, cpu.memory_bytes, cpu.device_type) == ("cpu", 64_000_000_000, "cpu")
    assert cpu.threads is not None and cpu.threads >= 1
    emu = resolve_target(loaded, "emu", threads=1, devices=gpu_node)
    assert (emu.kind, emu.memory_bytes, emu.slowdown, emu.device) == ("emulated", 1_000_000, 3.0, "cpu")
    with pytest.raises(InputError, match="no server named 'nope'"):
        resolve_target(loaded, "nope")
    with pytest.raises(InputError, match="--threads"):
        resolve_target(loaded, "cpu", threads=0)


def test_unwritable_output_folder_is_bad_input(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(InputError, match="not writable") as info:
        ensure_writable(blocker / "profiles")
    assert str(blocker / "profiles") in info.value.lines()[0]


# Reading: the seed's reference data ---------------------------------------------


def test_whole_reference_folder_reads_and_summarises(reference_dir: Path) -> None:
    profiles = load_profile_set(
        reference_dir / "cluster_mem_profile_data",
        reference_dir / "cluster_comp_profile_data",
        reference_dir / "comm_profile_data",
        reference_dir / "bucket_profile_data",
    )
    assert profiles.model == "resnet50" and set(profiles.comm) == {"intra", "inter"}
    assert read_comm_profile(reference_dir / "comm_profile_data", "inter") is not None
    summary = summarize_profiles(reference_dir)
    assert summary.model == "resnet50"
    assert summary.servers() == [("node0", "Tesla V100-PCIE-16GB"), ("node1", "Tesla P100-PCIE-16GB")]
    row = summary.row(32, "node0")
    assert row is not None and row.max_vsw == 3 and sorted(row.points) == [1, 3]
    assert row.throughput(3) == pytest.approx(32 * 3 / 281.06246129671734 * 1e3)
    assert summary.row(160, "node0") is None
    # The memory folder alone works too, and finds its computation folder beside it.
    assert summarize_profiles(reference_dir / "cluster_mem_profile_data").rows == summary.rows


def test_summary_names_a_malformed_file(tmp_path: Path, reference_dir: Path) -> None:
    root = tmp_path / "ref"
    shutil.copytree(reference_dir, root)
    bad = root / "cluster_mem_profile_data" / "64" / "node1" / "max_memory_profile_info.json"
    bad.write_text(json.dumps({"gpu_type": "x", "lbs": 64}))
    with pytest.raises(InputError) as info:
        summarize_profiles(root)
    assert all(str(bad) in line for line in info.value.lines())
    with pytest.raises(InputError, match="no profiles here"):
        summarize_profiles(tmp_path / "ref" / "bucket_profile_data")


# Buckets -----------------------------------------------------------------------


def test_buckets_follow_the_cap_in_gradient_ready_order() -> None:
    digits = load_workload("digits")
    model = digits.build_model()
    total = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    one, cap = ddp_bucket_sizes(digits, None)
    assert cap == 25 and one == [pytest.approx(total)]
    small, cap = ddp_bucket_sizes(digits, 0.01)
    assert len(small) == 3 and sum(small) == pytest.approx(total)
    head = (model.head.weight.numel() + model.head.bias.numel()) * 4 / 2**20
    assert small[0] == pytest.approx(head)  # the last layer's gradients are ready first


@pytest.mark.usefixtures("one_thread")
def test_resnet50_buckets_match_the_seed_measurement(tmp_path: Path, reference_dir: Path) -> None:
    path = tmp_path / "resnet50.py"
    path.write_text(RESNET50)
    sizes, _ = ddp_bucket_sizes(load_workload(str(path)), None)
    seed = read_bucket_profile(reference_dir / "bucket_profile_data").bucket_size_distribution
    assert len(sizes) == len(seed) == 5
    for ours, theirs in zip(sizes, seed, strict=True):
        assert ours == pytest.approx(theirs, abs=0.1)
