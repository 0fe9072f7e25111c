"""The seed's on-disk profile formats, read and written.

Layout (folder names come from the config, see ``ProfileDirs``)::

    <memory>/<LBS>/<server>/max_memory_profile_info.json
    <computation>/<LBS>/<server>/<server>_<model>_<LBS>_<VSW>_comp_profile.json
    <communication>/{intra,inter}_comm_profile_data.txt       lines "ideal_ms,measured_ms"
    <communication>/{intra,inter}_comm_profile_meta.json      bandwidth and world size (jabas's own; the seed had none)
    <bucket>/<model>_bucket_size_profile.json

The seed names computation files ``<model>_<LBS>_<VSW>_comp_profile.json``;
both names are read, and the LBS and VSW count are taken from the file's
content. Times are milliseconds; bucket sizes are MB in DDP's sense of
``bucket_cap_mb``, i.e. MiB (``BUCKET_MB`` bytes): ResNet-50's 25.6 M float32
parameters are 97.5 of them. New fields may be added to these files; none of
the seed's are renamed. Every write is atomic.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveInt, ValidationError

from jabascli.atomic import atomic_write_json, atomic_write_text
from jabascli.errors import InputError, Problem
from jabascli.inputs import read_json, read_text

MEMORY_FILENAME = "max_memory_profile_info.json"
COMP_SUFFIX = "_comp_profile.json"
BUCKET_SUFFIX = "_bucket_size_profile.json"
BUCKET_MB = 2**20  # DDP's bucket_cap_mb counts MiB; the seed's bucket sizes use the same unit
CommKind = Literal["intra", "inter"]


class _Format(BaseModel):
    # New fields written by newer versions must not break older readers.
    model_config = ConfigDict(extra="allow")


class _Measured(_Format):
    """How a memory or computation profile was measured (absent from seed files and older profiles)."""

    precision: str | None = None
    """``[job] precision`` of the measurement: ``fp32``, ``bf16`` or ``fp16``; None: unknown (seed files)."""
    torch_version: str | None = None
    threads: int | None = None
    """torch intra-op threads of the measuring process."""
    device: str | None = None
    """Where it was measured: ``cpu``, ``cuda`` or ``emulated`` (on the CPU, slowed by ``slowdown``)."""

    @property
    def measured_precision(self) -> str:
        return self.precision or "unknown"


class MemoryTrial(_Format):
    """One memory-profiler trial: did ``num_models`` VSWs fit, and at what peak."""

    num_models: PositiveInt
    peak_bytes: int | None = None
    fits: bool
    error: str | None = None


class MemoryProfile(_Measured):
    """The largest number of VSWs (model replicas) that fit at one LBS on one server."""

    gpu_type: str
    total_memory: int
    lbs: PositiveInt
    max_num_models: int = Field(ge=0)
    trials: list[MemoryTrial] | None = None
    vsw_bound: PositiveInt | None = None
    """Set when the search stopped at this count because no more VSWs could be used at the job's
    largest GBS (``jabas profile all``): ``max_num_models`` is then a lower bound of what fits."""


class CompProfile(_Measured):
    """Per-iteration times (ms) of ``num_models`` VSWs at one LBS on one server."""

    model: str
    gpu_type: str
    lbs: PositiveInt
    num_models: PositiveInt
    total_time: NonNegativeFloat
    data_time: NonNegativeFloat
    fwd_time: NonNegativeFloat
    bwd_time: NonNegativeFloat
    update_time: NonNegativeFloat
    copy_time: NonNegativeFloat
    bn_sync_time: NonNegativeFloat = 0.0
    # Written by jabas' profiler (absent from seed files):
    overhead_time: NonNegativeFloat = 0.0
    """The engine's work once per iteration beyond micro-steps, update and copy (ms; 0 in seed files)."""
    overlap_update_time: NonNegativeFloat | None = None
    """With ``overlap`` weight sync, what the per-bucket optimizer steps add to an iteration (ms)."""
    spread: dict[str, list[float]] | None = None
    """Quartiles ``[p25, p75]`` (ms) of each ``*_time`` over the measured iterations."""
    iterations: PositiveInt | None = None
    """Measured iterations (after ``warmup`` unmeasured ones)."""
    warmup: int | None = Field(None, ge=0)
    timer: str | None = None
    """``cuda-events`` or ``perf_counter``."""
    slowdown: float | None = Field(None, ge=1.0)
    """Emulated devices: the factor the compute phases were multiplied by."""
    vsw_strategy: str | None = None
    """How the engine ran the VSWs: ``sequential`` (one replica) or ``streams`` (one per VSW)."""
    run_totals: list[NonNegativeFloat] | None = None
    """When the point was measured in several processes: each one's ``total_time`` (ms), in order;
    the profile is the run of median total."""


