"""Load a job configuration from ``jabas.toml`` or the seed JSON format.

Every problem found is reported at once, one :class:`~jabascli.errors.Problem`
per line with the file and the field path, as an :class:`InputError`.

Relative paths of what a job reads resolve against the config file's folder,
then the working directory; the folders it writes to (``[storage]``,
``[profiles] dir``) against the config file's folder alone. Seed JSON files
were written relative to the working directory of the seed's scripts, which sat
above the data folder (``quickstart/...``); so for
seed files a path whose first component does not exist is also tried with that
component dropped, i.e. relative to the config's own folder.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from jabascli.config.models import (
    BUCKET_DIRNAME,
    COMMUNICATION_DIRNAME,
    COMPUTATION_DIRNAME,
    MEMORY_DIRNAME,
    JabasConfig,
)
from jabascli.config.parallel_checks import check_parallel
from jabascli.config.seed import TOML_TO_SEED_FIELD, SeedConfig, SeedServer, seed_to_toml_dict
from jabascli.errors import InputError, Problem
from jabascli.inputs import read_json, read_text

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


@dataclass(frozen=True)
class ProfileDirs:
    """The four profile folders of a job, in the seed layout."""

    memory: Path
    computation: Path
    communication: Path
    bucket: Path


@dataclass(frozen=True)
class LoadedConfig:
    """A validated configuration and where it came from."""

    config: JabasConfig
    path: Path
    format: str  # "toml" or "seed-json"
    cluster_info_path: Path | None = None

    @property
    def folder(self) -> Path:
        return self.path.parent

    def profile_dirs(self) -> ProfileDirs:
        p = self.config.profiles
        root = p.dir or self.folder / "profiles"
        return ProfileDirs(
            memory=p.memory or root / MEMORY_DIRNAME,
            computation=p.computation or root / COMPUTATION_DIRNAME,
            communication=p.communication or root / COMMUNICATION_DIRNAME,
            bucket=p.bucket or root / BUCKET_DIRNAME,
        )


def load_config(path: Path | str, *, check_profiles: bool = True) -> LoadedConfig:
    """Read, validate and resolve a config file (TOML, or seed JSON by its suffix).

    ``check_profiles=False`` skips the check that named profile folders exist,
    for the commands that create them.
    """
    path = Path(path)
    if not path.is_file():
        what = "is a folder, expected a config file" if path.is_dir() else "file not found"
        raise InputError.at(path, None, what)
    if path.suffix == ".json":
        loaded = _load_seed(path)
    else:
        loaded = LoadedConfig(_validate(_read_toml(path), path, {}), path.resolve(), "toml")
        _resolve_paths(loaded.config, loaded.folder, seed=False)
    field_names = TOML_TO_SEED_FIELD if loaded.format == "seed-json" else {}
    problems = check_config(loaded, check_profiles=check_profiles)
    if problems:
        raise InputError([_rename(p, field_names) for p in problems])
    return loaded


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(read_text(path))
    except tomllib.TOMLDecodeError as exc:
        raise InputError.at(path, None, f"invalid TOML: {exc}") from None


def _load_seed(path: Path) -> LoadedConfig:
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise InputError.at(path, None, "expected a JSON object (the seed job config)")
    try:
        seed = SeedConfig.model_validate(raw)
    except ValidationError as exc:
        raise InputError(pydantic_problems(exc, path)) from None

    folder = path.parent.resolve()
    info_path = resolve_path(Path(seed.gpu_cluster_info), folder, seed=True)
    info = read_json(info_path)
    if not isinstance(info, dict):
        raise InputError.at(info_path, None, "expected a JSON object mapping server names to GPU info")
    cluster: dict[str, SeedServer] = {}
    problems: list[Problem] = []
    for name, entry in info.items():
        try:
            cluster[name] = SeedServer.model_validate(entry)
        except ValidationError as exc:
            problems += pydantic_problems(exc, info_path, prefix=name)
    if problems:
        raise InputError(problems)

    config = _validate(seed_to_toml_dict(seed, cluster), path, TOML_TO_SEED_FIELD)
    _resolve_paths(config, folder, seed=True)
    return LoadedConfig(config, path.resolve(), "seed-json", info_path)


def _validate(data: dict[str, Any], path: Path, field_names: dict[str, str]) -> JabasConfig:
    try:
        return JabasConfig.model_validate(data)
    except ValidationError as exc:
        raise InputError([_rename(p, field_names) for p in pydantic_problems(exc, path)]) from None


def pydantic_problems(exc: ValidationError, file: Path, prefix: str = "") -> list[Problem]:
    """One problem per pydantic error, with a dotted field path and a plain message."""
    problems = []
    for err in exc.errors():
        field = field_path(err["loc"], prefix)
        kind = err["type"]
        if kind == "extra_forbidden":
            message = "unknown key"
        elif kind == "missing":
            message = "required key is missing"
        else:
            message = f"{err['msg']} (got {err['input']!r})"
        problems.append(Problem(file, field, message))
    return problems


def field_path(loc: Sequence[str | int], prefix: str = "") -> str:
    text = prefix
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text


def _rename(problem: Problem, field_names: dict[str, str]) -> Problem:
    if problem.field is None:
        return problem
    for toml_field, seed_field in field_names.items():
        if problem.field == toml_field or problem.field.startswith(toml_field + "["):
            return Problem(problem.file, seed_field + problem.field[len(toml_field) :], problem.message)
    return problem


def resolve_path(path: Path, folder: Path, *, seed: bool = False) -> Path:
    """Resolve a relative path: config folder, then working directory (then seed rule)."""
    path = path.expanduser()
    if path.is_absolute():
        return path
    candidates = [folder / path, Path.cwd() / path]
    if seed and len(path.parts) > 1:
        candidates.append(folder / Path(*path.parts[1:]))
    for candidate in candidates:
        if candidate.exists():
            return candidate.resolve()
    return (folder / path).resolve()


def _resolve_paths(config: JabasConfig, folder: Path, *, seed: bool) -> None:
    def resolve(p: Path | None) -> Path | None:
        return None if p is None else resolve_path(p, folder, seed=seed)

    job = config.job
    job.data = resolve(job.data)
    job.plan = resolve(job.plan)
    if job.workload is not None and _looks_like_path(job.workload):
        job.workload = str(resolve(Path(job.workload)))
    profiles = config.profiles
    for name in ("memory", "computation", "communication", "bucket"):
        setattr(profiles, name, resolve(getattr(profiles, name)))
    for server in config.cluster.servers:
        server.ssh_key = resolve(server.ssh_key)
    config.scheduler.token_file = resolve(config.scheduler.token_file)
    # The folders a job writes to are the config's own, whatever the working directory holds.
    profiles.dir = _beside(profiles.dir, folder)
    config.storage.checkpoint_dir = _beside(config.storage.checkpoint_dir, folder) or folder
    config.storage.run_dir = _beside(config.storage.run_dir, folder) or folder


def _beside(path: Path | None, folder: Path) -> Path | None:
    """A folder jabas writes to: relative to the config's folder (not the working directory)."""
    if path is None:
        return None
    path = path.expanduser()
    return (path if path.is_absolute() else folder / path).resolve()


