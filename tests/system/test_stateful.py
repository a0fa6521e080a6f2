"""Stateful fuzzing: hypothesis's rule-based state machine over the real HTTP API, on a live server.

Each example is a sequence of acquires (some waiting briefly, some naming the wrong max_holders,
some repeats with the same Idempotency-Key), renewals, metadata updates, releases (with the right
token or a wrong one, by the holder's organization, another organization or the admin key),
forced releases (admin key, organization key), reads of one lock and of the current lock, and
leases made to run out in the database; over 2 organizations (acme, globex) with 2 API keys
each and an admin key, and 2 job types per organization: a plain lock and a semaphore of 2.
The model (tests/lock_model.py) predicts every answer's status and problem kind, the holders a
409 names, the slot and the reclaimed lock of each grant, and each grant's fencing token must be
above every earlier one of its key. After every step the live locks the admin key lists must be
the model's. Each example uses job types of its own, and forces what it still holds at its end.
After the run, harness/history.py checks the database's rows against what the clients were told.

The CI size is the same on every run (derandomized): HELIX_STATEFUL_EXAMPLES sequences (default
200) of up to HELIX_STATEFUL_STEPS steps (default 20). Nightly:

    HELIX_STATEFUL_EXAMPLES=5000 HELIX_STATEFUL_STEPS=40 pytest -p no:cacheprovider \\
        tests/system/test_stateful.py

(its timeout grows with the size).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, ClassVar

import httpx
import psycopg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)

from harness.history import Renewed, Told, check, database_history
from harness.processes import running_service
from helix_locks.server import keys
from tests.lock_model import ADMIN, ORGANIZATIONS, Expected, Lock, Model, key_names
from tests.support import ROUTE

EXAMPLES = int(os.environ.get("HELIX_STATEFUL_EXAMPLES", "200"))
STEPS = int(os.environ.get("HELIX_STATEFUL_STEPS", "20"))
TTL = 300  # s: no lease runs out by itself within an example; `expire` makes one run out
WAIT = 0.1  # s: a waiting acquire's wait, kept short (and rare) so that examples stay fast
JOB_TYPES = {"report": 1, "export": 2}  # job type: the max_holders its acquires name
HOLDERS = ("worker-1", "worker-2")
WRONG_TOKEN = "0123456789abcdef" * 2
PROBLEM = "urn:helix-locks:problem:"
# Who calls, relative to the organization of the lock (or of the acquire).
CALLERS = ("own", "own-2", "admin", "other")
METADATA = st.one_of(st.none(), st.fixed_dictionaries({"done": st.integers(0, 3)}))
# Answers every CI run must have met, so that a change that starves a rule shows.
COVERED = {
    ("acquire", 201, None),
    ("acquire", 403, "forbidden"),
    ("acquire", 409, "lock-held"),
    ("acquire", 409, "max-holders-mismatch"),
    ("acquire", "reclaimed"),
    ("acquire", "waited"),
    ("replay", 201, None),
    ("release", 204, None),
    ("release", 403, "token-mismatch"),
    ("release", 404, "lock-not-found"),
    ("release", 410, "lock-ended"),
    ("renew", 200, None),
    ("renew", "lapsed"),
    ("renew", 410, "lock-ended"),
    ("update", 200, None),
    ("force", 204, None),
    ("force", 403, "forbidden"),
    ("get", 200, None),
    ("current", 200, None),
    ("current", 404, "lock-not-found"),
}


@dataclass
class Run:
    """The service and what its clients were told, across every example of one test."""

    url: str
    db_url: str
    secrets: dict[str, str]  # API key name: the key
    http: httpx.Client
    conn: psycopg.Connection[tuple[Any, ...]]
    examples: int = 0
    steps: int = 0
    told: list[Told] = field(default_factory=list)
    renewed: dict[int, list[Renewed]] = field(default_factory=dict)
    released: list[int] = field(default_factory=list)
    release_attempts: list[int] = field(default_factory=list)
    answers: Counter[tuple[Any, ...]] = field(default_factory=Counter)


def caller(who: str, organization_id: str) -> str:
    """The API key's name for `who`, relative to an organization."""
    other = next(org for org in ORGANIZATIONS if org != organization_id)
    return {
        "own": f"{organization_id}-1",
        "own-2": f"{organization_id}-2",
        "admin": ADMIN,
        "other": f"{other}-1",
    }[who]


