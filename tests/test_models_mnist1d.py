"""The mnist1d workload: the package's own data, generated here (never downloaded), cached safely, and the paper's CNN.

Training through two real ``jabas train`` processes is in ``test_models_train.py``
with the other built-ins.
"""

from __future__ import annotations

import pickle
import random
import socket
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from jabascli.errors import InputError
from jabascli.workload import Workload, load_workload

TINY = {"variant": "tiny"}


@pytest.fixture(autouse=True)
def fresh_memory() -> Any:
    """Each test generates or reads the data itself: no arrays kept in memory from another test."""
    module = load_workload("mnist1d").module
    module.arrays.cache_clear()
    yield module
    module.arrays.cache_clear()


def data(w: Workload) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    train, val = w.train_dataset(), w.val_dataset()
    return (*train.tensors, *val.tensors)


def test_the_data_is_the_packages_own_generator_with_its_defaults(tmp_path: Path) -> None:
    """The tiny variant's 800 + 200 samples are the package's make_dataset at 1,000 samples, split alike.

    The ``paper`` variant (4,000 + 1,000, seed 42) differs only in size, so it is
    the package's default data set (5,000 samples, an 80/20 split), as the paper used.
    """
    from mnist1d.data import get_dataset_args, make_dataset

    x, y, x_val, y_val = data(load_workload("mnist1d", TINY, data=tmp_path))
    args = get_dataset_args()
    args.num_samples = 1000
    reference = make_dataset(args)  # seed 42, an 80/20 split: 800 + 200
    assert x.shape == (800, 1, 40) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert np.array_equal(x.squeeze(1).numpy(), reference["x"].astype(np.float32))
    assert np.array_equal(y.numpy(), reference["y"])
    assert np.array_equal(x_val.squeeze(1).numpy(), reference["x_test"].astype(np.float32))
    assert np.array_equal(y_val.numpy(), reference["y_test"])
    paper = load_workload("mnist1d", {"variant": "paper"}).module.settings({"variant": "paper"})
    assert (paper.train_samples, paper.val_samples, paper.data_seed) == (4000, 1000, args.seed)


def test_data_is_deterministic_for_a_seed_and_has_the_sizes_asked_for(tmp_path: Path, fresh_memory: Any) -> None:
    # 137 + 41 = 178 samples: the generator makes 180 (18 per digit) and the last two are left out.
    options = {**TINY, "train_samples": 137, "val_samples": 41, "data_seed": 3}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = data(load_workload("mnist1d", options, data=tmp_path / "a"))
    assert [len(t) for t in first] == [137, 137, 41, 41]
    assert sorted(set(first[1].tolist())) == list(range(10))  # every digit occurs
    assert not set(map(tuple, first[0].squeeze(1).tolist())) & set(map(tuple, first[2].squeeze(1).tolist()))

    fresh_memory.arrays.cache_clear()
    again = data(load_workload("mnist1d", options, data=tmp_path / "b"))  # generated anew, in another folder
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)

    fresh_memory.arrays.cache_clear()
    other = data(load_workload("mnist1d", {**options, "data_seed": 4}, data=tmp_path / "a"))
    assert not torch.equal(other[0], first[0])


def test_generation_leaves_the_global_random_state_alone(tmp_path: Path) -> None:
    np.random.seed(7)
    random.seed(7)
    expected = (np.random.get_state()[1].copy(), random.getstate())
    load_workload("mnist1d", TINY, data=tmp_path).train_dataset()
    assert np.array_equal(np.random.get_state()[1], expected[0]) and random.getstate() == expected[1]


