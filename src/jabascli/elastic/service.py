"""The scheduler's HTTP API (FastAPI): authentication, routes, and the heartbeat watchdog.

Every request but ``GET /healthz`` must carry ``Authorization: Bearer <token>``;
the check is a middleware in front of routing, so it also covers the OpenAPI
schema, unknown paths and any route added later. Request bodies are pydantic
models (:mod:`jabascli.elastic.protocol`): a malformed one (a non-finite
number included) gets 422 naming the offending fields, with at most a short
excerpt of the input, never a traceback; a body over ``[scheduler]
max_body_bytes`` gets 413 before it is read whole. Library errors map to
HTTP: :class:`InputError` -> 422, :class:`Conflict` -> 409.

A heartbeat may ask to be held (``wait_s``: its node's trainers wait for a
recovery order). While a failure is being decided, its reply then goes out as
soon as any request or the watchdog gives that node a command or decides the
failure, instead of at its next beat.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jabascli.elastic.job import Conflict, Scheduler
from jabascli.elastic.protocol import Commands, Heartbeat, JobStatus, MoveRequest, Registered, Registration, StopRequest
from jabascli.elastic.token import same_token
from jabascli.errors import InputError, RuntimeFailure

OPEN_ROUTES = {("GET", "/healthz")}
WATCHDOG_S = 0.2
DEFAULT_MAX_BODY_BYTES = 1_000_000
EXCERPT_CHARS = 80
"""The most of a request's input an error body repeats."""


def create_app(scheduler: Scheduler, token: str, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The API of ``scheduler``, answering only requests that present ``token`` with bodies of at most
    ``max_body_bytes``."""

    changed = threading.Condition(scheduler.lock)
    """Notified after every call that may have changed the job: a held heartbeat looks for its commands."""

    @contextlib.contextmanager
    def changing() -> Iterator[None]:
        with changed:
            yield
            changed.notify_all()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(_watchdog(scheduler, changing))
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

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": [_brief(error) for error in exc.errors()]}, status_code=422)

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
        with changing():
            return scheduler.register(registration)

    @app.post("/v1/workers/{rank}/heartbeat", responses={409: {"description": "worker not registered"}})
    def heartbeat(rank: int, beat: Heartbeat) -> Commands:
        with changing():
            reply = scheduler.heartbeat(rank, beat)
            if reply.commands or reply.shutdown or beat.wait_s <= 0 or not scheduler.deciding():
                return reply
            changed.notify_all()  # this beat's own news first: it may be what the others wait for
            hold = min(beat.wait_s, scheduler.loaded.config.scheduler.heartbeat_timeout_s / 2)  # never "silent"
            changed.wait_for(lambda: scheduler.has_commands(rank) or not scheduler.deciding(), timeout=hold)
            return scheduler.commands_for(rank)

    @app.get("/v1/job")
    def job() -> JobStatus:
        with scheduler.lock:
            return scheduler.status()

    @app.post("/v1/job/move", responses={409: {"description": "the job is over or stopping"}})
    def move(request: MoveRequest) -> JobStatus:
        with changing():
            return scheduler.move(request.servers, request.when)

    @app.post("/v1/job/stop")
    def stop(request: StopRequest) -> JobStatus:
        with changing():
            return scheduler.stop(request.when)

    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)  # the outermost: before anything reads a body
    return app


def _brief(error: dict[str, Any]) -> dict[str, Any]:
    """One validation error, with a short excerpt of its input instead of the input (which may be huge, or
    a float JSON cannot encode)."""
    brief = {"loc": list(error.get("loc", ())), "msg": str(error.get("msg", "")), "type": str(error.get("type", ""))}
    if "input" in error:
        text = repr(error["input"])
        brief["input"] = text if len(text) <= EXCERPT_CHARS else text[:EXCERPT_CHARS] + " ..."
    return brief


class BodyLimit:
    """ASGI middleware: 413 for a request whose body is over ``max_bytes``, declared or streamed.

    The body is read here first (at most ``max_bytes`` of it), then handed on whole: FastAPI turns any
    error raised while it reads a body into a 400, so the limit cannot be enforced from inside.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", ())).get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
        body: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:
            nonlocal body
            if body is None:
                return await receive()
            message, body = body, None
            return message

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        detail = f"request body over {self.max_bytes} bytes ([scheduler] max_body_bytes)"
        await JSONResponse({"detail": detail}, status_code=413)(scope, receive, send)


async def _watchdog(scheduler: Scheduler, changing: Callable[[], contextlib.AbstractContextManager[None]]) -> None:
    while True:
        await asyncio.sleep(WATCHDOG_S)
        with changing():
            scheduler.check_heartbeats()


def serve(scheduler: Scheduler, token: str, host: str, port: int, linger_s: float = 3.0) -> Any:
    """Serve until the job is over (and ``linger_s`` more, so that workers hear it); returns its status."""
    import threading
    import time

    import uvicorn

    app = create_app(scheduler, token, scheduler.loaded.config.scheduler.max_body_bytes)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))

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
