"""The IIDP sampler: which samples every worker of every rank trains on.

Every rank draws the same seeded permutation of the dataset per epoch,
``perm = randperm(N, generator seeded with mix(seed, epoch))``. The epoch is
consumed in iterations of GBS samples; iteration ``i`` starting at position
``p`` (samples consumed so far in the epoch) hands worker ``w`` (numbered by
rank, then VSW, then GA step; see :meth:`TrainingPlan.worker_offset`) the
consecutive chunk::

    perm[p + w * LBS : p + (w + 1) * LBS]

In an uneven plan (ranks with their own LBS) a worker's chunk is its own
size, ``perm[p + o_w : p + o_w + LBS_r]`` with ``o_w`` the samples of the
workers before it; with one LBS, ``o_w = w * LBS`` as above.

So rank ``r`` gets a share proportional to its ``VSW_r * (GA_r + 1)``, every
sample is used exactly once per epoch when ``N`` is a multiple of GBS, and the
position within an epoch is one integer: a checkpoint resumed under any other
world size or per-rank configuration continues at ``perm[p:]``, neither
repeating nor skipping a sample.

Remainder rule: an epoch runs ``floor((N - p) / GBS)`` iterations; the last
``(N - p) mod GBS`` samples of the permutation are not used in that epoch (as
``drop_last``). The permutation changes every epoch, so over epochs every
sample is used equally often in expectation. Every rank computes the same
number, so all ranks agree on when the epoch ends without communicating.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from jabascli.engine.plan import TrainingPlan
from jabascli.errors import InputError

_MASK64 = (1 << 64) - 1


def mix64(*values: int) -> int:
    """A deterministic 63-bit seed from integers (SplitMix64 over each value in turn)."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h & (_MASK64 >> 1)


@dataclass(frozen=True)
class MicroBatch:
    """One worker's samples for one micro-step."""

    worker: int
    """Global worker index: ``worker_offset(rank) + vsw * (GA + 1) + ga_step``."""
    vsw: int
    ga_step: int
    position: int
    """Position in the epoch's permutation of the chunk's first sample."""
    indices: list[int]
    seed: int
    """Seeds the worker's random numbers (dropout, augmentation): a function of the samples, not of the plan."""


@dataclass(frozen=True)
class Iteration:
    """One iteration of one rank: its micro-batches, in worker order."""

    epoch: int
    position: int
    """Samples of the epoch consumed before this iteration."""
    micro_batches: list[MicroBatch]


class IIDPSampler:
    """Deals a shared, seeded permutation to the workers of a plan (see the module docstring)."""

    def __init__(self, dataset_size: int, seed: int) -> None:
        if dataset_size <= 0:
            raise InputError.at(None, "job.workload", "the workload's training dataset is empty")
        self.dataset_size = dataset_size
        self.seed = seed

    def permutation(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(mix64(self.seed, epoch))
        return torch.randperm(self.dataset_size, generator=generator).tolist()

    def worker_seed(self, epoch: int, position: int) -> int:
        """The random seed of the micro-batch that starts at ``position`` of ``epoch``."""
        return mix64(self.seed, epoch, position)

    def iterations_left(self, position: int, gbs: int) -> int:
        """Iterations an epoch still runs from ``position`` at this GBS."""
        return max(self.dataset_size - position, 0) // gbs

    def iterations_per_epoch(self, gbs: int) -> int:
        return self.dataset_size // gbs

    def check_gbs(self, plan: TrainingPlan) -> None:
        """InputError (naming where the GBS came from) when ``plan``'s GBS is more than the training samples."""
        if self.iterations_per_epoch(plan.gbs) == 0:
            field = "gbs" if plan.from_plan_file else "job.lbs"
            raise InputError.at(
                plan.file, field, f"GBS {plan.gbs} is more than the {self.dataset_size} training samples"
            )

    def rank_iterations(self, epoch: int, position: int, plan: TrainingPlan, rank: int) -> Iterator[Iteration]:
        """Rank ``rank``'s iterations of ``epoch``, starting at ``position``."""
        perm = self.permutation(epoch)
        lbs, gbs = plan.rank_lbs(rank), plan.gbs
        me = plan.rank(rank)
        offset, samples_before = plan.worker_offset(rank), plan.sample_offset(rank)
        for i in range(self.iterations_left(position, gbs)):
            start = position + i * gbs
            batches = []
            for v in range(me.vsw):
                for a in range(me.ga + 1):
                    step = v * (me.ga + 1) + a
                    worker = offset + step
                    at = start + samples_before + step * lbs
                    indices = perm[at : at + lbs]
                    batches.append(MicroBatch(worker, v, a, at, indices, self.worker_seed(epoch, at)))
            yield Iteration(epoch, start, batches)

    def replica_iterations(
        self, epoch: int, position: int, plan: TrainingPlan, ranks: Sequence[int]
    ) -> Iterator[Iteration]:
        """The iterations of a replica of several ranks (a ``[parallel]`` layout's TP group or pipeline): every
        one of its ranks' micro-batches, in rank order; every rank of the replica runs them all."""
        streams = [self.rank_iterations(epoch, position, plan, r) for r in ranks]
        for iterations in zip(*streams, strict=True):
            yield Iteration(epoch, iterations[0].position, [mb for it in iterations for mb in it.micro_batches])

    def global_iterations(self, epoch: int, position: int, plan: TrainingPlan) -> Iterator[Iteration]:
        """Every worker's micro-batch of every iteration, in worker order: what one process would feed."""
        perm = self.permutation(epoch)
        gbs, sizes = plan.gbs, plan.micro_batch_sizes()
        for i in range(self.iterations_left(position, gbs)):
            at = start = position + i * gbs
            batches = []
            for w, size in enumerate(sizes):
                batches.append(MicroBatch(w, 0, 0, at, perm[at : at + size], self.worker_seed(epoch, at)))
                at += size
            yield Iteration(epoch, start, batches)
