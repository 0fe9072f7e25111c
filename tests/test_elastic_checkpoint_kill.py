"""A trainer killed (SIGKILL) while it writes a checkpoint leaves the previous one whole and resumable."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from jabascli.engine.checkpoint import read_checkpoint, restore_checkpoint

# What rank 0 does at a checkpoint, in a loop, on a model big enough (64 MB) that a write takes a while.
WRITER = """
import sys
from pathlib import Path

import torch
from torch import nn

from jabascli.engine.checkpoint import CheckpointState, Progress, save_checkpoint
from jabascli.engine.checkpoint_store import CheckpointStore

torch.manual_seed(0)
model = nn.Linear(4000, 4000)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(1, 1000):
    with torch.no_grad():
        model.bias.fill_(step)
    state = CheckpointState(model, optimizer, None, Progress(step=step), workload="big", config={}, plan={})
    save_checkpoint(CheckpointStore(Path(sys.argv[1])), state)
    print(step, flush=True)
"""


def test_a_kill_during_a_checkpoint_write_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path
    for _attempt in range(5):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        saved = int(proc.stdout.readline())  # one whole checkpoint exists
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".checkpoint-*.pt.*.tmp")) and time.monotonic() < deadline:
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        saved = max([saved, *(int(line) for line in proc.stdout.read().split())])
        if list(tmp_path.glob(".checkpoint-*.pt.*.tmp")):
            break  # killed mid-write, as wanted
    leftovers = list(tmp_path.glob(".checkpoint-*.pt.*.tmp"))
    assert leftovers, "never caught the writer mid-write"

    payload = read_checkpoint(path)  # a whole checkpoint: the last one reported (or one renamed in place
    step = payload["progress"]["step"]  # just before the kill, not yet reported), never the half-written one
    assert step in (saved, saved + 1)
    model = nn.Linear(4000, 4000)
    progress = restore_checkpoint(
        payload, path, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), scheduler=None
    )
    assert progress.step == step and float(model.bias.detach()[0]) == step
