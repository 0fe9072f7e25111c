"""The profilers run on every built-in workload, and ResNet-50's buckets match the seed's."""

from __future__ import annotations

from pathlib import Path

import pytest

from jabascli.profiles import read_bucket_profile, read_comp_profiles, read_memory_profiles
from jabascli.workload import load_workload
from tests.conftest import REPO, run_jabas

TINY = ["resnet_tiny", "vit_tiny", "gnmt_tiny", "faster_rcnn_tiny"]


def jabas_ok(*args: str) -> None:
    result = run_jabas(*args)
    assert result.returncode == 0, result.stdout + result.stderr


def test_full_resnet50_buckets_match_the_seed_profile(tmp_path: Path, reference_dir: Path) -> None:
    jabas_ok("profile", "bucket", "-c", str(REPO / "examples" / "resnet50.toml"), "--out", str(tmp_path))
    ours = read_bucket_profile(tmp_path).bucket_size_distribution
    seed = read_bucket_profile(reference_dir / "bucket_profile_data").bucket_size_distribution
    assert sum(ours) == pytest.approx(25_557_032 * 4 / 2**20)  # every float32 parameter, once
    assert len(ours) == len(seed) == 5
    assert ours == pytest.approx(seed, abs=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("example", TINY)
def test_memory_comp_and_bucket_profilers_on_tiny_models(tmp_path: Path, example: str) -> None:
    config = str(REPO / "examples" / f"{example}.toml")
    mem, comp, bucket = tmp_path / "mem", tmp_path / "comp", tmp_path / "bucket"
    lbs = "2" if example == "faster_rcnn_tiny" else "4"
    jabas_ok("profile", "mem", "-c", config, "--out", str(mem), "--search", "static", "--lbs", lbs,
             "--max-vsw", "2", "--trial-iters", "1")  # fmt: skip
    jabas_ok("profile", "comp", "-c", config, "--out", str(comp), "--memory-dir", str(mem),
             "--warmup", "1", "--iters", "3", "--synthetic-data")  # fmt: skip
    jabas_ok("profile", "bucket", "-c", config, "--out", str(bucket))

    memory = read_memory_profiles(mem)
    assert [(server, b) for server, b in memory] == [("local", int(lbs))]
    assert memory[("local", int(lbs))].max_num_models == 2  # the cap: a CPU server's budget is its RAM
    times = read_comp_profiles(comp)
    assert sorted(n for _, _, n in times) == [1, 2]
    assert all(t.fwd_time > 0 and t.bwd_time > 0 for t in times.values())
    model = load_workload(*_workload_of(config)).build_model()
    total_mib = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) / 2**20
    assert sum(read_bucket_profile(bucket).bucket_size_distribution) == pytest.approx(total_mib, rel=1e-6)


def _workload_of(config: str) -> tuple[str | None, dict[str, object]]:
    from jabascli.config import load_config

    job = load_config(config, check_profiles=False).config.job
    return job.workload, job.options
