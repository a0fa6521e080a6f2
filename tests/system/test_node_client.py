"""The Node client (clients/node) against a real `helix-locks serve`: its own `node --test` suites,
a race of two Node processes and a Python SDK process judged by the history checker, and its npm
tarball installed into an empty project."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from harness.history import Grant, Renewed, Told, check, database_history
from harness.node import npm
from harness.processes import running_service
from helix_locks.server import keys
from tests.support import ROUTE

pytestmark = pytest.mark.slow

ORG = "acme"


def _inherited(more: Mapping[str, str]) -> dict[str, str]:
    """This process's environment without any HELIX_LOCKS_ variable of its own, plus `more`."""
    return {k: v for k, v in os.environ.items() if not k.startswith("HELIX_LOCKS_")} | dict(more)


@dataclass(frozen=True)
class Service:
    url: str
    pid: int
    admin_key: str
    acme_key: str  # an organization's key, for acme


@pytest.fixture
def service(db_url: str, tmp_path: Path) -> Iterator[Service]:
    """`helix-locks serve` on this test's database, with an admin key and one of acme's."""
    admin_key, acme_key = keys.create(db_url, None), keys.create(db_url, ORG)
    with running_service(env=ROUTE.env(db_url), log=tmp_path / "serve.log") as (url, process):
        yield Service(url, process.pid, admin_key, acme_key)


# The node --test suites in clients/node/test, each against a service of its own: kill.test.mjs
# SIGKILLs the one it is given.
SUITES = ["client", "faults", "hostile", "loss", "hold", "kill"]


@pytest.mark.parametrize("suite", SUITES)
def test_the_node_client_suite_passes_against_a_real_service(
    suite: str, node_client: Path, service: Service
) -> None:
    path = node_client / "test" / f"{suite}.test.mjs"
    env = _inherited(
        {
            "HELIX_LOCKS_TEST_URL": service.url,
            "HELIX_LOCKS_TEST_API_KEY": service.acme_key,
            "HELIX_LOCKS_TEST_ADMIN_KEY": service.admin_key,
            "HELIX_LOCKS_TEST_SERVER_PID": str(service.pid),
        }
    )
    started = time.monotonic()
    done = subprocess.run(
        ["node", "--test", str(path)], cwd=node_client, env=env, capture_output=True, text=True, timeout=100
    )
    output = f"{done.stdout}\n{done.stderr}"
    print(f"node --test {path.name}: {time.monotonic() - started:.1f} s\n{output}")
    assert done.returncode == 0, output
    summary = dict(re.findall(r"^# (tests|pass|fail|cancelled|skipped|todo) (\d+)$", done.stdout, re.M))
    declared = len(re.findall(r"^test\(", path.read_text(), re.M))
    # Every test the file declares ran and passed: none skipped, none left out.
    assert declared > 0
    assert summary == {
        "tests": str(declared),
        "pass": str(declared),
        "fail": "0",
        "cancelled": "0",
        "skipped": "0",
        "todo": "0",
    }, output


def test_the_node_client_keeps_the_clients_contract(node_client: Path) -> None:
    """clients/node/test/contract.test.mjs, which needs no service (it scripts a small HTTP
    server of its own): the same clients/contract.json as tests/unit/test_contract.py checks."""
    path = node_client / "test" / "contract.test.mjs"
    done = subprocess.run(
        ["node", "--test", str(path)],
        cwd=node_client,
        env=_inherited({}),
        capture_output=True,
        text=True,
        timeout=100,
    )
    output = f"{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, output
    contract = json.loads((node_client.parent / "contract.json").read_text(encoding="utf-8"))
    # One test per test( line, and one per event stream case: none left out, none skipped.
    declared = str(len(re.findall(r"^test\(", path.read_text(), re.M)) + len(contract["sse"]))
    summary = dict(re.findall(r"^# (tests|pass|skipped|todo) (\d+)$", done.stdout, re.M))
    assert summary == {"tests": declared, "pass": declared, "skipped": "0", "todo": "0"}, output


# The Python SDK's racer: the same loop as clients/node/test/race-worker.mjs, recording the same lines.
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
# Node's wall clock (Date.now(), as the racers read the host's) counts whole milliseconds.
NODE_CLOCK_RESOLUTION = 0.001


