"""Atomic writes never leave a half-written or missing file."""

from __future__ import annotations

from pathlib import Path

import pytest

from jabascli.atomic import atomic_write, atomic_write_json


def test_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "profile.json"
    atomic_write_json(target, {"v": 1})

    def explode(f):  # type: ignore[no-untyped-def]
        f.write(b'{"v": 2, "trunc')
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        atomic_write(target, explode)
    assert target.read_text() == '{"v": 1}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile.json"]


@pytest.mark.parametrize("durable", [True, False])
def test_a_failed_write_keeps_the_old_file_durable_or_not(tmp_path: Path, durable: bool) -> None:
    """Not durable (an agent's order to its trainer) skips the fsyncs, never the rename."""
    target = tmp_path / "control-g1"
    atomic_write(target, lambda f: f.write(b"epoch"), durable=durable)

    def explode(f):  # type: ignore[no-untyped-def]
        f.write(b'{"when": "rec')
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        atomic_write(target, explode, durable=durable)
    assert target.read_text() == "epoch"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["control-g1"]


def test_creates_missing_folders(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "c.json"
    atomic_write_json(target, [1, 2])
    assert target.read_text() == "[1, 2]"


def test_mode_follows_umask_and_keeps_an_existing_files_mode(tmp_path: Path) -> None:
    from jabascli import atomic

    fresh = atomic_write_json(tmp_path / "fresh.json", {})
    assert fresh.stat().st_mode & 0o777 == 0o666 & ~atomic._UMASK
    fresh.chmod(0o640)
    atomic_write_json(fresh, {"again": True})
    assert fresh.stat().st_mode & 0o777 == 0o640


def test_a_stop_landing_as_the_temporary_file_is_created_leaves_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trainer's SIGTERM becomes SystemExit between any two bytecodes; one that lands right after the temporary
    file was created (before its name was returned to the writer) must not leave the empty file behind (seen
    once: ``.checkpoint-4.pt.<random>.tmp``, 0 bytes, after Ctrl-C of ``jabas run``)."""
    import os

    target = tmp_path / "checkpoint-4.pt"
    target.write_bytes(b"old")
    real_open = os.open

    def open_then_stopped(path: object, *args: object, **kwargs: object) -> int:
        fd = real_open(path, *args, **kwargs)  # type: ignore[arg-type]
        os.close(fd)
        raise SystemExit(143)

    monkeypatch.setattr(os, "open", open_then_stopped)
    with pytest.raises(SystemExit):
        atomic_write(target, lambda f: f.write(b"new"))
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4.pt"]
    assert target.read_bytes() == b"old"
