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
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from harness.processes import ROOT, running_service, url_for
from helix_locks.server import keys
from tests.support import ROUTE
from tests.system.test_node_client import NODE_CLOCK_RESOLUTION, PYTHON_RACER, race_on_one_key

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
    lines, every, told, grants, attempts = race_on_one_key(racers, env, tmp_path, service.db_url, job)

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
        assert end <= start + NODE_CLOCK_RESOLUTION, f"{before} worked until {end}, {after} from {start}"
    # They did contend, every grant was told and released by its holder, and Go and Node renewed.
    assert {worker for _, _, worker in work} == set(racers)
    assert sorted(grant.lock_id for grant in grants) == sorted(answer.lock_id for answer in told)
    assert {grant.release_reason for grant in grants} == {"released"}
    assert sorted(attempts) == sorted(answer.lock_id for answer in told)
    assert {line["worker"] for line in every if line["kind"] == "renewed"} == {"go-1", "go-2", "node"}
