"""Shared by the refit tests: give a job a measured model error, as a first run's refit would."""

from __future__ import annotations

from pathlib import Path

from jabascli.config import LoadedConfig
from jabascli.perfmodel.online import fingerprint
from jabascli.profiles.refit import ObservedPlan, RefitRecord, write_refit
from jabascli.solver.online import measured_profiles


def write_measured_error(loaded: LoadedConfig, run_folder: Path, last: ObservedPlan) -> None:
    """A first refit generation in ``run_folder`` whose one observation is ``last`` (its measured time against
    its prediction is the model's measured error); the factors stay at the profile's."""
    record = RefitRecord(
        generation=1, prior=fingerprint(measured_profiles(loaded)), prior_iterations=2.0, compute={}, comm={},
        observations=[last],
    )  # fmt: skip
    write_refit(run_folder, record)
