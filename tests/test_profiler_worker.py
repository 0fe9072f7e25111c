"""What every measuring child shares (profiler/worker.py) and the port retry of a group (child.run_group)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from jabascli.profiler import child
from jabascli.profiler.child import ChildCrashed, run_group
from jabascli.profiler.worker import worker_main


def _run(tmp_path: Path, measure: Any) -> tuple[int, dict[str, Any]]:
    spec, result = tmp_path / "spec", tmp_path / "result"
    spec.write_text(json.dumps({"kind": "x"}), encoding="utf-8")
    code = worker_main([str(spec), str(result)], measure)
    return code, json.loads(result.read_text(encoding="utf-8"))


@pytest.mark.parametrize("status", ["ok", "oom", "skip"])
def test_a_child_with_a_result_to_read_exits_0(tmp_path: Path, status: str) -> None:
    code, result = _run(tmp_path, lambda spec: {"status": status, "kind": spec["kind"]})
    assert code == 0 and result == {"status": status, "kind": "x"}


def test_a_child_that_fails_reports_the_first_line_and_exits_1(tmp_path: Path) -> None:
    def measure(spec: dict[str, Any]) -> dict[str, Any]:
        raise ValueError("boom\nmore")

    assert _run(tmp_path, measure) == (1, {"status": "error", "error": "ValueError: boom"})
    assert _run(tmp_path, lambda spec: {"status": "error", "error": "the loss is not finite"})[0] == 1


def test_a_reported_error_is_shown_as_the_child_said_it() -> None:
    assert ChildCrashed(1, "ValueError: boom", reported=True).describe() == "ValueError: boom"
    assert ChildCrashed(1, "ValueError: boom").describe() == "exited with status 1: ValueError: boom"


def test_a_group_whose_port_is_taken_meets_at_another(monkeypatch: pytest.MonkeyPatch) -> None:
    tried: list[int] = []
    taken = {"tries": 2}

    def run_children(module: str, specs: list[dict[str, Any]], *args: Any) -> list[dict[str, Any]]:
        tried.append(specs[0]["port"])
        if len(tried) <= taken["tries"]:
            raise ChildCrashed(1, "RuntimeError: address already in use", reported=True)
        return [{"status": "ok"}]

    monkeypatch.setattr(child, "run_children", run_children)
    moved: list[int] = []
    assert run_group("m", lambda port: [{"port": port}], 1234, on_new_port=moved.append) == [{"status": "ok"}]
    assert tried[0] == 1234 and tried[1:] == moved and len(set(tried)) == 3

    tried.clear()
    with pytest.raises(ChildCrashed):  # a port someone else chose is not changed
        run_group("m", lambda port: [{"port": port}], 1234)
    assert tried == [1234]

    tried.clear()
    taken["tries"] = child.PORT_ATTEMPTS
    with pytest.raises(ChildCrashed):  # taken every time: the last try's failure
        run_group("m", lambda port: [{"port": port}], None, on_new_port=moved.append)
    assert len(tried) == child.PORT_ATTEMPTS
