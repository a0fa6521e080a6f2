"""The lock functions in SQL, on real connections: grant, conflict, reclaim, races, fencing."""

from __future__ import annotations

import functools
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import errors
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from harness.history import check, database_history
from helix_locks.server import queries, schemas
from tests.support import SWOLLEN, Conn, exactly, expire, stored_bytes


# The statements the service sends, as an admin sends them (scope NULL: any organization's lock).
def acquire(
    conn: Conn,
    holder: str = "w1",
    ttl_ms: int = 30_000,
    key: tuple[str, str] = ("org", "job"),
    idempotency_key: str | None = None,
    max_holders: int = 1,
) -> dict[str, Any]:
    organization_id, job_type = key
    rows = (
        conn.cursor(row_factory=dict_row)
        .execute(
            queries.ACQUIRE,
            {
                "organization_id": organization_id,
                "job_type": job_type,
                "holder": holder,
                "ttl_ms": ttl_ms,
                "metadata": None,
                "idempotency_key": idempotency_key,
                "max_holders": max_holders,
            },
        )
        .fetchall()
    )
    assert len(rows) == 1
    return rows[0]


def release(conn: Conn, lock_id: int, token: str) -> dict[str, Any]:
    rows = (
        conn.cursor(row_factory=dict_row)
        .execute(queries.RELEASE, {"lock_id": lock_id, "token": token, "scope": None})
        .fetchall()
    )
    assert len(rows) == 1
    return rows[0]


def renew(conn: Conn, lock_id: int, token: str, ttl_ms: int) -> dict[str, Any]:
    rows = (
        conn.cursor(row_factory=dict_row)
        .execute(queries.RENEW, {"lock_id": lock_id, "token": token, "ttl_ms": ttl_ms, "scope": None})
        .fetchall()
    )
    assert len(rows) == 1
    return rows[0]


def update(conn: Conn, lock_id: int, token: str, metadata: dict[str, Any] | None) -> dict[str, Any]:
    params = {
        "lock_id": lock_id,
        "token": token,
        "metadata": None if metadata is None else Jsonb(metadata),
        "scope": None,
    }
    rows = conn.cursor(row_factory=dict_row).execute(queries.UPDATE, params).fetchall()
    assert len(rows) == 1
    return rows[0]


def row(conn: Conn, lock_id: int) -> dict[str, Any]:
    found = conn.cursor(row_factory=dict_row).execute(
        "SELECT * FROM helix_job_locks WHERE id = %s", (lock_id,)
    )
    result = found.fetchone()
    assert result is not None
    return result


def backend_waiting_on_lock(conn: Conn, pid: int) -> bool:
    waiting = conn.execute(
        "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s", (pid,)
    ).fetchone()
    return bool(waiting and waiting[0])


