"""All the profiles of a job, loaded together and checked against each other.

Profiles are kept per server name (the seed layout). A server that has none of
its own may use those of another server with the same device type, since
profiles describe a device type, not a machine.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from jabascli.errors import InputError, Problem
from jabascli.profiles.formats import (
    BucketProfile,
    CommKind,
    CommProfile,
    CompProfile,
    MemoryProfile,
    read_bucket_profile,
    read_comm_profile,
    read_comp_profiles,
    read_memory_profiles,
)


@dataclass
class ProfileSet:
    """Memory, computation, bucket and communication profiles of one model."""

    memory: dict[tuple[str, int], MemoryProfile]
    comp: dict[tuple[str, int, int], CompProfile]
    bucket: BucketProfile | None
    comm: dict[CommKind, CommProfile] = field(default_factory=dict)
    folders: dict[str, Path] = field(default_factory=dict)

    @property
    def model(self) -> str | None:
        names = {p.model for p in self.comp.values()}
        return next(iter(names)) if names else (self.bucket.model if self.bucket else None)

    def servers(self) -> list[str]:
        return sorted({s for s, _ in self.memory} | {s for s, _, _ in self.comp})

    def device_type(self, server: str) -> str | None:
        for (s, _), profile in self.memory.items():
            if s == server:
                return profile.gpu_type
        for (s, _, _), c in self.comp.items():
            if s == server:
                return c.gpu_type
        return None

    def lbs_values(self, server: str) -> list[int]:
        """Local batch sizes at which at least one VSW fits on ``server``."""
        return sorted(lbs for (s, lbs), p in self.memory.items() if s == server and p.max_num_models > 0)

    def max_vsw(self, server: str, lbs: int) -> int:
        profile = self.memory.get((server, lbs))
        return 0 if profile is None else profile.max_num_models

    def comp_points(self, server: str, lbs: int) -> dict[int, CompProfile]:
        """Measured computation profiles at ``lbs``, keyed by VSW count."""
        return {n: p for (s, b, n), p in sorted(self.comp.items()) if s == server and b == lbs}

    def check_precision(self, precision: str) -> None:
        """Refuse profiles measured in another precision than the job's; unknown ones (seed files) are accepted."""
        kinds = (("memory", self.memory), ("computation", self.comp))
        for kind, profiles in kinds:
            for key, profile in sorted(profiles.items()):
                if profile.precision is not None and profile.precision != precision:
                    where = self.folders.get(kind, Path(kind)) / str(key[1]) / key[0]
                    raise InputError.at(
                        where,
                        "precision",
                        f"measured in {profile.precision}, but [job] precision is {precision}: profile again "
                        f"(jabas profile mem/comp --force) or set [job] precision = {profile.precision!r}",
                    )

    def resolve_servers(self, servers: Iterable[tuple[str, str]]) -> dict[str, str]:
        """For each ``(server, device_type)``, the profiled server whose profiles it uses.

        Raises an InputError naming every server without profiles and the
        folder that was looked in.
        """
        own = set(self.servers())
        by_type: dict[str, str] = {}
        for name in sorted(own):
            device_type = self.device_type(name)
            if device_type is not None:
                by_type.setdefault(device_type, name)
        mapping, problems = {}, []
        for name, device_type in servers:
            if name in own:
                mapping[name] = name
            elif device_type in by_type:
                mapping[name] = by_type[device_type]
            else:
                where = self.folders.get("memory", Path("?"))
                problems.append(
                    Problem(where, None, f"no profiles for server {name!r} ({device_type}) in {where}/<LBS>/{name}/")
                )
        if problems:
            raise InputError(problems)
        return mapping


def load_profile_set(
    memory: Path, computation: Path, communication: Path | None = None, bucket: Path | None = None
) -> ProfileSet:
    """Read every profile and check they describe one model consistently."""
    mem = read_memory_profiles(memory)
    comp = read_comp_profiles(computation)
    bucket_profile = read_bucket_profile(bucket) if bucket is not None and Path(bucket).is_dir() else None
    comm: dict[CommKind, CommProfile] = {}
    if communication is not None and Path(communication).is_dir():
        for kind in ("intra", "inter"):
            profile = read_comm_profile(communication, kind)  # type: ignore[arg-type]
            if profile is not None:
                comm[profile.kind] = profile
    profiles = ProfileSet(
        mem,
        comp,
        bucket_profile,
        comm,
        {"memory": Path(memory), "computation": Path(computation)},
    )
    _check_consistent(profiles, Path(computation))
    return profiles


def check_profiles_precision(memory: Path, computation: Path, precision: str) -> None:
    """Refuse the memory and computation profiles in these folders (where they exist) if of another precision."""
    mem = read_memory_profiles(memory) if Path(memory).is_dir() else {}
    comp = read_comp_profiles(computation) if Path(computation).is_dir() else {}
    ProfileSet(mem, comp, None, folders={"memory": Path(memory), "computation": Path(computation)}).check_precision(
        precision
    )


def _check_consistent(profiles: ProfileSet, comp_folder: Path) -> None:
    problems = []
    models = sorted({p.model for p in profiles.comp.values()})
    if profiles.bucket is not None and profiles.bucket.model not in models and models:
        models.append(profiles.bucket.model)
    if len(models) > 1:
        problems.append(Problem(comp_folder, "model", f"profiles disagree on the model: {', '.join(models)}"))
    for (server, lbs, n), c in profiles.comp.items():
        mem = profiles.memory.get((server, lbs))
        if mem is not None and c.gpu_type != mem.gpu_type:
            problems.append(
                Problem(comp_folder / str(lbs) / server, "gpu_type", f"{c.gpu_type!r} here, {mem.gpu_type!r} in memory")
            )
        if mem is not None and n > mem.max_num_models:
            problems.append(
                Problem(
                    comp_folder / str(lbs) / server,
                    "num_models",
                    f"{n} VSWs profiled but only {mem.max_num_models} fit in memory",
                )
            )
    if problems:
        raise InputError(problems)
