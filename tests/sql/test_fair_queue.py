"""The fair queue in SQL (migration 0029): a pair's free slots go to its live places in order, an
acquire without a place does not pass a live place, and a place lives only while its wait lasts
and its replica has a connection open under its name."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from tests.support import Conn

REPLICA = "helix-locks/sql-test"
OTHER = "helix-locks/sql-other"


@pytest.fixture
def other(db_url: str) -> Iterator[Conn]:
    """A second replica: a connection open under OTHER's name."""
    with psycopg.connect(db_url, autocommit=True, application_name=OTHER) as connection:
        yield connection


@pytest.fixture(autouse=True)
def named(conn: Conn) -> None:
    conn.execute(f"SET application_name = '{REPLICA}'")


def take_place(
    conn: Conn,
    holder: str,
    replica: str = REPLICA,
    seconds: float = 30,
    max_holders: int = 1,
    owner: str | None = None,
    key: str | None = None,
) -> int:
    row = conn.execute(
        "SELECT helix_take_places('acme', ARRAY['report'], %s, ARRAY[%s]::integer[], %s, %s, %s, %s)",
        (holder, max_holders, seconds, replica, owner or holder, key),
    ).fetchone()
    assert row is not None
    return int(row[0])


def leave(conn: Conn, place: int, owner: str, organization_id: str = "acme", keep: float = 0) -> int:
    """How many places of request `owner` left (or were kept) with order number `place`."""
    row = conn.execute(
        "SELECT helix_leave_queue(%s, %s, %s, %s)", (place, organization_id, owner, keep)
    ).fetchone()
    assert row is not None
    return int(row[0])


def acquire(conn: Conn, holder: str, place: int | None = None, max_holders: int = 1) -> dict[str, Any]:
    row = (
        conn.cursor(row_factory=dict_row)
        .execute(
            "SELECT id, fencing_token, token, holder FROM helix_acquire_job_lock("
            "'acme', 'report', %s, 30000, NULL, NULL, %s, %s)",
            (holder, max_holders, place),
        )
        .fetchone()
    )
    assert row is not None
    return row


def refusal(conn: Conn, holder: str, place: int | None = None, max_holders: int = 1) -> dict[str, Any]:
    """The 23505 an acquire raises, its DETAIL and constraint."""
    with pytest.raises(psycopg.errors.UniqueViolation) as refused:
        acquire(conn, holder, place, max_holders)
    detail: dict[str, Any] = json.loads(refused.value.diag.message_detail or "{}")
    detail["constraint"] = refused.value.diag.constraint_name
    return detail


def release(conn: Conn, lock: dict[str, Any]) -> None:
    conn.execute("SELECT helix_release_job_lock(%s, %s, NULL)", (lock["id"], lock["token"]))


def places(conn: Conn) -> list[int]:
    return [int(row[0]) for row in conn.execute("SELECT seq FROM helix_lock_waiters ORDER BY seq").fetchall()]


def test_free_slots_go_to_places_in_order_and_an_acquire_without_one_does_not_pass_them(
    conn: Conn, other: Conn
) -> None:
    held = acquire(conn, "holder")
    first = take_place(conn, "w1", replica=OTHER)
    second = take_place(conn, "w2")
    jumper = refusal(conn, "jumper")
    # Held, and places wait: counted only as far as it takes to know one is there; the holder's
    # lease is named, and the retry comes when it ends.
    assert jumper["expires_at"] is not None and jumper["retry_after_seconds"] == 30
    assert {key: jumper[key] for key in ("waiting", "ahead", "lock_id", "holder", "constraint")} == {
        "waiting": 2,
        "ahead": 1,
        "lock_id": held["id"],
        "holder": "holder",
        "constraint": "helix_lock_waiters_pkey",
    }
    # A waiter whose pair is held is told of the holder, whose lease it sleeps on.
    assert refusal(conn, "w1", first)["lock_id"] == held["id"]

    release(conn, held)
    assert refusal(conn, "jumper")["waiting"] == 2
    assert refusal(conn, "w2", second)["ahead"] == 1, "the second place waits for the first"
    granted = acquire(conn, "w1", first)
    assert granted["holder"] == "w1" and granted["fencing_token"] == held["fencing_token"] + 1
    assert places(conn) == [second], "the grant consumed its place"

    release(conn, granted)
    assert acquire(conn, "w2", second)["fencing_token"] == held["fencing_token"] + 2
    assert places(conn) == []
    assert "waiting" not in refusal(conn, "after"), "an empty queue: an ordinary conflict"


def test_a_place_lives_only_while_its_replica_is_connected_and_its_wait_lasts(
    conn: Conn, db_url: str
) -> None:
    with psycopg.connect(db_url, autocommit=True, application_name=OTHER) as replica:
        take_place(conn, "on-a-replica-that-dies", replica=OTHER)
        assert refusal(conn, "jumper")["waiting"] == 1
        pid = replica.info.backend_pid
    # The replica's connection is gone (as when its process is killed): once its backend has
    # exited, its place counts no longer, with nothing written.
    deadline = time.monotonic() + 10
    while conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone() != (0,):
        assert time.monotonic() < deadline, "the closed connection's backend did not exit"
        time.sleep(0.01)
    lock = acquire(conn, "after-the-replica")
    release(conn, lock)
    take_place(conn, "on-no-replica", replica="helix-locks/never-connected")
    take_place(conn, "wait-over", seconds=0.05)
    time.sleep(0.1)
    assert acquire(conn, "passes-what-is-not-live")["holder"] == "passes-what-is-not-live"
    assert len(places(conn)) == 3, "the dead places are still rows: nothing wrote for them"


