"""How a rank turns the reduced GBS gradient into an update: mixed precision and gradient clipping.

Every micro-step's forward (and loss) runs under ``torch.autocast`` in
``bf16``/``fp16``; its backward is of ``S * loss / W`` (``S`` the loss scale,
1 but in ``fp16``). Once every bucket is all-reduced, every rank holds the same
``S * g``, with ``g`` the mean gradient of the GBS samples, and then::

    fp16:  g <- (S * g) / S;  if any element of g is inf or NaN: skip the step, S <- S / 2
    clip:  g <- g * min(1, X / ||g||_2)        X = clip_grad_norm, the norm over all parameters
    optimizer step                             (fp16: S grows x2 after 2000 finite steps)

exactly as one process would (:mod:`jabascli.engine.reference` does the same
with ``torch.amp.GradScaler`` and ``clip_grad_norm_``).

**Same decision on every rank, without a collective.** The gradient the scaler
and the clip read is the all-reduced one, identical bit for bit on every rank
(a SUM all-reduce hands every rank the same result). An inf or NaN from any
rank's micro-batch is in that sum (``inf + x = inf``, ``NaN + x = NaN``), so
every rank finds it and skips the same step, and every rank computes the same
norm. Both need the whole gradient before any update, so ``fp16`` and
clipping force ``sequential`` weight sync (:meth:`StepPolicy.sequential_reason`);
per-bucket (``overlap``) updates would run before the last bucket is known to
be finite or the norm is known.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from jabascli.engine.precision_checks import DTYPE_NAMES

PRECISIONS: dict[str, torch.dtype | None] = {
    name: None if dtype is None else getattr(torch, dtype) for name, dtype in DTYPE_NAMES.items()
}
"""``[job] precision`` and the dtype autocast runs the forward in (None: the model's own)."""


@dataclass(frozen=True)
class StepSettings:
    """The job's precision and clipping, as resolved from the config and the workload."""

    precision: str = "fp32"
    clip_grad_norm: float | None = None

    def sequential_reason(self) -> str | None:
        """Why weight sync must be ``sequential`` (None when it need not)."""
        needs = []
        if self.precision == "fp16":
            needs.append("fp16 skips a step when any gradient is not finite")
        if self.clip_grad_norm is not None:
            needs.append(f"clip_grad_norm {self.clip_grad_norm:g} needs the norm of the whole gradient")
        if not needs:
            return None
        return "; ".join(needs) + ": every bucket is reduced before the update"


def step_settings(job: Any, workload: Any) -> StepSettings:
    """``[job] precision`` and the clip norm: ``[job] clip_grad_norm``, else the workload's ``clip_grad_norm``."""
    clip = job.clip_grad_norm if job.clip_grad_norm is not None else workload.clip_grad_norm()
    return StepSettings(job.precision, clip)


class Precision:
    """What a micro-step needs: where its forward runs (autocast) and what it back-propagates (loss scaling)."""

    def __init__(self, precision: str = "fp32", device: torch.device | None = None) -> None:
        self.device_type = device.type if device is not None else "cpu"
        self.dtype = PRECISIONS[precision]
        self.scaler = torch.amp.GradScaler(self.device_type, enabled=precision == "fp16")

    def autocast(self) -> AbstractContextManager[Any]:
        """Where a micro-step's forward and loss run."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``S * loss`` in fp16 (S a power of two, so scaling is exact), else ``loss``."""
        return self.scaler.scale(loss) if self.scaler.is_enabled() else loss


class StepPolicy:
    """Unscaling, the skip decision, clipping and the optimizer step of one rank (module docstring)."""

    def __init__(
        self,
        settings: StepSettings,
        optimizer: torch.optim.Optimizer,
        params: Iterable[torch.Tensor],
        device: torch.device,
        clip: Callable[[list[torch.Tensor], float], Any] | None = None,
    ) -> None:
        """``clip(params, max_norm)``: how to clip by the global norm (``clip_grad_norm_``; a ``[parallel]``
        layout gives its own, over every rank's part)."""
        self.settings = settings
        self.clip = clip or torch.nn.utils.clip_grad_norm_
        self.optimizer = optimizer
        self.params = [p for p in params if p.requires_grad]
        self.precision = Precision(settings.precision, device)
        self.scaler = self.precision.scaler
        self.applied = 0
        """Calls of :meth:`step` so far (engine/recovery.py: did a failed iteration change anything?)."""

    def step(self) -> None:
        """Unscale, skip on inf/NaN (fp16), clip, and step the optimizer, on the all-reduced gradient."""
        self.applied += 1
        clip = self.settings.clip_grad_norm
        if not self.scaler.is_enabled():
            if clip is not None:
                self.clip(self.params, clip)
            self.optimizer.step()
            return
        self.scaler.unscale_(self.optimizer)
        if clip is not None:
            self.clip(self.params, clip)  # NaN when not finite; the step is skipped then
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def loss_scale(self) -> float:
        """The factor ``S`` the reduced gradient carries until :meth:`step` unscales it (1 unless fp16)."""
        return float(self.scaler.get_scale()) if self.scaler.is_enabled() else 1.0

    def state_dict(self) -> dict[str, Any]:
        """The loss scaler's state (empty unless fp16), for checkpoints."""
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state and self.scaler.is_enabled():
            self.scaler.load_state_dict(state)
