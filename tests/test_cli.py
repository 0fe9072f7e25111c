"""The command-line surface: every command is registered and documented."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomllib
from typer.testing import CliRunner

from jabascli.cli.app import app
from jabascli.config import load_config
from tests.conftest import REPO

COMMANDS = [
    ["init"],
    ["validate"],
    ["cluster", "detect"],
    ["profile", "mem"],
    ["profile", "comp"],
    ["profile", "bucket"],
    ["profile", "comm"],
    ["profile", "summary"],
    ["profile", "import"],
    ["profile", "link"],
    ["sync"],
    ["solve"],
    ["schedule"],
    ["worker"],
    ["token"],
    ["job", "status"],
    ["job", "move"],
    ["job", "stop"],
    ["train"],
    ["run"],
]


def test_top_level_help_lists_every_command(cli: CliRunner) -> None:
    result = cli.invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for command in {c[0] for c in COMMANDS}:
        assert f" {command} " in result.output, command


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_has_help_with_an_example(cli: CliRunner, command: list[str]) -> None:
    result = cli.invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "Example" in result.output
    assert f"jabas {' '.join(command)}" in result.output or "torchrun" in result.output


def test_cluster_detect_entry_is_a_valid_server(cli: CliRunner, tmp_path: Path) -> None:
    result = cli.invoke(app, ["cluster", "detect", "--name", "here", "--json"])
    assert result.exit_code == 0, result.output
    entry = json.loads(result.stdout)
    toml = cli.invoke(app, ["cluster", "detect", "--name", "here"])
    servers = tomllib.loads(toml.stdout)["cluster"]["servers"]
    assert servers[0]["name"] == "here" == entry["name"]
    config = tmp_path / "jabas.toml"
    config.write_text(toml.stdout)
    assert load_config(config).config.server("here").devices == entry["devices"]


def test_init_writes_a_valid_config_and_never_overwrites(cli: CliRunner, tmp_path: Path) -> None:
    out = tmp_path / "jabas.toml"
    result = cli.invoke(app, ["init", "--out", str(out)])
    assert result.exit_code == 0, result.output
    cfg = load_config(out).config
    assert cfg.job.workload == "digits" and cfg.cluster.servers
    [server] = cfg.cluster.servers
    assert f"for {server.devices} " in result.output  # what it says is what it wrote (not "1 x cpu" for 2)
    out.write_text("# mine\n")
    result = cli.invoke(app, ["init", "--out", str(out)])
    assert result.exit_code == 2 and "already exists" in result.stderr
    assert out.read_text() == "# mine\n"


def _commands(group, path=()):  # type: ignore[no-untyped-def]
    import click

    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from _commands(command, (*path, name))
        else:
            yield (*path, name), command


def test_help_texts_survive_rich_markup(cli: CliRunner) -> None:
    # Rich reads "[job]" as a markup tag and drops it unless escaped as "\[job]".
    import re

    import typer.main

    for path, command in _commands(typer.main.get_command(app)):
        output = " ".join(cli.invoke(app, [*path, "--help"], env={"COLUMNS": "250"}).output.split())
        for param in command.params:
            for tag in re.findall(r"\[[a-z_.]+\]", (getattr(param, "help", None) or "").replace("\\[", "[")):
                assert tag in output, f"jabas {' '.join(path)} {param.name}: help lost {tag}"
        for tag in re.findall(r"\[[a-z_.]+\]", (command.help or "").replace("\\[", "[")):  # the description
            assert tag in output, f"jabas {' '.join(path)}: help lost {tag}"


def test_init_names_every_builtin_workload_and_refuses_an_unknown_one(cli: CliRunner, tmp_path: Path) -> None:
    from jabascli.workload import builtin_workloads

    out = tmp_path / "jabas.toml"
    result = cli.invoke(app, ["init", "--out", str(out), "--workload", "gpt"])
    assert result.exit_code == 0, result.output
    [comment] = [line for line in out.read_text().splitlines() if line.startswith("workload = ")]
    assert all(name in comment for name in builtin_workloads()) and "gpt" in builtin_workloads()
    refused = tmp_path / "other.toml"
    result = cli.invoke(app, ["init", "--out", str(refused), "--workload", "no_such_workload"])
    assert result.exit_code == 2 and "--workload: unknown workload 'no_such_workload'" in result.output
    assert not refused.exists()


def test_profiling_doc_says_which_profile_commands_take_out(cli: CliRunner) -> None:
    """docs/profiling.md names the commands with --out; each has it, and `profile all` has none."""
    doc = (REPO / "docs" / "profiling.md").read_text()
    assert "`mem`, `comp`, `bucket`, `comm`, `hybrid` and `link` take `--out" in doc and "`all` has no\n`--out`" in doc
    for name in ("mem", "comp", "bucket", "comm", "hybrid", "link", "import"):
        assert "--out" in cli.invoke(app, ["profile", name, "--help"], env={"COLUMNS": "200"}).output, name
    assert "--out" not in cli.invoke(app, ["profile", "all", "--help"], env={"COLUMNS": "200"}).output