class BucketProfile(_Format):
    """DDP gradient bucket sizes in MB (MiB), in gradient-ready order."""

    model: str
    bucket_size_distribution: list[NonNegativeFloat]
    bucket_cap_mb: float | None = Field(None, gt=0)
    """The DDP bucket cap the distribution was measured with (absent from seed files)."""


class CommMeta(_Format):
    """How ``ideal_ms`` of a communication profile was computed."""

    bandwidth: float = Field(gt=0)  # bytes per second
    world_size: PositiveInt
    backend: str | None = None
    sizes_bytes: list[PositiveInt] | None = None
    """The all-reduce message size of each line of the profile."""
    after_wait_ms: list[NonNegativeFloat] | None = None
    """Per line: the median all-reduce time of the last rank to enter it, when the others entered
    first and waited blocked (gloo; as in training, where ranks finish their backward apart)."""


class CommProfile(BaseModel):
    """All-reduce cost: measured vs bandwidth-only ring time, per message size."""

    kind: CommKind
    ideal_ms: list[float]
    measured_ms: list[float]
    meta: CommMeta | None = None


# Paths -------------------------------------------------------------------


def memory_profile_path(folder: Path, lbs: int, server: str) -> Path:
    return Path(folder) / str(lbs) / server / MEMORY_FILENAME


def comp_profile_path(folder: Path, lbs: int, server: str, model: str, num_models: int) -> Path:
    return Path(folder) / str(lbs) / server / f"{server}_{model}_{lbs}_{num_models}{COMP_SUFFIX}"


def bucket_profile_path(folder: Path, model: str) -> Path:
    return Path(folder) / f"{model}{BUCKET_SUFFIX}"


def comm_profile_path(folder: Path, kind: CommKind) -> Path:
    return Path(folder) / f"{kind}_comm_profile_data.txt"


def comm_meta_path(folder: Path, kind: CommKind) -> Path:
    return Path(folder) / f"{kind}_comm_profile_meta.json"


# Reading ------------------------------------------------------------------


def _parse(model: type[_Format], path: Path) -> Any:
    data = read_json(path)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"]) or None
            message = "required key is missing" if err["type"] == "missing" else err["msg"]
            problems.append(Problem(path, field, message))
        raise InputError(problems) from None


def _require_dir(folder: Path, what: str) -> Path:
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError.at(folder, None, f"{what} folder does not exist")
    return folder


def _lbs_server_dirs(folder: Path) -> list[tuple[int, str, Path]]:
    """``(lbs, server, path)`` of every ``<LBS>/<server>/`` folder, in LBS order."""
    found = []
    for lbs_dir in folder.iterdir():
        if not lbs_dir.is_dir() or lbs_dir.name.startswith("."):
            continue
        if not lbs_dir.name.isdigit():
            raise InputError.at(lbs_dir, None, "expected a folder named by a local batch size (an integer)")
        for server_dir in lbs_dir.iterdir():
            if server_dir.is_dir() and not server_dir.name.startswith("."):
                found.append((int(lbs_dir.name), server_dir.name, server_dir))
    return sorted(found, key=lambda t: (t[0], t[1]))


def read_memory_profile(path: Path) -> MemoryProfile:
    return _parse(MemoryProfile, Path(path))


def read_memory_profiles(folder: Path) -> dict[tuple[str, int], MemoryProfile]:
    """Every memory profile in a folder, keyed by ``(server, lbs)``."""
    folder = _require_dir(folder, "memory profile")
    profiles = {}
    for lbs, server, path in _lbs_server_dirs(folder):
        file = path / MEMORY_FILENAME
        if not file.is_file():
            continue
        profile = read_memory_profile(file)
        if profile.lbs != lbs:
            raise InputError.at(file, "lbs", f"is {profile.lbs} but the file sits in folder {lbs}")
        profiles[(server, lbs)] = profile
    return profiles


def read_comp_profile(path: Path) -> CompProfile:
    return _parse(CompProfile, Path(path))


