"""A real PostgreSQL stopped and started again under a running service; SIGTERM with requests in flight."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from harness.processes import children, running_service
from helix_locks.server import embedded
from helix_locks.server.migrate import migrate
from tests.support import lock_body

# A fault test: run by `scripts/test -m fault`, after the default suite (docs/development.md).
pytestmark = pytest.mark.fault


class OwnPostgres:
    """An embedded PostgreSQL of this test's own, to stop and start again at the same address."""

    def __init__(self, pgdata: Path) -> None:
        self.pgdata = pgdata
        self.url = ""
        self._running: AbstractContextManager[str] | None = None

    def start(self) -> str:
        self._running = embedded.server(self.pgdata)
        url = self._running.__enter__()
        assert self.url in ("", url), "the server came back at another address"
        self.url = url
        return url

    def stop(self) -> None:
        assert self._running is not None
        self._running.__exit__(None, None, None)
        self._running = None


@pytest.fixture
def own_postgres() -> Iterator[OwnPostgres]:
    workdir = Path(tempfile.mkdtemp(prefix="helix-outage-"))
    server = OwnPostgres(workdir / "pgdata")
    try:
        migrate(server.start())
        yield server
    finally:
        if server._running is not None:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def workers_of(pid: int) -> set[int]:
    """uvicorn's worker processes (its other child is multiprocessing's resource tracker)."""
    return {
        child
        for child in children(pid)
        if "spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace")
    }


def timed(call: Any) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = call()
    return response, time.monotonic() - started


def test_a_database_outage_is_503_and_the_service_recovers_by_itself(
    own_postgres: OwnPostgres, tmp_path: Path
) -> None:
    log = tmp_path / "s.log"
    with (
        running_service("--workers", "2", env={"DATABASE_URL": own_postgres.url}, log=log) as (url, server),
        httpx.Client(base_url=url, timeout=30) as http,
    ):
        before = http.post("/v1/locks", json=lock_body(job_type="before")).json()
        own_postgres.stop()

        stopped = time.monotonic()
        for _ in range(2):
            for call in (
                lambda: http.post("/v1/locks", json=lock_body(job_type="during")),
                lambda: http.get(f"/v1/locks/{before['id']}"),
                lambda: http.get("/readyz"),
            ):
                response, took = timed(call)
                assert response.status_code == 503, response.text
                assert response.headers["Retry-After"] == "2"
                assert response.json()["type"] == "urn:helix-locks:problem:database-unavailable"
                assert took < 2.5, f"answered 503 after {took:.2f} s"
        assert http.get("/healthz").status_code == 200, "alive all along"
        # A worker that crashes meanwhile is replaced, and its replacement starts without a database.
        workers = workers_of(server.pid)
        assert len(workers) == 2, workers
        crashed = min(workers)
        os.kill(crashed, signal.SIGKILL)
        wait_until(lambda: len(workers_of(server.pid) - {crashed}) == 2, timeout=15)
        # Long enough for reconnection attempts to back off far (they wait 1, 2, 4, 8, 16... s).
        while time.monotonic() - stopped < 16:
            assert http.get("/readyz").status_code == 503

        own_postgres.start()
        restarted = time.monotonic()
        while (response := http.post("/v1/locks", json=lock_body(job_type="after"))).status_code != 201:
            assert response.status_code == 503, response.text
            assert time.monotonic() - restarted < 10, "not serving again 10 s after the database came back"
            time.sleep(0.1)
        recovered = time.monotonic() - restarted
        assert http.get("/readyz").status_code == 200
        # The lock taken before the outage is intact: its token still releases it.
        assert (
            http.delete(f"/v1/locks/{before['id']}", headers={"Lock-Token": before["token"]}).status_code
            == 204
        )
        assert server.poll() is None, "the same process, never restarted"
    print(f"serving again {recovered:.2f} s after the database came back")


@contextmanager
def key_row_locked(db_url: str, job_type: str) -> Iterator[psycopg.Connection[Any]]:
    """Hold the row lock of a key's fencing counter, so that an acquire of the key waits in
    PostgreSQL: a request in flight for as long as the test likes. Committed on exit."""
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "SELECT 1 FROM helix_lock_keys WHERE organization_id = 'acme' AND job_type = %s FOR UPDATE",
            (job_type,),
        )
        yield conn


def waiting_statements(db_url: str) -> int:
    with psycopg.connect(db_url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE wait_event_type = 'Lock' AND datname = current_database()"
        ).fetchone()
        assert row is not None
        return int(row[0])


def in_flight_acquire(url: str, job_type: str, answers: list[httpx.Response | Exception]) -> threading.Thread:
    def call() -> None:
        try:
            answers.append(httpx.post(f"{url}/v1/locks", json=lock_body(job_type=job_type), timeout=30))
        except httpx.HTTPError as exc:
            answers.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    return thread


def wait_until(predicate: Any, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_sigterm_finishes_requests_in_flight_then_exits_0(db_url: str, tmp_path: Path) -> None:
    with running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "s.log") as (url, server):
        first = httpx.post(f"{url}/v1/locks", json=lock_body(job_type="slow")).json()
        httpx.delete(f"{url}/v1/locks/{first['id']}", headers={"Lock-Token": first["token"]})
        answers: list[httpx.Response | Exception] = []
        with key_row_locked(db_url, "slow"):
            thread = in_flight_acquire(url, "slow", answers)
            wait_until(lambda: waiting_statements(db_url) == 1)
            server.send_signal(signal.SIGTERM)
            # It stops accepting at once...
            wait_until(lambda: not accepts(url), timeout=5)
            time.sleep(0.5)
            assert server.poll() is None, "...but waits for the request in flight"
        thread.join(timeout=10)
        assert server.wait(timeout=10) == 0
    [answer] = answers
    assert isinstance(answer, httpx.Response) and answer.status_code == 201, answer
    assert answer.json()["fencing_token"] == first["fencing_token"] + 1


def test_sigterm_waits_for_requests_in_flight_only_so_long(db_url: str, tmp_path: Path) -> None:
    env = {"DATABASE_URL": db_url, "HELIX_LOCKS_SHUTDOWN_TIMEOUT_SECONDS": "2"}
    with running_service(env=env, log=tmp_path / "s.log") as (url, server):
        first = httpx.post(f"{url}/v1/locks", json=lock_body(job_type="stuck")).json()
        httpx.delete(f"{url}/v1/locks/{first['id']}", headers={"Lock-Token": first["token"]})
        answers: list[httpx.Response | Exception] = []
        with key_row_locked(db_url, "stuck"):
            thread = in_flight_acquire(url, "stuck", answers)
            wait_until(lambda: waiting_statements(db_url) == 1)
            server.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            assert server.wait(timeout=20) == 0
            took = time.monotonic() - signalled
            thread.join(timeout=10)
    assert 2 <= took < 10, f"stopped {took:.1f} s after SIGTERM"
    [answer] = answers
    assert isinstance(answer, httpx.Response), answer
    assert answer.status_code == 503 and answer.headers["Retry-After"] == "1"
    assert answer.json()["type"] == "urn:helix-locks:problem:service-stopping"


def accepts(url: str) -> bool:
    """Whether the service still takes new requests: a connection refused, or one closed without an
    answer (taken from the backlog as the listener closed, seen in a CI run), is a no."""
    try:
        httpx.get(f"{url}/healthz", timeout=1)
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
        return False
    return True
