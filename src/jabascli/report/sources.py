"""What a report shows, read from a run folder or a simulation's JSON.

A run folder (``[storage] run_dir/<job>``, see ``engine/metrics.py``) has
``steps.csv``, ``epochs.csv``, ``changes.csv`` (the exact steps where GBS or LR
changed) and, under automatic scaling, ``scaling.jsonl``
(one planner decision per line, :func:`jabascli.autoscale.decide.decide`).
Rows are read leniently: a run that is still going may end in a line being
written, and that line is skipped. A simulation file is what
``jabas simulate --json`` prints.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jabascli.errors import InputError
from jabascli.inputs import read_json, read_text


def _number(text: str | None) -> float:
    try:
        return float(text) if text not in (None, "") else math.nan
    except ValueError:
        return math.nan


def read_rows(path: Path) -> list[dict[str, float]]:
    """A metrics CSV as numbers (missing or unreadable cells are NaN; a row cut short is dropped)."""
    if not path.is_file():
        return []
    text = read_text(path, what="metrics file")
    reader = csv.DictReader(text.splitlines())
    fields = reader.fieldnames or []
    rows = []
    for row in reader:
        if None in row.values() or None in row:  # a line still being written
            continue
        rows.append({k: _number(row.get(k)) for k in fields})
    return rows


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    records = []
    for line in read_text(path, what="scaling log").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line still being written
        if isinstance(record, dict):
            records.append(record)
    return records


@dataclass
class RunData:
    folder: Path
    steps: list[dict[str, float]]
    epochs: list[dict[str, float]]
    scaling: list[dict[str, Any]] = field(default_factory=list)
    changes: list[dict[str, float]] = field(default_factory=list)
    """``changes.csv``: the GBS and LR from each step on (empty for runs written before it existed)."""
    failures: list[dict[str, Any]] = field(default_factory=list)
    """An elastic job's failures, as its ``ended.json`` recorded them (``moves[]`` with a ``failure``)."""


def read_failures(folder: Path) -> list[dict[str, Any]]:
    """The records of ``folder/ended.json``'s failures (recovered in place or restarted); none without one."""
    path = folder / "ended.json"
    if not path.is_file():
        return []
    data = read_json(path, what="ended job record")
    moves = data.get("status", {}).get("moves", []) if isinstance(data, dict) else []
    return [m for m in moves if isinstance(m, dict) and m.get("failure")]


@dataclass
class SimulationData:
    path: Path
    data: dict[str, Any]

    @property
    def policies(self) -> list[dict[str, Any]]:
        return list(self.data["policies"])

    @property
    def is_trace(self) -> bool:
        """A ``jabas simulate --trace`` file (per-policy timelines) rather than a trajectory simulation."""
        return "timeline" in self.data["policies"][0]


def read_source(path: Path) -> RunData | SimulationData:
    """A run folder with metrics, or a simulation JSON file; InputError for anything else."""
    if path.is_dir():
        run = RunData(
            path,
            read_rows(path / "steps.csv"),
            read_rows(path / "epochs.csv"),
            read_jsonl(path / "scaling.jsonl"),
            read_rows(path / "changes.csv"),
            read_failures(path),
        )
        if not run.steps and not run.epochs:
            raise InputError.at(path, None, "is not a run folder with metrics: no rows in steps.csv or epochs.csv")
        return run
    if not path.exists():
        raise InputError.at(path, None, "not found: expected a run folder or a `jabas simulate --json` file")
    data = read_json(path, what="simulation file")
    if not isinstance(data, dict) or not isinstance(data.get("policies"), list) or not data["policies"]:
        raise InputError.at(path, "policies", "expected the JSON that `jabas simulate --json` prints")
    for i, policy in enumerate(data["policies"]):
        if not isinstance(policy, dict) or "policy" not in policy:
            raise InputError.at(path, f"policies[{i}]", "expected an object with 'policy' and 'epochs' or 'timeline'")
        if isinstance(policy.get("timeline"), list):
            _check_timeline(path, i, policy)
        elif not isinstance(policy.get("epochs"), list):
            raise InputError.at(path, f"policies[{i}]", "expected an object with 'policy' and 'epochs' or 'timeline'")
    return SimulationData(path, data)


def _check_timeline(path: Path, i: int, policy: dict[str, Any]) -> None:
    """A trace simulation's policy: a finishing time and timeline entries with numbers where plotted."""
    if not isinstance(policy.get("time_s"), int | float):
        raise InputError.at(path, f"policies[{i}].time_s", "expected a number of seconds")
    for k, entry in enumerate(policy["timeline"]):
        if not isinstance(entry, dict) or not all(
            isinstance(entry.get(key), int | float) for key in ("start_s", "progress", "gbs")
        ):
            raise InputError.at(
                path, f"policies[{i}].timeline[{k}]", "expected numbers 'start_s', 'progress' and 'gbs'"
            )
