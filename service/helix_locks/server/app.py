"""The app factory: settings, the pool's lifespan, the body limit and the error handlers."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import re
import signal
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import timedelta
from types import FrameType
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send
from swagger_ui_bundle import swagger_ui_path

import helix_locks
from helix_locks.server import api, console, hot, migrate, problems, queries, query, schemas, telemetry
from helix_locks.server.db import Database, create_pool
from helix_locks.server.errors import (
    BodyTooLarge,
    DatabaseUnavailable,
    EmptyResult,
    InvalidArgument,
    InvalidRequest,
    LockError,
    UnsupportedMediaType,
)
from helix_locks.server.events import EventHub
from helix_locks.server.keys import KeyRing
from helix_locks.server.listener import Listener
from helix_locks.server.locks import LiveLockQuota, Locks
from helix_locks.server.retention import Pruner
from helix_locks.server.sessions import Sessions
from helix_locks.server.settings import Settings
from helix_locks.server.waiting import Waiters

MAX_BODY_BYTES = 64 * 1024
logger = logging.getLogger("helix_locks")


class BodyLimit:
    """Answers 413 (as a problem) to a body over the limit, declared or streamed, before parsing.

    FastAPI's own max_body_size answers a declared oversize body in plain text, so not that.
    """

    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        too_large = declared is not None and declared.isdigit() and int(declared) > self.max_bytes
        body = b""
        while not too_large:
            message = await receive()
            if message["type"] != "http.request":
                break  # the client went away; the app will see that on its next receive
            body += message.get("body", b"")
            too_large = len(body) > self.max_bytes
            if not message.get("more_body", False):
                break
        if too_large:
            await problems.from_error(BodyTooLarge(self.max_bytes))(scope, receive, send)
            return
        await self.app(
            scope, hot.replaying({"type": "http.request", "body": body, "more_body": False}, receive), send
        )


def _field(loc: tuple[int | str, ...], kind: str) -> str:
    """'ttl_seconds' for ('body', 'ttl_seconds'); the whole body for body-level errors."""
    if kind == "json_invalid" or len(loc) < 2:
        return str(loc[0]) if loc else "body"
    return ".".join(str(part) for part in loc[1:])


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    body_errors = any(err["loc"][:1] == ("body",) for err in exc.errors())
    if body_errors and not api.declared_json(request.headers.get("content-type", "application/json")):
        return problems.from_error(UnsupportedMediaType())
    errors = [
        {
            "field": _field(tuple(err["loc"]), err["type"]),
            "message": str(err["msg"]).removeprefix("Value error, "),
        }
        for err in exc.errors()
    ]
    return problems.from_error(InvalidRequest(errors))


async def _domain_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, LockError)
    if isinstance(exc, DatabaseUnavailable):
        logger.warning("database unavailable: %s", exc.reason)
    elif isinstance(exc, EmptyResult):
        logger.error("a lock function returned no row: %s", exc)
    return problems.from_error(exc)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 400:
        # FastAPI's only 400: a body it could not decode (not UTF-8, nested too deep for JSON).
        return problems.from_error(InvalidArgument("body", "not a readable JSON document"))
    headers = dict(exc.headers or {})
    if exc.status_code == 405:
        # Starlette names only the methods of the first route that matched the path; the document
        # names them all. A path it leaves out (the console, /docs) has one route, which names its own.
        documented = _methods_for(request)
        allowed = documented or sorted(method.strip() for method in headers.get("Allow", "").split(","))
        headers["Allow"] = ", ".join(method for method in allowed if method)
    return problems.problem(
        exc.status_code,
        f"http-{exc.status_code}",
        str(exc.detail),
        str(exc.detail),
        headers=headers,
    )


def _methods_for(request: Request) -> list[str]:
    """The methods the API declares for this request's path: those of the most specific path
    template that matches it (/v1/locks/current, not /v1/locks/{lock_id})."""
    matching = [
        (template.count("{"), sorted(method.upper() for method in operations))
        for template, operations in request.app.openapi()["paths"].items()
        if re.fullmatch(_pattern(template), request.url.path)
    ]
    return min(matching)[1] if matching else []


def _pattern(template: str) -> str:
    """/v1/locks/{lock_id} -> /v1/locks/[^/]+"""
    parts = re.split(r"(\{[^}/]+\})", template)
    return "".join("[^/]+" if part.startswith("{") else re.escape(part) for part in parts)


def _answer_on_stop(*stops: Callable[[], None]) -> Callable[[], None]:
    """Chain SIGTERM/SIGINT so that waiting acquires answer, and event streams end, at once when
    the server is told to stop: uvicorn reaches the lifespan's shutdown only after every request
    has finished, and a waiting request or a stream would otherwise hold the stop. Returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    loop = asyncio.get_running_loop()
    previous: dict[int, Any] = {
        signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)
    }

    def stopping(signum: int, frame: FrameType | None) -> None:
        for stop in stops:
            loop.call_soon_threadsafe(stop)
        chained = previous[signum]
        if callable(chained):
            chained(signum, frame)
        elif chained == signal.SIG_DFL:  # as if we were not here
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)

    for signum in previous:
        signal.signal(signum, stopping)

    def undo() -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    return undo


