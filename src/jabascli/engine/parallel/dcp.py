"""Checkpoints of hybrid layouts (torch.distributed.checkpoint, DCP): each rank writes its shards.

A sharded, tensor-parallel or pipelined model exists whole on no rank, so its
checkpoint is written by all of them: ``checkpoint-<step>.dcp/`` holds DCP's
files (each rank's part of every tensor, and ``.metadata``: which part of which
whole tensor each file holds), ``param-groups-<rank>.json`` (the parameter
names of each of that rank's optimizer groups, in order) and ``extra.pt``
(rank 0's payload without model and optimizer: progress, scheduler, RNG,
config, plan...). Every tensor is keyed by its name in the whole model (its
FQN), which no layout changes: FSDP2 and DTensor keep the module tree, and a
pipeline stage keeps the names of the blocks it holds. The optimizer's state is
keyed the same way (``state.<fqn>.<key>``, ``param_groups.<fqn>.<key>``:
``get_state_dict``'s flattened form), so it does not depend on the order of
the parameters either.

So any layout restores any other's checkpoint: each rank asks DCP for the
parts of the whole tensors it holds under its own layout and DCP reads them
from whichever files hold them (resharding). A checkpoint also reads back
whole, without a process group (:func:`read_sharded`), as the same payload a
plain IIDP checkpoint holds: a plain trainer resumes it, and ``jabas
checkpoint export`` writes its model.

Commit: every rank writes into ``.checkpoint-<step>.dcp.tmp``; after a barrier
rank 0 digests the files, renames the folder and names it in the manifest
(:meth:`~jabascli.engine.checkpoint_store.CheckpointStore.commit_folder`). A
save cut off before that leaves the previous checkpoint the newest. Every rank
must see the same checkpoint folder (a shared file system across servers).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from jabascli.atomic import atomic_write, atomic_write_json
from jabascli.engine.checkpoint_store import CheckpointStore
from jabascli.errors import InputError

EXTRA = "extra.pt"
GROUPS = "param-groups-{rank}.json"
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def save_sharded(
    store: CheckpointStore,
    *,
    step: int,
    epoch: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any],
) -> Path:
    """Collective (every rank of the job calls it): write this rank's shards of ``model`` and ``optimizer`` and,
    on rank 0, ``extra`` (save_checkpoint's payload without model and optimizer) as ``checkpoint-<step>.dcp``;
    returns that folder once rank 0 has committed it."""
    rank = _rank()
    staged = store.staging(step)
    if rank == 0:
        shutil.rmtree(staged, ignore_errors=True)  # what a save of this step cut off by a kill left
    _barrier()
    dcp.save(
        {"model": get_model_state_dict(model), "optim": _optimizer_state(model, optimizer)},
        checkpoint_id=staged,
        no_dist=not dist.is_initialized(),
    )
    atomic_write_json(staged / GROUPS.format(rank=rank), _group_names(model, optimizer))
    if rank == 0:
        atomic_write(staged / EXTRA, lambda f: torch.save(extra, f))
    _barrier()  # every rank's files are on disk
    path = store.folder / f"checkpoint-{step}.dcp"
    if rank == 0:
        store.commit_folder(staged, step=step, epoch=epoch)
    _barrier()  # nobody goes on (or is killed for a move) before the checkpoint is committed
    return path


def load_whole(path: Path, payload: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Restore ``model`` and ``optimizer`` under this rank's layout from a plain checkpoint's payload (read from
    ``path``, named in errors): each rank keeps its slice of the whole model's tensors."""
    with _fitting(path):
        _restore_whole(path, payload, model, optimizer)


@contextlib.contextmanager
def _fitting(path: Path) -> Iterator[None]:
    """What restoring raises when a checkpoint's tensors do not fit the model: one InputError naming ``path``."""
    try:
        yield
    except (RuntimeError, KeyError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError.at(path, None, f"does not fit this model and optimizer: {reason}") from None


def load_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Collective: restore ``model`` and ``optimizer`` under this rank's layout from ``path``, a ``.dcp`` folder of
    any layout and world size; returns the payload without model and optimizer. The caller resolves and verifies
    ``path`` first (engine/checkpoint.py: resolve_checkpoint)."""
    with _fitting(path):
        keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        if any(key.startswith("optim.state.") for key in keys):
            model_state, optim_state = get_state_dict(model, optimizer, options=OPTIONS)
            state = {"model": model_state, "optim": optim_state}
            dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        else:  # written before the optimizer's first step: only its hyperparameters
            state = {"model": get_model_state_dict(model), "optim": _optimizer_state(model, optimizer)}
            dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())
            set_model_state_dict(model, state["model"])
            _set_hyperparameters(model, optimizer, state["optim"])
    return torch.load(path / EXTRA, map_location="cpu", weights_only=True)


def read_sharded(path: Path) -> dict[str, Any]:
    """The whole checkpoint in this process, as a plain checkpoint's payload: ``model`` the whole model's
    tensors, ``optimizer`` a plain optimizer's state dict (parameters numbered group by group, in order)."""
    state: dict[str, Any] = {}
    # dcp.load fills only the keys it is given; DCP's own dcp_to_torch_save reads a whole checkpoint this way.
    _load_state_dict(
        state, storage_reader=dcp.FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True
    )
    model, optim = state["model"], state.get("optim", {})
    groups = _merged_groups(path)
    numbers = {name: i for i, name in enumerate(name for group in groups for name in group)}
    per_param: dict[int, dict[str, Any]] = {}
    hyper: dict[str, dict[str, Any]] = {}
    for key, value in optim.items():
        kind, _, rest = key.partition(".")
        name, _, field = rest.rpartition(".")
        if kind == "state":
            per_param.setdefault(numbers[name], {})[field] = value
        else:
            hyper.setdefault(name, {})[field] = value
    param_groups = [{**hyper.get(group[0], {}), "params": [numbers[n] for n in group]} for group in groups if group]
    return {
        **read_fingerprint(path),
        "model": model,
        "optimizer": {"state": dict(sorted(per_param.items())), "param_groups": param_groups},
        "parameter_names": groups,
    }


def read_fingerprint(path: Path) -> dict[str, Any]:
    """``extra`` with the whole model's fingerprint (name -> shape, dtype), from DCP's metadata: what checking a
    checkpoint against a workload's model needs, without reading its tensors."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    fingerprint = {}
    for key, item in metadata.state_dict_metadata.items():
        where = (metadata.planner_data or {}).get(key, ())
        if isinstance(item, TensorStorageMetadata) and len(where) == 2 and where[0] == "model":
            fingerprint[where[1]] = (list(item.size), str(item.properties.dtype))
    return {**torch.load(path / EXTRA, map_location="cpu", weights_only=True), "fingerprint": fingerprint}


def _optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state in ``get_state_dict``'s flattened FQN form. Before its first step, only the
    hyperparameters: ``get_state_dict`` would take a step of zero gradients to make its state, which changes
    Adam's step count, so the state of a job that has not stepped is left alone."""
    if optimizer.state:
        return get_state_dict(model, optimizer, options=OPTIONS)[1]
    names = _names(model)
    return {
        f"param_groups.{names[p]}.{k}": v
        for g in optimizer.param_groups
        for p in g["params"]
        for k, v in g.items()
        if k != "params"
    }


def _set_hyperparameters(model: nn.Module, optimizer: torch.optim.Optimizer, flat: dict[str, Any]) -> None:
    names = _names(model)
    for group in optimizer.param_groups:
        first = names[group["params"][0]]
        group.update({k: flat[f"param_groups.{first}.{k}"] for k in group if k != "params"})


def _names(model: nn.Module) -> dict[nn.Parameter, str]:
    return {p: name for name, p in model.named_parameters()}


def _group_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    names = _names(model)
    return [[names[p] for p in group["params"]] for group in optimizer.param_groups]


def _merged_groups(path: Path) -> list[list[str]]:
    """The whole model's optimizer groups: each rank's group ``i`` in rank order (so pipeline stages in stage
    order), each name once. Ranks of a TP group or data-parallel replicas name the same parameters."""
    merged: list[list[str]] = []
    files = sorted(path.glob(GROUPS.format(rank="*")), key=lambda f: int(f.stem.rsplit("-", 1)[1]))
    for file in files:
        for i, group in enumerate(json.loads(file.read_text(encoding="utf-8"))):
            while len(merged) <= i:
                merged.append([])
            merged[i].extend(n for n in group if n not in merged[i])
    return merged


def _restore_whole(path: Path, payload: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a whole-model payload into this rank's part of the model and optimizer (each rank keeps its slice)."""
    state = payload["optimizer"]
    groups = payload.get("parameter_names") or _group_names(model, optimizer)
    names = [n for group in groups for n in group]
    if len(names) != sum(len(g["params"]) for g in state["param_groups"]):
        raise InputError.at(path, "optimizer", "its parameter groups do not fit this workload's optimizer")
    by_number = dict(zip((i for g in state["param_groups"] for i in g["params"]), names, strict=True))
    whole = {f"state.{by_number[i]}.{k}": v for i, s in state["state"].items() for k, v in s.items()}
    for group in state["param_groups"]:
        for i in group["params"]:
            whole.update({f"param_groups.{by_number[i]}.{k}": v for k, v in group.items() if k != "params"})
    if state["state"]:
        model_state, optim_state = get_state_dict(model, optimizer, options=OPTIONS)
    else:
        model_state, optim_state = get_model_state_dict(model), _optimizer_state(model, optimizer)
    model_state = _sliced_like(model_state, payload["model"])
    optim_state = _sliced_like(optim_state, whole)
    if state["state"]:
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    else:
        set_model_state_dict(model, model_state)
        _set_hyperparameters(model, optimizer, optim_state)


def _sliced_like(template: dict[str, Any], whole: dict[str, Any]) -> dict[str, Any]:
    """``whole``'s values for ``template``'s keys, each whole tensor cut as the template's DTensor is (locally:
    every rank holds the whole tensor)."""
    out: dict[str, Any] = {}
    for key, like in template.items():
        value = whole[key]
        if isinstance(like, DTensor):
            value = distribute_tensor(value.to(like.dtype), like.device_mesh, like.placements, src_data_rank=None)
        out[key] = value
    return out


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
