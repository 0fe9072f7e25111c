"""`jabas profile hybrid` on tiny GPT (a fast CPU server and an emulated 3x slower one, real child processes and
two gloo processes): the profiles parse back, hold what the model is, and `jabas solve --hybrid` plans from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jabascli.config import load_config
from jabascli.engine.plan import load_plan
from jabascli.profiles.hybrid import read_profiles
from tests.conftest import run_jabas

TINY_GPT_PARAMS = 55_488  # models/gpt.py's table
BUDGET = 600_000
"""Bytes: tiny GPT's parameters, gradients and AdamW state take 4 x 222 KB, so neither device holds it whole."""


@pytest.mark.slow
def test_profile_parses_back_and_plans(tmp_path: Path) -> None:
    config = tmp_path / "jabas.toml"
    config.write_text(
        '[job]\nworkload = "gpt"\noptions = { variant = "tiny" }\n\n'
        f'[[cluster.servers]]\nname = "fast"\ndevice_type = "cpu"\nmemory_bytes = {BUDGET}\n\n'
        f'[[cluster.servers]]\nname = "slow"\ndevice_type = "cpu-slow"\n'
        f"emulate = {{ slowdown = 3.0, memory_bytes = {BUDGET} }}\n"
    )
    profiled = run_jabas("profile", "hybrid", "-c", str(config), "--mbs", "1,2", "--json")
    assert profiled.returncode == 0, profiled.stderr
    assert json.loads(profiled.stdout)["devices"] == ["cpu", "cpu-slow"]

    profiles = read_profiles(tmp_path / "profiles", "gpt")
    blocks = profiles.blocks
    assert len(blocks.blocks) == 4
    assert sum(b.params_bytes[1] for b in blocks.blocks) == 4 * TINY_GPT_PARAMS
    assert all(b.act_bytes[1] > b.boundary_bytes > 0 for b in blocks.blocks)  # checkpointing keeps less
    assert blocks.optimizer_bytes_per_param_byte == pytest.approx(2.0, abs=0.01)  # AdamW: two moments
    fast, slow = profiles.devices["cpu"], profiles.devices["cpu-slow"]
    assert (fast.memory_bytes, slow.memory_bytes) == (BUDGET, BUDGET)
    assert sorted(fast.times) == [1, 2] and sorted(fast.times[1]) == [1, 2]  # gpt has a TP plan: TP 2 too
    assert "TP 2 measured" in fast.source and "TP 2 measured" in slow.source
    for b in (1, 2):
        # the emulated device is measured running the engine's emulation (3x, and the emulation's own cost; summed
        # over the blocks, and only 1.5x asked, since the two are measured at different moments of a shared machine)
        plain, emulated = fast.times[b][1], slow.times[b][1]
        assert sum(fs + gs for fs, gs, _ in emulated) > 1.5 * sum(f + g for f, g, _ in plain)
        assert [u for _, _, u in emulated] == pytest.approx([u for _, _, u in plain])  # the update is not slowed
        # every block checkpointed, as the runtime does it: its forward and backward with the recompute cost more,
        # summed over the blocks (one block's is about a millisecond here, and a busy host's noise flipped one once)
        for dev in (fast, slow):
            assert len(dev.checkpointed[b]) == 4 and all(fc > 0 and gc > 0 for fc, gc in dev.checkpointed[b])
            assert sum(fc + gc for fc, gc in dev.checkpointed[b]) > sum(f + g for f, g, _ in dev.times[b][1])
        # TP 2, measured on two processes: the emulated device sleeps twice each block's CPU time on top
        assert len(fast.times[b][2]) == len(slow.times[b][2]) == 4
        for (f, g, u), (fs, gs, us) in zip(fast.times[b][2], slow.times[b][2], strict=True):
            assert 0 < f < fs and 0 < g < gs and us == pytest.approx(u)
    # Sharded over 2 (FSDP2 units, two processes): every block at every micro-batch size; the emulated device
    # measured running the emulation, slower in sum
    assert "sharded (FSDP2) over 2 measured" in fast.source and fast.sharded_over == 2
    for b in (1, 2):
        assert len(fast.sharded[b]) == len(slow.sharded[b]) == 4
        for row in fast.sharded[b] + slow.sharded[b]:
            assert min(row.fwd_first, row.fwd, row.bwd, row.bwd_last, row.update) > 0
        assert sum(r.fwd + r.bwd for r in slow.sharded[b]) > sum(r.fwd + r.bwd for r in fast.sharded[b])
        # the first forward gathers the parameters, the later ones do not
        assert sum(r.fwd_first for r in fast.sharded[b]) > sum(r.fwd for r in fast.sharded[b])
    kinds = {(c.collective, c.size_bytes) for c in profiles.network.collectives}
    assert {k for k, _ in kinds} == {"all_reduce", "all_gather", "reduce_scatter", "send"}
    assert {c.link for c in profiles.network.collectives} == {"intra", "inter"}  # the servers share this machine
    sent = sorted((c.size_bytes, c.seconds) for c in profiles.network.collectives if c.collective == "send")
    assert profiles.network.measured_seconds("send", "inter", sent[0][0]) == pytest.approx(sent[0][1])
    assert all(c.seconds > 0 for c in profiles.network.collectives)

    out = tmp_path / "plan.json"
    solved = run_jabas("solve", "-c", str(config), "--hybrid", "--gbs", "16", "--out", str(out))
    assert solved.returncode == 0, solved.stderr
    plan = load_plan(load_config(config), out)
    assert plan.parallel is not None and plan.parallel.pp == 2  # the only way to fit: one stage per device
    assert plan.world_size == 2 and plan.gbs == 16
    assert sorted(r.server for r in plan.ranks) == ["fast", "slow"]