def wait_until_blocked(observer: Conn, pid: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not backend_waiting_on_lock(observer, pid):
        assert time.monotonic() < deadline, "the competing acquire never waited on the lock"
        time.sleep(0.01)


@contextmanager
def waiting(observer: Conn, waiter: Conn, call: Callable[[], Any]) -> Iterator[dict[str, Any]]:
    """Run call() on waiter in a thread until it waits on a lock; join it when the block ends.

    The outcome dict gets "result" or "error" once the caller has let the lock go.
    """
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = call()
        except psycopg.Error as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    wait_until_blocked(observer, waiter.info.backend_pid)
    assert not outcome, "the call must wait while the lock's holder is uncommitted"
    yield outcome
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_grant_returns_one_row_with_database_times(conn: Conn) -> None:
    lock = acquire(conn, ttl_ms=1500)
    assert lock["state"] == "held"
    assert lock["fencing_token"] == 1
    assert len(lock["token"]) == 32
    assert (lock["expires_at"] - lock["acquired_at"]).total_seconds() == 1.5
    assert 0 < lock["ttl_remaining_ms"] <= 1500
    assert lock["reclaimed_lock_id"] is None
    stored = row(conn, lock["id"])
    assert stored["token"] == lock["token"] and stored["released_at"] is None


def test_live_lock_conflict_raises_23505_naming_the_holder(conn: Conn) -> None:
    first = acquire(conn, holder="worker-1")
    with pytest.raises(errors.UniqueViolation) as raised:
        acquire(conn, holder="worker-2")
    assert raised.value.sqlstate == "23505"
    detail = json.loads(raised.value.diag.message_detail or "")
    assert detail["lock_id"] == first["id"]
    assert detail["holder"] == "worker-1"
    assert detail["retry_after_seconds"] == 30
    count = conn.execute("SELECT count(*) FROM helix_job_locks").fetchone()
    assert count == (1,)
    # The failed call's fencing increment was rolled back with it.
    counter = conn.execute("SELECT last_fencing_token FROM helix_lock_keys").fetchone()
    assert counter == (1,)


def test_expired_lock_is_reclaimed_in_the_same_call(conn: Conn) -> None:
    stale = acquire(conn, holder="crashed")
    expire(conn, stale["id"])
    fresh = acquire(conn, holder="next")
    assert fresh["reclaimed_lock_id"] == stale["id"]
    assert fresh["reclaimed_holder"] == "crashed"
    old = row(conn, stale["id"])
    assert fresh["reclaimed_expired_at"] == old["expires_at"]
    assert old["release_reason"] == "reclaimed"
    assert old["released_at"] == fresh["acquired_at"]
    assert old["expires_at"] < fresh["acquired_at"]
    assert fresh["fencing_token"] == stale["fencing_token"] + 1


def test_other_keys_do_not_conflict(conn: Conn) -> None:
    acquire(conn, key=("org", "job"))
    other_job = acquire(conn, key=("org", "other"))
    other_org = acquire(conn, key=("org2", "job"))
    assert other_job["fencing_token"] == other_org["fencing_token"] == 1


@pytest.mark.parametrize("first_outcome", ["commit", "rollback"])
def test_race_at_expiry_has_exactly_one_winner(db_url: str, conn: Conn, first_outcome: str) -> None:
    """Two connections reclaim one expired lock at once; the second waits for the first."""
    stale = acquire(conn, holder="crashed")
    expire(conn, stale["id"])
    with psycopg.connect(db_url) as first, psycopg.connect(db_url, autocommit=True) as second:
        winner = acquire(first, holder="first")  # transaction left open, key row locked
        assert winner["reclaimed_lock_id"] == stale["id"]
        with waiting(conn, second, lambda: acquire(second, holder="second")) as outcome:
            if first_outcome == "commit":
                first.commit()
            else:
                first.rollback()

    live = conn.execute(
        "SELECT holder, fencing_token FROM helix_job_locks WHERE released_at IS NULL"
    ).fetchall()
    if first_outcome == "commit":
        assert isinstance(outcome.get("error"), errors.UniqueViolation)
        assert live == [("first", 2)]
    else:
        assert outcome["result"]["reclaimed_lock_id"] == stale["id"]
        assert live == [("second", 2)]
    assert conn.execute("SELECT count(*) FROM helix_job_locks").fetchone() == (2,)


def test_grant_after_a_waited_release_starts_after_it(db_url: str, conn: Conn) -> None:
    """A grant that waited on a release in flight is stamped after the release's end."""
    held = acquire(conn, holder="holder")
    with psycopg.connect(db_url) as releaser, psycopg.connect(db_url, autocommit=True) as acquirer:
        release(releaser, held["id"], held["token"])
        with waiting(conn, acquirer, lambda: acquire(acquirer, holder="next")) as outcome:
            releaser.commit()
    released = row(conn, held["id"])
    assert outcome["result"]["acquired_at"] >= released["released_at"]
    assert outcome["result"]["fencing_token"] == 2


def test_a_release_that_waited_on_a_renewal_in_flight_is_dated_after_its_commit(
    db_url: str, conn: Conn
) -> None:
    """A release deletes the hold without locking it first: its end is dated as the hold is
    deleted, after the wait, never before the renewal it waited for committed."""
    held = acquire(conn, holder="holder")
    with psycopg.connect(db_url) as renewer, psycopg.connect(db_url, autocommit=True) as releaser:
        renew(renewer, held["id"], held["token"], 30000)
        with waiting(conn, releaser, lambda: release(releaser, held["id"], held["token"])) as outcome:
            [(committing,)] = renewer.execute("SELECT clock_timestamp()").fetchall()
            renewer.commit()
    assert outcome["result"]["released_at"] > committing
    ended = row(conn, held["id"])
    assert (ended["release_reason"], ended["renewed_at"] < ended["released_at"]) == ("released", True)


def test_fencing_tokens_increase_and_survive_pruned_history(conn: Conn) -> None:
    tokens = []
    for _ in range(3):
        lock = acquire(conn)
        tokens.append(lock["fencing_token"])
        release(conn, lock["id"], lock["token"])
    stale = acquire(conn)
    tokens.append(stale["fencing_token"])
    expire(conn, stale["id"])
    tokens.append(acquire(conn)["fencing_token"])
    conn.execute("DELETE FROM helix_job_locks")  # retention pruning everything
    tokens.append(acquire(conn)["fencing_token"])
    assert tokens == [1, 2, 3, 4, 5, 6]


def test_unique_index_forbids_two_live_locks_whatever_the_code(conn: Conn) -> None:
    acquire(conn)
    with pytest.raises(errors.UniqueViolation):
        conn.execute(
            "INSERT INTO helix_job_locks (organization_id, job_type, holder, token, fencing_token,"
            " acquired_at, expires_at) VALUES ('org', 'job', 'rogue', 't', 99, now(), now() + interval '1 s')"
        )


def test_release_and_renew_report_their_failures_as_sqlstates(conn: Conn) -> None:
    lock = acquire(conn)
    cases = [
        ((lock["id"] + 1000, lock["token"]), "HL001"),
        ((lock["id"], "not-the-token"), "HL002"),
    ]
    for (lock_id, token), code in cases:
        for call in (
            release,
            functools.partial(renew, ttl_ms=1000),
            functools.partial(update, metadata=None),
        ):
            with pytest.raises(psycopg.Error) as raised:
                call(conn, lock_id, token)
            assert raised.value.sqlstate == code
    release(conn, lock["id"], lock["token"])
    with pytest.raises(psycopg.Error) as ended:
        release(conn, lock["id"], lock["token"])
    assert ended.value.sqlstate == "HL003"
    assert json.loads(ended.value.diag.message_detail or "")["release_reason"] == "released"
    # A wrong token is 403 material whatever the state: it is checked before the state.
    with pytest.raises(psycopg.Error) as wrong:
        release(conn, lock["id"], "nope")
    assert wrong.value.sqlstate == "HL002"


def test_renew_extends_from_database_now_and_reports_a_lapse(conn: Conn) -> None:
    lock = acquire(conn, ttl_ms=1000)
    renewed = renew(conn, lock["id"], lock["token"], 60000)
    assert renewed["lapsed"] is False
    assert 59_000 < renewed["ttl_remaining_ms"] <= 60_000
    expire(conn, lock["id"])
    lapsed = renew(conn, lock["id"], lock["token"], 60000)
    assert lapsed["lapsed"] is True and lapsed["state"] == "held"
    expire(conn, lock["id"])
    acquire(conn, holder="next")  # reclaims it
    with pytest.raises(psycopg.Error) as gone:
        renew(conn, lock["id"], lock["token"], 60000)
    assert gone.value.sqlstate == "HL003"
    assert json.loads(gone.value.diag.message_detail or "")["release_reason"] == "reclaimed"


@pytest.mark.parametrize("reclaimer_outcome", ["commit", "rollback"])
def test_an_update_racing_a_reclaim_waits_for_it(db_url: str, conn: Conn, reclaimer_outcome: str) -> None:
    """The holder's update of a lapsed lease waits for an uncommitted reclaim, then fails with
    HL003 if it committed, or updates the lock (lease unchanged) if it rolled back."""
    lapsed = acquire(conn)
    expire(conn, lapsed["id"])
    with psycopg.connect(db_url) as reclaimer, psycopg.connect(db_url, autocommit=True) as holder:
        acquire(reclaimer, holder="reclaimer")
        with waiting(
            conn, holder, lambda: update(holder, lapsed["id"], lapsed["token"], {"done": 1})
        ) as outcome:
            getattr(reclaimer, reclaimer_outcome)()
    if reclaimer_outcome == "commit":
        assert outcome["error"].sqlstate == "HL003"
        assert row(conn, lapsed["id"])["metadata"] is None
    else:
        updated = outcome["result"]
        assert (updated["metadata"], updated["state"]) == ({"done": 1}, "expired")
        assert updated["expires_at"] == row(conn, lapsed["id"])["expires_at"]


@pytest.mark.parametrize("ttl_ms", [999, 86_400_001, -5, None])
def test_ttl_out_of_range_is_invalid_parameter(conn: Conn, ttl_ms: int | None) -> None:
    with pytest.raises(errors.InvalidParameterValue):
        acquire(conn, ttl_ms=ttl_ms)  # type: ignore[arg-type]


def test_fencing_token_is_current_only_while_held(conn: Conn) -> None:
    def current(token: int) -> bool:
        answer = conn.execute("SELECT helix_fencing_token_is_current('org', 'job', %s)", (token,)).fetchone()
        assert answer is not None
        return bool(answer[0])

    lock = acquire(conn)
    assert current(1) and not current(2) and not current(0)
    expire(conn, lock["id"])
    assert not current(1), "a lapsed lease is not current"
    successor = acquire(conn)
    assert current(2) and not current(1)
    release(conn, successor["id"], successor["token"])
    assert not current(2)


def test_acquire_waits_out_a_renewal_of_a_lapsed_lease_and_then_conflicts(db_url: str, conn: Conn) -> None:
    lapsed = acquire(conn, holder="slow-heartbeat")
    expire(conn, lapsed["id"])
    with psycopg.connect(db_url) as renewer, psycopg.connect(db_url, autocommit=True) as acquirer:
        renew(renewer, lapsed["id"], lapsed["token"], 30000)
        with waiting(conn, acquirer, lambda: acquire(acquirer, holder="reclaimer")) as outcome:
            renewer.commit()
    assert isinstance(outcome.get("error"), errors.UniqueViolation), "the renewed lease must not be reclaimed"
    detail = json.loads(outcome["error"].diag.message_detail)
    assert detail["lock_id"] == lapsed["id"]
    assert datetime.fromisoformat(detail["expires_at"]) == row(conn, lapsed["id"])["expires_at"]


@pytest.mark.parametrize("holder_call", ["renew", "release"])
def test_holder_waiting_behind_a_reclaim_learns_it_lost_the_lock(
    db_url: str, conn: Conn, holder_call: str
) -> None:
    lapsed = acquire(conn, holder="crashed")
    expire(conn, lapsed["id"])
    with psycopg.connect(db_url) as reclaimer, psycopg.connect(db_url, autocommit=True) as holder:
        acquire(reclaimer, holder="reclaimer")  # transaction left open

        def renew_or_release() -> dict[str, Any]:
            if holder_call == "renew":
                return renew(holder, lapsed["id"], lapsed["token"], 30000)
            return release(holder, lapsed["id"], lapsed["token"])

        with waiting(conn, holder, renew_or_release) as outcome:
            reclaimer.commit()
    assert outcome["error"].sqlstate == "HL003"
    assert json.loads(outcome["error"].diag.message_detail)["release_reason"] == "reclaimed"


def acquire_keyed(conn: Conn, holder: str, key: str, ttl_ms: int = 30_000) -> dict[str, Any]:
    return acquire(conn, holder, ttl_ms, idempotency_key=key)


def counter(conn: Conn) -> int:
    value = conn.execute(
        "SELECT last_fencing_token FROM helix_lock_keys WHERE organization_id = 'org'"
    ).fetchone()
    assert value is not None
    return int(value[0])


def test_a_replay_that_waited_for_its_uncommitted_original_gets_the_original_grant(
    db_url: str, conn: Conn
) -> None:
    """Issue 15, finding 1: the original still runs (its client got 503 and retried); the retry
    waits for the key, then must get the original's grant back, not a 409 naming itself."""
    with psycopg.connect(db_url) as original, psycopg.connect(db_url, autocommit=True) as retry:
        first = acquire_keyed(original, "w1", "anon/k1")  # transaction left open
        with waiting(conn, retry, lambda: acquire_keyed(retry, "w1", "anon/k1")) as outcome:
            original.commit()
    assert "error" not in outcome, outcome.get("error")
    again = outcome["result"]
    assert (again["id"], again["token"], again["fencing_token"]) == (first["id"], first["token"], 1)
    assert counter(conn) == 1, "the replay gave its fencing increment back"
    release(conn, first["id"], first["token"])
    assert acquire_keyed(conn, "w2", "anon/k2")["fencing_token"] == 2


@pytest.mark.parametrize("first", ["claim", "cleanup"])
def test_a_claimed_grant_is_never_released_by_the_clean_up_of_a_client_that_left(
    db_url: str, conn: Conn, first: str
) -> None:
    """Issue 15, finding 2: whichever of the retry's claim and the clean-up comes first, the other
    sees it: the retry keeps the lock, or the lock is released and the retry gets a new grant."""
    grant = acquire_keyed(conn, "w1", "anon/k1")

    def claim(c: Conn) -> dict[str, Any]:
        return acquire_keyed(c, "w1", "anon/k1")

    def cleanup(c: Conn) -> bool:
        released = c.execute(
            queries.RELEASE_UNCLAIMED, {"lock_id": grant["id"], "token": grant["token"], "scope": None}
        )
        return bool(released.fetchone()[0])  # type: ignore[index]

    with psycopg.connect(db_url) as leader, psycopg.connect(db_url, autocommit=True) as follower:
        if first == "claim":
            again = claim(leader)
            with waiting(conn, follower, lambda: cleanup(follower)) as outcome:
                leader.commit()
            assert again["id"] == grant["id"] and outcome["result"] is False
            assert row(conn, grant["id"])["released_at"] is None, "the retry keeps its lock"
        else:
            assert cleanup(leader) is True
            with waiting(conn, follower, lambda: claim(follower)) as outcome:
                leader.commit()
            fresh = outcome["result"]
            assert fresh["id"] != grant["id"] and fresh["token"] != grant["token"]
            assert row(conn, grant["id"])["release_reason"] == "released"


def test_a_fencing_check_inside_a_writing_transaction_holds_off_the_reclaim(db_url: str, conn: Conn) -> None:
    """Issue 15, finding 3: h1 checks token 1 in its storage transaction; its lease lapses; h2's
    reclaim waits until h1's transaction ends, so h1's write cannot land after h2's."""
    h1 = acquire(conn, holder="h1", ttl_ms=1000)
    with psycopg.connect(db_url) as storage, psycopg.connect(db_url, autocommit=True) as h2:
        current = storage.execute("SELECT helix_fencing_token_is_current('org', 'job', 1)").fetchone()
        assert current == (True,)
        time.sleep(1.1)  # the lease lapses on the database clock (moving it would wait on the share lock)
        with waiting(conn, h2, lambda: acquire(h2, holder="h2")) as outcome:
            storage.commit()  # h1's write lands before the reclaim, never after
    assert outcome["result"]["fencing_token"] == 2
    assert outcome["result"]["reclaimed_lock_id"] == h1["id"]


def test_a_replay_names_what_it_reclaimed_after_retention_deleted_it(conn: Conn) -> None:
    stale = acquire(conn, holder="crashed")
    expire(conn, stale["id"])
    grant = acquire_keyed(conn, "w1", "anon/k1")
    assert grant["reclaimed_lock_id"] == stale["id"]
    conn.execute("DELETE FROM helix_job_locks WHERE id = %s", (stale["id"],))  # retention
    again = acquire_keyed(conn, "w1", "anon/k1")
    assert (again["id"], again["reclaimed_lock_id"], again["reclaimed_holder"]) == (
        grant["id"],
        stale["id"],
        "crashed",
    )
    assert again["reclaimed_expired_at"] == grant["reclaimed_expired_at"]


def test_releasing_an_ended_lock_that_retention_is_deleting_is_410_not_404(db_url: str, conn: Conn) -> None:
    """Issue 15, finding 5: retention holds the ended row; a release of it must learn it ended."""
    lock = acquire(conn)
    release(conn, lock["id"], lock["token"])
    outcome: dict[str, Any] = {}
    with psycopg.connect(db_url) as pruner, psycopg.connect(db_url, autocommit=True) as holder:
        pruner.execute("SELECT id FROM helix_job_locks WHERE id = %s FOR UPDATE", (lock["id"],))

        def release_ended() -> None:
            try:
                release(holder, lock["id"], lock["token"])
            except psycopg.Error as exc:
                outcome["error"] = exc

        thread = threading.Thread(target=release_ended)
        thread.start()
        time.sleep(0.3)  # the release runs into the row retention holds, or has its answer already
        pruner.execute("DELETE FROM helix_job_locks WHERE id = %s", (lock["id"],))
        pruner.commit()
        thread.join(timeout=10)
    assert outcome["error"].sqlstate == "HL003"


def test_a_writing_transaction_holds_off_the_holders_release_but_not_its_renewal(
    db_url: str, conn: Conn
) -> None:
    """The fencing check's key share lock: a long writing transaction does not cost the holder its
    heartbeat, but the holder's release waits for the write (so its successor's write comes after)."""
    h1 = acquire(conn, holder="h1")
    with psycopg.connect(db_url) as storage, psycopg.connect(db_url, autocommit=True) as holder:
        assert storage.execute("SELECT helix_fencing_token_is_current('org', 'job', 1)").fetchone() == (True,)
        holder.execute("SET statement_timeout = '3s'")
        renewed = renew(holder, h1["id"], h1["token"], 30000)
        assert renewed["lapsed"] is False, "renewed while the writing transaction is open"
        with waiting(conn, holder, lambda: release(holder, h1["id"], h1["token"])) as outcome:
            storage.commit()
    assert "error" not in outcome
    assert row(conn, h1["id"])["release_reason"] == "released"


def test_tokens_carry_128_random_bits(conn: Conn) -> None:
    """32 hex digits, every one of them random: a UUIDv4's version digit (always 4) and variant
    digit (8 to b) would show as digits that never take some values."""
    tokens = [
        row[0]
        for row in conn.execute(
            "SELECT (helix_acquire_job_lock('acme', 'job-' || n, 'w', 60000, NULL, NULL)).token"
            " FROM generate_series(1, 400) AS n"
        ).fetchall()
    ]
    assert all(re.fullmatch(r"[0-9a-f]{32}", token) for token in tokens)
    assert len(set(tokens)) == len(tokens)
    for position in range(32):
        seen = {token[position] for token in tokens}
        assert len(seen) == 16, f"hex digit {position} took only {sorted(seen)} in 400 tokens"


# Semaphores (issue 21): the races of several slots, each forced into one interleaving.

SEMAPHORE = ("org", "exports")


def acquire_slot(conn: Conn, holder: str, max_holders: int = 3) -> dict[str, Any]:
    return acquire(conn, holder, key=SEMAPHORE, max_holders=max_holders)


def live_slots(conn: Conn) -> list[tuple[int, str, int, int]]:
    """(slot, holder, fencing token, max_holders) of each unreleased lock, by slot."""
    return [
        (r[0], r[1], r[2], r[3])
        for r in conn.execute(
            "SELECT slot, holder, fencing_token, max_holders FROM helix_job_locks"
            " WHERE released_at IS NULL ORDER BY slot"
        ).fetchall()
    ]


def assert_history_sound(db_url: str) -> None:
    """The database's own history passes the checker: no slot doubled, never more live than
    max_holders, tokens increasing across slots."""
    violations = check(database_history(db_url), [], [])
    assert violations == [], violations


@pytest.mark.parametrize("first_outcome", ["commit", "rollback"])
def test_two_acquires_for_the_last_free_slot_have_exactly_one_winner(
    db_url: str, conn: Conn, first_outcome: str
) -> None:
    """Slots 0 and 1 are held; two connections race for slot 2. The second waits on the pair's
    counter row: if the first commits, the pair is full (23505 naming all three holders); if it
    rolls back, the second takes slot 2 with the token the first gave back."""
    held = [acquire_slot(conn, f"w{n}") for n in range(2)]
    with psycopg.connect(db_url) as first, psycopg.connect(db_url, autocommit=True) as second:
        winner = acquire_slot(first, "first")  # transaction left open, the counter row locked
        assert (winner["slot"], winner["fencing_token"]) == (2, 3)
        with waiting(conn, second, lambda: acquire_slot(second, "second")) as outcome:
            getattr(first, first_outcome)()

    if first_outcome == "commit":
        assert isinstance(outcome.get("error"), errors.UniqueViolation), outcome
        detail = json.loads(outcome["error"].diag.message_detail)
        assert [(h["lock_id"], h["slot"]) for h in detail["holders"]] == [
            (held[0]["id"], 0),
            (held[1]["id"], 1),
            (winner["id"], 2),
        ]
        assert (detail["max_holders"], detail["max_holders_in_force"]) == (3, None)
        assert live_slots(conn) == [(0, "w0", 1, 3), (1, "w1", 2, 3), (2, "first", 3, 3)]
    else:
        assert "error" not in outcome, outcome["error"]
        assert outcome["result"]["reclaimed_lock_id"] is None
        assert live_slots(conn) == [(0, "w0", 1, 3), (1, "w1", 2, 3), (2, "second", 3, 3)]
    assert counter_of(conn, SEMAPHORE) == 3, "the loser's fencing increment was rolled back"
    assert conn.execute("SELECT count(*) FROM helix_job_locks").fetchone() == (3,)
    assert_history_sound(db_url)


@pytest.mark.parametrize("order", ["release commits first", "release rolls back", "reclaim first"])
def test_a_reclaim_racing_the_release_of_another_slot(db_url: str, conn: Conn, order: str) -> None:
    """A full semaphore of 3: slot 0's lease has run out (its holder crashed), and slot 2's holder
    releases while a fourth worker acquires. Both succeed whatever the order, and no slot is held
    twice. Which slot the acquire takes follows API.md: a free slot if there is one, else the
    lock that expired first, reclaimed.
    - The release commits first: the acquire waited on slot 2's row (it locks every unreleased
      lock of the pair) and then sees slot 2 free, so it takes slot 2 and reclaims nothing, though
      slot 0 is lower and expired: the crashed holder's lease stays, unreleased, for a later
      acquire to reclaim (or its holder to renew).
    - The release rolls back (it is retried after): the acquire sees no free slot and reclaims
      slot 0.
    - The acquire comes first: it reclaims slot 0, and the release waits on slot 2's row, which
      the acquire locked, then succeeds once the acquire commits."""
    crashed, steady, leaving = (acquire_slot(conn, name) for name in ("crashed", "steady", "leaving"))
    expire(conn, crashed["id"])  # the first grant: moving its times back keeps tokens in time order
    with psycopg.connect(db_url) as first, psycopg.connect(db_url, autocommit=True) as second:
        if order == "reclaim first":
            grant = acquire_slot(first, "fourth")  # transaction left open
            with waiting(conn, second, lambda: release(second, leaving["id"], leaving["token"])) as outcome:
                first.commit()
            assert "error" not in outcome, outcome["error"]
            assert outcome["result"]["released_at"] > grant["acquired_at"]
        else:
            release(first, leaving["id"], leaving["token"])  # transaction left open, the row locked
            with waiting(conn, second, lambda: acquire_slot(second, "fourth")) as outcome:
                getattr(first, "commit" if order == "release commits first" else "rollback")()
            assert "error" not in outcome, outcome["error"]
            grant = outcome["result"]
            if order == "release rolls back":
                release(conn, leaving["id"], leaving["token"])  # its holder retries

    assert grant["fencing_token"] == 4
    if order == "release commits first":
        assert (grant["slot"], grant["reclaimed_lock_id"]) == (2, None)
        assert grant["acquired_at"] >= row(conn, leaving["id"])["released_at"]
        assert row(conn, crashed["id"])["released_at"] is None, "a free slot is taken before a reclaim"
        assert live_slots(conn) == [(0, "crashed", 1, 3), (1, "steady", 2, 3), (2, "fourth", 4, 3)]
    else:
        assert (grant["slot"], grant["reclaimed_lock_id"]) == (0, crashed["id"])
        reclaimed = row(conn, crashed["id"])
        assert (reclaimed["release_reason"], reclaimed["released_at"]) == ("reclaimed", grant["acquired_at"])
        assert live_slots(conn) == [(0, "fourth", 4, 3), (1, "steady", 2, 3)]
    assert row(conn, leaving["id"])["release_reason"] == "released"
    assert row(conn, steady["id"])["released_at"] is None
    assert_history_sound(db_url)


@pytest.mark.parametrize("order", ["release commits first", "release rolls back", "release after"])
def test_a_max_holders_mismatch_racing_the_release_of_the_last_live_lock(
    db_url: str, conn: Conn, order: str
) -> None:
    """A semaphore of 3 with one held lock (slot 1) and one whose lease ran out (slot 0); an
    acquire with max_holders 2 races the release of the held one.
    - The release commits first (the acquire waited on its row): none is held, so the acquire
      starts the pair afresh: granted with max_holders 2 in slot 0, reclaiming the expired lock
      of the other value.
    - The release rolls back: the acquire sees the lock held with 3: 23505, max_holders_in_force 3.
    - The release comes after (the acquire decided first): 23505 the same way, at once and
      leaving nothing behind; the release then succeeds, and a repeat of the acquire starts the
      pair afresh."""
    expired = acquire_slot(conn, "crashed")
    last = acquire_slot(conn, "last")
    expire(conn, expired["id"])

    def mismatch(c: Conn) -> dict[str, Any]:
        return acquire_slot(c, "other", max_holders=2)

    with psycopg.connect(db_url) as releaser, psycopg.connect(db_url, autocommit=True) as acquirer:
        if order == "release after":
            releaser.execute("SELECT 1")  # its transaction is open before the acquire and ends after
            with pytest.raises(errors.UniqueViolation) as raised:
                mismatch(acquirer)
            outcome: dict[str, Any] = {"error": raised.value}
            release(releaser, last["id"], last["token"])
            releaser.commit()
        else:
            release(releaser, last["id"], last["token"])  # transaction left open, the row locked
            with waiting(conn, acquirer, lambda: mismatch(acquirer)) as outcome:
                getattr(releaser, "commit" if order == "release commits first" else "rollback")()

    if order == "release commits first":
        assert "error" not in outcome, outcome["error"]
        grant = outcome["result"]
        assert grant["acquired_at"] >= row(conn, last["id"])["released_at"]
    else:
        assert isinstance(outcome.get("error"), errors.UniqueViolation), outcome
        detail = json.loads(outcome["error"].diag.message_detail)
        assert (detail["max_holders"], detail["max_holders_in_force"]) == (3, 3)
        assert [(h["lock_id"], h["slot"]) for h in detail["holders"]] == [(last["id"], 1)]
        assert counter_of(conn, SEMAPHORE) == 2, "the refused acquire's fencing increment was rolled back"
        assert row(conn, expired["id"])["released_at"] is None, "nor did it reclaim anything"
        if order == "release rolls back":
            assert row(conn, last["id"])["released_at"] is None
            release(conn, last["id"], last["token"])  # its holder retries
        assert row(conn, last["id"])["release_reason"] == "released"
        grant = mismatch(conn)

    assert (grant["slot"], grant["max_holders"], grant["fencing_token"]) == (0, 2, 3)
    assert grant["reclaimed_lock_id"] == expired["id"]
    assert row(conn, expired["id"])["released_at"] == grant["acquired_at"]
    assert live_slots(conn) == [(0, "other", 3, 2)]
    assert_history_sound(db_url)


def counter_of(conn: Conn, key: tuple[str, str]) -> int:
    value = conn.execute(
        "SELECT last_fencing_token FROM helix_lock_keys WHERE organization_id = %s AND job_type = %s", key
    ).fetchone()
    assert value is not None
    return int(value[0])


# --- metadata as stored (issue 34, item 7) ------------------------------------------------------


def test_metadata_over_8_kib_as_stored_is_refused_by_every_function_that_writes_it(conn: Conn) -> None:
    """As a worker with its own SQL calls them: acquire, the quota's acquire and update refuse
    (22023, naming the column metadata), store nothing and take no fencing token; 8 KiB exactly
    is kept intact. Any other write of the table is bounded alike."""
    cursor = conn.cursor(row_factory=dict_row)

    def grant(job_type: str, metadata: Any, quota: int | None = None) -> dict[str, Any]:
        params = {
            "organization_id": "org",
            "job_type": job_type,
            "holder": "w1",
            "ttl_ms": 30_000,
            "metadata": Jsonb(metadata),
            "idempotency_key": None,
            "max_holders": 1,
            "quota": quota,
            "place": None,
            "mode": "exclusive",
            "max_hold_ms": None,
            "hold_at_least_ms": None,
        }
        statement = queries.ACQUIRE if quota is None else queries.ACQUIRE_WITHIN_QUOTA
        rows = cursor.execute(statement, params).fetchall()
        assert len(rows) == 1
        return rows[0]

    too_big = [*SWOLLEN, exactly(conn, 8193)]
    for metadata in too_big:
        assert len(json.dumps(metadata, separators=(",", ":"))) <= 8192, "small as sent"
        for quota in (None, 10):
            with pytest.raises(errors.InvalidParameterValue) as refused:
                grant("job", metadata, quota)
            assert refused.value.diag.column_name == "metadata"
            assert "8192" in (refused.value.diag.message_primary or "")
    assert conn.execute("SELECT count(*) FROM helix_job_locks").fetchone() == (0,)

    fits = exactly(conn, 8192)
    granted = grant("job", fits)
    assert granted["fencing_token"] == 1, "no refusal took a token"
    assert granted["metadata"] == fits
    assert row(conn, granted["id"])["metadata"] == fits
    assert grant("quota", fits, quota=10)["metadata"] == fits

    for metadata in too_big:
        with pytest.raises(errors.InvalidParameterValue) as refused:
            update(conn, granted["id"], granted["token"], metadata)
        assert refused.value.diag.column_name == "metadata"
    assert row(conn, granted["id"])["metadata"] == fits
    assert update(conn, granted["id"], granted["token"], {"done": 1})["metadata"] == {"done": 1}

    # The table itself, whoever writes it.
    swollen = (Jsonb(SWOLLEN[0]), granted["id"])
    with pytest.raises(errors.InvalidParameterValue):
        conn.execute("UPDATE helix_job_locks SET metadata = %s WHERE id = %s", swollen)
    with pytest.raises(errors.InvalidParameterValue):
        conn.execute(
            "INSERT INTO helix_job_locks (organization_id, job_type, holder, token, metadata, fencing_token,"
            " acquired_at, expires_at) VALUES ('org', 'raw', 'w', 'x', %s, 1, now(), now() + interval '1 s')",
            (Jsonb(SWOLLEN[1]),),
        )


_TEXT = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=8)
_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**40), max_value=10**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(metadata=st.dictionaries(_TEXT, _JSON, max_size=4))
def test_the_edge_knows_the_size_as_stored(conn: Conn, metadata: dict[str, Any]) -> None:
    """The edge refuses metadata over the bound by the size the database will store it in
    (schemas.stored_bytes), so that a 422 comes before the API key is checked, as for every
    other invalid field, and never needs the database; the trigger of 0021 is the authority."""
    assert schemas.stored_bytes(metadata) == stored_bytes(conn, metadata)


