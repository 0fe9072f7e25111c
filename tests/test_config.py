"""Configuration loading: TOML, seed JSON, and every kind of bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from jabascli.config import load_config
from jabascli.config.models import JabasConfig
from jabascli.errors import InputError
from tests.conftest import REPO, run_jabas

GOOD = """
[job]
workload = "digits"
lbs = 16

[batching]
gbs_min = 64
gbs_max = 512
similarity_target = 0.1

[[cluster.servers]]
name = "a"
device_type = "cpu"
devices = 2

[[cluster.servers]]
name = "b"
device_type = "slow"
emulate = { slowdown = 2.0, memory_bytes = 1000000 }

[cluster]
"""


def write(tmp_path: Path, text: str, name: str = "jabas.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def problems_of(path: Path) -> list[str]:
    with pytest.raises(InputError) as info:
        load_config(path)
    return info.value.lines()


def test_good_toml_loads_and_resolves_paths(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, GOOD.replace("[cluster]\n", "[storage]\nrun_dir = 'out'\n"))).config
    assert cfg.job.lbs == 16
    assert [s.name for s in cfg.available()] == ["a", "b"]
    assert cfg.server("b").emulate is not None and cfg.server("b").emulate.slowdown == 2.0
    assert cfg.storage.run_dir == tmp_path / "out"


@pytest.mark.parametrize(
    ("text", "field", "words"),
    [
        ("[job]\nlbs = 0\n", "job.lbs", "greater than 0"),
        ("[job]\nepochs = 'ten'\n", "job.epochs", "integer"),
        ("[job]\nlbz = 3\n", "job.lbz", "unknown key"),
        ("[batching]\ngbs_min = -64\n", "batching.gbs_min", "greater than 0"),
        ("[batching]\ngbs_max = 0\n", "batching.gbs_max", "greater than 0"),
        ("[batching]\ngbs_min = 512\ngbs_max = 64\n", "batching.gbs_min", "above the upper bound"),
        ("[batching]\nsimilarity_target = 0\n", "batching.similarity_target", "greater than 0"),
        ("[batching]\nsimilarity_target = 1.5\n", "batching.similarity_target", "less than or equal to 1"),
        ("[cluster]\navailable_servers = ['nope']\n", "cluster.available_servers[0]", "no cluster entry"),
        ("[profiles]\ncomputation = 'missing_dir'\n", "profiles.computation", "does not exist"),
        ("[[cluster.servers]]\nname = 'x'\n", "cluster.servers[0].device_type", "required key is missing"),
    ],
)
def test_bad_toml_names_file_and_field(tmp_path: Path, text: str, field: str, words: str) -> None:
    path = write(tmp_path, text)
    lines = problems_of(path)
    assert any(str(path) in line and field in line and words in line for line in lines), lines


def test_profiles_root_may_not_exist_yet(tmp_path: Path) -> None:
    # `jabas profile` creates [profiles] dir; only folders named to be read from must exist.
    loaded = load_config(write(tmp_path, "[profiles]\ndir = 'later'\n"))
    assert loaded.profile_dirs().memory == tmp_path / "later" / "cluster_mem_profile_data"


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    path = write(tmp_path, "[job]\nlbs = 0\nepochs = 0\n[batching]\nsimilarity_target = 2\n")
    lines = problems_of(path)
    assert len(lines) == 3
    assert {line.split(": ")[1] for line in lines} == {"job.lbs", "job.epochs", "batching.similarity_target"}


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    assert "file not found" in problems_of(tmp_path / "absent.toml")[0]
    assert "invalid TOML" in problems_of(write(tmp_path, "[job\nname=1"))[0]
    assert "invalid JSON" in problems_of(write(tmp_path, "{not json", "config.json"))[0]


def test_reference_seed_config_from_quickstart_parent(seed_quickstart: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(seed_quickstart)
    loaded = load_config("quickstart/config.json")
    cfg = loaded.config
    assert loaded.format == "seed-json"
    assert [s.name for s in cfg.available()] == ["node0", "node1"]
    assert cfg.server("node0").device_type == "Tesla V100-PCIE-16GB"
    assert cfg.server("node1").tflops == 9.52
    assert cfg.server("node1").host == "node1"  # the seed reached servers by name
    assert cfg.batching.gbs_min == 256 and cfg.batching.gbs_max == 32768
    assert loaded.profile_dirs().memory == (seed_quickstart / "quickstart" / "cluster_mem_profile_data").resolve()


def test_reference_seed_config_from_its_own_folder(reference_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(reference_dir)
    loaded = load_config("config.json")
    assert loaded.profile_dirs().bucket == (reference_dir / "bucket_profile_data").resolve()


def seed_copy(seed_quickstart: Path, **changes: object) -> Path:
    path = seed_quickstart / "quickstart" / "config.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    ("changes", "field", "words"),
    [
        ({"batch_size_lower_bound": 0}, "batch_size_lower_bound", "greater than 0"),
        ({"batch_size_lower_bound": 4096, "batch_size_upper_bound": 256}, "batch_size_lower_bound", "above"),
        ({"similarity_target": 1.2}, "similarity_target", "less than or equal to 1"),
        ({"available_servers": ["node0", "node7"]}, "available_servers[1]", "'node7' has no cluster entry"),
        ({"comp_profile_dir": "quickstart/nowhere"}, "comp_profile_dir", "does not exist"),
        ({"batch_size_upper_bound": "big"}, "batch_size_upper_bound", "integer"),
        ({"typo_key": 1}, "typo_key", "unknown key"),
    ],
)
def test_bad_seed_json_uses_seed_field_names(
    seed_quickstart: Path, monkeypatch: pytest.MonkeyPatch, changes: dict[str, object], field: str, words: str
) -> None:
    monkeypatch.chdir(seed_quickstart)
    lines = problems_of(seed_copy(seed_quickstart, **changes))
    assert any("config.json" in line and field in line and words in line for line in lines), lines


def test_bad_seed_cluster_info(seed_quickstart: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(seed_quickstart)
    info = seed_quickstart / "quickstart" / "cluster_info.json"
    data = json.loads(info.read_text())
    data["node1"]["number"] = "four"
    info.write_text(json.dumps(data))
    lines = problems_of(seed_quickstart / "quickstart" / "config.json")
    assert any("cluster_info.json" in line and "node1.number" in line for line in lines), lines


def test_example_config_is_valid_and_mentions_every_key() -> None:
    example = REPO / "jabas.toml.example"
    loaded = load_config(example, check_profiles=False)
    text = example.read_text()

    def keys(model: type, prefix: str = "") -> list[str]:
        found = []
        for name, info in model.model_fields.items():
            found.append(name)
            annotation = info.annotation
            for candidate in (annotation, *getattr(annotation, "__args__", ())):
                if isinstance(candidate, type) and hasattr(candidate, "model_fields"):
                    found += keys(candidate)
        return found

    missing = [key for key in keys(JabasConfig) if key not in text]
    assert not missing, f"jabas.toml.example does not explain: {missing}"
    assert loaded.config.cluster.servers


def test_cli_bad_input_exits_2_without_traceback(tmp_path: Path) -> None:
    path = write(tmp_path, "[job]\nlbs = 0\n[batching]\ngbs_min = 9\ngbs_max = 3\n")
    result = run_jabas("validate", "-c", str(path))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr + result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "job.lbs" in lines[0], result.stderr
    result = run_jabas("validate", "-c", str(tmp_path / "nope.toml"))
    assert result.returncode == 2 and "file not found" in result.stderr and "Traceback" not in result.stderr


def test_cli_validate_json_round_trips(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    from jabascli.cli.app import app

    result = cli.invoke(app, ["validate", "-c", str(write(tmp_path, GOOD)), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert JabasConfig.model_validate(data["config"]).server("a").devices == 2


SEED_EXAMPLE = REPO / "examples" / "seed"


def test_validate_takes_the_seed_format_for_what_it_is(tmp_path: Path) -> None:
    """A seed config.json has no workload: validate checks its profiles, GBS range and cluster, and exits 0."""
    result = run_jabas("validate", "-c", "examples/seed/config.json", cwd=REPO)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "(seed-json) is valid" in out and "64 .. 256" in out and "cpu-slow" in out
    assert "no workload" not in result.stderr + out
    needs = [line for line in out.splitlines() if line.startswith("a run needs")]
    assert len(needs) == 1 and "[job] workload" in needs[0], out
    solved = run_jabas("solve", "-c", "examples/seed/config.json", "--gbs", "256", cwd=REPO)
    assert solved.returncode == 0, solved.stderr  # the file validate accepts, solve accepts

    # Its profiles are read as the solver reads them: a broken one is one line, exit 2.
    copy = tmp_path / "seed"
    shutil.copytree(SEED_EXAMPLE, copy)
    broken = next((copy / "cluster_comp_profile_data").rglob("*_comp_profile.json"))
    broken.write_text('{"lbs": ')
    result = run_jabas("validate", "-c", str(copy / "config.json"))
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and str(broken) in lines[0], result.stderr

    # One without profile folders is valid too, and says it needs profiles as well.
    config = json.loads((copy / "config.json").read_text())
    for key in ("memory_profile_dir", "comp_profile_dir", "comm_profile_dir", "bucket_profile_dir"):
        del config[key]
    (copy / "config.json").write_text(json.dumps(config))
    result = run_jabas("validate", "-c", str(copy / "config.json"))
    assert result.returncode == 0, result.stderr
    assert "not yet" in result.stdout and "jabas profile all" in result.stdout.splitlines()[-1]


def test_readme_validate_examples_name_files_the_repository_holds() -> None:
    readme = (REPO / "README.md").read_text()
    named = [line.split()[3] for line in readme.splitlines() if line.startswith("jabas validate -c ")]
    assert "examples/seed/config.json" in named
    assert all((REPO / name).is_file() for name in named if name != "jabas.toml"), named


def test_the_folders_a_job_writes_to_are_beside_its_config_whatever_the_working_directory_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job, elsewhere = tmp_path / "job", tmp_path / "elsewhere"
    for name in ("runs", "checkpoints", "profiles"):
        (elsewhere / name).mkdir(parents=True)  # e.g. a checkout where the examples ran
    job.mkdir()
    monkeypatch.chdir(elsewhere)
    text = GOOD.replace("[cluster]\n", "[profiles]\ndir = 'profiles'\n[storage]\nrun_dir = 'runs'\n")
    cfg = load_config(write(job, text)).config
    assert cfg.storage.run_dir == job / "runs"
    assert cfg.storage.checkpoint_dir == job / "checkpoints"  # the default, "checkpoints"
    assert cfg.profiles.dir == job / "profiles"


def test_validate_prints_one_gbs_for_a_fixed_gbs_job_and_a_range_for_an_adaptive_one(tmp_path: Path) -> None:
    def gbs_row(text: str) -> str:
        result = run_jabas("validate", "-c", str(write(tmp_path, text)))
        assert result.returncode == 0, result.stderr
        [row] = [line for line in result.stdout.splitlines() if "global batch size" in line]
        return row

    # GOOD's bounds are for adaptive jobs; with metric "fixed" (the default) the servers' plan is the GBS.
    fixed = gbs_row(GOOD)  # LBS 16 x (2 devices + 1), VSW 1, GA 0
    assert "48, fixed (LBS 16 x 3 workers" in fixed and ".." not in fixed and "target" not in fixed
    initial = gbs_row(GOOD.replace("similarity_target = 0.1", "initial_gbs = 128"))
    assert "128, fixed ([batching] initial_gbs" in initial and ".." not in initial
    adaptive = gbs_row(GOOD.replace("similarity_target = 0.1", 'metric = "similarity"'))
    assert "64 .. 512 (similarity, target 0.1)" in adaptive


def test_validate_prints_each_replicas_micro_batches_under_a_layout(tmp_path: Path) -> None:
    """tp = 2 with ga = 3 on two devices: one replica of 2 x (3 + 1) = 8 micro-batches, GBS 8 x 8 = 64."""
    text = """
