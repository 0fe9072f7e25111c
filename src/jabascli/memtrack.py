"""Peak tensor memory of CPU work, measured as CUDA's caching allocator would count it.

On a GPU the memory profiler asks ``torch.cuda.max_memory_allocated``: the
peak of bytes held by tensors. The CPU has no such counter, and the process's
resident size is a poor stand-in (the allocator keeps freed pages, libraries
and the interpreter add hundreds of MB of baseline, and it moves with the
machine's other load). So on the CPU and on emulated devices this tracker
counts the same thing directly: every tensor storage created while it is
active is counted from the operation that creates it until the storage is
freed (a weak reference to the storage fires then), and the peak of the live
total is kept. Views share their base's storage and count once.

Only new storage is counted: an operator's output that aliases an input (a
view, an in-place or ``out=`` operation, by its schema, or a collective that
hands back its input tensors) adds nothing, so working on tensors created
before the tracker (a trainer's parameters, a dataset's samples) is free.

What it does not see: memory an operator uses internally and frees before it
returns (convolution workspaces, for instance), and tensors created before it
was entered. Memory trials therefore build the model, the optimizer and the
batches inside it; the engine counts what exists before as a ``baseline``
(:mod:`jabascli.engine.memory_limit`).

With a ``budget``, the first allocation that takes the live total over it
raises :class:`BudgetExceeded`, as a real device's out-of-memory error
would, so that a trial far over budget never uses that much of the node's RAM.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class BudgetExceeded(RuntimeError):
    """The tensors of an emulated device took more than its memory budget."""

    def __init__(self, live: int, budget: int) -> None:
        self.live = live
        self.budget = budget
        super().__init__(f"out of memory: {live:,} bytes of tensors exceed the budget of {budget:,} bytes")


class TensorMemoryTracker(TorchDispatchMode):
    """Live and peak bytes of CPU tensor storage created under it (plus ``baseline`` bytes held already)."""

    def __init__(self, budget: int | None = None, baseline: int = 0) -> None:
        super().__init__()
        self.budget = budget
        self.live = baseline
        self.peak = baseline
        self.exceeded: BudgetExceeded | None = None
        self._sizes: dict[int, int] = {}
        self._aliasing: dict[Any, bool] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self._returns_alias(func):
            return out
        outputs = [v for v in tree_flatten(out)[0] if isinstance(v, torch.Tensor)]
        if outputs:
            inputs = {_storage_ptr(v) for v in tree_flatten((args, kwargs))[0] if isinstance(v, torch.Tensor)}
            for value in outputs:
                if _storage_ptr(value) not in inputs:
                    self._track(value)
        return out

    def _returns_alias(self, func: Any) -> bool:
        aliasing = self._aliasing.get(func)
        if aliasing is None:
            schema = getattr(func, "_schema", None)
            returns = schema.returns if schema is not None else []
            aliasing = self._aliasing[func] = any(r.alias_info is not None for r in returns)
        return aliasing

    def _track(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cpu" or tensor.is_sparse:
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without a plain storage
            return
        key = id(storage)
        if key in self._sizes:
            return
        size = storage.nbytes()
        self._sizes[key] = size
        weakref.finalize(storage, self._free, key)
        self.live += size
        if self.live > self.peak:
            self.peak = self.live
        if self.budget is not None and self.live > self.budget and self.exceeded is None:
            self.exceeded = BudgetExceeded(self.live, self.budget)
            raise self.exceeded

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)


def _storage_ptr(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return -1
