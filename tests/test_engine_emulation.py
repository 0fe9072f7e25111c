"""Emulated slowdown: a rank sleeps (slowdown - 1) x each compute step, and oversleeping does not add up."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import jabascli.engine.vsw as vsw
from jabascli.engine.vsw import Emulation


class FakeClock:
    """perf_counter and sleep on a virtual clock; every sleep ends ``late`` seconds after it should."""

    def __init__(self, late: float) -> None:
        self.now, self.late, self.slept = 0.0, late, 0.0

    def perf_counter(self) -> float:
        return self.now

    def as_time_module(self) -> SimpleNamespace:
        return SimpleNamespace(perf_counter=self.perf_counter, thread_time=self.perf_counter, sleep=self.sleep)

    def sleep(self, seconds: float) -> None:
        self.now += seconds + self.late
        self.slept += seconds + self.late


def test_the_time_overslept_is_taken_off_the_next_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock(late=0.0004)
    monkeypatch.setattr(vsw, "time", clock.as_time_module())
    emulation = Emulation(slowdown=3.0)
    asked = 0.0
    for step in range(100):
        start = clock.now
        clock.now += 0.001 * (1 + step % 3)  # a compute step of 1 to 3 ms
        asked += 2 * (clock.now - start)
        emulation.pause_since(start)
    # Without the correction the rank would have slept 100 x 0.4 ms too long; now only the last sleep's lateness.
    assert clock.slept == pytest.approx(asked + clock.late, abs=1e-9)


def test_a_plain_rank_never_sleeps(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock(late=0.0)
    monkeypatch.setattr(vsw, "time", clock.as_time_module())
    emulation = Emulation(slowdown=1.0)
    assert not emulation.active
    emulation.pause_since(0.0)
    assert clock.slept == 0.0
