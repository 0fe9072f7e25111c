"""The smoothed gradient noise scale ``B_noise = tr(Sigma) / |G|^2``.

Each measurement gives unbiased estimates of ``|G|^2`` and ``tr(Sigma)``
(:mod:`jabascli.adaptive.estimators`); their ratio is not unbiased, and one
measurement is noisy. So each is smoothed on its own with a bias-corrected
exponential moving average over measurements (as AdaptDL does per step)::

    m_k = beta m_{k-1} + (1 - beta) x_k        x_hat_k = m_k / (1 - beta^k)

and ``B_noise = tr_hat / max(G2_hat, tiny)``; ``|G|^2`` is clipped at ``tiny``
and ``tr(Sigma)`` at 0 (an estimate can come out negative). ``beta = 0.8``
per measurement: measurements are ``adjust_interval`` iterations apart, so
AdaptDL's per-step 0.999 would take thousands of iterations to forget the start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BETA = 0.8
TINY = 1e-12


@dataclass
class NoiseScale:
    beta: float = BETA
    sqr: float = 0.0
    """Moving average of ``|G|^2`` (not bias-corrected)."""
    var: float = 0.0
    """Moving average of ``tr(Sigma)`` (not bias-corrected)."""
    count: int = 0

    def update(self, grad_sq: float, trace: float) -> None:
        self.sqr = self.beta * self.sqr + (1 - self.beta) * grad_sq
        self.var = self.beta * self.var + (1 - self.beta) * trace
        self.count += 1

    def grad_sq(self) -> float | None:
        return None if self.count == 0 else max(self.sqr / (1 - self.beta**self.count), TINY)

    def trace(self) -> float | None:
        return None if self.count == 0 else max(self.var / (1 - self.beta**self.count), 0.0)

    def value(self) -> float | None:
        """The smoothed ``B_noise`` in samples, None before the first measurement."""
        grad_sq, trace = self.grad_sq(), self.trace()
        return None if grad_sq is None or trace is None else trace / grad_sq

    def state_dict(self) -> dict[str, Any]:
        return {"beta": self.beta, "sqr": self.sqr, "var": self.var, "count": self.count}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> NoiseScale:
        return cls(float(state["beta"]), float(state["sqr"]), float(state["var"]), int(state["count"]))