def race_on_one_key(
    racers: Mapping[str, list[str]], env: Mapping[str, str], tmp_path: Path, db_url: str, job: str
) -> tuple[dict[str, list[dict[str, Any]]], list[dict[str, Any]], list[Told], list[Grant], list[int]]:
    """Run the racers (worker processes of any client: each appends what it was told to a JSON
    lines file) on one key of ORG for RACE_SECONDS; every one exits 0, and the history checker
    finds nothing wrong in the database's grants of the key. The Go client's race runs it too.
    Returns each racer's lines, all of them, what the racers were told, the key's grants in the
    database, and the release attempts, for the callers' own checks."""
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
    grants = [grant for grant in database_history(db_url) if grant.key == (ORG, job)]
    violations = check(grants, told, renewed, [], attempts)
    assert violations == [], "\n".join(violations)
    return lines, every, told, grants, attempts


def test_two_node_processes_and_a_python_one_racing_on_one_key_never_hold_it_at_once(
    node_client: Path, service: Service, db_url: str, tmp_path: Path
) -> None:
    job = "race"
    env = _inherited({"HELIX_LOCKS_URL": service.url, "HELIX_LOCKS_API_KEY": service.acme_key})
    racers = {
        "node-1": ["node", str(node_client / "test" / "race-worker.mjs")],
        "node-2": ["node", str(node_client / "test" / "race-worker.mjs")],
        "python": [sys.executable, "-c", PYTHON_RACER],
    }
    lines, every, told, grants, attempts = race_on_one_key(racers, env, tmp_path, db_url, job)

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
        # Node's wall clock has whole milliseconds: a start in the millisecond an end came in reads
        # as up to a millisecond before it.
        assert end <= start + NODE_CLOCK_RESOLUTION, f"{before} worked until {end}, {after} from {start}"
    # They did contend, every grant was told and released by its holder, and Node renewed its leases.
    assert {worker for _, _, worker in work} == set(racers)
    assert sorted(grant.lock_id for grant in grants) == sorted(answer.lock_id for answer in told)
    assert {grant.release_reason for grant in grants} == {"released"}
    assert sorted(attempts) == sorted(answer.lock_id for answer in told)
    assert {line["worker"] for line in every if line["kind"] == "renewed"} == {"node-1", "node-2"}


CONSUMER_SCRIPT = """
import { LockClient, LockHeldError } from "helix-locks";

const client = new LockClient(); // HELIX_LOCKS_URL, HELIX_LOCKS_API_KEY
const key = { organizationId: "acme", jobType: "packaged" };
const held = await client.withLock({ ...key, ttl: 5 }, async (lease) => {
  let rival = null;
  try {
    await client.acquire(key);
  } catch (error) {
    rival = error instanceof LockHeldError ? error.holder : String(error);
  }
  return { id: lease.id, fencingToken: lease.fencingToken, slot: lease.slot, rival };
});
const grant = await client.acquire({ ...key, ttl: 5 });
await client.release(grant);
const after = await client.current(key);
console.log(JSON.stringify({ held, second: grant.fencingToken, after }));
"""

