"""Servers, allocation units and the allocations ``--servers auto`` chooses among.

An *allocation unit* is ``allocation_unit`` GPUs of one server that run the
same (VSW, GA). Units of servers that are alike (same profiles, GPU count and
links) are interchangeable, so an allocation is described by how many units of
each *server type* it uses; the units of a type are packed onto as few of its
servers as possible, in config order.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from jabascli.config.models import JabasConfig
from jabascli.errors import InputError, Problem
from jabascli.perfmodel import ServerSpec
from jabascli.profiles import ProfileSet


def allocation_key(time_s: float, gpus: int) -> tuple[float, int]:
    """What allocations are ranked by, everywhere (``--servers auto``, the auto-scaler, replanning):
    the predicted iteration time, then fewer GPUs. A server is left out exactly when the job is
    predicted no faster with it (docs/solver.md, "Servers")."""
    return (time_s, gpus)


@dataclass(frozen=True)
class UnitGroup:
    """``units`` allocation units of one server (``units * allocation_unit`` of its GPUs)."""

    server: ServerSpec
    units: int


@dataclass(frozen=True)
class ServerType:
    """Servers that are interchangeable for the model."""

    servers: tuple[ServerSpec, ...]
    units_per_server: int

    @property
    def units(self) -> int:
        return len(self.servers) * self.units_per_server

    def take(self, units: int) -> list[UnitGroup]:
        """``units`` units packed onto the fewest servers, in config order."""
        groups = []
        for server in self.servers:
            if units <= 0:
                break
            n = min(units, self.units_per_server)
            groups.append(UnitGroup(server, n))
            units -= n
        return groups


def server_specs(config: JabasConfig, profiles: ProfileSet, names: Sequence[str] | None = None) -> list[ServerSpec]:
    """The servers to plan for (``names``, else the available ones) with the profiles each one uses."""
    if names is None:
        chosen = config.available()
    else:
        known = {s.name: s for s in config.cluster.servers}
        missing = [n for n in names if n not in known]
        if missing:
            listed = ", ".join(known) or "none"
            raise InputError.at(None, "--servers", f"unknown server(s) {', '.join(missing)} (known: {listed})")
        if len(set(names)) != len(names):
            raise InputError.at(None, "--servers", f"a server is listed twice in {','.join(names)}")
        chosen = [known[n] for n in names]
    if not chosen:
        raise InputError.at(None, "cluster.servers", "no servers to plan for")
    mapping = profiles.resolve_servers((s.name, s.device_type) for s in chosen)
    return [
        ServerSpec(
            name=s.name,
            device_type=s.device_type,
            devices=s.devices,
            profile_server=mapping[s.name],
            intra_bandwidth=s.intra_bandwidth,
            inter_bandwidth=s.inter_bandwidth,
            price_per_hour=s.price_per_hour,
        )
        for s in chosen
    ]


def check_allocation_unit(servers: Sequence[ServerSpec], allocation_unit: int) -> None:
    problems = [
        Problem(None, f"server {s.name}", f"{s.devices} GPUs do not split into units of {allocation_unit} GPUs")
        for s in servers
        if s.devices % allocation_unit
    ]
    if allocation_unit < 1:
        problems.append(Problem(None, "scaling.allocation_unit", f"must be >= 1, got {allocation_unit}"))
    if problems:
        raise InputError(problems)


def whole_servers(servers: Sequence[ServerSpec], allocation_unit: int) -> tuple[UnitGroup, ...]:
    """Every unit of every server."""
    return tuple(UnitGroup(s, s.devices // allocation_unit) for s in servers)


def server_types(servers: Sequence[ServerSpec], allocation_unit: int) -> list[ServerType]:
    """Servers grouped by everything the model sees of them, in order of first appearance."""
    groups: dict[tuple[object, ...], list[ServerSpec]] = {}
    for s in servers:
        key = (s.profile_server, s.device_type, s.devices, s.intra_bandwidth, s.inter_bandwidth)
        groups.setdefault(key, []).append(s)
    return [ServerType(tuple(g), g[0].devices // allocation_unit) for g in groups.values()]


def count_allocations(types: Sequence[ServerType]) -> int:
    """How many non-empty allocations :func:`allocations` yields."""
    return math.prod(t.units + 1 for t in types) - 1


def allocations(types: Sequence[ServerType]) -> Iterator[tuple[UnitGroup, ...]]:
    """Every non-empty allocation, as unit counts per server type (not as subsets of servers)."""
    for counts in itertools.product(*(range(t.units + 1) for t in types)):
        if any(counts):
            yield tuple(g for t, k in zip(types, counts, strict=True) for g in t.take(k))