def test_a_row_stored_over_the_bound_before_it_still_renews_ends_and_is_reclaimed(conn: Conn) -> None:
    """Migration 0021 bounds only what is being written. A row stored before it, over the
    bound, is renewed, updated, released, forced and reclaimed as any other (a CHECK constraint,
    tested on every UPDATE of the row, would refuse each of these, and leave its key stuck)."""
    conn.execute("ALTER TABLE helix_holds DISABLE TRIGGER helix_metadata_bounded")
    before = conn.cursor(row_factory=dict_row)

    def legacy(job_type: str) -> dict[str, Any]:
        params = {
            "organization_id": "org",
            "job_type": job_type,
            "holder": "old",
            "ttl_ms": 30_000,
            "metadata": Jsonb(SWOLLEN[0]),
            "idempotency_key": None,
            "max_holders": 1,
        }
        found = before.execute(queries.ACQUIRE, params).fetchone()
        assert found is not None
        return found

    renewed, forced, reclaimed = legacy("renewed"), legacy("forced"), legacy("reclaimed")
    conn.execute("ALTER TABLE helix_holds ENABLE TRIGGER helix_metadata_bounded")

    assert len(renew(conn, renewed["id"], renewed["token"], 60_000)["metadata"]["a"]) == 1160
    assert release(conn, renewed["id"], renewed["token"])["state"] == "released"
    ended = conn.execute("SELECT state FROM helix_force_release_job_lock(%s, 'admin')", (forced["id"],))
    assert ended.fetchone() == ("released",)
    expire(conn, reclaimed["id"])
    successor = acquire(conn, key=("org", "reclaimed"))
    assert successor["reclaimed_lock_id"] == reclaimed["id"]
    assert update(conn, successor["id"], successor["token"], {"small": True})["metadata"] == {"small": True}