def _looks_like_path(workload: str) -> bool:
    return workload.endswith(".py") or "/" in workload or "\\" in workload


def check_config(loaded: LoadedConfig, *, check_profiles: bool = True) -> list[Problem]:
    """Checks that span fields; each problem names the field it is about."""
    config, file = loaded.config, loaded.path
    problems: list[Problem] = []

    b = config.batching
    if b.gbs_min is not None and b.gbs_max is not None and b.gbs_min > b.gbs_max:
        problems.append(
            Problem(file, "batching.gbs_min", f"lower bound {b.gbs_min} is above the upper bound {b.gbs_max}")
        )
    if b.initial_gbs is not None:
        if b.gbs_min is not None and b.initial_gbs < b.gbs_min:
            problems.append(Problem(file, "batching.initial_gbs", f"{b.initial_gbs} is below gbs_min {b.gbs_min}"))
        if b.gbs_max is not None and b.initial_gbs > b.gbs_max:
            problems.append(Problem(file, "batching.initial_gbs", f"{b.initial_gbs} is above gbs_max {b.gbs_max}"))

    names = [s.name for s in config.cluster.servers]
    seen: set[str] = set()
    for i, name in enumerate(names):
        if name in seen:
            problems.append(Problem(file, f"cluster.servers[{i}].name", f"server name {name!r} is used twice"))
        seen.add(name)
    for i, name in enumerate(config.cluster.available_servers or []):
        if name not in seen:
            known = ", ".join(names) or "none"
            problems.append(
                Problem(
                    file,
                    f"cluster.available_servers[{i}]",
                    f"server {name!r} has no cluster entry (known servers: {known})",
                )
            )

    if check_profiles:
        # [profiles] dir is where `jabas profile` writes, so it may not exist yet; a
        # folder named on its own is one to read from and must exist.
        for name in ("memory", "computation", "communication", "bucket"):
            folder = getattr(config.profiles, name)
            if folder is not None and not folder.is_dir():
                problems.append(Problem(file, f"profiles.{name}", f"profile folder {folder} does not exist"))

    for field, path in (("job.plan", config.job.plan), ("job.data", config.job.data)):
        if path is not None and not path.exists():
            problems.append(Problem(file, field, f"{path} does not exist"))
    problems += check_parallel(config, file)
    return problems
