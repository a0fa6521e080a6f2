"""The worker examples (examples/curl-worker.sh, examples/node-worker.mjs, examples/go-worker) against a
real service."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from datetime import datetime
from pathlib import Path

import httpx
import psycopg
import pytest

from harness.history import Told, check, database_history
from harness.node import node_example
from harness.processes import ROOT, logged_requests, running_service

# Slow: built and run in three languages (Go among them, which the default suite does not need).
pytestmark = pytest.mark.slow

EXAMPLES = {
    "curl": ROOT / "examples" / "curl-worker.sh",
    "node": ROOT / "examples" / "node-worker.mjs",
    "go": ROOT / "examples" / "go-worker",
}
KEY = ("acme", "nightly-report")
LOST = 76  # the examples' documented exit status when their lock was taken away (as helix-locks run's)


@pytest.fixture(scope="module")
def go_worker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/go-worker, built as a user builds it, its go.mod's replace directive pointing at
    clients/go (once for the module's tests)."""
    go = shutil.which("go")
    if go is None:
        pytest.fail("the Go example needs the go command (Debian's golang-go) on PATH")
    built = tmp_path_factory.mktemp("go-worker") / "go-worker"
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("HELIX_LOCKS_", "WORKER_"))}
    done = subprocess.run(
        [go, "build", "-o", str(built), "."],
        cwd=EXAMPLES["go"],
        env={**inherited, "GOTOOLCHAIN": "local", "GOPROXY": "off", "GOFLAGS": ""},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return built


@pytest.fixture(autouse=True)
def installed(node_client: Path, go_worker: Path, tmp_path: Path) -> None:
    """The Node example runs as a user runs it: beside a node_modules that holds the client; the Go
    one as built."""
    node_example(node_client, tmp_path)
    shutil.copy(go_worker, tmp_path / "go-worker")


@contextmanager
def worker(
    name: str, base_url: str, tmp_path: Path, settings: Mapping[str, str]
) -> Iterator[subprocess.Popen[bytes]]:
    """Run one example (its output in tmp_path/NAME.out, its log in NAME.log); killed if left running.
    The Node example runs from its copy in tmp_path, where it finds the client; the Go one as built
    there."""
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("HELIX_LOCKS_", "WORKER_"))}
    env = {
        **inherited,
        "HELIX_LOCKS_URL": base_url,
        "WORKER_ORG": KEY[0],
        "WORKER_JOB_TYPE": KEY[1],
        "WORKER_HOLDER": f"{name}-worker",
        **settings,
    }
    path = EXAMPLES[name]
    with (tmp_path / f"{name}.log").open("wb") as log:
        process = subprocess.Popen(
            [str(tmp_path / path.name if name in ("node", "go") else path), str(tmp_path / f"{name}.out")],
            env=env,
            stdout=log,
            stderr=log,
        )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def lines(path: Path) -> list[list[str]]:
    """The examples' output: one line "fencing_token holder lock_id acquired_at slot" per piece of
    work."""
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def written(path: Path) -> list[Told]:
    told = []
    for token, _holder, lock_id, acquired_at, _slot in lines(path):
        told.append(Told(int(lock_id), KEY, int(token), datetime.fromisoformat(acquired_at)))
    return told


