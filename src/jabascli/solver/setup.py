"""Build a :class:`~jabascli.solver.solve.Solver` from a loaded job config."""

from __future__ import annotations

from jabascli.config import LoadedConfig
from jabascli.errors import InputError
from jabascli.perfmodel import PerformanceModel
from jabascli.profiles import ProfileSet, load_profile_set
from jabascli.solver.cluster import server_specs
from jabascli.solver.online import refit_in_use
from jabascli.solver.solve import Solver


def performance_model_from_config(loaded: LoadedConfig, online: bool = True) -> tuple[ProfileSet, PerformanceModel]:
    """The job's four profiles, and the performance model built on them.

    ``online``: the profiles with the job's latest refit applied (:mod:`jabascli.solver.online`), when it has
    one made on these profiles; else (and with ``online=False``) the profiles as measured.
    """
    dirs = loaded.profile_dirs()
    profiles = load_profile_set(dirs.memory, dirs.computation, dirs.communication, dirs.bucket)
    if online:
        in_use = refit_in_use(loaded, profiles)
        if in_use is not None:
            profiles = in_use.refit.apply(profiles)
    folders = {
        "memory": dirs.memory,
        "computation": dirs.computation,
        "communication": dirs.communication,
        "bucket": dirs.bucket,
    }
    return profiles, PerformanceModel(profiles, folders)


def solver_from_config(loaded: LoadedConfig, servers: str | None = None, weight_sync: str | None = None) -> Solver:
    """The solver for a job: its profiles, and ``servers`` (None: the available ones, ``auto``, or ``a,b``)."""
    profiles, model = performance_model_from_config(loaded)
    profiles.check_precision(loaded.config.job.precision)
    auto = servers is not None and servers.strip() == "auto"
    names = None
    if servers is not None and not auto:
        names = [n.strip() for n in servers.split(",") if n.strip()]
        if not names:
            raise InputError.at(None, "--servers", f"expected 'auto' or a comma-separated list, got {servers!r}")
    config = loaded.config
    return Solver(
        model,
        server_specs(config, profiles, names),
        config.scaling.allocation_unit,
        weight_sync or config.job.weight_sync,
        auto=auto,
    )
