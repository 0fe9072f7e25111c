"""DCP checkpoints of hybrid layouts (engine/parallel/dcp.py): restored under another layout and world size.

On real gloo processes (tests/hybrid_support.py): tiny GPT in float64 trains 4 iterations under layout A and
saves every 2, then a new job under layout B (another world size, the same GBS) resumes the newest intact
checkpoint and trains to the end of its 2 epochs (12 iterations); every parameter equals the single-process
reference (engine/reference.py) within 1e-9. A plain layout on one process saves and resumes as the plain
trainer does (``save_checkpoint``, ``read_checkpoint`` + ``restore_checkpoint``), so hybrid -> plain and
plain -> hybrid are both crossed. In-process cases check what a ``.dcp`` checkpoint reads back as, and
``jabas checkpoint export``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from jabascli.cli.app import app
from jabascli.engine.checkpoint import CheckpointState, Progress, check_resumable, extra_payload, read_checkpoint
from jabascli.engine.checkpoint_store import CheckpointStore
from jabascli.engine.layout import checkpoint_folder
from jabascli.engine.parallel.dcp import load_sharded, save_sharded
from jabascli.engine.plan import load_plan
from jabascli.engine.reference import reference_run
from jabascli.engine.rerun import choose_start
from jabascli.errors import InputError
from jabascli.workload import load_workload
from tests.engine_support import load, max_abs_diff
from tests.test_hybrid_exactness import run_ranks, write_config

# (ga per server, [parallel], devices per server): each layout's GBS is 8 (12 for the 3-rank one).
TP2 = ([1], {"tp": 2}, 2)
PP2 = ([1], {"pp": 2, "stages": [[0, 2], [3, 3]]}, 2)
PLAIN = ([3], {}, 1)
SHARDED2 = ([1, 1], {"sharding": "full"}, 1)
SHARDED3 = ([0, 1, 2], {"sharding": "full"}, 1)
SHARDED2_GBS12 = ([2, 2], {"sharding": "full"}, 1)


def job(folder: Path, layout: tuple[list[int], dict[str, Any], int]) -> Path:
    ga, parallel, devices = layout
    folder.mkdir()
    return write_config(folder, "gpt", "adam", ga, parallel, devices=devices)


def world_of(layout: tuple[list[int], dict[str, Any], int]) -> int:
    return len(layout[0]) * layout[2]


def train_then_resume(
    tmp_path: Path, first: tuple[list[int], dict[str, Any], int], then: tuple[list[int], dict[str, Any], int]
) -> tuple[Path, Path]:
    """Layout ``first`` trains 4 iterations (checkpoints at 2 and 4); ``then`` resumes the store's newest intact
    one, trains to the end and is compared with the reference. Returns the store and ``first``'s config."""
    store = tmp_path / "store"
    config_a = job(tmp_path / "a", first)
    run_ranks(
        config_a, world_of(first), tmp_path / "a.pt", "--store", str(store), "--save-every", "2", "--stop-at", "4"
    )
    assert_resumed_run_equals_reference(tmp_path, store, then)
    return store, config_a


def assert_resumed_run_equals_reference(
    tmp_path: Path, store: Path, then: tuple[list[int], dict[str, Any], int]
) -> None:
    config_b = job(tmp_path / "b", then)
    out = tmp_path / "b.pt"
    run_ranks(config_b, world_of(then), out, "--resume", str(store))
    stages = then[1].get("pp", 1)
    trained: dict[str, torch.Tensor] = {}
    for part in [out] if stages == 1 else [Path(f"{out}.{r}") for r in range(world_of(then))]:
        trained.update(torch.load(part, weights_only=True))
    loaded = load(config_b)
    reference, _ = reference_run(loaded, load_plan(loaded), steps=12)
    diffs = max_abs_diff(trained, reference.state_dict())
    assert max(diffs.values()) <= 1e-9, {k: v for k, v in diffs.items() if v > 1e-9}