def test_the_examples_working_on_one_key_never_hold_it_at_once(db_url: str, tmp_path: Path) -> None:
    # Work longer than ttl/3, so that every piece of work is renewed once on the way.
    settings = {"WORKER_TTL": "1", "WORKER_ITERATIONS": "5", "WORKER_WORK_SECONDS": "0.4"}
    with (
        running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "serve.log") as (url, _),
        ExitStack() as stack,
    ):
        workers = {name: stack.enter_context(worker(name, url, tmp_path, settings)) for name in EXAMPLES}
        statuses = {name: process.wait(timeout=30) for name, process in workers.items()}
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in EXAMPLES}
    assert statuses == dict.fromkeys(EXAMPLES, 0), logs

    outputs = {name: written(tmp_path / f"{name}.out") for name in EXAMPLES}
    grants = database_history(db_url)
    told = [grant for writes in outputs.values() for grant in writes]
    violations = check(grants, told, [])
    assert violations == [], "\n".join(violations)
    for name, writes in outputs.items():
        tokens = [grant.fencing_token for grant in writes]
        assert len(tokens) == 5 and tokens == sorted(set(tokens)), (name, tokens)
    # Every grant was written once and released by its holder: no lease ran out, nothing lapsed.
    assert sorted(grant.lock_id for grant in told) == sorted(grant.lock_id for grant in grants)
    assert {grant.release_reason for grant in grants} == {"released"}
    # They did contend: an acquire was refused (curl polls) or waited for a release (Node and Go
    # wait in the service), longer than a grant takes.
    acquires = [
        line
        for line in logged_requests(tmp_path / "serve.log")
        if line["method"] == "POST" and line["path"] == "/v1/locks"
    ]
    assert any(line["status"] == 409 or line["duration_ms"] > 100 for line in acquires), acquires
    assert {line[4] for name in EXAMPLES for line in lines(tmp_path / f"{name}.out")} == {"0"}
    # Each renewed its locks while working (the service logs each renewal with its lock id).
    renewed = {
        line["lock_id"]
        for line in logged_requests(tmp_path / "serve.log")
        if line["path"].endswith("/renew") and line["status"] == 200
    }
    for name, writes in outputs.items():
        assert renewed & {grant.lock_id for grant in writes}, f"{name} never renewed its lock"


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_an_example_whose_lock_is_taken_away_stops_with_its_lost_status(
    name: str, db_url: str, tmp_path: Path
) -> None:
    settings = {"WORKER_TTL": "2", "WORKER_ITERATIONS": "1", "WORKER_WORK_SECONDS": "60"}
    with (
        running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "serve.log") as (url, _),
        worker(name, url, tmp_path, settings) as process,
        psycopg.connect(db_url, autocommit=True) as conn,
    ):
        current = f"{url}/v1/locks/current?organization_id={KEY[0]}&job_type={KEY[1]}"
        deadline = time.monotonic() + 10
        while (held := httpx.get(current, timeout=5)).status_code == 404:
            assert process.poll() is None and time.monotonic() < deadline, "the worker took no lock"
            time.sleep(0.05)
        assert held.status_code == 200, held.text
        victim = held.json()["id"]

        # Its lease runs out (as if the worker had stalled) and another worker reclaims it. The
        # worker may renew the lapsed lease in between, so expire it again until the reclaim wins.
        for _ in range(10):
            conn.execute(
                "UPDATE helix_job_locks SET expires_at = clock_timestamp() - interval '1 ms',"
                " acquired_at = acquired_at - interval '1 hour' WHERE released_at IS NULL"
            )
            body = {"organization_id": KEY[0], "job_type": KEY[1], "holder": "thief", "ttl_seconds": 30}
            thief = httpx.post(f"{url}/v1/locks", json=body, timeout=5)
            if thief.status_code != 409:
                break
        assert thief.status_code == 201, thief.text
        assert thief.json()["reclaimed"]["lock_id"] == victim

        status = process.wait(timeout=10)  # its next renewal, within ttl/3, answers 410
    log = (tmp_path / f"{name}.log").read_text()
    assert status == LOST, log
    assert "410" in log, log
    assert written(tmp_path / f"{name}.out") == [], "it finished the work of a lock it had lost"
    with psycopg.connect(db_url) as conn:
        rows = {
            row[0]: row[1:]
            for row in conn.execute("SELECT id, release_reason, holder FROM helix_job_locks").fetchall()
        }
    # It did not release the lock it lost, and the thief's lock stands.
    assert rows == {victim: ("reclaimed", f"{name}-worker"), thief.json()["id"]: (None, "thief")}


def test_the_examples_hold_a_semaphore_of_as_many_at_once_and_another_max_holders_is_refused(
    db_url: str, tmp_path: Path
) -> None:
    slots = len(EXAMPLES)
    settings = {"WORKER_TTL": "5", "WORKER_WORK_SECONDS": "1.5", "WORKER_WAIT_SECONDS": "0"}
    with running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "serve.log") as (url, _):
        with ExitStack() as stack:
            semaphore = {**settings, "WORKER_MAX_HOLDERS": str(slots)}
            workers = {name: stack.enter_context(worker(name, url, tmp_path, semaphore)) for name in EXAMPLES}
            statuses = {name: process.wait(timeout=30) for name, process in workers.items()}
        logs = {name: (tmp_path / f"{name}.log").read_text() for name in EXAMPLES}
        assert statuses == dict.fromkeys(EXAMPLES, 0), logs  # no wait: each got a slot at once
        outputs = {name: lines(tmp_path / f"{name}.out") for name in EXAMPLES}
        assert sorted(output[0][4] for output in outputs.values()) == [str(n) for n in range(slots)], outputs

        body = {"organization_id": KEY[0], "job_type": KEY[1], "holder": "another", "ttl_seconds": 30}
        held = httpx.post(f"{url}/v1/locks", json={**body, "max_holders": slots + 1}, timeout=5)
        assert held.status_code == 201, held.text
        mismatch = {**settings, "WORKER_MAX_HOLDERS": str(slots), "WORKER_WAIT_SECONDS": "20"}
        for name in EXAMPLES:
            (tmp_path / f"{name}.out").unlink()
            with worker(name, url, tmp_path, mismatch) as process:
                assert process.wait(timeout=10) == 2, "a mismatch is a configuration error, not waited for"
            log = (tmp_path / f"{name}.log").read_text()
            said = {
                "curl": f"WORKER_MAX_HOLDERS is {slots}, the key's is {slots + 1}",
                "node": "MaxHoldersMismatchError",
                "go": "MaxHoldersMismatchError",
            }
            assert said[name] in log and str(slots + 1) in log, log
            assert lines(tmp_path / f"{name}.out") == []
