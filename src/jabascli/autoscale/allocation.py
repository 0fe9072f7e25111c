"""The allocations a job can move between, and what each costs per hour.

An *allocation unit* is ``[scaling] allocation_unit`` GPUs of one server.
Servers that are alike for the performance model *and* cost the same per GPU
form a *server type*; their units are interchangeable, so an allocation is a
:data:`Choice`, the number of units taken of each type (packed onto as few of
the type's servers as possible, in config order). A cluster of ``U`` units in
``T`` types has ``prod(U_t + 1) - 1`` allocations, far fewer than the ``2^U``
subsets of units; :mod:`jabascli.autoscale.planner` still does not enumerate
them on large clusters.

Prices: a server's ``price_per_hour`` is for the whole server, so one of its
GPUs costs ``price_per_hour / devices`` per hour. When no server of the config
has a price, every GPU costs the seed's rule, ``3.06 $ x TFLOPS / 14.13`` per
hour (a V100's on-demand price scaled by compute), and :attr:`AllocationSpace.seed_prices`
says so.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

from jabascli.config.models import ServerConfig
from jabascli.errors import InputError
from jabascli.perfmodel import ServerSpec
from jabascli.solver.cluster import check_allocation_unit

Choice = tuple[int, ...]
"""Units taken of each server type, in the order of :attr:`AllocationSpace.types`."""

SEED_PRICE_PER_GPU_HOUR = 3.06
SEED_REFERENCE_TFLOPS = 14.13


def seed_gpu_hour_price(tflops: float) -> float:
    """The seed's price of one GPU-hour: 3.06 $ for 14.13 TFLOPS (a V100), proportional to TFLOPS."""
    return SEED_PRICE_PER_GPU_HOUR * tflops / SEED_REFERENCE_TFLOPS


@dataclass(frozen=True)
class ServerType:
    """Servers whose units are interchangeable: same profiles, GPU count, links and price per GPU."""

    servers: tuple[ServerSpec, ...]
    units_per_server: int
    gpu_hour_price: float

    @property
    def units(self) -> int:
        return len(self.servers) * self.units_per_server

    @property
    def device_type(self) -> str:
        return self.servers[0].device_type


class AllocationSpace:
    """Every allocation of ``servers`` in units of ``allocation_unit`` GPUs."""

    def __init__(
        self, servers: Sequence[ServerSpec], allocation_unit: int, gpu_hour_prices: Mapping[str, float]
    ) -> None:
        check_allocation_unit(servers, allocation_unit)
        self.unit = allocation_unit
        self.servers = list(servers)
        groups: dict[tuple[object, ...], list[ServerSpec]] = {}
        for s in servers:
            price = gpu_hour_prices[s.name]
            key = (s.profile_server, s.device_type, s.devices, s.intra_bandwidth, s.inter_bandwidth, price)
            groups.setdefault(key, []).append(s)
        self.types = [
            ServerType(tuple(g), g[0].devices // allocation_unit, gpu_hour_prices[g[0].name]) for g in groups.values()
        ]
        self.seed_prices = False

    @classmethod
    def from_config(
        cls, servers: Sequence[ServerSpec], configs: Sequence[ServerConfig], allocation_unit: int
    ) -> AllocationSpace:
        """Prices from ``price_per_hour``, or the seed's rule when no server has one (see the module doc)."""
        by_name = {c.name: c for c in configs}
        seed = not any(by_name[s.name].price_per_hour > 0 for s in servers)
        prices = {
            s.name: seed_gpu_hour_price(by_name[s.name].tflops)
            if seed
            else by_name[s.name].price_per_hour / by_name[s.name].devices
            for s in servers
        }
        space = cls(servers, allocation_unit, prices)
        space.seed_prices = seed
        return space

    # Counting and enumerating ---------------------------------------------------

    def count(self) -> int:
        return math.prod(t.units + 1 for t in self.types) - 1

    def __iter__(self) -> Iterator[Choice]:
        for counts in itertools.product(*(range(t.units + 1) for t in self.types)):
            if any(counts):
                yield counts

    def everything(self) -> Choice:
        return tuple(t.units for t in self.types)

    def check(self, choice: Choice) -> Choice:
        if len(choice) != len(self.types) or not any(choice):
            raise InputError.at(None, "allocation", f"expected {len(self.types)} unit counts, not all 0: {choice}")
        for k, t in zip(choice, self.types, strict=True):
            if not 0 <= k <= t.units:
                raise InputError.at(None, "allocation", f"{k} units of {t.device_type}: it has {t.units}")
        return tuple(choice)

    # One allocation ---------------------------------------------------------------

    def gpus(self, choice: Choice) -> int:
        return sum(choice) * self.unit

    def price_per_hour(self, choice: Choice) -> float:
        return sum(k * self.unit * t.gpu_hour_price for k, t in zip(choice, self.types, strict=True))

    def used(self, choice: Choice) -> dict[str, int]:
        """GPUs used per server name (servers not used are left out)."""
        out: dict[str, int] = {}
        for k, t in zip(choice, self.types, strict=True):
            for server in t.servers:
                if k <= 0:
                    break
                n = min(k, t.units_per_server)
                out[server.name] = n * self.unit
                k -= n
        return out

    def specs(self, choice: Choice) -> list[ServerSpec]:
        """The used servers, each with only its used GPUs (what a solver plans on)."""
        by_name = {s.name: s for s in self.servers}
        return [replace(by_name[name], devices=gpus) for name, gpus in self.used(choice).items()]

    def choice_of(self, used: Mapping[str, int]) -> Choice:
        """The choice that uses ``used`` GPUs per server name (as :meth:`used` would pack them)."""
        known = {s.name for s in self.servers}
        unknown = sorted(set(used) - known)
        if unknown:
            raise InputError.at(None, "allocation", f"unknown server(s) {', '.join(unknown)}")
        counts = []
        for t in self.types:
            gpus = sum(used.get(s.name, 0) for s in t.servers)
            if gpus % self.unit:
                raise InputError.at(None, "allocation", f"{gpus} GPUs of {t.device_type} are not whole units")
            counts.append(gpus // self.unit)
        return self.check(tuple(counts))

    def describe(self, choice: Choice) -> str:
        """``node0:4,node1:2`` (GPUs per server)."""
        return ",".join(f"{name}:{gpus}" for name, gpus in self.used(choice).items())