def at(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


class LockMachine(RuleBasedStateMachine):
    run: ClassVar[Run]
    locks = Bundle("locks")

    def __init__(self) -> None:
        super().__init__()
        self.run.examples += 1
        self.prefix = f"e{self.run.examples}"
        self.model = Model()
        self.fenced: dict[tuple[str, str], int] = {}  # the highest fencing token granted, per key
        self.requests = 0

    # Calls and their checks

    def call(self, method: str, path: str, api_key: str, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.run.secrets[api_key]}", **kwargs.pop("headers", {})}
        return self.run.http.request(method, path, headers=headers, **kwargs)

    def expect(self, rule: str, what: str, expected: Expected, response: httpx.Response) -> Any:
        """The answer's body, once its status and problem kind are the model's; else fail, saying both."""
        body = response.json() if response.content else None
        kind = None
        if response.status_code >= 400 and isinstance(body, dict):
            kind = str(body.get("type", "")).removeprefix(PROBLEM)
        got = f"{response.status_code} {kind}" if kind else str(response.status_code)
        assert (response.status_code, kind) == (expected.status, expected.problem), (
            f"{what}: the model expected {expected}, the service answered {got}: {response.text}"
        )
        self.run.answers[(rule, expected.status, expected.problem)] += 1
        return body

    def ended(self, what: str, expected: Expected, body: Any) -> None:
        """A 410's body names the lock and why it ended."""
        assert expected.lock is not None
        assert body["lock_id"] == expected.lock.id, f"{what}: {body}"
        assert body["release_reason"] == expected.release_reason, (
            f"{what}: the model expected release_reason {expected.release_reason}: {body}"
        )
        assert (body["forced_by"] is not None) == (expected.release_reason == "forced"), f"{what}: {body}"

    def job_type(self, name: str) -> str:
        return f"{self.prefix}.{name}"

    # Acquire

    def acquire_as(
        self,
        rule: str,
        api_key: str,
        organization_id: str,
        name: str,
        holder: str,
        max_holders: int,
        idempotency_key: str,
        metadata: dict[str, Any] | None,
        wait: float = 0,
    ) -> Any:
        job_type = self.job_type(name)
        key = (organization_id, job_type)
        what = (
            f"{rule} {organization_id}/{name} as {api_key}, holder {holder}, max_holders {max_holders},"
            f" Idempotency-Key {idempotency_key}, wait {wait}"
        )
        expected = self.model.acquire(
            api_key, organization_id, job_type, holder, max_holders, idempotency_key
        )
        request = {
            "organization_id": organization_id,
            "job_type": job_type,
            "holder": holder,
            "ttl_seconds": TTL,
            "max_holders": max_holders,
            "metadata": metadata,
            "wait_seconds": wait,
        }
        started = time.monotonic()
        response = self.call(
            "POST", "/v1/locks", api_key, json=request, headers={"Idempotency-Key": idempotency_key}
        )
        took = time.monotonic() - started
        body = self.expect("replay" if expected.lock else rule, what, expected, response)
        if expected.status == 409:
            assert body["max_holders"] == expected.max_holders, f"{what}: {body}"
            if expected.problem == "lock-held":
                assert expected.first is not None
                holders = [(h["lock_id"], h["holder"], h["slot"]) for h in body["holders"]]
                want = [(lock.id, lock.holder, lock.slot) for lock in expected.holders]
                assert holders == want, f"{what}: the model expected holders {want}: {body}"
                assert body["holders_total"] == expected.holders_total, f"{what}: {body}"
                assert body["lock_id"] == expected.first.id, f"{what}: lease ending first: {body}"
                assert int(response.headers["Retry-After"]) >= 1
                if wait:
                    assert took >= wait, f"{what}: 409 after {took:.3f} s, before the wait ran out"
                    self.run.answers[("acquire", "waited")] += 1
            else:
                assert "Retry-After" not in response.headers, f"{what}: {response.headers}"
            return multiple()
        if expected.status != 201:
            return multiple()
        grant = body
        assert grant["organization_id"] == organization_id and grant["job_type"] == job_type
        assert grant["holder"] == holder and grant["state"] == "held", f"{what}: {grant}"
        if expected.lock is not None:  # a repeat: the same grant, as it is now
            candidates = {lock.id: lock for lock in expected.holders or (expected.lock,)}
            assert grant["id"] in candidates, (
                f"{what}: a repeat answered lock {grant['id']}, not {candidates}"
            )
            lock = candidates[grant["id"]]
            if len(candidates) > 1:
                self.run.answers[("replay", "of two grants")] += 1
            assert (grant["token"], grant["fencing_token"], grant["slot"]) == (
                lock.token,
                lock.fencing_token,
                lock.slot,
            ), f"{what}: a repeat answered another grant than {lock}: {grant}"
            assert grant["reclaimed"] == lock.reclaimed, f"{what}: {grant}"
            assert grant["metadata"] == lock.metadata, f"{what}: {grant}"
            return multiple()
        assert grant["slot"] == expected.slot, f"{what}: the model expected slot {expected.slot}: {grant}"
        assert grant["max_holders"] == max_holders and grant["metadata"] == metadata, f"{what}: {grant}"
        assert grant["fencing_token"] > self.fenced.get(key, 0), (
            f"{what}: fencing token {grant['fencing_token']} after {self.fenced.get(key)} for {key}"
        )
        self.fenced[key] = grant["fencing_token"]
        if expected.reclaimed is None:
            assert grant["reclaimed"] is None, f"{what}: the model expected no reclaim: {grant}"
        else:
            reclaimed = grant["reclaimed"] or {}
            assert (reclaimed.get("lock_id"), reclaimed.get("holder")) == (
                expected.reclaimed.id,
                expected.reclaimed.holder,
            ), f"{what}: the model expected lock {expected.reclaimed.id} reclaimed: {grant}"
            self.run.answers[("acquire", "reclaimed")] += 1
        lock = Lock(
            id=grant["id"],
            organization_id=organization_id,
            job_type=job_type,
            holder=holder,
            token=grant["token"],
            fencing_token=grant["fencing_token"],
            slot=grant["slot"],
            max_holders=max_holders,
            metadata=metadata,
            api_key=api_key,
            idempotency_key=idempotency_key,
            reclaimed=grant["reclaimed"],
            lease=self.model.next_lease(),
        )
        assert lock.id not in self.model.locks, f"{what}: lock id {lock.id} granted twice"
        self.model.granted(expected, lock)
        self.run.told.append(Told(lock.id, key, lock.fencing_token, at(grant["acquired_at"]), lock.slot))
        return lock.id

    @rule(
        target=locks,
        organization_id=st.sampled_from(ORGANIZATIONS),
        name=st.sampled_from(sorted(JOB_TYPES)),
        who=st.sampled_from(CALLERS),
        holder=st.sampled_from(HOLDERS),
        wrong_max_holders=st.sampled_from([False, False, False, True]),
        wait=st.sampled_from([0] * 7 + [WAIT]),
        metadata=METADATA,
    )
    def acquire(
        self,
        organization_id: str,
        name: str,
        who: str,
        holder: str,
        wrong_max_holders: bool,
        wait: float,
        metadata: dict[str, Any] | None,
    ) -> Any:
        max_holders = JOB_TYPES[name] % 2 + 1 if wrong_max_holders else JOB_TYPES[name]
        self.requests += 1
        idempotency_key = f"{self.prefix}-{self.requests}"
        api_key = caller(who, organization_id)
        return self.acquire_as(
            "acquire", api_key, organization_id, name, holder, max_holders, idempotency_key, metadata, wait
        )

    @rule(target=locks, lock_id=locks)
    def repeat(self, lock_id: int) -> Any:
        """The acquire that made the lock, again with its Idempotency-Key: the same grant while it
        is held; once it ended or lapsed, a new acquire."""
        lock = self.model.locks[lock_id]
        name = lock.job_type.removeprefix(f"{self.prefix}.")
        assert lock.idempotency_key is not None
        return self.acquire_as(
            "repeat",
            lock.api_key,
            lock.organization_id,
            name,
            lock.holder,
            lock.max_holders,
            lock.idempotency_key,
            lock.metadata,
        )

    # The holder's calls

    def token(self, lock: Lock, right: bool) -> str:
        return lock.token if right else WRONG_TOKEN

    @rule(lock_id=locks, who=st.sampled_from(CALLERS), right_token=st.sampled_from([True, True, False]))
    def release(self, lock_id: int, who: str, right_token: bool) -> None:
        lock = self.model.locks[lock_id]
        api_key = caller(who, lock.organization_id)
        what = (
            f"release lock {lock.id} ({lock.state}) as {api_key}, {'right' if right_token else 'wrong'} token"
        )
        expected = self.model.release(api_key, lock, right_token)
        self.run.release_attempts.append(lock.id)
        response = self.call(
            "DELETE", f"/v1/locks/{lock.id}", api_key, headers={"Lock-Token": self.token(lock, right_token)}
        )
        body = self.expect("release", what, expected, response)
        if expected.status == 204:
            self.run.released.append(lock.id)
        elif expected.status == 410:
            self.ended(what, expected, body)

    @rule(lock_id=locks, who=st.sampled_from(CALLERS), right_token=st.sampled_from([True, True, False]))
    def renew(self, lock_id: int, who: str, right_token: bool) -> None:
        lock = self.model.locks[lock_id]
        api_key = caller(who, lock.organization_id)
        what = (
            f"renew lock {lock.id} ({lock.state}) as {api_key}, {'right' if right_token else 'wrong'} token"
        )
        expected = self.model.renew(api_key, lock, right_token)
        response = self.call(
            "POST",
            f"/v1/locks/{lock.id}/renew",
            api_key,
            json={"ttl_seconds": TTL},
            headers={"Lock-Token": self.token(lock, right_token)},
        )
        body = self.expect("renew", what, expected, response)
        if expected.status == 410:
            self.ended(what, expected, body)
        if expected.status != 200:
            return
        assert body["id"] == lock.id and body["state"] == "held", f"{what}: {body}"
        assert body["lapsed"] is expected.lapsed, (
            f"{what}: the model expected lapsed {expected.lapsed}: {body}"
        )
        assert body["fencing_token"] == lock.fencing_token, f"{what}: {body}"
        if expected.lapsed:
            self.run.answers[("renew", "lapsed")] += 1
        expires_at = at(body["expires_at"])
        renewal = Renewed(lock.id, expires_at - timedelta(seconds=TTL), expires_at)
        self.run.renewed.setdefault(lock.id, []).append(renewal)

    @rule(
        lock_id=locks,
        who=st.sampled_from(CALLERS),
        right_token=st.sampled_from([True, True, False]),
        metadata=METADATA,
    )
    def update(self, lock_id: int, who: str, right_token: bool, metadata: dict[str, Any] | None) -> None:
        lock = self.model.locks[lock_id]
        api_key = caller(who, lock.organization_id)
        what = (
            f"update lock {lock.id} ({lock.state}) as {api_key}, {'right' if right_token else 'wrong'} token"
        )
        state = lock.state
        expected = self.model.update(api_key, lock, right_token, metadata)
        response = self.call(
            "PATCH",
            f"/v1/locks/{lock.id}",
            api_key,
            json={"metadata": metadata},
            headers={"Lock-Token": self.token(lock, right_token)},
        )
        body = self.expect("update", what, expected, response)
        if expected.status == 410:
            self.ended(what, expected, body)
        if expected.status == 200:
            assert body["id"] == lock.id and body["metadata"] == metadata, f"{what}: {body}"
            assert body["state"] == state, f"{what}: the model expected state {state}: {body}"

    @rule(lock_id=locks, who=st.sampled_from(["admin", "admin", "own", "other"]))
    def force(self, lock_id: int, who: str) -> None:
        lock = self.model.locks[lock_id]
        api_key = caller(who, lock.organization_id)
        what = f"force lock {lock.id} ({lock.state}) as {api_key}"
        expected = self.model.force(api_key, lock)
        response = self.call("DELETE", f"/v1/locks/{lock.id}", api_key, params={"force": "true"})
        body = self.expect("force", what, expected, response)
        if expected.status == 410:
            self.ended(what, expected, body)

    @rule(lock_id=locks, who=st.sampled_from(CALLERS))
    def get(self, lock_id: int, who: str) -> None:
        lock = self.model.locks[lock_id]
        api_key = caller(who, lock.organization_id)
        what = f"get lock {lock.id} ({lock.state}) as {api_key}"
        expected = self.model.get(api_key, lock)
        body = self.expect("get", what, expected, self.call("GET", f"/v1/locks/{lock.id}", api_key))
        if expected.status == 200:
            assert body["state"] == lock.state, f"{what}: the model expected {lock.state}: {body}"
            assert body["release_reason"] == lock.ended, f"{what}: {body}"
            assert (body["forced_by"] is not None) == (lock.ended == "forced"), f"{what}: {body}"
            assert (body["fencing_token"], body["slot"], body["metadata"]) == (
                lock.fencing_token,
                lock.slot,
                lock.metadata,
            ), f"{what}: {body}"

    @rule(lock_id=locks, who=st.sampled_from(CALLERS))
    def current(self, lock_id: int, who: str) -> None:
        """The lock held now for the key of a lock the example made (a key's, not that lock's)."""
        key = self.model.locks[lock_id].key
        api_key = caller(who, key[0])
        what = f"current {key[0]}/{key[1]} as {api_key}"
        expected = self.model.current(api_key, key)
        response = self.call(
            "GET", "/v1/locks/current", api_key, params={"organization_id": key[0], "job_type": key[1]}
        )
        body = self.expect("current", what, expected, response)
        if expected.status == 200:
            assert expected.lock is not None
            assert body["id"] == expected.lock.id, (
                f"{what}: the model expected lock {expected.lock.id}: {body}"
            )

    @rule(lock_id=locks)
    def expire(self, lock_id: int) -> None:
        """The lease runs out now: its expiry moved to the database's clock (after acquired_at)."""
        lock = self.model.locks[lock_id]
        if not lock.live:
            return
        row = self.run.conn.execute(
            "UPDATE helix_job_locks SET expires_at = clock_timestamp()"
            " WHERE id = %s AND released_at IS NULL RETURNING id",
            (lock.id,),
        ).fetchone()
        assert row is not None, f"expire lock {lock.id}: the database has it ended, the model live"
        self.model.expire(lock)
        # Its earlier renewals announced expiries this time travel took back.
        self.run.renewed.pop(lock.id, None)

    # After every step

    @invariant()
    def live_locks_are_the_models(self) -> None:
        self.run.steps += 1
        response = self.call("GET", "/v1/locks", ADMIN, params={"limit": 500})
        assert response.status_code == 200, response.text
        page = response.json()
        assert page["next_cursor"] is None, "more live locks than one page: an example leaked its locks"
        listed = {
            item["id"]: (
                item["organization_id"],
                item["job_type"],
                item["holder"],
                item["slot"],
                item["max_holders"],
                item["fencing_token"],
                item["state"],
                item["metadata"],
            )
            for item in page["items"]
            if item["job_type"].startswith(f"{self.prefix}.")
        }
        modelled = {
            lock.id: (
                lock.organization_id,
                lock.job_type,
                lock.holder,
                lock.slot,
                lock.max_holders,
                lock.fencing_token,
                lock.state,
                lock.metadata,
            )
            for lock in self.model.locks.values()
            if lock.live
        }
        assert listed == modelled, f"live locks: the service lists {listed}, the model has {modelled}"

    def teardown(self) -> None:
        """Force what the example still holds, so that live locks never pile up across examples."""
        for lock in self.model.locks.values():
            if lock.live:
                self.call("DELETE", f"/v1/locks/{lock.id}", ADMIN, params={"force": "true"})


@pytest.fixture
def run(db_url: str, tmp_path: Path) -> Iterator[Run]:
    """The service with keys required: 2 keys of each organization and an admin key."""
    secrets = {name: keys.create(db_url, organization) for name, organization in key_names().items()}
    with (
        running_service(env=ROUTE.env(db_url), log=tmp_path / "service.log") as (url, _),
        httpx.Client(base_url=url, timeout=10) as http,
        psycopg.connect(db_url, autocommit=True) as conn,
    ):
        yield Run(url, db_url, secrets, http, conn)


# About 10 ms a step here, unloaded; room for a busy CI machine, and for the nightly size.
@pytest.mark.timeout(max(300, EXAMPLES * STEPS // 10))
def test_the_model_predicts_every_answer(run: Run) -> None:
    LockMachine.run = run
    run_state_machine_as_test(
        LockMachine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            derandomize=True,  # the same sequences on every run: CI must not fail by luck
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    renewed = [renewal for renewals in run.renewed.values() for renewal in renewals]
    violations = check(database_history(run.db_url), run.told, renewed, run.released, run.release_attempts)
    assert violations == [], "\n".join(violations)
    steps = run.steps - run.examples  # the invariant runs once before the first step too
    print(f"{run.examples} examples, {steps} steps, {len(run.told)} grants; answers:")
    for answer, count in sorted(run.answers.items(), key=str):
        print(f"  {answer}: {count}")
    met = {answer for answer, count in run.answers.items() if count}
    assert not COVERED - met, f"answers no example met: {sorted(map(str, COVERED - met))}"
