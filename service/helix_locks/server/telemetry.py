"""What operators see: Prometheus metrics, and one log line with a request id per request.

With several worker processes (`serve --workers N`) the metrics live in PROMETHEUS_MULTIPROC_DIR,
which `serve` sets, and any worker's /metrics answers for all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.metrics import MetricWrapperBase
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from helix_locks.server import logs, problems, queries
from helix_locks.server.db import Database, Pool
from helix_locks.server.errors import LockError, ShuttingDown
from helix_locks.server.outcome import Outcome, outcome

logger = logging.getLogger("helix_locks.requests")

MULTIPROCESS_DIR = "PROMETHEUS_MULTIPROC_DIR"
# The held/expired gauges come from one query, run at most this often per process, on a scrape.
LOCK_GAUGE_SECONDS = 5.0
POOL_SAMPLE_SECONDS = 5.0
REQUEST_ID_HEADER = "X-Request-Id"
# A client's own request id is kept when it looks like one; anything else gets a fresh id.
_GOOD_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# Problems that are results of their own in the operation counters.
_RESULTS = {"lock-held": "conflict", "lock-ended": "gone"}
# Which route (by its method and path) counts in which counter.
OPERATIONS = {
    ("POST", "/v1/locks"): "acquisitions",
    ("DELETE", "/v1/locks/{lock_id}"): "releases",
    ("POST", "/v1/locks/{lock_id}/renew"): "renewals",
    ("PATCH", "/v1/locks/{lock_id}"): "updates",
}
# Methods with a series of their own; any other is counted as "other", so that made-up methods
# cannot add series without end.
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
# A logged path is cut to this many characters (a path may be as long as the request's head).
LOGGED_PATH_CHARS = 512
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """The service's metrics, in a registry of this app's own (several apps may share a process)."""

    def __init__(self, label_organizations: bool) -> None:
        self.label_organizations = label_organizations
        self.registry = CollectorRegistry()
        registry = self.registry
        result = ("organization", "result")
        self.acquisitions = Counter(
            "helix_locks_acquisitions",
            "Acquire answers by result: granted, reclaimed (a lock whose worker died was taken over), "
            "conflict (409: a plain lock held), full (409: every slot of a semaphore held), or the problem "
            "type of another error.",
            result,
            registry=registry,
        )
        self.releases = Counter(
            "helix_locks_releases",
            "Release answers by result: released, forced, gone (410), or the problem type.",
            result,
            registry=registry,
        )
        self.renewals = Counter(
            "helix_locks_renewals",
            "Renewal answers by result: renewed, gone (410), or the problem type.",
            result,
            registry=registry,
        )
        self.updates = Counter(
            "helix_locks_updates",
            "Metadata update answers by result: updated, gone (410), or the problem type.",
            result,
            registry=registry,
        )
        self.lost = Counter(
            "helix_locks_lost",
            "410 answers: a worker was told that the lock it thought it held had ended.",
            ("organization",),
            registry=registry,
        )
        self.requests = Histogram(
            "helix_locks_http_request_duration_seconds",
            "HTTP requests by route and status, and how long they took.",
            ("method", "route", "status"),
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.pool_connections = Gauge(
            "helix_locks_pool_connections",
            "Connections in the pools (in use or idle).",
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.pool_idle = Gauge(
            "helix_locks_pool_idle_connections",
            "Idle connections in the pools.",
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.pool_waiting = Gauge(
            "helix_locks_pool_requests_waiting",
            "Requests waiting for a pooled connection.",
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.pool_events = Counter(
            "helix_locks_pool_events",
            "Pool trouble: connection_errors (a connection could not be made), connections_lost "
            "(found broken), request_errors (no connection in time: 503).",
            ("event",),
            registry=registry,
        )
        self.locks = Gauge(
            "helix_locks_locks",
            "Unreleased locks by state: held, or expired (lease over, not yet reclaimed).",
            ("state",),
            registry=registry,
            multiprocess_mode="mostrecent",
        )
        self._locks_read = 0.0
        self._children: dict[tuple[MetricWrapperBase, tuple[str, ...]], Any] = {}

    def organization(self, outcome: Outcome) -> str:
        """The organization label: empty (no label, to Prometheus) unless enabled by setting, and
        for a request refused for its organization (403), which names whatever it likes."""
        if not self.label_organizations or outcome.problem == "forbidden":
            return ""
        return outcome.organization_id or ""

    def answered(self, path: str | None, method: str, status: int, seconds: float, outcome: Outcome) -> None:
        """Count one finished request: its route's path, and what its route and answer recorded."""
        method = method if method in _METHODS else "other"
        self._child(self.requests, method, path or "unmatched", str(status)).observe(seconds)
        organization = self.organization(outcome)
        if outcome.problem == "lock-ended":
            self._child(self.lost, organization).inc()
        counter = OPERATIONS.get((method, path or ""))
        if counter is not None:
            result = outcome.result or _RESULTS.get(str(outcome.problem), str(outcome.problem or "error"))
            self._child(getattr(self, counter), organization, result).inc()

    def _child(self, metric: MetricWrapperBase, *labels: str) -> Any:
        """metric.labels(*labels), found in a dict of our own: labels() takes a lock and checks
        its arguments on every call. Holds what prometheus_client holds: one per series."""
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def sample_pool(self, pool: Pool) -> None:
        stats = pool.pop_stats()
        self.pool_connections.set(stats.get("pool_size", 0))
        self.pool_idle.set(stats.get("pool_available", 0))
        self.pool_waiting.set(stats.get("requests_waiting", 0))
        for event, key in (
            ("connection_errors", "connections_errors"),
            ("connections_lost", "connections_lost"),
            ("request_errors", "requests_errors"),
        ):
            self.pool_events.labels(event).inc(stats.get(key, 0))

    async def sample_locks(self, db: Database) -> None:
        """Held and expired locks, from one cheap query at most every LOCK_GAUGE_SECONDS."""
        if time.monotonic() - self._locks_read < LOCK_GAUGE_SECONDS:
            return
        self._locks_read = time.monotonic()
        try:
            row = await db.fetch_first(queries.COUNT_LIVE, {})
        except LockError:
            return  # the database is away: the last figures stand, and requests say 503
        self.locks.labels("held").set(row["held"])
        self.locks.labels("expired").set(row["expired"])

    async def sample(self, db: Database) -> None:
        """Fresh figures of the locks and of this process's pool, for a scrape."""
        await self.sample_locks(db)
        self.sample_pool(db.pool)

    async def sample_pool_every(self, pool: Pool) -> None:
        """Keep this process's pool figures fresh for scrapes answered by other workers."""
        while True:
            self.sample_pool(pool)
            await asyncio.sleep(POOL_SAMPLE_SECONDS)

    def render(self) -> tuple[bytes, str]:
        """The exposition: this app's registry, or every worker's when there are several."""
        directory = os.environ.get(MULTIPROCESS_DIR)
        if not directory:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        _forget_dead_workers(Path(directory))
        combined = CollectorRegistry()
        multiprocess.MultiProcessCollector(combined, path=directory)  # type: ignore[no-untyped-call]
        return generate_latest(combined), CONTENT_TYPE_LATEST