def test_nothing_is_downloaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Generation works with every way to the network blocked, and writes no pickle anywhere."""
    import mnist1d.data
    import requests

    def no_network(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("mnist1d tried to use the network")

    for name in ("socket", "create_connection", "getaddrinfo"):
        monkeypatch.setattr(socket, name, no_network)
    monkeypatch.setattr(requests, "get", no_network)
    monkeypatch.setattr(mnist1d.data, "get_dataset", no_network)
    monkeypatch.chdir(tmp_path)  # get_dataset would write ./mnist1d_data.pkl
    cache = tmp_path / "cache"
    cache.mkdir()
    x, y, x_val, y_val = data(load_workload("mnist1d", TINY, data=cache))
    assert (len(x), len(y), len(x_val), len(y_val)) == (800, 800, 200, 200)
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert files == [f"cache/mnist1d-1000-seed42-{version()}.npz"], files
    with np.load(cache / files[0].removeprefix("cache/"), allow_pickle=False) as f:  # arrays only, no objects
        assert f["x"].shape == (1000, 40) and f["y"].shape == (1000,)


def version() -> str:
    from importlib.metadata import version

    return version("mnist1d")


def test_the_cache_file_is_used_and_a_broken_one_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_memory: Any
) -> None:
    first = data(load_workload("mnist1d", TINY, data=tmp_path))
    path = tmp_path / f"mnist1d-1000-seed42-{version()}.npz"

    fresh_memory.arrays.cache_clear()
    real_generate = fresh_memory.generate

    def must_not_generate(*args: Any) -> Any:
        raise AssertionError("regenerated although the cache file is good")

    monkeypatch.setattr(fresh_memory, "generate", must_not_generate)
    for a, b in zip(first, data(load_workload("mnist1d", TINY, data=tmp_path)), strict=True):
        assert torch.equal(a, b)

    # Truncated, or someone else's arrays under the name: both are regenerated and replaced.
    good = path.read_bytes()
    monkeypatch.setattr(fresh_memory, "generate", real_generate)
    with path.open("wb") as f:
        np.savez(f, x=np.zeros((1000, 40), np.float64), y=np.zeros(1000, np.int64))
    for broken in (good[: len(good) // 2], path.read_bytes()):
        path.write_bytes(broken)
        fresh_memory.arrays.cache_clear()
        for a, b in zip(first, data(load_workload("mnist1d", TINY, data=tmp_path)), strict=True):
            assert torch.equal(a, b)
        assert path.read_bytes() == good
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind


def test_a_data_path_that_is_not_a_folder_is_named(tmp_path: Path) -> None:
    path = tmp_path / "file.npz"
    path.write_bytes(b"")
    with pytest.raises(InputError, match=r"job\.data: .*file\.npz is not a folder"):
        load_workload("mnist1d", TINY, data=path).train_dataset()


def test_unknown_and_wrong_options_are_named() -> None:
    with pytest.raises(InputError) as raised:
        load_workload("mnist1d", {"train_sampels": 10, "val_samples": -1, "optimizer": "lbfgs"}).build_model()
    lines = "\n".join(raised.value.lines())
    assert "job.options.train_sampels: unknown option" in lines
    assert "job.options.val_samples: must be at least 0" in lines
    assert "job.options.optimizer: expected one of adam, sgd" in lines
    with pytest.raises(InputError, match=r"job\.options\.data_seed: must be below 2\*\*32"):
        load_workload("mnist1d", {"data_seed": 2**32}).build_model()


def test_no_validation_set_when_asked(tmp_path: Path) -> None:
    assert load_workload("mnist1d", {**TINY, "val_samples": 0}, data=tmp_path).val_dataset() is None


def test_the_model_is_the_papers_conv_base() -> None:
    w = load_workload("mnist1d")
    torch.manual_seed(0)
    model = w.build_model()
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert shapes == {
        "conv1.weight": (25, 1, 5),
        "conv1.bias": (25,),
        "conv2.weight": (25, 25, 3),
        "conv2.bias": (25,),
        "conv3.weight": (25, 25, 3),
        "conv3.bias": (25,),
        "linear.weight": (10, 125),
        "linear.bias": (10,),
    }
    assert sum(p.numel() for p in model.parameters()) == 5210  # the paper's count
    inputs, target = w.synthetic_batch(6)
    w.loss(model(inputs), target).backward()
    assert all(p.grad is not None for p in model.parameters())  # DDP needs every gradient
    narrow = load_workload("mnist1d", {"width": 8}).build_model()
    assert narrow.linear.in_features == 40


def test_datasets_survive_pickling(tmp_path: Path) -> None:
    """DataLoader workers started with spawn or forkserver receive the dataset by pickle."""
    dataset = load_workload("mnist1d", TINY, data=tmp_path).train_dataset()
    copy = pickle.loads(pickle.dumps(dataset))
    assert len(copy) == len(dataset) and all(torch.equal(a, b) for a, b in zip(copy[5], dataset[5], strict=True))


def test_the_papers_recipe_learns_in_one_process(tmp_path: Path) -> None:
    """Adam at 1e-2, 4 epochs of the tiny set at batch 50 (64 steps): far above chance on held-out samples."""
    torch.set_num_threads(1)
    w = load_workload("mnist1d", TINY, data=tmp_path)
    torch.manual_seed(0)
    model = w.build_model()
    opt = w.optimizer(model.parameters())
    loader = torch.utils.data.DataLoader(w.train_dataset(), batch_size=50, shuffle=True)
    for _ in range(4):
        for x, y in loader:
            opt.zero_grad()
            w.loss(model(x), y).backward()
            opt.step()
    x_val, y_val = w.val_dataset().tensors
    with torch.no_grad():
        accuracy = w.count_correct(model(x_val), y_val) / len(y_val)
    assert accuracy > 0.3, accuracy  # 0.53 here; labels that do not belong to their signals give 0.1


def test_trainers_starting_together_generate_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The folder lock: three trainers at once (threads here; flock works per open file) make the data once."""
    module = load_workload("mnist1d").module
    real_generate, calls = module.generate, []

    def slow_generate(*args: Any) -> Any:
        calls.append(args)
        time.sleep(0.3)  # all three are waiting by now
        return real_generate(*args)

    monkeypatch.setattr(module, "generate", slow_generate)
    results: list[tuple[torch.Tensor, torch.Tensor]] = []
    threads = [
        threading.Thread(target=lambda: results.append(module.arrays.__wrapped__(1000, 42, tmp_path))) for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(results) == 3
    assert all(torch.equal(x, results[0][0]) and torch.equal(y, results[0][1]) for x, y in results)