[job]
workload = "gpt"
lbs = 8
options = { variant = "tiny" }

[parallel]
tp = 2

[[cluster.servers]]
name = "a"
device_type = "cpu"
devices = 2
ga = 3
"""
    result = run_jabas("validate", "-c", str(write(tmp_path, text)))
    assert result.returncode == 0, result.stderr
    out = " ".join(result.stdout.split())
    assert "64, fixed (LBS 8 x 8 micro-batches" in out, result.stdout
    assert "1 replica of 8 micro-batches (GBS 64)" in out, result.stdout
    two = text.replace("devices = 2\nga = 3", "devices = 2\nga = 3\n\n[[cluster.servers]]\nname = 'b'\n"
                       "device_type = 'cpu'\ndevices = 2\nga = 1")  # fmt: skip
    out = " ".join(run_jabas("validate", "-c", str(write(tmp_path, two))).stdout.split())
    assert "2 replicas of 8 and 4 micro-batches (GBS 96)" in out, out


def test_replica_lines_count_as_they_should() -> None:
    from jabascli.cli.common import replicas_line

    assert replicas_line([1]) == "1 replica of 1 micro-batch"
    assert replicas_line([8]) == "1 replica of 8 micro-batches"
    assert replicas_line([4, 4, 2]) == "3 replicas of 4, 4 and 2 micro-batches"
