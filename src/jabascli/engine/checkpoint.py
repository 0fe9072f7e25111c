"""Checkpoints: everything needed to continue training exactly, under any plan.

A checkpoint holds the model (replica 0; buffers are identical everywhere),
the optimizer, the LR scheduler, rank 0's random number generator states, the
progress (epoch, position in the epoch in samples, iterations done), the
configuration and plan it was written under, and the GBS history. None of it
depends on the world size or on the per-rank (VSW, GA): the optimizer steps
once per iteration on the whole model, and the sampler resumes at
``perm[position:]`` (see :mod:`jabascli.engine.sampler`). So a checkpoint can be
resumed by a different number of trainers with a different configuration.

Written by rank 0 into the job's :class:`~jabascli.engine.checkpoint_store.CheckpointStore`,
which keeps the last few, each with its digest: an interrupted save leaves the
previous checkpoints in place, and a damaged newest one falls back to the one before.
A hybrid layout's checkpoint is a ``.dcp`` folder written by every rank
(:mod:`jabascli.engine.parallel.dcp`); it reads back here as the same payload.
Every writer (here and the layout's) takes the trainer's live objects as one :class:`CheckpointState`.
"""

from __future__ import annotations

import io
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from jabascli.engine.checkpoint_store import CheckpointStore, Found, newest_checkpoint
from jabascli.errors import InputError

FORMAT = "jabas-checkpoint"
VERSION = 1


@dataclass
class Progress:
    """Where training stands."""

    epoch: int = 0
    position: int = 0
    """Samples of ``epoch`` already consumed."""
    step: int = 0
    """Iterations (optimizer steps) done since the start of training."""
    gbs_history: list[dict[str, Any]] = field(default_factory=list)
    """One entry per change of GBS or plan: ``{step, epoch, position, gbs, lbs, plan, lr_factor}``, and under an
    uneven plan ``sizes``, every worker's samples in worker order (what the reference process feeds)."""

    def record_plan(
        self, gbs: int, lbs: int, plan: str, lr_factor: float = 1.0, sizes: list[int] | None = None
    ) -> None:
        last = self.gbs_history[-1] if self.gbs_history else None
        key = (gbs, lbs, plan, lr_factor)
        if last is None or (last["gbs"], last["lbs"], last["plan"], last.get("lr_factor", 1.0)) != key:
            entry = {"step": self.step, "epoch": self.epoch, "position": self.position, "gbs": gbs, "lbs": lbs}
            self.gbs_history.append(
                {**entry, "plan": plan, "lr_factor": lr_factor, **({"sizes": sizes} if sizes else {})}
            )


def fingerprint(model: nn.Module) -> dict[str, tuple[list[int], str]]:
    """Name -> (shape, dtype) of every entry of the model's state dict."""
    return {name: (list(t.shape), str(t.dtype)) for name, t in model.state_dict().items()}


def rng_states() -> dict[str, Any]:
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    states["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos)}
    states["numpy"].update(has_gauss=int(has_gauss), gauss=float(gauss))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(_tuples(states["python"]))
    n = states["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if "cuda" in states and torch.cuda.is_available():
        cuda = states["cuda"][: torch.cuda.device_count()]
        torch.cuda.set_rng_state_all(cuda)


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list | tuple) else value


@dataclass(frozen=True)
class CheckpointState:
    """What a checkpoint of a trainer holds: the live objects, not copies."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any | None
    progress: Progress
    workload: str
    config: dict[str, Any]
    plan: dict[str, Any]
    """The plan the job resumes with (the plan file form)."""
    adaptive: dict[str, Any] | None = None
    grad_scaler: dict[str, Any] | None = None


def save_checkpoint(store: CheckpointStore, state: CheckpointState) -> tuple[dict[str, Any], Path]:
    """Add the checkpoint of ``state`` to ``store`` as its newest; returns what it holds, in memory, and its file.

    The returned payload's tensors are the live model's and optimizer's, not copies: it equals
    the file only until they change (a trainer that stops here may resume from it, not from disk).
    """
    payload = checkpoint_payload(state)
    buffer = io.BytesIO()  # serialise first: a failure cannot leave a temporary file behind
    torch.save(payload, buffer)
    path = store.write(buffer.getvalue(), step=state.progress.step, epoch=state.progress.epoch)
    return payload, path


def checkpoint_payload(state: CheckpointState) -> dict[str, Any]:
    """What a checkpoint of ``state`` holds, in memory: the live model's and optimizer's tensors, not copies."""
    names = {p: name for name, p in state.model.named_parameters()}
    return {
        **extra_payload(state),
        "model": state.model.state_dict(),
        "optimizer": state.optimizer.state_dict(),
        # Which parameter each of the optimizer's numbers is: lets a sharded or split layout restore it.
        "parameter_names": [[names[p] for p in group["params"]] for group in state.optimizer.param_groups],
    }


def extra_payload(state: CheckpointState) -> dict[str, Any]:
    """A checkpoint's payload without model and optimizer (``state.optimizer`` is not read): what rank 0 writes
    beside a ``.dcp`` checkpoint's shards (engine/parallel/dcp.py: save_sharded's ``extra``)."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "workload": state.workload,
        "fingerprint": fingerprint(state.model),
        "lr_scheduler": None if state.scheduler is None else state.scheduler.state_dict(),
        "rng": rng_states(),
        "progress": asdict(state.progress),
        "config": state.config,
        "plan": state.plan,
        "adaptive": state.adaptive,
        "grad_scaler": state.grad_scaler or {},  # fp16's loss scale (engine/step_policy.py); empty otherwise
    }


