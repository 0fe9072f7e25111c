"""A simulated cluster: nodes per traced GPU type, and what a GPU-hour costs.

``parse_cluster("aws:6,dgx-ext:2,rtx:3")`` -> ``{"aws": 6, "dgx-ext": 2, "rtx": 3}``
(Sia's default cluster). GPUs per node come from the trace's NOTICE
(:data:`~jabascli.simulate.trace.GPUS_PER_NODE`).

Prices are US dollars per GPU-hour (docs/simulation.md explains each):
on-demand list prices of the cloud machine per GPU where the traced machine is a
cloud instance (aws: g4dn.12xlarge / 4; azure: ND40rs_v2 / 8; dgx, dgx-ext:
AWS p4d.24xlarge / 8, the cloud DGX-A100 equivalent), and for the on-premise
machines the seed's rule, 3.06 $/GPU-hour scaled by FP32 TFLOPS / 14.13
(rtx: RTX 2080 Ti, 13.45 TFLOPS; quad: Quadro RTX 6000, 16.3 TFLOPS).
"""

from __future__ import annotations

from collections.abc import Mapping

from jabascli.errors import InputError
from jabascli.simulate.trace import GPUS_PER_NODE

PRICE_PER_GPU_HOUR: dict[str, float] = {
    "aws": 3.912 / 4,
    "azure": 22.032 / 8,
    "dgx": 32.7726 / 8,
    "dgx-ext": 32.7726 / 8,
    "rtx": 3.06 * 13.45 / 14.13,
    "quad": 3.06 * 16.3 / 14.13,
}

SIA_DEFAULT_CLUSTER = "aws:6,dgx-ext:2,rtx:3"


def parse_cluster(spec: str) -> dict[str, int]:
    """``TYPE:NODES,...`` -> nodes per GPU type, in the order written."""
    nodes: dict[str, int] = {}
    for part in (p.strip() for p in spec.split(",")):
        name, sep, count = part.partition(":")
        name = name.strip()
        if not sep or not name:
            raise InputError.at(None, "cluster", f"{part!r} is not TYPE:NODES (for example aws:2)")
        if name not in GPUS_PER_NODE:
            raise InputError.at(
                None, "cluster", f"unknown GPU type {name!r}; expected one of {', '.join(GPUS_PER_NODE)}"
            )
        if name in nodes:
            raise InputError.at(None, "cluster", f"GPU type {name!r} is given twice")
        try:
            value = int(count)
        except ValueError:
            value = 0
        if value < 1:
            raise InputError.at(None, "cluster", f"{part!r}: NODES must be a whole number >= 1")
        nodes[name] = value
    return nodes


def parse_prices(spec: str) -> dict[str, float]:
    """``TYPE=PRICE,...`` ($/GPU-hour) -> overrides for :func:`prices_for`."""
    prices: dict[str, float] = {}
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        name, sep, value = part.partition("=")
        try:
            price = float(value)
        except ValueError:
            price = float("nan")
        if not sep or not name.strip() or not price >= 0:
            raise InputError.at(None, "prices", f"{part!r} is not TYPE=PRICE with a price >= 0 (for example rtx=1.2)")
        prices[name.strip()] = price
    return prices


def prices_for(types: list[str], override: Mapping[str, float] | None = None) -> dict[str, float]:
    """$/GPU-hour of each type: the table above, with ``override`` taking precedence."""
    override = dict(override or {})
    for name, price in override.items():
        if name not in GPUS_PER_NODE:
            raise InputError.at(
                None, "prices", f"unknown GPU type {name!r}; expected one of {', '.join(GPUS_PER_NODE)}"
            )
        if not price >= 0:
            raise InputError.at(None, "prices", f"{name}: price must be >= 0, got {price}")
    return {t: float(override.get(t, PRICE_PER_GPU_HOUR[t])) for t in types}
