"""Checks of ``[parallel]`` against the cluster: what can be said before any workload is loaded.

A replica is a ``tp x pp`` sub-mesh of devices. Its TP groups sit inside one
server (tensor parallelism all-reduces activations every block, too often for
the links between servers), so ``tp`` divides every available server's device
count; and the job's devices split into whole replicas, so ``tp x pp`` divides
their total. Stage and layer ranges must not overlap or leave gaps; whether
they cover every block is checked once the workload says how many blocks it
has (:mod:`jabascli.engine.parallel.layout`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from jabascli.config.models import JabasConfig
from jabascli.errors import Problem


def check_parallel(config: JabasConfig, file: Path) -> list[Problem]:
    """Every problem of ``[parallel]`` that needs no workload, each naming its field."""
    parallel = config.parallel
    if parallel is None:
        return []
    problems: list[Problem] = []
    servers = config.available()
    for server in servers:
        if parallel.tp > server.devices:
            problems.append(
                Problem(
                    file,
                    "parallel.tp",
                    f"a TP group of {parallel.tp} would span servers: server {server.name!r} has "
                    f"{server.devices} devices (a TP group stays inside one server)",
                )
            )
        elif server.devices % parallel.tp:
            problems.append(
                Problem(
                    file,
                    "parallel.tp",
                    f"{parallel.tp} does not divide server {server.name!r}'s {server.devices} devices",
                )
            )
        if problems:
            break  # one line for the field: the first server it does not fit
    total = sum(s.devices for s in servers)
    replica = parallel.tp * parallel.pp
    if servers and not problems and total % replica:  # a bad tp is said once, above
        problems.append(
            Problem(
                file,
                "parallel.pp",
                f"tp x pp = {replica} does not divide the job's {total} devices into whole replicas",
            )
        )
    if parallel.stages is not None:
        if len(parallel.stages) != parallel.pp:
            problems.append(
                Problem(file, "parallel.stages", f"{len(parallel.stages)} stage ranges for pp = {parallel.pp}")
            )
        problems += range_problems(parallel.stages, file, "parallel.stages", contiguous=True)
    if parallel.layers is not None:
        ranges = [layer.blocks for layer in parallel.layers]
        problems += range_problems(ranges, file, "parallel.layers", contiguous=False, suffix=".blocks")
    return problems


def range_problems(
    ranges: Sequence[tuple[int, int]], file: Path, field: str, *, contiguous: bool, suffix: str = ""
) -> list[Problem]:
    """Inclusive ``[first, last]`` ranges in order: none reversed, none overlapping; ``contiguous``: no gaps,
    from block 0."""
    problems: list[Problem] = []
    expected = 0
    for i, (first, last) in enumerate(ranges):
        where = f"{field}[{i}]{suffix}"
        if first > last:
            problems.append(Problem(file, where, f"[{first}, {last}]: the first block is after the last"))
            continue
        if first < expected:
            problems.append(
                Problem(file, where, f"[{first}, {last}] overlaps the range before it (which ends at {expected - 1})")
            )
        elif contiguous and first > expected:
            problems.append(
                Problem(file, where, f"[{first}, {last}] leaves blocks {expected}-{first - 1} out of every stage")
            )
        expected = max(expected, last + 1)
    return problems
