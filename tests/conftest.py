"""Shared test fixtures."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO.parent / "shared" / "reference"
REFERENCE_RUN = REFERENCE / "jabas-resnet50-v100-p100"


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
