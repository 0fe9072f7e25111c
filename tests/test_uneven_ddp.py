"""Uneven-batch DDP (benchmarks/uneven_ddp.py) is synchronous SGD at GBS: real gloo processes, float64.

The reference is plain torch in this process: the mean loss of the iteration's GBS samples on one model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from benchmarks.uneven_ddp import UnevenSpec, split_batch, train_uneven

from jabascli.workload import load_workload

WORKLOAD = """
import torch
from torch import nn

def build_model(options):
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))

def train_dataset(options):
    g = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(torch.randn(40, 6, generator=g), torch.randint(0, 3, (40,), generator=g))

def loss(output, target):
    return nn.functional.cross_entropy(output, target)

def optimizer(params, options):
    return torch.optim.SGD(params, lr=0.3, momentum=0.9)

def synthetic_batch(batch_size, options):
    return torch.randn(batch_size, 6), torch.randint(0, 3, (batch_size,))
"""


def test_split_batch_follows_the_speeds() -> None:
    assert split_batch(64, [3.0, 1.0]) == [48, 16]
    assert split_batch(64, [1.5, 1.0]) == [38, 26]  # 38.4 and 25.6: the larger remainder gets the sample
    assert split_batch(3, [100.0, 1.0]) == [2, 1] and sum(split_batch(257, [2.2, 1.3, 0.4])) == 257


def test_uneven_batches_train_exactly_as_one_gbs(tmp_path: Path) -> None:
    (tmp_path / "toy.py").write_text(WORKLOAD)
    steps, batches = 3, (5, 3)
    # The slow rank sleeps in its hook: timing moves, numbers must not.
    spec = UnevenSpec(str(tmp_path / "toy.py"), {}, batches, (1.0, 2.0), steps, seed=11, dtype="float64", record=True)
    train_uneven(spec, tmp_path / "out")

    workload = load_workload(str(tmp_path / "toy.py"), {})
    torch.manual_seed(11)
    model = workload.build_model().double()
    optimizer = workload.optimizer(model.parameters())
    data = workload.train_dataset()
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(11)).tolist()
    gbs, first_grads = sum(batches), None
    for step in range(steps):
        idx = order[step * gbs : (step + 1) * gbs]
        inputs, target = data.tensors[0][idx].double(), data.tensors[1][idx]
        optimizer.zero_grad()
        workload.loss(model(inputs), target).backward()
        if first_grads is None:
            first_grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()
        optimizer.step()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()

    assert first_grads is not None
    np.testing.assert_allclose(np.load(tmp_path / "out" / "grads.npy"), first_grads, rtol=0, atol=1e-9)
    np.testing.assert_allclose(np.load(tmp_path / "out" / "params.npy"), params, rtol=0, atol=1e-9)
    assert (
        np.abs(
            params
            - np.concatenate([p.detach().reshape(-1).numpy() for p in workload.build_model().double().parameters()])
        ).max()
        > 1e-3
    )  # it trained


def test_the_split_must_be_the_gbs() -> None:
    with pytest.raises(ValueError):
        split_batch(1, [1.0, 1.0])
