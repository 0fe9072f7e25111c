"""The first-half gradient of a measurement iteration, on any mix of ranks, VSW and GA.

Workers ``0 .. W_A - 1`` (:func:`~jabascli.adaptive.estimators.half_split`) form
the first half. A rank's workers are consecutive; each of its replicas runs its
micro-batches in worker order, so on every replica the first-half workers are
a prefix of its micro-steps. The rank's share of ``F = sum_{w in A} g_w / W`` is
the sum, over its replicas, of the replica's gradient right after that prefix:

* a prefix that ends before the replica's last micro-step: the replica's
  ``.grad`` just after that micro-step (:meth:`FirstHalf.after_backward`);
* a whole replica other than replica 0: its ``.grad`` after the iteration's
  backward (the communication hook only reads it);
* all of replica 0: its gradients just before the communication hook adds the
  other replicas' and all-reduces (:meth:`FirstHalf.tap`, per bucket).

One gradient-sized buffer, one extra all-reduce (SUM) of it, then three inner
products with the all-reduced gradient ``T``: ``|F|^2``, ``F.T``, ``|T|^2``
(:class:`~jabascli.adaptive.estimators.HalfGradients`). Off measurement
iterations the two callbacks return at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from jabascli.adaptive.estimators import HalfGradients, half_split
from jabascli.engine.sampler import Iteration, MicroBatch


class FirstHalf:
    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.params = [p for p in params if p.requires_grad]
        self._index = {p: i for i, p in enumerate(self.params)}
        self._flat: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        self.active = False
        self._replicas: list[list[nn.Parameter]] = []
        self._prefix: list[int] = []
        self._length: list[int] = []
        self._done: list[int] = []
        self._tap_replica0 = False

    def begin(self, iteration: Iteration, workers: int, replicas: Sequence[Sequence[nn.Parameter]]) -> None:
        """Arm for this iteration: ``replicas[v]`` are replica ``v``'s parameters, in ``self.params`` order."""
        split = half_split(workers)
        self.active = split > 0
        if not self.active:
            return
        if self._flat is None:
            numel = sum(p.numel() for p in self.params)
            self._flat = torch.zeros(numel, dtype=self.params[0].dtype, device=self.params[0].device)
            offset, self._views = 0, []
            for p in self.params:
                self._views.append(self._flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        self._flat.zero_()
        self._replicas = [[p for p in r if p.requires_grad] for r in replicas]
        count = len(self._replicas)
        per_replica = [[mb for mb in iteration.micro_batches if _replica(mb, count) == v] for v in range(count)]
        self._length = [len(mbs) for mbs in per_replica]
        self._prefix = [sum(mb.worker < split for mb in mbs) for mbs in per_replica]
        self._done = [0] * count
        self._tap_replica0 = self._length[0] > 0 and self._prefix[0] == self._length[0]

    def after_backward(self, replica: int, mb: MicroBatch) -> None:
        """After each micro-step's backward (the engine's worker step calls this)."""
        if not self.active:
            return
        self._done[replica] += 1
        if self._done[replica] == self._prefix[replica] < self._length[replica]:
            self._add(self._replicas[replica])

    def tap(self, params: Sequence[torch.Tensor]) -> None:
        """Replica 0's gradients of one bucket before aggregation and all-reduce (the comm hook calls this)."""
        if not (self.active and self._tap_replica0):
            return
        pairs = [(self._views[self._index[p]], p.grad) for p in params if p in self._index and p.grad is not None]
        if pairs:
            torch._foreach_add_([v for v, _ in pairs], [g for _, g in pairs])

    def finish(self, workers: int, lbs: int) -> HalfGradients | None:
        """After the iteration's backward: the all-reduced half sums and inner products (None if not armed)."""
        if not self.active:
            return None
        self.active = False
        for v in range(1, len(self._replicas)):
            if self._length[v] > 0 and self._prefix[v] == self._length[v]:
                self._add(self._replicas[v])
        assert self._flat is not None
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(self._flat)
        f = self._flat.to(torch.float64)
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.params]
        t = torch.cat([g.reshape(-1) for g in grads]).to(torch.float64)
        ff, ft, tt = (float(x) for x in torch.stack([f.dot(f), f.dot(t), t.dot(t)]).tolist())
        return HalfGradients(ff, ft, tt, workers, lbs)

    def _add(self, params: Sequence[nn.Parameter]) -> None:
        pairs = [(v, p.grad) for v, p in zip(self._views, params, strict=True) if p.grad is not None]
        if pairs:
            torch._foreach_add_([v for v, _ in pairs], [g for _, g in pairs])


def _replica(mb: MicroBatch, replicas: int) -> int:
    """The replica a micro-batch runs on: its VSW with one replica per VSW, else replica 0."""
    return mb.vsw if replicas > 1 else 0
