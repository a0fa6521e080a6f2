"""The Go client (clients/go) against a real `helix-locks serve`: its `go test` suite (the contract
and lease tests script servers of their own; the rest run against the service started here), and
a race of Go, Node and Python SDK processes on one pair judged by the history checker."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from harness.history import Renewed, Told, check, database_history
from harness.processes import ROOT, running_service, url_for
from helix_locks.server import keys
from tests.support import ROUTE

# A long system test of a whole, as the Node client's suites are: `scripts/test -m slow` runs it.
pytestmark = pytest.mark.slow

ORG = "acme"
GO_CLIENT = ROOT / "clients" / "go"


def go_environment(more: Mapping[str, str]) -> dict[str, str]:
    """This process's environment without any HELIX_LOCKS_ variable of its own, plus `more`; the
    go command kept off the network (the module uses the standard library alone) and on the
    toolchain installed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HELIX_LOCKS_")}
    env.update({"GOTOOLCHAIN": "local", "GOPROXY": "off", "GOFLAGS": ""})
    if not any(env.get(name) for name in ("GOCACHE", "XDG_CACHE_HOME", "HOME")):
        env["GOCACHE"] = str(Path("/tmp") / "helix-locks-go-cache")
    return env | dict(more)


@pytest.fixture(scope="session")
def go() -> str:
    """The go command: CI installs Debian's golang-go (.ci/run)."""
    found = shutil.which("go")
    if found is None:
        pytest.fail("the Go client's tests need the go command (Debian's golang-go) on PATH")
    return found


@dataclass(frozen=True)
class Service:
    url: str
    db_url: str
    admin_key: str
    acme_key: str  # an organization's key, for acme