def test_a_full_pairs_refusal_names_at_most_20_holders_those_expiring_first(conn: Conn) -> None:
    """23505's DETAIL, as a worker with its own SQL reads it: the 20 held locks whose leases run
    out first (by expires_at, then slot), holders_total counting every one, and lock_id naming the
    first (issue 34, item 11)."""
    slots = 30
    grants = [
        acquire(conn, f"w{n}", ttl_ms=60_000 + 1000 * ((11 * n) % slots), key=SEMAPHORE, max_holders=slots)
        for n in range(slots)
    ]
    conn.execute(  # three leases that end first, at one moment (slot 0's): by slot, then
        "UPDATE helix_job_locks SET expires_at = (SELECT min(expires_at) FROM helix_job_locks)"
        " WHERE id IN (%s, %s)",
        (grants[9]["id"], grants[3]["id"]),
    )
    held = sorted(
        (row(conn, grant["id"]) for grant in grants), key=lambda lock: (lock["expires_at"], lock["slot"])
    )
    with pytest.raises(errors.UniqueViolation) as refused:
        acquire(conn, "late", key=SEMAPHORE, max_holders=slots)
    detail = json.loads(refused.value.diag.message_detail or "")
    listed = [(h["lock_id"], h["slot"]) for h in detail["holders"]]
    assert listed == [(lock["id"], lock["slot"]) for lock in held[:20]]
    assert [slot for _, slot in listed[:3]] == [0, 3, 9]
    assert detail["holders_total"] == slots
    assert detail["lock_id"] == held[0]["id"] and detail["max_holders"] == slots