def _forget_dead_workers(directory: Path) -> None:
    """Drop the live gauges of workers that died (a crashed worker cannot do it itself)."""
    for path in directory.glob("gauge_live*_*.db"):
        pid = int(path.stem.rsplit("_", 1)[1])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            multiprocess.mark_process_dead(pid, str(directory))  # type: ignore[no-untyped-call]
        except PermissionError:
            pass  # alive, someone else's


def forget_this_worker() -> None:
    """At a worker's exit: its live gauges stop counting."""
    directory = os.environ.get(MULTIPROCESS_DIR)
    if directory:
        with contextlib.suppress(OSError):
            multiprocess.mark_process_dead(os.getpid(), directory)  # type: ignore[no-untyped-call]


def _logged(path: str) -> str:
    if len(path) <= LOGGED_PATH_CHARS:
        return path
    return f"{path[:LOGGED_PATH_CHARS]}... ({len(path)} characters)"


def request_id(scope: Scope) -> str:
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            given = bytes(value).decode("latin-1")
            if _GOOD_REQUEST_ID.fullmatch(given):
                return given
    return secrets.token_hex(16)  # as random as uuid4().hex, without building a UUID


class Observe:
    """Per request: an id (X-Request-Id, the client's own if it sent one), the log fields that
    every line logged meanwhile carries, then one log line and the metrics when it ends."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # unless a response starts
        responded = False
        answered = outcome(scope)
        with logs.request(request_id=request_id(scope)) as fields:
            rid = fields["request_id"].encode()

            async def send_with_id(message: Message) -> None:
                nonlocal status, responded
                if message["type"] == "http.response.start":
                    status, responded = message["status"], True
                    message["headers"] = [*message.get("headers", []), (b"x-request-id", rid)]
                await send(message)

            try:
                await self.app(scope, receive, send_with_id)
            except asyncio.CancelledError:
                # The server stopped waiting for this request (SIGTERM, and the grace time ran
                # out): answer it, rather than let the server answer 500.
                if responded:
                    raise
                await problems.from_error(ShuttingDown())(scope, receive, send_with_id)
            except Exception:
                # Any other failure: logged once, with the request's fields, and answered 500
                # with the request id like every other answer.
                logger.exception("unhandled error on %s %s", scope["method"], scope["path"])
                if responded:
                    raise
                await problems.internal()(scope, receive, send_with_id)
            finally:
                seconds = time.perf_counter() - started
                path = getattr(scope.get("route"), "path", None)
                self.metrics.answered(path, scope["method"], status, seconds, answered)
                if path != "/metrics" and not (path in ("/healthz", "/readyz") and status == 200):
                    logs.line(
                        logger,
                        logging.INFO if status < 500 else logging.WARNING if status != 500 else logging.ERROR,
                        "request",
                        {
                            "method": scope["method"][:16],
                            "path": _logged(scope["path"]),
                            "status": status,
                            "duration_ms": round(seconds * 1000, 2),
                            **answered.fields(),
                        },
                    )