CONSUMER_TYPES = """
import {
  ClosedUntilError, HoldLimitError, LockClient, LockHeldError, LockLostError, type Lease, type Lock,
  type LockMode,
} from "helix-locks";

const client: LockClient = new LockClient({ url: "http://127.0.0.1:8080" });
export async function work(): Promise<number> {
  return client.withLock({ organizationId: "acme", jobType: "typed", ttl: 30 }, async (lease: Lease) => {
    const signal: AbortSignal = lease.signal;
    const lock: Lock = await lease.update({ done: 1 });
    if (signal.aborted) throw new LockLostError("lost");
    return lock.fencing_token + lease.fencingToken;
  });
}
// @ts-expect-error: ttl is a number of seconds
client.acquire({ organizationId: "acme", jobType: "typed", ttl: "30" });
export const reader: Promise<LockMode> = client
  .acquire({ organizationId: "acme", jobType: "typed", mode: "shared" })
  .then((grant) => grant.mode)
  .catch((error: unknown) => (error instanceof LockHeldError ? error.mode : "exclusive"));
// @ts-expect-error: a lock's mode is exclusive or shared
client.acquire({ organizationId: "acme", jobType: "typed", mode: "read" });
client.openSession({ organizationId: "acme", jobTypes: ["a", "b"], shared: ["a"] });
const bounded = { organizationId: "acme", jobType: "typed", maxHoldSeconds: 3600 };
export const limit: Promise<string | null> = client
  .withLock(bounded, (lease: Lease) => lease.holdLimitAt)
  .catch((error: unknown) => (error instanceof HoldLimitError ? error.holdLimitAt : null));
// @ts-expect-error: a hold limit is a number of seconds
client.acquire({ organizationId: "acme", jobType: "typed", maxHoldSeconds: "1h" });
export const sessionLimit: Promise<string | null> = client
  .openSession({ organizationId: "acme", jobTypes: ["a"], maxHoldSeconds: 60 })
  .then((grant) => grant.holdLimitAt);
const closing = { organizationId: "acme", jobType: "typed", holdAtLeastSeconds: 3000 };
export const opens: Promise<string | null> = client
  .withLock(closing, (lease: Lease) => lease.closedUntil ?? lease.grant.closedUntil)
  .catch((error: unknown) => (error instanceof ClosedUntilError ? error.closedUntil : null));
// A ClosedUntilError is a LockHeldError: code written before closed keys still catches it.
export const held: LockHeldError = new ClosedUntilError({ closed_until: "2026-12-01T00:00:00Z" }, 60);
// @ts-expect-error: a closing is a number of seconds
client.acquire({ organizationId: "acme", jobType: "typed", holdAtLeastSeconds: "50m" });
"""


def test_the_packed_tarball_installs_into_an_empty_project_and_works_there(
    node_client: Path, service: Service, db_url: str, tmp_path: Path
) -> None:
    packed = json.loads(npm("pack", "--json", "--pack-destination", str(tmp_path), cwd=node_client))
    files = {entry["path"] for entry in packed[0]["files"]}
    assert {"package.json", "README.md", "dist/index.js", "dist/index.d.ts", "dist/client.js"} <= files
    unwanted = ("src/", "test/", "bench/", "node_modules/")
    assert not [path for path in files if path.startswith(unwanted)], files
    tarball = tmp_path / packed[0]["filename"]

    project = tmp_path / "project"
    project.mkdir()
    (project / "package.json").write_text(json.dumps({"name": "consumer", "private": True, "type": "module"}))
    # Offline: the package has no dependencies to fetch.
    npm("install", "--offline", "--no-audit", "--no-fund", str(tarball), cwd=project, timeout=120)
    installed = json.loads((project / "node_modules" / "helix-locks" / "package.json").read_text())
    assert installed["name"] == "helix-locks" and not installed.get("dependencies")
    installed_packages = [path.name for path in (project / "node_modules").iterdir()]
    assert [name for name in installed_packages if not name.startswith(".")] == ["helix-locks"]

    (project / "main.mjs").write_text(CONSUMER_SCRIPT)
    env = _inherited({"HELIX_LOCKS_URL": service.url, "HELIX_LOCKS_API_KEY": service.acme_key})
    done = subprocess.run(
        ["node", "main.mjs"], cwd=project, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout)
    assert said["held"]["slot"] == 0 and said["held"]["rival"], said
    assert said["second"] == said["held"]["fencingToken"] + 1
    assert said["after"] is None
    with psycopg.connect(db_url) as conn:
        rows = conn.execute(
            "SELECT release_reason FROM helix_job_locks WHERE job_type = 'packaged' ORDER BY id"
        ).fetchall()
    assert rows == [("released",), ("released",)]

    # Its types, as a TypeScript project that installed it sees them.
    (project / "consumer.ts").write_text(CONSUMER_TYPES)
    tsc = node_client / "node_modules" / "typescript" / "bin" / "tsc"
    types = node_client / "node_modules" / "@types"
    checked = subprocess.run(
        [
            *("node", str(tsc), "--noEmit", "--strict", "--target", "es2022", "--module", "nodenext"),
            *("--moduleResolution", "nodenext", "--typeRoots", str(types), "--types", "node", "consumer.ts"),
        ],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