def test_a_semaphores_places_take_its_free_slots_in_order(conn: Conn) -> None:
    held = [acquire(conn, f"h{n}", max_holders=2) for n in range(2)]
    first, second, third = (take_place(conn, f"w{n}", max_holders=2) for n in range(1, 4))
    for lock in held:
        release(conn, lock)
    assert refusal(conn, "w3", third, max_holders=2)["ahead"] == 2, "two places first, two free slots"
    acquire(conn, "w2", second, max_holders=2)  # one place first, two free slots: it may go
    assert refusal(conn, "w3", third, max_holders=2)["ahead"] == 1, "one place first, one free slot"
    acquire(conn, "w1", first, max_holders=2)
    assert refusal(conn, "w3", third, max_holders=2)["holders_total"] == 2, "full: held, not queued"


def test_another_max_holders_is_refused_as_such_even_behind_places(conn: Conn) -> None:
    acquire(conn, "holder", max_holders=2)
    take_place(conn, "w1", max_holders=2)
    assert refusal(conn, "other", max_holders=3)["max_holders_in_force"] == 2


def test_a_larger_max_holders_does_not_pass_a_place_that_named_a_smaller_one(conn: Conn) -> None:
    """The pair is free and a place waits for it as a plain lock: an acquire of a semaphore of two
    would find a slot to spare by its own count, but the place comes first."""
    first = take_place(conn, "w1")
    assert refusal(conn, "semaphore", max_holders=2)["waiting"] == 1
    second = take_place(conn, "w2", max_holders=2)
    assert refusal(conn, "w2", second, max_holders=2)["ahead"] == 1
    assert acquire(conn, "w1", first)["holder"] == "w1"


def test_leaving_the_queue_wakes_the_pairs_waiters(conn: Conn, db_url: str) -> None:
    first = take_place(conn, "w1")
    second = take_place(conn, "w2")
    with psycopg.connect(db_url, autocommit=True) as listening:
        listening.execute("LISTEN helix_lock_released")
        assert leave(conn, first, "w1", "globex") == 0
        assert leave(conn, first, "w2") == 0
        assert places(conn) == [first, second], "another organization's place, or request's, is not found"
        assert leave(conn, first, "w1") == 1
        assert leave(conn, first, "w1") == 0
        heard = [notify.payload for notify in listening.notifies(timeout=2, stop_after=1)]
        assert heard == ["acme/report"]
        assert acquire(conn, "w2", second)["holder"] == "w2", "the next place goes at once"


def test_a_retry_with_the_same_idempotency_key_takes_over_the_place_of_the_try_it_repeats(conn: Conn) -> None:
    acquire(conn, "holder")
    first = take_place(conn, "w1", owner="try-1", key="key/k")
    second = take_place(conn, "w2", owner="w2")
    assert take_place(conn, "other-holder", owner="x", key="key/k") not in (first, second), "the holder too"
    # The try is still open (its client's loss not yet seen): the retry takes its place over, and
    # the try can no longer leave it.
    assert take_place(conn, "w1", owner="try-2", key="key/k") == first
    assert leave(conn, first, "try-1") == 0
    # The retry's wait runs out: the place is kept a moment for the next retry, then lapses.
    assert leave(conn, first, "try-2", keep=0.3) == 1
    assert take_place(conn, "w1", owner="try-3", key="key/k") == first, "the next round keeps its place"
    assert leave(conn, first, "try-3", keep=0.2) == 1
    time.sleep(0.3)
    assert take_place(conn, "w1", owner="try-4", key="key/k") not in (first, second), "kept no longer"
    # Without a key there is nothing to keep: leaving deletes.
    assert leave(conn, second, "w2", keep=5) == 1
    assert second not in places(conn)


def test_a_retry_takes_over_only_the_places_of_the_same_set(conn: Conn) -> None:
    """A session's places in a and b are not taken over by an acquire of a alone with the same key
    and holder: its grant would consume the place in a and leave the one in b behind."""

    def take(job_types: list[str], owner: str) -> int:
        row = conn.execute(
            "SELECT helix_take_places('acme', %s, 'h', %s, 30, %s, %s, 'key/k')",
            (job_types, [1] * len(job_types), REPLICA, owner),
        ).fetchone()
        assert row is not None
        return int(row[0])

    session = take(["a", "b"], "session")
    assert take(["a"], "acquire") != session
    assert take(["b", "a"], "retry") == session, "the same set, in any order"
    owners = conn.execute("SELECT DISTINCT owner FROM helix_lock_waiters WHERE seq = %s", (session,))
    assert owners.fetchall() == [("retry",)]