def test_tensor_parallel_checkpoint_resumes_as_a_plain_job_and_exports_the_whole_model(tmp_path: Path, cli) -> None:
    store, config_a = train_then_resume(tmp_path, TP2, PLAIN)
    assert sorted(p.name for p in store.iterdir()) == ["checkpoint-2.dcp", "checkpoint-4.dcp", "checkpoints.json"]
    out = tmp_path / "export" / "model.pt"
    result = cli.invoke(app, ["checkpoint", "export", str(store), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "checkpoint-4.dcp (step 4)" in result.output
    exported = torch.load(out, weights_only=True)
    loaded = load(config_a)
    reference, _ = reference_run(loaded, load_plan(loaded), steps=4)
    diffs = max_abs_diff(exported, reference.state_dict())
    assert max(diffs.values()) <= 1e-9, {k: v for k, v in diffs.items() if v > 1e-9}


def test_cut_off_checkpoint_of_pipeline_stages_is_passed_over_and_the_previous_resumed_plain(tmp_path: Path) -> None:
    """The newest ``.dcp`` checkpoint loses the end of a shard file (a save cut off, a disk error): the plain job
    resumes the one before (step 2) and still equals the reference."""
    store = tmp_path / "store"
    run_ranks(
        job(tmp_path / "a", PP2), 2, tmp_path / "a.pt", "--store", str(store), "--save-every", "2", "--stop-at", "4"
    )
    shard = next((store / "checkpoint-4.dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-16])
    with pytest.raises(Exception, match="cut off"):
        CheckpointStore(store).verify_folder(store / "checkpoint-4.dcp")
    found = CheckpointStore(store).newest()
    assert found is not None and found.path.name == "checkpoint-2.dcp" and "checkpoint-4.dcp" in found.passed_over[0]
    assert_resumed_run_equals_reference(tmp_path, store, PLAIN)


@pytest.mark.slow
def test_checkpoint_sharded_over_3_ranks_resumes_sharded_over_2(tmp_path: Path) -> None:
    train_then_resume(tmp_path, SHARDED3, SHARDED2_GBS12)


@pytest.mark.slow
def test_plain_checkpoint_resumes_sharded(tmp_path: Path) -> None:
    store, _ = train_then_resume(tmp_path, PLAIN, SHARDED2)
    assert (store / "checkpoint-4.pt").is_file()


def _tiny_gpt(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from jabascli.builtin_models import gpt

    torch.manual_seed(seed)
    options = {"variant": "tiny", "context": 8}
    model = gpt.build_model(options)
    return model, gpt.optimizer(model.parameters(), options)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    tokens = torch.randint(0, 64, (2, 9))
    torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


def _extra(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    state = CheckpointState(model, optimizer, None, Progress(step=step), workload="gpt", config={}, plan={})
    return extra_payload(state)


def test_dcp_checkpoint_reads_back_as_the_plain_payload(tmp_path: Path) -> None:
    """One process, no process group: the model and a two-group AdamW's state read back as the live ones."""
    model, optimizer = _tiny_gpt()
    _step(model, optimizer)
    path = save_sharded(
        CheckpointStore(tmp_path), step=1, epoch=0, model=model, optimizer=optimizer, extra=_extra(model, optimizer, 1)
    )
    payload = read_checkpoint(tmp_path)
    assert payload["progress"]["step"] == 1 and path == tmp_path / "checkpoint-1.dcp"
    assert max(max_abs_diff(payload["model"], model.state_dict()).values()) == 0
    theirs, ours = payload["optimizer"], optimizer.state_dict()
    assert theirs["param_groups"] == ours["param_groups"]
    assert theirs["state"].keys() == ours["state"].keys()
    for i, state in ours["state"].items():
        assert all(torch.equal(theirs["state"][i][k], v) for k, v in state.items())


def test_checkpoint_before_the_first_step_leaves_adam_fresh(tmp_path: Path) -> None:
    """Saved and restored before any optimizer step: Adam keeps no state (its first step stays its first)."""
    model, optimizer = _tiny_gpt()
    save_sharded(
        CheckpointStore(tmp_path), step=0, epoch=0, model=model, optimizer=optimizer, extra=_extra(model, optimizer, 0)
    )
    assert not optimizer.state
    restored, fresh = _tiny_gpt(seed=1)
    load_sharded(tmp_path / "checkpoint-0.dcp", restored, fresh)
    assert not fresh.state
    assert max(max_abs_diff(restored.state_dict(), model.state_dict()).values()) == 0


def test_a_save_cut_off_before_its_commit_is_never_resumed(tmp_path: Path) -> None:
    """Killed after the ranks wrote (the staging folder is whole) but before rank 0 committed it."""
    model, optimizer = _tiny_gpt()
    _step(model, optimizer)
    store = CheckpointStore(tmp_path)
    save_sharded(store, step=1, epoch=0, model=model, optimizer=optimizer, extra=_extra(model, optimizer, 1))
    _step(model, optimizer)
    save_sharded(store, step=2, epoch=0, model=model, optimizer=optimizer, extra=_extra(model, optimizer, 2))
    (tmp_path / "checkpoint-2.dcp").rename(store.staging(3))
    found = store.newest()
    assert found is not None and found.path.name == "checkpoint-1.dcp"
    save_sharded(store, step=4, epoch=0, model=model, optimizer=optimizer, extra=_extra(model, optimizer, 4))
    # The next commit removes what the cut-off save left, and all but the newest two the manifest names.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4.dcp", "checkpoints.json"]


def test_export_of_a_missing_or_cut_off_checkpoint_writes_nothing(tmp_path: Path, cli) -> None:
    model, optimizer = _tiny_gpt()
    _step(model, optimizer)
    path = save_sharded(
        CheckpointStore(tmp_path), step=1, epoch=0, model=model, optimizer=optimizer, extra=_extra(model, optimizer, 1)
    )
    (path / ".metadata").unlink()
    out = tmp_path / "model.pt"
    for source in (tmp_path / "nothing", path, tmp_path):
        result = cli.invoke(app, ["checkpoint", "export", str(source), "--out", str(out)])
        assert result.exit_code == 2, result.output
        assert len(result.output.strip().splitlines()) == 1 and str(source) in result.output
        assert not out.exists()


def test_workload_model_loads_the_export(tmp_path: Path, cli) -> None:
    """What the user does with the file: the workload's fresh model loads it strictly."""
    model, optimizer = _tiny_gpt()
    _step(model, optimizer)
    save_sharded(
        CheckpointStore(tmp_path), step=1, epoch=0, model=model, optimizer=optimizer, extra=_extra(model, optimizer, 1)
    )
    result = cli.invoke(app, ["checkpoint", "export", str(tmp_path), "-o", str(tmp_path / "m.pt")])
    assert result.exit_code == 0, result.output
    fresh = load_workload("gpt", {"variant": "tiny", "context": 8}).build_model()
    fresh.load_state_dict(torch.load(tmp_path / "m.pt", weights_only=True))
    assert max(max_abs_diff(fresh.state_dict(), model.state_dict()).values()) == 0


def test_resume_check_reads_a_dcp_checkpoints_fingerprint(tmp_path: Path) -> None:
    """``jabas train --resume`` checks the model from DCP's metadata: the same workload passes, another fails."""
    model, optimizer = _tiny_gpt()
    save_sharded(
        CheckpointStore(tmp_path), step=0, epoch=0, model=model, optimizer=optimizer, extra=_extra(model, optimizer, 0)
    )
    found = check_resumable(tmp_path, load_workload("gpt", {"variant": "tiny", "context": 8}))
    assert found.path == tmp_path / "checkpoint-0.dcp"
    with pytest.raises(InputError, match="another model"):
        check_resumable(tmp_path, load_workload("vit", {"variant": "tiny", "image_size": 16}))


def test_a_rerun_starts_from_the_newest_dcp_checkpoint(tmp_path: Path) -> None:
    """``jabas run``'s rerun takes a ``.dcp`` checkpoint as it takes a ``.pt`` one, newest first."""
    loaded = load(job(tmp_path / "a", PLAIN))
    model, optimizer = _tiny_gpt()
    _step(model, optimizer)
    store = CheckpointStore(checkpoint_folder(loaded))
    save_sharded(store, step=3, epoch=1, model=model, optimizer=optimizer, extra=_extra(model, optimizer, 3))
    start = choose_start(loaded, resume=None, fresh=False, max_steps=None)
    assert (start.resume, start.step, start.epoch, start.done) == (store.folder / "checkpoint-3.dcp", 3, 1, None)