async def _cancelled(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def create_app(settings: Settings | None = None) -> FastAPI:
    """The service; settings come from the environment unless given."""
    settings = settings or Settings()  # type: ignore[call-arg]  # database_url comes from the env
    metrics = telemetry.Metrics(settings.metrics_organization_label)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[api.LifespanState]:
        async with contextlib.AsyncExitStack() as stack:  # what starts here stops in reverse order
            pool = create_pool(settings)
            # Not waiting for connections: a worker that starts while PostgreSQL is away (uvicorn
            # replacing one that crashed, say) serves 503 until it is back, rather than failing to
            # start, which makes uvicorn stop every worker.
            await pool.open(wait=False)
            db = Database(pool, settings)
            stack.push_async_callback(db.close)
            keys = KeyRing(db, settings.allow_anonymous)
            await keys.start()
            stack.push_async_callback(keys.stop)
            waiters = Waiters(settings.max_waiters, settings.max_waiters_per_organization)

            async def probe(payload: str) -> None:
                await db.fetch_all(queries.PROBE, {"payload": payload})

            # LISTEN needs a session of its own: the direct URL, when database_url is a pooler's.
            keys.listener = listener = Listener(
                settings.session_database_url,
                {queries.KEYS_CHANNEL: keys.reload, queries.RELEASED_CHANNEL: waiters.released},
                probe,
                settings.statement_timeout_ms,
                waiters.replica,
            )
            await listener.start()
            stack.push_async_callback(listener.stop)
            stack.callback(waiters.close)
            if settings.retention_days > 0:
                keep = timedelta(days=settings.retention_days)
                pruner = Pruner(db, keep, settings.retention_batch, settings.retention_interval_seconds)
                await pruner.start()
                stack.push_async_callback(pruner.stop)
            stack.callback(telemetry.forget_this_worker)
            sampler = asyncio.create_task(metrics.sample_pool_every(pool), name="helix-locks-pool-metrics")
            stack.push_async_callback(_cancelled, sampler)
            events = EventHub(
                db,
                keys,
                schemas.event_data,
                poll_seconds=settings.events_poll_ms / 1000,
                max_watchers=settings.max_watchers,
                max_per_organization=settings.max_watchers_per_organization,
                replay_limit=settings.events_replay_limit,
                stream_bytes=settings.events_stream_bytes,
                memory_bytes=settings.events_memory_bytes,
                organization_bytes=settings.events_organization_bytes,
                keep=timedelta(days=settings.retention_days) if settings.retention_days > 0 else None,
                keepalive_seconds=settings.events_keepalive_seconds,
            )
            stack.callback(events.close)
            stack.callback(_answer_on_stop(waiters.close, events.close))
            quota = LiveLockQuota(db, settings.max_live_locks_per_organization)
            services = api.Services(
                locks=Locks(db, quota),
                sessions=Sessions(
                    db, quota, settings.max_sessions_per_organization, settings.max_locks_per_session
                ),
                keys=keys,
                waiters=waiters,
                events=events,
                metrics=metrics,
                ready=functools.partial(migrate.check_ready, db),
                sample=functools.partial(metrics.sample, db),
                anonymous_any_host=settings.anonymous_any_host,
            )
            # What exists now (modules, the app, its routes and schemas) lives as long as the app.
            # Out of the collector's sight, a full collection is far shorter (docs/performance.md):
            # a pause that every request in flight waits out. Undone at the end, for processes that
            # run one app after another (the tests).
            gc.collect()
            gc.freeze()
            stack.callback(gc.unfreeze)
            yield {"services": services}

    app = FastAPI(
        docs_url=None,  # served below, with Swagger UI's files from the package
        redoc_url=None,
        openapi_url=None,  # served below, by a route that refuses unknown query parameters too
        title="Helix Locks",
        version=helix_locks.__version__,
        summary="A lock authority for background workers: one job per organization and job type at once.",
        lifespan=lifespan,
        # A body sent without any Content-Type is read as JSON; other types are refused.
        strict_content_type=False,
        # No OpenTelemetry: /metrics and the log lines are ours, and checking for tracer, meter
        # and logger providers on every request is a cost with nothing to show for it.
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.router.route_class = query.Route  # every route refuses a query parameter it does not declare
    app.include_router(api.router)
    app.include_router(api.health)

    @app.api_route("/openapi.json", methods=["GET", "HEAD"], include_in_schema=False)
    async def openapi_document(request: Request) -> JSONResponse:
        # request.app, not `app`: FastAPI keeps endpoints in caches that outlive their app.
        return JSONResponse(request.app.openapi())

    # /docs from files of our own, not a CDN: it works where the service's users have no internet.
    app.mount("/docs/assets", query.Files(directory=swagger_ui_path), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title="Helix Locks",
            swagger_js_url="/docs/assets/swagger-ui-bundle.js",
            swagger_css_url="/docs/assets/swagger-ui.css",
            swagger_favicon_url="/docs/assets/favicon-32x32.png",
        )

    console.mount(app)  # /console: the operator's console, also from files of our own

    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(LockError, _domain_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_middleware(hot.HotRoutes, on_error=_domain_error)  # inside BodyLimit: bodies arrive whole
    app.add_middleware(BodyLimit)
    app.add_middleware(telemetry.Observe, metrics=metrics)  # outermost: sees every answer

    def openapi() -> dict[str, Any]:
        """FastAPI's document, with the API key scheme that the lock routes check themselves."""
        schema = FastAPI.openapi(app)  # built once, then cached by FastAPI
        schema.setdefault("components", {}).setdefault("securitySchemes", {}).update(api.SECURITY_SCHEMES)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
