"""What an elastic job leaves in its run folder once it is over: ``ended.json``.

The scheduler (``jabas schedule``, which ``jabas run --elastic`` starts) removes
the file when it starts and writes it, atomically, when the job has ended:
succeeded, failed or stopped. It holds the job's last status, when it ended and
where its results are, so that ``jabas job status -c CONFIG`` can answer after
the scheduler is gone.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from jabascli.atomic import atomic_write_json
from jabascli.config import LoadedConfig
from jabascli.elastic.protocol import JobStatus
from jabascli.engine.layout import run_folder
from jabascli.errors import InputError

ENDED = "ended.json"


@dataclass(frozen=True)
class Ended:
    """A job that is over: its last status, when it ended (seconds since the epoch), and its run folder."""

    status: JobStatus
    ended_at: float
    run_folder: Path
    path: Path

    def line(self) -> str:
        """``two_servers ended: succeeded (finished 8 epochs at step 56) at 2026-11-27 17:30:05; results in ...``."""
        s = self.status
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.ended_at))
        why = f" ({s.message})" if s.message else ""
        where = f"results in {self.run_folder}"
        if s.checkpoint:
            step = f" (step {s.checkpoint_step})" if s.checkpoint_step is not None else ""
            where += f", checkpoint {s.checkpoint}{step}"
        return f"{s.job} ended: {s.state}{why} at {when}; {where}"


def clear_ended(loaded: LoadedConfig) -> None:
    """The job starts (again): it is not over."""
    (run_folder(loaded) / ENDED).unlink(missing_ok=True)


def write_ended(loaded: LoadedConfig, status: JobStatus) -> Path:
    folder = run_folder(loaded)
    record = {"ended_at": time.time(), "run_folder": str(folder), "status": status.model_dump(mode="json")}
    return atomic_write_json(folder / ENDED, record, indent=2)


def read_ended(loaded: LoadedConfig) -> Ended | None:
    """The job's ``ended.json``, or None while it has none (it runs, or never ran under a scheduler)."""
    path = run_folder(loaded) / ENDED
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        return Ended(
            JobStatus.model_validate(record["status"]), float(record["ended_at"]), Path(record["run_folder"]), path
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, ValidationError) as exc:
        raise InputError.at(path, None, f"not a readable record of the job's end: {exc}") from None
