"""Host work per iteration and per micro-step: what a GPU would wait for, counted on the CPU.

On a GPU every aten operator is a kernel launch (or more) and every host read of a tensor's value
(``.item()``, ``bool(tensor)``) stalls the host until the device has caught up, so jabas's iteration keeps
pace with a plain loop only if it adds few operators and no reads. Both are counted here with a
``TorchDispatchMode`` (``benchmarks/gpu_resnet50.py``'s counter), which sees the same operators on the CPU;
no GPU is needed, and no time is measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from benchmarks.gpu_resnet50 import CASES, Case, OpCounter, generated_batches, jabas_loop, plain_loop, trainer_for
from torch import nn

from jabascli.engine.buffers import BufferSync
from jabascli.engine.distributed import DistEnv, init_process_group
from jabascli.engine.timing import PhaseTimer

ARGS = argparse.Namespace(variant="tiny", image_size=8, gbs=8, weight_sync="sequential")
"""The tiny ResNet (12 BatchNorm layers) on 8x8 images, GBS 8: a real engine iteration in milliseconds."""


def bn_net(layers: int) -> nn.Module:
    blocks = [m for _ in range(layers) for m in (nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU())]
    return nn.Sequential(*blocks)


def buffer_sync_ops(layers: int) -> int:
    """Operators of one iteration of BufferSync (2 replicas, 3 workers) on a model with ``layers`` BatchNorms."""
    replicas = [bn_net(layers), bn_net(layers)]
    sync = BufferSync(replicas, workers=3)
    x = torch.randn(5, 4)

    def iteration() -> None:
        sync.begin()
        for worker, replica in enumerate((0, 1, 0)):
            sync.before_micro_step(replica, worker)
            replicas[replica](x)
            sync.after_micro_step(replica, worker)
        sync.end_iteration()

    iteration()  # the first iteration sets up what the others reuse
    forward_ops = OpCounter()
    with forward_ops:
        for replica in (0, 1, 0):
            replicas[replica](x)
    with OpCounter() as ops:
        iteration()
    return ops.total - forward_ops.total


def test_buffer_sync_does_the_same_work_whatever_the_number_of_batchnorm_layers() -> None:
    # Multi-tensor operators over all layers at once: building per-layer tensors every iteration cost
    # several hundred kernel launches per iteration on a ResNet-50.
    assert buffer_sync_ops(2) == buffer_sync_ops(12)


def _count_rank(rank: int, out: str) -> None:
    torch.set_num_threads(1)
    device = torch.device("cpu")
    init_process_group(DistEnv(0, 1, 0, None, None), device)
    found: dict[str, dict[str, int]] = {}
    try:
        cases = {**CASES, "ga3": Case("LBS {lbs}, GA 3", 4, 1, 3)}
        for key in ("lbs", "ga", "vsw", "ga3"):
            case = cases[key]
            trainer = trainer_for(case, ARGS, device)
            batches = generated_batches(trainer.workload, case.lbs(ARGS.gbs), 2 * case.micro_batches, device)
            loops = {
                "plain": plain_loop(case, trainer.workload, device, batches),
                "jabas": jabas_loop(trainer, batches),
            }
            for name, loop in loops.items():
                for _ in range(2):  # warm up: lazily built state, the optimizer's buffers
                    loop.step(PhaseTimer())
                with OpCounter() as ops:
                    loop.step(PhaseTimer())
                found[f"{key}/{name}"] = {"total": ops.total, "host_reads": ops.host_reads}
            del loops, trainer
            gc.collect()
    finally:
        dist.destroy_process_group()
    Path(out).write_text(json.dumps(found))


@pytest.fixture(scope="module")
def counted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, int]]:
    out = tmp_path_factory.mktemp("host-work") / "counts.json"
    mp.spawn(_count_rank, args=(str(out),), nprocs=1)
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", ["lbs", "ga", "vsw", "ga3"])
def test_an_iteration_reads_no_tensor_value_back_to_the_host(counted: dict[str, dict[str, int]], case: str) -> None:
    # The plain loop reads none either: a read would be jabas's own, once per iteration or per micro-step.
    assert counted[f"{case}/plain"]["host_reads"] == 0
    assert counted[f"{case}/jabas"]["host_reads"] == 0


def test_a_micro_step_adds_a_few_operators_to_the_plain_loops(counted: dict[str, dict[str, int]]) -> None:
    # Per extra micro-step jabas runs what the plain loop runs plus its own bookkeeping: the worker's
    # BatchNorm terms (zero, add) and the loss kept for the log (detach, add), and DDP's no_sync.
    def extra(case: str) -> int:
        return counted[f"{case}/jabas"]["total"] - counted[f"{case}/plain"]["total"]

    per_micro_step = (extra("ga3") - extra("lbs")) / 3
    assert per_micro_step <= 6, per_micro_step
    assert extra("ga") - extra("lbs") <= 6


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
