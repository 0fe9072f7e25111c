"""The planner's entry point for the scheduler: one epoch-end decision, as a ``scaling.jsonl`` record.

At an epoch end the scheduler hands over the job's GBS history (one value per
adjustment point so far), the servers it runs on, and the planner's parts
(:class:`~jabascli.autoscale.setup.ScalingSetup`); :func:`decide` forecasts the
next epoch, plans it and returns a record: the forecast, the candidates'
predicted time and cost, the choice and the reason. :func:`append_decision`
adds the record to the run folder's ``scaling.jsonl``, which ``jabas report``
plots. The wiring into the elastic scheduler is not built yet (it needs the
adaptive batching and elastic runtime work).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jabascli.autoscale.forecast import forecast, horizon_for
from jabascli.autoscale.planner import Planner
from jabascli.autoscale.setup import ScalingSetup
from jabascli.autoscale.trajectory import epoch_segments
from jabascli.errors import InputError

SCALING_LOG = "scaling.jsonl"


def decide(
    history: Sequence[float],
    current: Mapping[str, int] | None,
    setup: ScalingSetup,
    *,
    dataset_size: int,
    adjust_interval: int,
    gbs_min: int,
    gbs_max: int,
    gbs_step: int = 1,
    forecast_model: str = "holt",
    epoch: int | None = None,
) -> dict[str, Any]:
    """Plan the next epoch from the GBS ``history``; ``current``: GPUs per server now (None: not started)."""
    if not history:
        raise InputError.at(None, "GBS history", "is empty: the job has not run an adjustment point yet")
    horizon = horizon_for(dataset_size, adjust_interval, gbs_min)
    values = forecast(history, horizon, lo=gbs_min, hi=gbs_max, step=gbs_step, model=forecast_model)
    segments = epoch_segments(values, dataset_size, adjust_interval)
    planner = Planner(setup.space, setup.cost_model, setup.objective)
    now = setup.space.choice_of(current) if current is not None else None
    decision = planner.plan(segments, now)
    record: dict[str, Any] = {"time": round(time.time(), 3)}
    if epoch is not None:
        record["epoch"] = epoch
    record["forecast"] = [s.gbs for s in segments]
    record["forecast_iterations"] = [s.iterations for s in segments]
    record["forecast_model"] = forecast_model if isinstance(forecast_model, str) else "custom"
    record["objective"] = setup.objective.kind
    record.update(decision.to_dict(setup.space))
    return record


def append_decision(run_folder: Path, record: Mapping[str, Any]) -> Path:
    """Add one line to ``run_folder/scaling.jsonl``, written whole in one call and flushed to disk."""
    run_folder.mkdir(parents=True, exist_ok=True)
    path = run_folder / SCALING_LOG
    line = json.dumps(record, separators=(",", ":"), default=float) + "\n"
    with path.open("a", encoding="utf-8") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())
    return path
