"""Bad input to `jabas worker`, `jabas schedule` and `jabas job`: one line, the right exit code, nothing started."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
from typer.testing import CliRunner

from jabascli.cli.app import app
from jabascli.elastic.local import agent_environment
from jabascli.elastic.token import TOKEN_ENV
from jabascli.net import free_port
from tests.elastic_support import TOKEN, auth, load, serving, write_config


def _one_line_error(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in output, output
    return lines[0]


def test_a_worker_with_a_wrong_token_exits_2(tmp_path: Path, cli: CliRunner) -> None:
    config = write_config(tmp_path)
    with serving(load(config)) as (url, scheduler):
        address = url.removeprefix("http://")
        env = {"JABAS_TOKEN": "not-the-token-0123456789"}
        result = cli.invoke(app, ["worker", "-c", str(config), "--rank", "0", "--scheduler", address], env=env)
        assert result.exit_code == 2
        assert "refused the token" in _one_line_error(result.output)
        assert scheduler.workers == {}


def test_a_second_worker_of_a_rank_gets_409_and_exits_2_and_a_move_to_an_unknown_server_exits_2(
    tmp_path: Path, cli: CliRunner
) -> None:
    config = write_config(tmp_path)
    with serving(load(config)) as (url, scheduler):
        address = url.removeprefix("http://")
        first = {"rank": 0, "host": "elsewhere", "devices": {"backend": "cpu", "device_type": "cpu", "count": 1}}
        first["devices"]["memory_bytes"] = 1  # type: ignore[index]
        assert httpx.post(url + "/v1/workers", json=first, headers=auth()).status_code == 200
        env = {"JABAS_TOKEN": TOKEN}
        result = cli.invoke(app, ["worker", "-c", str(config), "--rank", "0", "--scheduler", address], env=env)
        assert result.exit_code == 2
        assert "already registered from elsewhere" in _one_line_error(result.output)

        result = cli.invoke(app, ["job", "move", "-c", str(config), "A", "C", "--scheduler", address], env=env)
        assert result.exit_code == 2 and "unknown server 'C'" in _one_line_error(result.output)
        assert scheduler.state == "running" and scheduler.allocation == ["A"] and scheduler.pending is None


def test_an_unreachable_scheduler_is_retried_then_the_worker_exits_1(tmp_path: Path, cli: CliRunner) -> None:
    config = write_config(tmp_path, port=free_port(), scheduler={"connect_timeout_s": 1.0})
    result = cli.invoke(app, ["worker", "-c", str(config), "--rank", "1"], env={"JABAS_TOKEN": TOKEN})
    assert result.exit_code == 1
    assert "unreachable for 1 s" in _one_line_error(result.output)


def test_a_checkpoint_folder_that_cannot_be_written_is_refused_before_anything_starts(
    tmp_path: Path, cli: CliRunner
) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    config = write_config(tmp_path)
    text = config.read_text().replace(str(tmp_path / "checkpoints"), str(tmp_path / "a-file" / "checkpoints"))
    config.write_text(text)
    for args in (["schedule", "-c", str(config)], ["worker", "-c", str(config), "--rank", "0"]):
        result = cli.invoke(app, args, env={"JABAS_TOKEN": TOKEN})
        assert result.exit_code == 2, (args, result.output)
        assert "checkpoint folder is not writable" in _one_line_error(result.output)
    assert not (tmp_path / "runs").exists()


def test_job_status_and_stop_talk_to_the_scheduler(tmp_path: Path, cli: CliRunner) -> None:
    config = write_config(tmp_path)
    with serving(load(config)) as (url, scheduler):
        address = url.removeprefix("http://")
        env = {"JABAS_TOKEN": TOKEN, "COLUMNS": "200"}
        result = cli.invoke(app, ["job", "status", "-c", str(config), "--scheduler", address, "--json"], env=env)
        assert result.exit_code == 0, result.output
        status = json.loads(result.stdout)
        assert (status["state"], status["allocation"], status["epochs"]) == ("waiting", ["A"], 2)
        result = cli.invoke(app, ["job", "status", "-c", str(config), "--scheduler", address], env=env)
        assert result.exit_code == 0 and "digits: waiting, epoch 0/2" in result.output
        result = cli.invoke(app, ["job", "stop", "-c", str(config), "--scheduler", address], env=env)
        assert result.exit_code == 0 and result.output.startswith("stopped")
        assert scheduler.state == "stopped"


def test_jabas_run_elastic_shares_this_machines_cores_among_every_servers_trainers(tmp_path: Path) -> None:
    # Each agent alone would give its trainers every core, as on a node of its own; on one machine
    # the two servers' trainers then oversubscribe it.
    loaded = load(write_config(tmp_path))  # two servers of one device each
    env = agent_environment(loaded, "a-token", {"PATH": "/usr/bin"})
    assert env["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2)) and env[TOKEN_ENV] == "a-token"
    assert env["PATH"] == "/usr/bin"
    # A count the user set stands, as for `jabas run`.
    assert agent_environment(loaded, "a-token", {"OMP_NUM_THREADS": "3"})["OMP_NUM_THREADS"] == "3"


def test_jabas_run_elastic_leaves_planning_to_the_scheduler(tmp_path: Path, cli: CliRunner) -> None:
    """A fixed-GBS job with a profiles folder: `jabas run` solves no plan of its own before --elastic.

    It used to, then refused its own solved plan as "--plan is not used with --elastic". The profiles
    folder here is empty, so a plan solved first would fail on it: the error must name the option given.
    """
    config = write_config(tmp_path)
    text = config.read_text().replace('metric = "fixed"', 'metric = "fixed"\ninitial_gbs = 32')
    config.write_text(text)
    load(config).profile_dirs().computation.mkdir(parents=True)
    result = cli.invoke(app, ["run", "-c", str(config), "--elastic", "--max-steps", "3"])
    assert result.exit_code == 2
    assert "--max-steps: is not used with --elastic" in _one_line_error(result.output)
    result = cli.invoke(app, ["run", "-c", str(config), "--elastic", "--gbs", "32"])
    assert result.exit_code == 2
    assert "--gbs: is not used with --elastic" in _one_line_error(result.output)