def read_comp_profiles(folder: Path) -> dict[tuple[str, int, int], CompProfile]:
    """Every computation profile in a folder, keyed by ``(server, lbs, num_models)``."""
    folder = _require_dir(folder, "computation profile")
    profiles = {}
    for lbs, server, path in _lbs_server_dirs(folder):
        for file in sorted(path.glob(f"*{COMP_SUFFIX}")):
            profile = read_comp_profile(file)
            if profile.lbs != lbs:
                raise InputError.at(file, "lbs", f"is {profile.lbs} but the file sits in folder {lbs}")
            key = (server, lbs, profile.num_models)
            if key in profiles:
                raise InputError.at(file, "num_models", f"a second profile of {profile.num_models} VSWs at LBS {lbs}")
            profiles[key] = profile
    return profiles


def read_bucket_profile(folder: Path, model: str | None = None) -> BucketProfile:
    """The bucket profile of ``model``, or the only one in the folder."""
    folder = _require_dir(folder, "bucket profile")
    if model is not None:
        path = bucket_profile_path(folder, model)
        if not path.is_file():
            raise InputError.at(path, None, f"no bucket profile for model {model!r}")
    else:
        files = sorted(folder.glob(f"*{BUCKET_SUFFIX}"))
        if len(files) != 1:
            found = ", ".join(f.name for f in files) or "none"
            raise InputError.at(folder, None, f"expected one *{BUCKET_SUFFIX} file, found {found}")
        path = files[0]
    return _parse(BucketProfile, path)


def profiled_bucket_sizes(folder: Path | None, model: str) -> list[float] | None:
    """The bucket sizes (MB) of ``model``'s bucket profile in ``folder``; None when it has none."""
    if folder is None or not bucket_profile_path(folder, model).is_file():
        return None
    return read_bucket_profile(folder, model).bucket_size_distribution or None


def read_comm_profile(folder: Path, kind: CommKind) -> CommProfile | None:
    """The intra- or inter-node all-reduce profile, or None when it was not measured."""
    path = comm_profile_path(folder, kind)
    if not path.is_file():
        return None
    ideal, measured = [], []
    lines = read_text(path).splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            a, b = (float(x) for x in line.split(","))
        except ValueError:
            raise InputError.at(path, f"line {number}", f"expected 'ideal_ms,measured_ms', got {line!r}") from None
        if not (math.isfinite(a) and math.isfinite(b)) or a < 0 or b < 0:
            raise InputError.at(path, f"line {number}", "times must be finite and non-negative")
        ideal.append(a)
        measured.append(b)
    if not ideal:
        raise InputError.at(path, None, "no measurements in the file")
    meta_path = comm_meta_path(folder, kind)
    meta = _parse(CommMeta, meta_path) if meta_path.is_file() else None
    return CommProfile(kind=kind, ideal_ms=ideal, measured_ms=measured, meta=meta)


# Writing ------------------------------------------------------------------


def write_memory_profile(folder: Path, server: str, profile: MemoryProfile) -> Path:
    return atomic_write_json(memory_profile_path(folder, profile.lbs, server), profile.model_dump(exclude_none=True))


def write_comp_profile(folder: Path, server: str, profile: CompProfile) -> Path:
    path = comp_profile_path(folder, profile.lbs, server, profile.model, profile.num_models)
    return atomic_write_json(path, profile.model_dump(exclude_none=True))


def write_bucket_profile(folder: Path, profile: BucketProfile) -> Path:
    return atomic_write_json(bucket_profile_path(folder, profile.model), profile.model_dump(exclude_none=True))


def write_comm_profile(folder: Path, profile: CommProfile) -> Path:
    """Write the data file, then its meta file.

    The old meta file goes first: however the writing is interrupted, a data
    file is never left beside the meta file of another measurement.
    """
    lines = "".join(f"{a!r},{b!r}\n" for a, b in zip(profile.ideal_ms, profile.measured_ms, strict=True))
    comm_meta_path(folder, profile.kind).unlink(missing_ok=True)
    path = atomic_write_text(comm_profile_path(folder, profile.kind), lines)
    if profile.meta is not None:
        atomic_write_json(comm_meta_path(folder, profile.kind), profile.meta.model_dump(exclude_none=True))
    return path


def ring_allreduce_ideal_ms(size_bytes: float, bandwidth: float, world_size: int) -> float:
    """Bandwidth-only ring all-reduce time: ``2 (n-1)/n * size / bandwidth``, in ms."""
    if world_size <= 1:
        return 0.0
    return 2.0 * (world_size - 1) / world_size * size_bytes / bandwidth * 1e3
