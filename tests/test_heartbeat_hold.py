"""A heartbeat that asks to be held (its node's trainers wait for a recovery order) against a real scheduler
server on loopback: while a failure is being decided, its reply goes out as soon as another agent's report
decides it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

from jabascli.elastic.protocol import Commands
from tests.elastic_support import auth, load, serving, write_config

HOLD_S = 2.0
DEVICES = {"backend": "cpu", "device_type": "cpu", "count": 1, "memory_bytes": 1}


def _beat(url: str, rank: int, **body: object) -> Commands:
    response = httpx.post(f"{url}/v1/workers/{rank}/heartbeat", json=body, headers=auth(), timeout=10)
    assert response.status_code == 200, response.text
    return Commands.model_validate(response.json())


def _event(event: str, **fields: object) -> dict[str, object]:
    return {"generation": 1, "event": {"event": event, **fields}}


def test_a_held_heartbeat_gets_its_recovery_order_the_moment_another_agents_report_decides_it(
    tmp_path: Path,
) -> None:
    # A frozen clock: the scheduler's own deadlines (a failure's grace, heartbeat timeouts) never pass, so
    # only B's report can decide the failure while A's heartbeat is held.
    with serving(load(write_config(tmp_path, available=["A", "B"])), clock=lambda: 0.0) as (url, scheduler):
        for rank in (0, 1):
            httpx.post(url + "/v1/workers", json={"rank": rank, "host": "h", "devices": DEVICES}, headers=auth())
        assert [c.kind for c in _beat(url, 0).commands] == ["start"] == [c.kind for c in _beat(url, 1).commands]
        # Nothing being decided: a heartbeat asking to be held comes back at once, empty.
        assert _beat(url, 0, events=[_event("start", step=0, epoch=0, gbs=48)], wait_s=HOLD_S).commands == []

        replies: list[tuple[Commands, float]] = []

        def survivor_reports() -> None:  # rank 0's collective failed: its agent asks to be held
            sent = time.monotonic()
            lost = _event("peer_lost", rank=0, step=7, time=100.0, in_place=True)
            replies.append((_beat(url, 0, events=[lost], wait_s=HOLD_S), time.monotonic() - sent))

        held = threading.Thread(target=survivor_reports)
        held.start()
        time.sleep(0.3)
        assert held.is_alive() and not replies  # held: B has not spoken, nothing is decided
        assert scheduler.deciding()
        _beat(url, 1, exits=[{"generation": 1, "rank": 1, "code": -9}])  # B's trainer died: decided now
        held.join(HOLD_S + 10)
        [(reply, took)] = replies
        assert [(c.kind, getattr(c, "when", None)) for c in reply.commands] == [("stop", "recover")]
        assert took < HOLD_S, took  # went out with the decision, not when the hold ran out
        assert scheduler.allocation == ["A"] and not scheduler.deciding()
