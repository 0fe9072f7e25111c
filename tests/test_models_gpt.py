"""The gpt workload: GPT-2's sizes, generated tokens and token files, and that it learns."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from jabascli.errors import InputError
from jabascli.workload import load_workload


@pytest.mark.parametrize(
    ("variant", "parameters"),
    [("tiny", 55_488), ("small", 163_037_184), ("medium", 406_286_336), ("large", 838_359_040), ("xl", 1_638_022_400)],
)
def test_sizes_are_gpt2s_with_an_untied_head(variant: str, parameters: int) -> None:
    with torch.device("meta"):  # no memory: only the shapes
        model = load_workload("gpt", {"variant": variant}).build_model()
    assert sum(p.numel() for p in model.parameters()) == parameters
    blocks = load_workload("gpt", {"variant": variant}).blocks(model)
    assert blocks is not None and len(blocks) == {"tiny": 4, "small": 12, "medium": 24, "large": 36, "xl": 48}[variant]


def test_token_files_npy_and_bin_give_windows_of_context_plus_one(tmp_path: Path) -> None:
    tokens = np.arange(100) % 64
    np.save(tmp_path / "tokens.npy", tokens.astype(np.int32))
    tokens.astype("<u2").tofile(tmp_path / "tokens.bin")
    for name in ("tokens.npy", "tokens.bin"):
        w = load_workload("gpt", {"variant": "tiny", "context": 9, "val_fraction": 0.2}, data=tmp_path / name)
        train, val = w.train_dataset(), w.val_dataset()
        assert (len(train), len(val)) == (8, 2)  # 100 // 10 windows, the last fifth held out
        inputs, target = train[1]
        assert inputs.tolist() == list(range(10, 19)) and target.tolist() == list(range(11, 20))
        assert val[0][0].tolist() == [t % 64 for t in range(80, 89)]


def test_token_ids_outside_the_vocabulary_are_refused(tmp_path: Path) -> None:
    np.save(tmp_path / "tokens.npy", np.array([1, 2, 64]))
    with pytest.raises(InputError, match=r"token ids must lie in \[0, 64\)"):
        load_workload("gpt", {"variant": "tiny"}, data=tmp_path / "tokens.npy").train_dataset()
    with pytest.raises(InputError, match=r"job\.options\.context"):
        load_workload("gpt", {"variant": "tiny", "context": 17}).build_model()


def test_tiny_gpt_learns_the_generated_tokens() -> None:
    torch.manual_seed(0)
    w = load_workload("gpt", {"variant": "tiny", "lr": 1e-2})
    model, data = w.build_model(), w.train_dataset()
    optimizer = w.optimizer(model.parameters())
    losses = []
    for step in range(80):
        batch = [data[(step * 16 + i) % len(data)] for i in range(16)]
        inputs, target = torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch])
        loss = w.loss(model(inputs), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    # From chance (ln 64 = 4.2) towards the walk's entropy (5 next tokens: ln 5 = 1.6).
    assert np.mean(losses[:5]) > 3.8 and np.mean(losses[-5:]) < 3.2, losses
