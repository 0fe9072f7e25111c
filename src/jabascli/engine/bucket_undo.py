"""Taking back the bucket updates of an iteration that a lost peer interrupted (``overlap`` weight sync).

With ``overlap`` a bucket's parameters are updated as soon as its own all-reduce
returns (:class:`~jabascli.engine.weight_sync.BucketOptimizer`), while later buckets
are still being reduced. A peer lost between two buckets leaves the survivors with
the first buckets updated from the full GBS and the others not: no step at all
would be redone exactly from there. So, where a job recovers in place, each bucket
update first copies what it will overwrite (the bucket's parameters and their
optimizer state) into buffers kept for the purpose, and a survivor puts those back
(:meth:`UndoLog.take_back`): its state is again that of the last completed
iteration, and the failed iteration is redone like any other.

Cost: one more copy of the parameters and optimizer state in memory, and a copy of
each bucket before its update (about as many bytes as the update itself writes).
``[scheduler] recover_in_place = false`` turns it off with recovery in place.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch


class UndoLog:
    """What this iteration's bucket updates overwrote, until :meth:`begin` starts the next iteration."""

    def __init__(self) -> None:
        self._params: dict[torch.Tensor, torch.Tensor] = {}
        """Per parameter, the buffer its value is copied to before an update (allocated once)."""
        self._state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        """Per parameter, the buffers its optimizer state tensors are copied to."""
        self._saved: list[list[tuple[torch.Tensor, dict[str, Any] | None]]] = []
        """This iteration's bucket updates, in order: each parameter with the optimizer state it had (None: none
        yet)."""
        self._lock = threading.Lock()
        self.closed = False
        """Taken back: no further update may be applied (a bucket's all-reduce finishing late is ignored)."""

    def begin(self) -> None:
        """A new iteration: the last one's updates are kept."""
        with self._lock:
            self._saved.clear()

    def save(self, params: Sequence[torch.Tensor], state: dict[torch.Tensor, dict[str, Any]]) -> bool:
        """Before ``params`` are updated: copy them and their optimizer ``state``. False once taken back (the
        update must not be applied)."""
        with self._lock:
            if self.closed:
                return False
            update = []
            with torch.no_grad():
                for p in params:
                    buffer = self._params.get(p)
                    if buffer is None:
                        buffer = self._params[p] = torch.empty_like(p)
                    buffer.copy_(p)
                    update.append((p, self._copy_state(p, state.get(p))))
            self._saved.append(update)
            return True

    def take_back(self, state: dict[torch.Tensor, dict[str, Any]]) -> int:
        """Put back every parameter and optimizer state this iteration's updates overwrote, newest first, and
        refuse any later update. Returns how many bucket updates were taken back."""
        with self._lock:
            self.closed = True
            with torch.no_grad():
                for update in reversed(self._saved):
                    for p, saved in update:
                        p.copy_(self._params[p])
                        if saved is None:
                            state.pop(p, None)  # the update created it
                        else:
                            state[p] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in saved.items()}
            count, self._saved = len(self._saved), []
            return count

    def _copy_state(self, p: torch.Tensor, state: dict[str, Any] | None) -> dict[str, Any] | None:
        if not state:
            return None
        buffers = self._state.setdefault(p, {})
        copied: dict[str, Any] = {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                buffer = buffers.get(key)
                if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                    buffer = buffers[key] = torch.empty_like(value)
                buffer.copy_(value)
                copied[key] = buffer
            else:
                copied[key] = value
        return copied