def test_a_repeat_at_the_quota_is_judged_by_what_it_did_while_another_acquire_commits(
    db_url: str, conn: Conn
) -> None:
    """Issue 34, item 6, in SQL: at the quota, the repeat of a live semaphore grant waits for its
    pair's counter row (0018) while another acquire of the organization commits, one that takes
    no part in the quota's advisory lock (a replica of the build before 0020, during a rolling
    upgrade). The repeat adds no live lock and is the grant it repeats. 0018 judged it by
    counting the organization's live locks again, raised by the other commit: HL004."""
    first = acquire(conn, "w", key=("org", "pool"), idempotency_key="k", max_holders=2)
    for n in range(19):
        acquire(conn, key=("org", f"job-{n}"))
    params = {
        "organization_id": "org",
        "job_type": "pool",
        "holder": "w",
        "ttl_ms": 30_000,
        "metadata": None,
        "idempotency_key": "k",
        "max_holders": 2,
        "quota": 20,
        "place": None,
        "mode": "exclusive",
        "max_hold_ms": None,
        "hold_at_least_ms": None,
    }
    with psycopg.connect(db_url) as pool_key, psycopg.connect(db_url, autocommit=True) as repeat:
        pool_key.execute(
            "SELECT FROM helix_lock_keys WHERE organization_id = 'org' AND job_type = 'pool' FOR UPDATE"
        )
        with waiting(
            conn,
            repeat,
            lambda: (
                repeat.cursor(row_factory=dict_row).execute(queries.ACQUIRE_WITHIN_QUOTA, params).fetchone()
            ),
        ) as outcome:
            acquire(conn, key=("org", "previous-build"))  # 21 live, committed while the repeat waits
            pool_key.rollback()
    assert "error" not in outcome, f"the repeat of a live grant was refused: {outcome.get('error')!r}"
    assert (outcome["result"]["id"], outcome["result"]["token"]) == (first["id"], first["token"])
