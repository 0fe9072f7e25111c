"""LR scaling rules, and how they compose with the workload's LR scheduler.

At GBS ``M``, with ``M0`` the job's initial GBS and ``s = M / M0``, every param
group's LR is the scheduler's LR times a factor:

* ``linear``: ``s`` (Goyal et al.);
* ``sqrt``: ``sqrt(s)`` (the seed's rule; Krizhevsky);
* ``adascale``: AdaScale's gain from the smoothed noise estimates, as AdaptDL:
  ``gain = (tr(Sigma)/M0 + |G|^2) / (tr(Sigma)/M + |G|^2) = (B_noise + M0) s / (B_noise + M)``,
  between 1 and ``s`` (1 before the first measurement);
* ``none``: 1.

Composition (:class:`ScaledLr`): the scheduler sets the base and the rule
scales it. Before every scheduler step the groups get back exactly the LRs the
scheduler last produced, it steps, its new LRs are kept as the base, and the
groups get ``base x factor``. So chainable schedulers (``StepLR``, which
multiplies the current LR) and closed-form ones (``LambdaLR``) both see only
their own values, and a factor change takes effect at once.
"""

from __future__ import annotations

import math
from typing import Any

import torch

RULES = ("linear", "sqrt", "adascale", "none")


def lr_factor(rule: str, gbs: int, initial_gbs: int, noise_scale: float | None = None) -> float:
    s = gbs / initial_gbs
    if rule == "linear":
        return s
    if rule == "sqrt":
        return math.sqrt(s)
    if rule == "none":
        return 1.0
    if rule == "adascale":
        if noise_scale is None:
            return 1.0
        return (noise_scale + initial_gbs) * s / (noise_scale + gbs)
    raise ValueError(f"unknown LR scaling rule {rule!r}")


class ScaledLr:
    """The workload's LR scheduler (or none) with a factor on every group's LR; steps like a scheduler."""

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: Any | None) -> None:
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.base = [float(g["lr"]) for g in optimizer.param_groups]
        self.factor = 1.0

    def step(self) -> None:
        self._set(self.base)
        if self.scheduler is not None:
            self.scheduler.step()
        self.base = [float(g["lr"]) for g in self.optimizer.param_groups]
        self._apply()

    def set_factor(self, factor: float) -> None:
        self.factor = factor
        self._apply()

    def _apply(self) -> None:
        if self.factor == 1.0:
            self._set(self.base)
        else:
            self._set([lr * self.factor for lr in self.base])

    def _set(self, lrs: list[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr

    # A checkpoint stores the scheduler's own state; the factor and base live in the adaptive state.
    def state_dict(self) -> dict[str, Any] | None:
        return None if self.scheduler is None else self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state)

    def lr_state(self) -> dict[str, Any]:
        return {"base": list(self.base), "factor": self.factor}

    def load_lr_state(self, state: dict[str, Any]) -> None:
        self.base = [float(x) for x in state["base"]]
        self.set_factor(float(state["factor"]))
