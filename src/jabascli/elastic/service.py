"""The scheduler's HTTP API (FastAPI): authentication, routes, and the heartbeat watchdog.

Every request but ``GET /healthz`` must carry ``Authorization: Bearer <token>``;
the check is a middleware in front of routing, so it also covers the OpenAPI
schema, unknown paths and any route added later. Request bodies are pydantic
models (:mod:`jabascli.elastic.protocol`): a malformed one gets FastAPI's 422
with the offending fields, never a traceback. Library errors map to HTTP:
:class:`InputError` -> 422, :class:`Conflict` -> 409.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from jabascli.elastic.job import Conflict, Scheduler
from jabascli.elastic.protocol import Commands, Heartbeat, JobStatus, MoveRequest, Registered, Registration, StopRequest
from jabascli.elastic.token import same_token
from jabascli.errors import InputError, RuntimeFailure

OPEN_ROUTES = {("GET", "/healthz")}
WATCHDOG_S = 0.2


def create_app(scheduler: Scheduler, token: str) -> FastAPI:
    """The API of ``scheduler``, answering only requests that present ``token``."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(_watchdog(scheduler))
        try:
            yield
        finally:
            task.cancel()

    app = FastAPI(
        title="jabas scheduler",
        version="1",
        docs_url=None,
        redoc_url=None,
        lifespan=lifespan,
        description="Authorization: Bearer <token> on every route but GET /healthz (docs/elastic.md).",
    )

    @app.middleware("http")
    async def require_token(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if (request.method, request.url.path) in OPEN_ROUTES:
            return await call_next(request)
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not same_token(given.strip(), token):
            return JSONResponse(
                {"detail": "missing or wrong bearer token"}, status_code=401, headers={"WWW-Authenticate": "Bearer"}
            )
        return await call_next(request)

    @app.exception_handler(InputError)
    async def input_error(request: Request, exc: InputError) -> JSONResponse:
        return JSONResponse({"detail": exc.lines()}, status_code=422)

    @app.exception_handler(Conflict)
    async def conflict(request: Request, exc: Conflict) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.get("/healthz")
    def healthz() -> dict[str, bool]:
        return {"ok": True}

    @app.post("/v1/workers", responses={409: {"description": "rank already registered"}})
    def register(registration: Registration) -> Registered:
        with scheduler.lock:
            return scheduler.register(registration)

    @app.post("/v1/workers/{rank}/heartbeat", responses={409: {"description": "worker not registered"}})
    def heartbeat(rank: int, beat: Heartbeat) -> Commands:
        with scheduler.lock:
            return scheduler.heartbeat(rank, beat)

    @app.get("/v1/job")
    def job() -> JobStatus:
        with scheduler.lock:
            return scheduler.status()

    @app.post("/v1/job/move", responses={409: {"description": "the job is over or stopping"}})
    def move(request: MoveRequest) -> JobStatus:
        with scheduler.lock:
            return scheduler.move(request.servers, request.when)

    @app.post("/v1/job/stop")
    def stop(request: StopRequest) -> JobStatus:
        with scheduler.lock:
            return scheduler.stop(request.when)

    return app


async def _watchdog(scheduler: Scheduler) -> None:
    while True:
        await asyncio.sleep(WATCHDOG_S)
        with scheduler.lock:
            scheduler.check_heartbeats()


def serve(scheduler: Scheduler, token: str, host: str, port: int, linger_s: float = 3.0) -> Any:
    """Serve until the job is over (and ``linger_s`` more, so that workers hear it); returns its status."""
    import threading
    import time

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(create_app(scheduler, token), host=host, port=port, log_level="warning"))

    def until_over() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        while not server.should_exit:
            time.sleep(0.1)
            with scheduler.lock:
                over = scheduler.finished_at
            if over is not None and scheduler.clock() - over >= linger_s:
                server.should_exit = True

    watcher = threading.Thread(target=until_over, daemon=True)
    watcher.start()
    try:
        server.run()
    except SystemExit:  # uvicorn exits when it cannot bind
        raise RuntimeFailure.at(None, None, f"the scheduler cannot listen on {host}:{port} (in use?)") from None
    with scheduler.lock:
        return scheduler.status()
