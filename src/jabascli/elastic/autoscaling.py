"""The auto-scaling planner as the elastic scheduler's epoch-end hook (``[scaling] enabled``).

At every epoch end the scheduler calls :class:`AutoScaler` with the job's
status. Its GBS history is the GBS after every adjustment point so far
(``epoch_history[].gbs_history``, from the trainers' ``adjustment`` events; a
fixed-GBS epoch counts once, with its GBS). :func:`jabascli.autoscale.decide.decide`
forecasts the next epoch and plans it over every ``[[cluster.servers]]`` entry
(each has an agent; ``available_servers`` is only where the job starts); the
record is appended to the run folder's ``scaling.jsonl`` and kept as
:attr:`AutoScaler.last` for the status.

Granularity: the planner counts allocation units of ``[scaling] allocation_unit``
GPUs, but the elastic runtime moves whole servers. A decision runs on every
server it takes at least one unit of (``servers`` in the record), so its
predictions are exact only when ``allocation_unit`` is each server's GPU count
(then a unit *is* a server); the current allocation is passed to the planner as
all the GPUs of its servers.

The move happens ``now`` (at the next iteration boundary, early in the epoch
that just began): the decision is about that epoch, and an ``epoch`` move would
land only at its end.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from jabascli.autoscale.decide import append_decision, decide
from jabascli.autoscale.setup import ScalingSetup, scaling_from_config
from jabascli.autoscale.simulate import GBS_CEILING, dataset_size_of
from jabascli.config import LoadedConfig
from jabascli.elastic.protocol import JobStatus, When
from jabascli.engine.layout import run_folder
from jabascli.errors import InputError, JabasError, RuntimeFailure


def gbs_history(status: JobStatus) -> list[float]:
    """The GBS at every adjustment point so far; an epoch without adjustments counts once, with its GBS."""
    values: list[float] = []
    for e in status.epoch_history:
        if e.gbs_history:
            values.extend(e.gbs_history)
        elif e.gbs is not None:
            values.append(e.gbs)
    return values


def scaling_setup(loaded: LoadedConfig) -> ScalingSetup:
    """The planner's parts over every configured server; an InputError (no profiles, ...) before anything starts."""
    everywhere = loaded.config.model_copy(deep=True)
    everywhere.cluster.available_servers = [s.name for s in loaded.config.cluster.servers]
    return scaling_from_config(dataclasses.replace(loaded, config=everywhere))


class AutoScaler:
    """``Scheduler(loaded, planner=AutoScaler(loaded))``: forecast, plan, log, and move when the planner says so."""

    def __init__(
        self, loaded: LoadedConfig, *, dataset_size: int | None = None, setup: ScalingSetup | None = None
    ) -> None:
        self.loaded = loaded
        config = loaded.config
        self.setup = setup or scaling_setup(loaded)
        batching = config.batching
        self.lo, self.hi = batching.gbs_min or 1, batching.gbs_max or GBS_CEILING
        model = self.setup.cost_model.model
        lbs_values = [b for s in self.setup.space.servers for b in model.lbs_values(s.profile_server)]
        if not lbs_values:
            raise InputError.at(None, "profiles", "no LBS has both a memory and a computation profile")
        self.step = min(lbs_values) * self.setup.space.unit
        if batching.gbs_max is not None:
            self.setup.cost_model.warm_gbs = batching.gbs_max
        # The training set's size needs the workload's dataset (torch, maybe files): seconds that the
        # scheduler must not spend before it listens, so it is read on the side until the first decision.
        self._dataset_size: Future[int] = Future()
        if dataset_size is not None:
            self._dataset_size.set_result(dataset_size)
        else:
            threading.Thread(target=self._read_dataset_size, daemon=True).start()
        self.folder: Path = run_folder(loaded)
        self.last: dict[str, Any] | None = None
        """The latest decision's record (as written to ``scaling.jsonl``)."""

    def _read_dataset_size(self) -> None:
        try:
            self._dataset_size.set_result(dataset_size_of(self.loaded))
        except JabasError as exc:  # handed to the first decision: the scheduler reports it, the job stays
            self._dataset_size.set_exception(exc)
        except Exception as exc:  # a workload's own failure, as one line rather than a heartbeat's HTTP 500
            why = f"cannot read the training set's size: {type(exc).__name__}: {exc}"
            self._dataset_size.set_exception(RuntimeFailure.at(None, "job.workload", why))

    @property
    def dataset_size(self) -> int:
        return self._dataset_size.result()

    def __call__(self, status: JobStatus) -> tuple[list[str], When] | None:
        """The servers to move to at once, or None to stay; raises InputError when it cannot plan."""
        history = gbs_history(status)
        if not history:
            return None
        devices = {s.name: s.devices for s in self.loaded.config.cluster.servers}
        record = decide(
            history,
            {name: devices[name] for name in status.allocation},
            self.setup,
            dataset_size=self.dataset_size,
            adjust_interval=self.loaded.config.batching.adjust_interval,
            gbs_min=self.lo,
            gbs_max=self.hi,
            gbs_step=self.step,
            forecast_model=self.loaded.config.scaling.forecast,
            epoch=status.epoch,
        )
        servers = [name for name in devices if name in record["choice"]]  # whole servers, in config order
        record["servers"] = servers
        record["move"] = servers != list(status.allocation)
        append_decision(self.folder, record)
        self.last = record
        return (servers, "now") if record["move"] else None


def describe(record: dict[str, Any]) -> str:
    """One line: ``epoch 2: forecast GBS 48..96: move to A,B (12.3 s, 0.0041 $ predicted): <reason>``."""
    forecast = record.get("forecast") or []
    span = f"{min(forecast)}..{max(forecast)}" if forecast else "-"
    predicted = record.get("predicted") or {}
    action = "move to" if record.get("move") else "stay on"
    return (
        f"epoch {record.get('epoch', '?')}: forecast GBS {span}: {action} {','.join(record.get('servers', []))} "
        f"({predicted.get('time_s', 0.0):.1f} s, {predicted.get('cost', 0.0):.4g} predicted for the epoch): "
        f"{record.get('reason', '')}"
    )
