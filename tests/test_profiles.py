"""Profile formats: the seed's reference data reads back, writes round-trip, bad files are named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from jabascli.errors import InputError
from jabascli.profiles import (
    BucketProfile,
    CommMeta,
    CommProfile,
    CompProfile,
    MemoryProfile,
    load_profile_set,
    read_bucket_profile,
    read_comm_profile,
    read_comp_profiles,
    read_memory_profiles,
    write_bucket_profile,
    write_comm_profile,
    write_comp_profile,
    write_memory_profile,
)


def load_reference(root: Path):  # type: ignore[no-untyped-def]
    return load_profile_set(
        root / "cluster_mem_profile_data",
        root / "cluster_comp_profile_data",
        root / "comm_profile_data",
        root / "bucket_profile_data",
    )


def test_whole_reference_folder_reads(reference_dir: Path) -> None:
    profiles = load_reference(reference_dir)
    assert profiles.model == "resnet50"
    assert profiles.servers() == ["node0", "node1"]
    assert profiles.device_type("node0") == "Tesla V100-PCIE-16GB"
    # V100 fits 3 VSWs at LBS 32 and nothing at LBS 160 (no profile there); P100 fits 4.
    assert profiles.max_vsw("node0", 32) == 3 and profiles.max_vsw("node1", 32) == 4
    assert profiles.lbs_values("node0") == [32, 64, 96, 128]
    assert profiles.lbs_values("node1") == [32, 64, 96, 128, 160]
    assert sorted(profiles.comp_points("node1", 32)) == [1, 2, 4]
    assert profiles.comp_points("node0", 32)[3].fwd_time == pytest.approx(87.008, abs=1e-3)
    assert profiles.bucket is not None and len(profiles.bucket.bucket_size_distribution) == 5
    assert sum(profiles.bucket.bucket_size_distribution) == pytest.approx(97.5, abs=0.5)
    assert set(profiles.comm) == {"intra", "inter"}
    assert len(profiles.comm["intra"].ideal_ms) == 9 and profiles.comm["intra"].meta is None


def test_round_trip(tmp_path: Path) -> None:
    mem = MemoryProfile(gpu_type="cpu", total_memory=10**9, lbs=16, max_num_models=3)
    comp = CompProfile(
        model="digits", gpu_type="cpu", lbs=16, num_models=3, total_time=9.0, data_time=1.0, fwd_time=2.0,
        bwd_time=4.0, update_time=1.5, copy_time=0.5,
    )  # fmt: skip
    write_memory_profile(tmp_path / "mem", "local", mem)
    path = write_comp_profile(tmp_path / "comp", "local", comp)
    assert path.name == "local_digits_16_3_comp_profile.json"
    write_bucket_profile(tmp_path / "bucket", BucketProfile(model="digits", bucket_size_distribution=[0.1, 0.2]))
    comm = CommProfile(
        kind="intra", ideal_ms=[0.1, 1.0], measured_ms=[0.5, 2.0], meta=CommMeta(bandwidth=1e9, world_size=2)
    )
    write_comm_profile(tmp_path / "comm", comm)

    assert read_memory_profiles(tmp_path / "mem") == {("local", 16): mem}
    assert read_comp_profiles(tmp_path / "comp") == {("local", 16, 3): comp}
    assert read_bucket_profile(tmp_path / "bucket").bucket_size_distribution == [0.1, 0.2]
    assert read_comm_profile(tmp_path / "comm", "intra") == comm
    assert read_comm_profile(tmp_path / "comm", "inter") is None


def test_profiles_without_a_precision_are_unknown_and_fit_any_job(tmp_path: Path) -> None:
    # The seed's files (and jabas' before precision was recorded) have no precision field.
    write_memory_profile(tmp_path / "mem", "a", MemoryProfile(gpu_type="x", total_memory=1, lbs=8, max_num_models=1))
    measured = MemoryProfile(gpu_type="x", total_memory=1, lbs=16, max_num_models=1, precision="bf16", threads=2)
    write_memory_profile(tmp_path / "mem", "a", measured)
    (tmp_path / "comp").mkdir()
    profiles = load_profile_set(tmp_path / "mem", tmp_path / "comp")
    assert {lbs: p.measured_precision for (_, lbs), p in profiles.memory.items()} == {8: "unknown", 16: "bf16"}
    profiles.check_precision("bf16")
    with pytest.raises(InputError, match=r"16/a: precision: measured in bf16, but \[job\] precision is fp32"):
        profiles.check_precision("fp32")


def test_malformed_json_names_the_file(tmp_path: Path, reference_dir: Path) -> None:
    root = tmp_path / "ref"
    shutil.copytree(reference_dir, root)
    bad = root / "cluster_comp_profile_data" / "32" / "node1" / "resnet50_32_2_comp_profile.json"
    bad.write_text("{broken")
    with pytest.raises(InputError) as info:
        load_reference(root)
    assert str(bad) in info.value.lines()[0] and "invalid JSON" in info.value.lines()[0]


def test_missing_key_and_wrong_lbs_folder(tmp_path: Path) -> None:
    folder = tmp_path / "mem" / "32" / "node0"
    folder.mkdir(parents=True)
    (folder / "max_memory_profile_info.json").write_text(json.dumps({"gpu_type": "x", "lbs": 32, "max_num_models": 1}))
    with pytest.raises(InputError, match="total_memory: required key is missing"):
        read_memory_profiles(tmp_path / "mem")
    (folder / "max_memory_profile_info.json").write_text(
        json.dumps({"gpu_type": "x", "total_memory": 1, "lbs": 64, "max_num_models": 1})
    )
    with pytest.raises(InputError, match="sits in folder 32"):
        read_memory_profiles(tmp_path / "mem")


def test_disagreeing_models_and_unknown_servers(tmp_path: Path, reference_dir: Path) -> None:
    root = tmp_path / "ref"
    shutil.copytree(reference_dir, root)
    profiles = load_reference(root)
    # A server with no profiles of its own borrows those of its device type...
    assert profiles.resolve_servers([("node7", "Tesla P100-PCIE-16GB")]) == {"node7": "node1"}
    # ...and one of an unknown type is named, with the folder looked in.
    with pytest.raises(InputError, match="no profiles for server 'node9'"):
        profiles.resolve_servers([("node9", "RTX 3090")])
    bucket = root / "bucket_profile_data" / "resnet50_bucket_size_profile.json"
    bucket.write_text(json.dumps({"model": "vit", "bucket_size_distribution": [1.0]}))
    bucket.rename(bucket.with_name("vit_bucket_size_profile.json"))
    with pytest.raises(InputError, match="profiles disagree on the model: resnet50, vit"):
        load_reference(root)


def test_bad_comm_line_named(tmp_path: Path) -> None:
    (tmp_path / "intra_comm_profile_data.txt").write_text("0.1,0.2\nfoo\n")
    with pytest.raises(InputError, match="line 2"):
        read_comm_profile(tmp_path, "intra")