@pytest.fixture(scope="module")
def service(
    server_url: str, template_name: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    """One `helix-locks serve` for this file's tests, on a database of its own, with an admin key and
    one of acme's: the Go suite's tests each take job types of their own, and the race its own key."""
    name = f"helix_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        create = sql.SQL("CREATE DATABASE {} TEMPLATE {}")
        conn.execute(create.format(sql.Identifier(name), sql.Identifier(template_name)))
    db_url = url_for(server_url, name)
    try:
        admin_key, acme_key = keys.create(db_url, None), keys.create(db_url, ORG)
        log = tmp_path_factory.mktemp("go-client") / "serve.log"
        with running_service(env=ROUTE.env(db_url), log=log) as (url, _):
            yield Service(url, db_url, admin_key, acme_key)
    finally:
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _declared_tests() -> set[str]:
    return {
        name
        for path in GO_CLIENT.glob("*_test.go")
        for name in re.findall(r"^func (Test\w+)\(t \*testing\.T\)", path.read_text(), re.M)
    }


def test_the_go_client_suite_passes_against_a_real_service(go: str, service: Service) -> None:
    env = go_environment(
        {
            "HELIX_LOCKS_TEST_URL": service.url,
            "HELIX_LOCKS_TEST_API_KEY": service.acme_key,
            "HELIX_LOCKS_TEST_ADMIN_KEY": service.admin_key,
        }
    )
    started = time.monotonic()
    done = subprocess.run(
        # Most of its tests wait on the service or on a clock, not on the CPU: several at a time.
        [go, "test", "-json", "-count=1", "-p", "1", "-parallel", "8", "./..."],
        cwd=GO_CLIENT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    output = "".join(event.get("Output", "") for event in events) + done.stderr
    print(f"go test: {time.monotonic() - started:.1f} s\n{output}")
    assert done.returncode == 0, output
    outcomes = {
        event["Test"]: event["Action"]
        for event in events
        if "Test" in event and event["Action"] in ("pass", "fail", "skip")
    }
    # Every test the files declare ran and passed against the service: none skipped, none left out.
    declared = _declared_tests()
    assert len(declared) >= 20, declared
    assert {name: outcomes.get(name) for name in declared} == dict.fromkeys(declared, "pass"), output
    assert [name for name, action in outcomes.items() if action != "pass"] == [], output
    # One subtest per event stream case of the contract that the other clients' tests read.
    contract = json.loads((ROOT / "clients" / "contract.json").read_text(encoding="utf-8"))
    cases = [name for name in outcomes if name.startswith("TestContractEventStream/")]
    assert len(cases) == len(contract["sse"]), cases


# The Python SDK's racer: the same loop as clients/node/test/race-worker.mjs and
# clients/go/internal/raceworker, recording the same lines (as tests/system/test_node_client.py's).
PYTHON_RACER = """
import json, sys, time
from helix_locks import LockClient, LockHeld, LockLost

name, seconds, output, org, job = sys.argv[1:6]

def record(**line):
    with open(output, "a") as out:
        out.write(json.dumps({"worker": name, **line}) + "\\n")

deadline = time.monotonic() + float(seconds)
with LockClient() as client:
    while time.monotonic() < deadline:
        lock_id = None
        try:
            with client.lock(org, job, ttl=1.5, wait=10, holder=name) as lease:
                lock = lease.grant.body
                lock_id = lock["id"]
                record(kind="told", lock_id=lock_id, fencing_token=lock["fencing_token"],
                       acquired_at=lock["acquired_at"], slot=lock["slot"])
                start = time.time()
                time.sleep(0.6)
                lease.check()
                record(kind="work", lock_id=lock_id, start=start, end=time.time())
            record(kind="release_attempt", lock_id=lock_id)
        except LockHeld:
            record(kind="held")
        except LockLost as exc:
            record(kind="lost", lock_id=lock_id, message=str(exc))
"""

RACE_SECONDS = 7


def test_go_node_and_python_processes_racing_on_one_key_never_hold_it_at_once(
    go: str, node_client: Path, service: Service, tmp_path: Path
) -> None:
    job = "race"  # a key of its own: the Go suite's tests take job types named by a random suffix
    racer = tmp_path / "raceworker"
    built = subprocess.run(
        [go, "build", "-o", str(racer), "./internal/raceworker"],
        cwd=GO_CLIENT,
        env=go_environment({}),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    env = go_environment({"HELIX_LOCKS_URL": service.url, "HELIX_LOCKS_API_KEY": service.acme_key})
    racers = {
        "go-1": [str(racer)],
        "go-2": [str(racer)],
        "node": ["node", str(node_client / "test" / "race-worker.mjs")],
        "python": [sys.executable, "-c", PYTHON_RACER],
    }
    with ExitStack() as stack:
        processes = {}
        for name, command in racers.items():
            log = stack.enter_context((tmp_path / f"{name}.log").open("wb"))
            out = tmp_path / f"{name}.jsonl"
            processes[name] = subprocess.Popen(
                [*command, name, str(RACE_SECONDS), str(out), ORG, job], env=env, stdout=log, stderr=log
            )
        try:
            statuses = {name: process.wait(timeout=RACE_SECONDS + 30) for name, process in processes.items()}
        finally:
            for process in processes.values():
                if process.poll() is None:
                    process.kill()
                    process.wait()
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in racers}
    assert statuses == dict.fromkeys(racers, 0), logs

    lines: dict[str, list[dict[str, Any]]] = {
        name: [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        for name in racers
    }
    every = [line for name in racers for line in lines[name]]
    told = [
        Told(
            line["lock_id"],
            (ORG, job),
            line["fencing_token"],
            datetime.fromisoformat(line["acquired_at"]),
            line["slot"],
        )
        for line in every
        if line["kind"] == "told"
    ]
    renewed = [
        Renewed(line["lock_id"], expires - timedelta(seconds=line["ttl"]), expires)
        for line in every
        if line["kind"] == "renewed"
        for expires in [datetime.fromisoformat(line["expires_at"])]
    ]
    attempts = [line["lock_id"] for line in every if line["kind"] == "release_attempt"]
    grants = [grant for grant in database_history(service.db_url) if grant.key == (ORG, job)]
    violations = check(grants, told, renewed, [], attempts)
    assert violations == [], "\n".join(violations)

    assert [line for line in every if line["kind"] == "lost"] == [], "no lease was lost in a healthy run"
    for name in racers:
        tokens = [line["fencing_token"] for line in lines[name] if line["kind"] == "told"]
        assert len(tokens) >= 2, f"{name} got the lock {len(tokens)} times"
        assert tokens == sorted(set(tokens)), f"{name}: fencing tokens {tokens} do not strictly increase"
    tokens = sorted(answer.fencing_token for answer in told)
    assert len(set(tokens)) == len(tokens), "a fencing token granted twice"
    # The work done under the lock, by the wall clock of one host: one holder at a time.
    work = sorted((line["start"], line["end"], line["worker"]) for line in every if line["kind"] == "work")
    assert len(work) == len(told)
    for (_, end, before), (start, _, after) in itertools.pairwise(work):
        assert end <= start, f"{before} worked until {end}, {after} from {start}"
    # They did contend, every grant was told and released by its holder, and Go and Node renewed.
    assert {worker for _, _, worker in work} == set(racers)
    assert sorted(grant.lock_id for grant in grants) == sorted(answer.lock_id for answer in told)
    assert {grant.release_reason for grant in grants} == {"released"}
    assert sorted(attempts) == sorted(answer.lock_id for answer in told)
    assert {line["worker"] for line in every if line["kind"] == "renewed"} == {"go-1", "go-2", "node"}
