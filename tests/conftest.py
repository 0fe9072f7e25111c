"""Shared test fixtures."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

# Rich sizes the CLI's tables to the terminal: a pytest-xdist worker has none and got 80 columns, which
# wrapped the words the CLI tests look for. Every test sees one width, set before jabas's consoles exist.
os.environ["COLUMNS"] = "200"
# Two xdist workers share the two cores: a torch process that spread its ops over every core would oversubscribe
# them (each worker and every trainer it starts, spinning OpenMP threads against each other); one thread each
# made the exactness tests 25% faster under `make test`. Set before torch is imported in this process, and
# passed on to every process a test starts; the tests of the default thread split (test_profile_all) unset it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO.parent / "shared" / "reference"
REFERENCE_RUN = REFERENCE / "jabas-resnet50-v100-p100"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the slow tests first (their order among themselves kept), with the rest after them.

    ``make test`` deals tests to two xdist workers as they free up; a minute-long test dealt last leaves the
    other worker idle while it runs. Longest first is the usual cure for that tail.
    """
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


# Output folders of the examples (examples/*.toml write to ../runs, ../checkpoints, ../profiles): a test
# must write under its own temporary folder, never into these.
CHECKOUT_OUTPUTS = ("runs", "checkpoints", "profiles")
# What running the suite makes by itself.
TOOL_FOLDERS = ("__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache", ".egg-info")


def _checkout_state() -> set[str] | None:
    """What the checkout holds that git does not track, with the files of its output folders; None without git."""
    try:
        listed = subprocess.run(
            ["git", "status", "--porcelain", "--ignored"], cwd=REPO, capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if listed.returncode != 0:
        return None
    # Untracked and ignored entries only: a tracked file edited while the suite runs is the developer's.
    lines = [line for line in listed.stdout.splitlines() if line.startswith(("??", "!!"))]
    state = {line for line in lines if not any(t in line for t in TOOL_FOLDERS)}
    for name in CHECKOUT_OUTPUTS:
        for path in (REPO / name).rglob("*"):
            if path.is_file():
                info = path.stat()
                state.add(f"{path.relative_to(REPO)} {info.st_size} {info.st_mtime_ns}")
    return state


@pytest.fixture(scope="session", autouse=True)
def checkout_stays_clean() -> Iterator[None]:
    """Fail the session if its tests created or changed files in the checkout (outside git's tracked files)."""
    before = _checkout_state()
    yield
    after = _checkout_state()
    if before is None or after is None:
        return
    changed = sorted(after - before)
    if changed:
        listed = "\n  ".join(changed[:20])
        pytest.fail(f"the tests wrote into the checkout {REPO} (write under tmp_path instead):\n  {listed}")


@pytest.fixture
def reference_dir() -> Path:
    """The seed's ResNet-50 V100/P100 measurements, or a skip when they are absent."""
    if not REFERENCE_RUN.is_dir():
        pytest.skip(f"reference data not found at {REFERENCE_RUN} (it sits in ../shared/reference beside the repo)")
    return REFERENCE_RUN


@pytest.fixture
def seed_quickstart(tmp_path: Path, reference_dir: Path) -> Path:
    """A copy of the reference data named quickstart/, as the seed's relative paths expect."""
    shutil.copytree(reference_dir, tmp_path / "quickstart")
    return tmp_path


@pytest.fixture
def cli() -> CliRunner:
    return CliRunner()


def run_jabas(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run the real `jabas` command in a subprocess (what a user types)."""
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("JABAS_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "jabascli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


WITH_SIGINT = (
    "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from jabascli.cli.app import main; main()"
)
"""``python -c WITH_SIGINT ARGS...``: the CLI with Ctrl-C delivered as KeyboardInterrupt, even where the test
runner ignores SIGINT (a shell starts background jobs so, and children inherit it)."""
