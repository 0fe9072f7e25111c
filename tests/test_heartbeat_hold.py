"""A heartbeat that asks to be held (its node's trainers wait for a recovery order) against a real scheduler
server on loopback: its reply goes out as soon as another request gives the node a command."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

from jabascli.elastic.protocol import Commands
from tests.elastic_support import auth, load, serving, write_config

HOLD_S = 2.0


def _post(url: str, path: str, body: dict[str, object]) -> httpx.Response:
    response = httpx.post(url + path, json=body, headers=auth(), timeout=10)
    assert response.status_code == 200, (path, response.text)
    return response


def test_a_held_heartbeat_gets_the_command_another_request_makes_without_waiting_out_its_hold(
    tmp_path: Path,
) -> None:
    devices = {"backend": "cpu", "device_type": "cpu", "count": 1, "memory_bytes": 1}
    with serving(load(write_config(tmp_path))) as (url, scheduler):
        _post(url, "/v1/workers", {"rank": 0, "host": "h", "devices": devices})
        start = Commands.model_validate(_post(url, "/v1/workers/0/heartbeat", {}).json())
        assert [c.kind for c in start.commands] == ["start"] and scheduler.state == "running"

        replies: list[tuple[Commands, float]] = []

        def held_beat() -> None:
            sent = time.monotonic()
            reply = _post(url, "/v1/workers/0/heartbeat", {"wait_s": HOLD_S})
            replies.append((Commands.model_validate(reply.json()), time.monotonic() - sent))

        beat = threading.Thread(target=held_beat)
        beat.start()
        time.sleep(0.3)
        assert beat.is_alive() and not replies  # held: no command for this node yet
        _post(url, "/v1/job/stop", {"when": "now"})
        beat.join(HOLD_S + 10)
        [(reply, took)] = replies
        assert [(c.kind, getattr(c, "when", None)) for c in reply.commands] == [("stop", "now")]
        assert took < HOLD_S, took  # went out with the stop, not when the hold ran out

        # Nothing due: a held heartbeat comes back empty once its hold runs out (half the heartbeat timeout
        # at most), and the worker still counts as alive.
        empty = Commands.model_validate(_post(url, "/v1/workers/0/heartbeat", {"wait_s": 0.2}).json())
        assert empty.commands == [] and scheduler.workers[0].alive