def resolve_checkpoint(path: Path) -> Found:
    """``path``, a checkpoint (a ``.pt`` file or a ``.dcp`` folder) or a job's checkpoint folder (then its newest
    intact checkpoint), checked against the digests it was written with; InputError when there is none or it is
    corrupt. A ``.pt`` file's bytes are read once, here."""
    if is_sharded(path):
        return Found(path, b"", CheckpointStore(path.parent).verify_folder(path))
    if path.is_dir():
        found = newest_checkpoint(path)
        if found is None:
            raise InputError.at(path, None, "no checkpoint in this folder")
        return found
    if not path.is_file():
        raise InputError.at(path, None, "checkpoint not found")
    data = path.read_bytes()
    return Found(path, data, CheckpointStore(path.parent).verify(path, data))


def is_sharded(path: Path) -> bool:
    """Whether ``path`` is a ``.dcp`` checkpoint folder (written by every rank of a hybrid layout)."""
    return path.is_dir() and (path.suffix == ".dcp" or (path / ".metadata").is_file())


def read_checkpoint(path: Path) -> dict[str, Any]:
    """Load a checkpoint (a file, a ``.dcp`` folder, or a job's folder: its newest intact one) onto the CPU,
    whole, whatever layout wrote it.

    Anything that is not an intact jabas checkpoint is an InputError.
    """
    return load_found(resolve_checkpoint(path))


def load_found(found: Found, *, tensors: bool = True) -> dict[str, Any]:
    """The payload of a checkpoint found (and checked) by :func:`resolve_checkpoint` or :func:`newest_checkpoint`.
    ``tensors=False``: of a ``.dcp`` checkpoint, all but model and optimizer (the fingerprint from its metadata)."""
    if not is_sharded(found.path):
        return load_payload(found.path, found.data)
    from jabascli.engine.parallel.dcp import read_fingerprint, read_sharded  # torch.distributed.checkpoint: late

    try:
        payload = read_sharded(found.path) if tensors else read_fingerprint(found.path)
    except Exception as exc:  # a folder whose files were checked yet do not parse: not written by jabas
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError.at(found.path, None, f"corrupt or not a checkpoint (DCP: {reason})") from None
    return _checked(found.path, payload)


def load_payload(path: Path, data: bytes) -> dict[str, Any]:
    """The payload of a checkpoint's bytes; InputError naming ``path`` unless it is a jabas checkpoint."""
    try:
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError.at(path, None, f"corrupt or not a checkpoint (torch.load: {reason})") from None
    return _checked(path, payload)


def _checked(path: Path, payload: Any) -> dict[str, Any]:
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise InputError.at(path, None, "not a jabas checkpoint")
    if payload.get("version") != VERSION:
        raise InputError.at(path, "version", f"checkpoint version {payload.get('version')!r}, expected {VERSION}")
    return payload


def restore_checkpoint(
    payload: dict[str, Any],
    path: Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None,
) -> Progress:
    """Load states into a freshly built model, optimizer and scheduler; returns the progress."""
    check_same_model(payload, path, model)
    model.load_state_dict(payload["model"])
    try:
        optimizer.load_state_dict(payload["optimizer"])
    except (ValueError, KeyError) as exc:
        raise InputError.at(path, "optimizer", f"does not fit this workload's optimizer: {exc}") from None
    if scheduler is not None and payload.get("lr_scheduler") is not None:
        scheduler.load_state_dict(payload["lr_scheduler"])
    set_rng_states(payload["rng"])
    return Progress(**payload["progress"])


def check_same_model(payload: dict[str, Any], path: Path, model: nn.Module) -> None:
    theirs = {name: (list(shape), dtype) for name, (shape, dtype) in payload["fingerprint"].items()}
    ours = fingerprint(model)
    if theirs == ours:
        return
    missing = sorted(set(ours) - set(theirs))
    extra = sorted(set(theirs) - set(ours))
    differ = sorted(n for n in set(ours) & set(theirs) if ours[n] != theirs[n])
    details = []
    if missing:
        details.append(f"{len(missing)} tensors missing (e.g. {missing[0]!r})")
    if extra:
        details.append(f"{len(extra)} unexpected tensors (e.g. {extra[0]!r})")
    if differ:
        n = differ[0]
        details.append(
            f"{len(differ)} tensors differ (e.g. {n!r}: {theirs[n][0]} {theirs[n][1]} in the checkpoint, "
            f"{ours[n][0]} {ours[n][1]} here)"
        )
    workload = payload.get("workload", "?")
    raise InputError.at(path, "model", f"checkpoint is of another model (workload {workload!r}): {'; '.join(details)}")


def check_resumable(path: Path, workload: Any) -> Found:
    """Fail early (InputError) unless ``path`` (a file or a job's folder) holds a checkpoint of ``workload``'s
    model; returns the checkpoint found, so that every rank resumes that one file."""
    found = resolve_checkpoint(path)
    check_same_model(load_found(found, tensors=False), found.path, workload.build_model())
    return found
