"""What a profile folder says, per LBS and server: max VSWs, time per iteration, throughput.

Reads through :mod:`jabascli.profiles` only (no torch), so it also serves
profiles measured elsewhere, the seed's included.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from jabascli.config.models import COMPUTATION_DIRNAME, MEMORY_DIRNAME
from jabascli.errors import InputError
from jabascli.profiles.formats import COMP_SUFFIX, MEMORY_FILENAME, CompProfile, read_comp_profiles
from jabascli.profiles.formats import read_memory_profiles as _read_memory
from jabascli.profiles.store import load_profile_set


@dataclass
class SummaryRow:
    lbs: int
    server: str
    device_type: str
    max_vsw: int | None
    """From the memory profile; None when there is none for this LBS."""
    points: dict[int, CompProfile] = field(default_factory=dict)
    """Computation profiles by VSW count."""

    def throughput(self, n: int) -> float:
        """Samples per second with ``n`` VSWs."""
        profile = self.points[n]
        return self.lbs * n / profile.total_time * 1e3 if profile.total_time > 0 else 0.0

    @property
    def best_vsw(self) -> int | None:
        """The measured VSW count with the highest throughput."""
        return max(self.points, key=self.throughput) if self.points else None


@dataclass
class Summary:
    memory_folder: Path | None
    computation_folder: Path | None
    model: str | None
    rows: list[SummaryRow]

    def servers(self) -> list[tuple[str, str]]:
        """(server, device type) pairs, in name order."""
        return sorted({(r.server, r.device_type) for r in self.rows})

    def lbs_values(self) -> list[int]:
        return sorted({r.lbs for r in self.rows})

    def row(self, lbs: int, server: str) -> SummaryRow | None:
        return next((r for r in self.rows if r.lbs == lbs and r.server == server), None)


def _holds(folder: Path, pattern: str) -> bool:
    return folder.is_dir() and any(folder.glob(f"*/*/{pattern}"))


def find_folders(folder: Path) -> tuple[Path | None, Path | None]:
    """The memory and computation folders of a profile root, or of one of them."""
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError.at(folder, None, "profile folder does not exist")
    if (folder / MEMORY_DIRNAME).is_dir() or (folder / COMPUTATION_DIRNAME).is_dir():
        memory, comp = folder / MEMORY_DIRNAME, folder / COMPUTATION_DIRNAME
    elif _holds(folder, MEMORY_FILENAME):
        memory, comp = folder, folder.parent / COMPUTATION_DIRNAME
    elif _holds(folder, f"*{COMP_SUFFIX}"):
        memory, comp = folder.parent / MEMORY_DIRNAME, folder
    else:
        raise InputError.at(
            folder,
            None,
            f"no profiles here: expected {MEMORY_DIRNAME}/ or {COMPUTATION_DIRNAME}/, or <LBS>/<server>/ folders",
        )
    return (memory if memory.is_dir() else None), (comp if comp.is_dir() else None)


def summarize_profiles(folder: Path) -> Summary:
    memory_folder, comp_folder = find_folders(folder)
    if memory_folder is not None and comp_folder is not None:
        profiles = load_profile_set(memory_folder, comp_folder)
        memory, comp, model = profiles.memory, profiles.comp, profiles.model
    else:
        memory = _read_memory(memory_folder) if memory_folder is not None else {}
        comp = read_comp_profiles(comp_folder) if comp_folder is not None else {}
        model = next(iter({p.model for p in comp.values()}), None)
    rows: dict[tuple[int, str], SummaryRow] = {}
    for (server, lbs), profile in memory.items():
        rows[(lbs, server)] = SummaryRow(lbs, server, profile.gpu_type, profile.max_num_models)
    for (server, lbs, n), profile in comp.items():
        row = rows.setdefault((lbs, server), SummaryRow(lbs, server, profile.gpu_type, None))
        row.points[n] = profile
    ordered = [rows[key] for key in sorted(rows)]
    return Summary(memory_folder, comp_folder, model, ordered)
