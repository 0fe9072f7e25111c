"""An HTTP client of the scheduler's API (httpx), for worker agents and ``jabas job``.

Errors become the library's: a wrong token (401) and a refused request (409,
422) are :class:`InputError` with the scheduler's one-line reason; a scheduler
that cannot be reached is :class:`Unreachable` (a :class:`RuntimeFailure`), so
callers can retry it.
"""

from __future__ import annotations

from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from jabascli.elastic.protocol import (
    Commands,
    Heartbeat,
    JobStatus,
    MoveRequest,
    Registered,
    Registration,
    StopRequest,
    When,
)
from jabascli.errors import InputError, RuntimeFailure

M = TypeVar("M", bound=BaseModel)
TIMEOUT_S = 10.0


class Unreachable(RuntimeFailure):
    """The scheduler did not answer (connection refused, timeout)."""


class Rejected(InputError):
    """The scheduler refused a request: wrong token (401), conflict (409), invalid (422)."""

    def __init__(self, status: int, lines: list[str]) -> None:
        super().__init__(lines)
        self.status = status


class SchedulerClient:
    def __init__(self, address: str, token: str, timeout_s: float = TIMEOUT_S) -> None:
        self.address = address
        base = address if address.startswith(("http://", "https://")) else f"http://{address}"
        self.http = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> SchedulerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def register(self, registration: Registration) -> Registered:
        return self._call("POST", "/v1/workers", Registered, registration)

    def heartbeat(self, rank: int, beat: Heartbeat) -> Commands:
        return self._call("POST", f"/v1/workers/{rank}/heartbeat", Commands, beat)

    def status(self) -> JobStatus:
        return self._call("GET", "/v1/job", JobStatus)

    def move(self, servers: list[str], when: When = "epoch") -> JobStatus:
        return self._call("POST", "/v1/job/move", JobStatus, MoveRequest(servers=servers, when=when))

    def stop(self, when: When = "now") -> JobStatus:
        return self._call("POST", "/v1/job/stop", JobStatus, StopRequest(when=when))

    def _call(self, method: str, path: str, reply: type[M], body: BaseModel | None = None) -> M:
        try:
            response = self.http.request(method, path, json=None if body is None else body.model_dump(mode="json"))
        except httpx.TransportError as exc:
            why = str(exc) or type(exc).__name__
            raise Unreachable.at(None, None, f"scheduler {self.address} unreachable: {why}") from None
        if response.status_code == 401:
            why = "refused the token (401): check JABAS_TOKEN or [scheduler] token_file"
            raise Rejected(401, [f"scheduler {self.address} {why}"])
        if response.status_code in (409, 422):
            raise Rejected(response.status_code, [f"scheduler {self.address}: {line}" for line in _detail(response)])
        if response.status_code != 200:
            answer = f"answered {response.status_code} to {method} {path}"
            raise RuntimeFailure.at(None, None, f"scheduler {self.address} {answer}")
        return reply.model_validate(response.json())


def _detail(response: httpx.Response) -> list[str]:
    try:
        detail: Any = response.json().get("detail")
    except ValueError:
        return [response.text[:200]]
    if isinstance(detail, str):
        return [detail]
    if isinstance(detail, list):
        lines = []
        for item in detail:
            if isinstance(item, dict):  # FastAPI's validation errors
                where = ".".join(str(p) for p in item.get("loc", []) if p != "body")
                lines.append(f"{where}: {item.get('msg', '')}")
            else:
                lines.append(str(item))
        return lines or [f"HTTP {response.status_code}"]
    return [f"HTTP {response.status_code}"]
