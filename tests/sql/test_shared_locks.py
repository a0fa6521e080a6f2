"""Shared and exclusive locks in SQL (migration 0030): shared locks of a pair are held together,
each with its own lock and lease; an exclusive lock is held alone; expired locks of the other mode
are reclaimed; a place of the other mode ahead in the queue goes first; and the database itself
(helix_holds_modes_apart) refuses a live lock beside one of the other mode, whatever writes it
and whatever the isolation, forced statement by statement."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from tests.support import Conn

REPLICA = "helix-locks/sql-test"
ISOLATIONS = ("READ COMMITTED", "REPEATABLE READ", "SERIALIZABLE")


@pytest.fixture(autouse=True)
def named(conn: Conn) -> None:
    conn.execute(f"SET application_name = '{REPLICA}'")


def acquire(
    conn: Conn, holder: str, mode: str = "exclusive", max_holders: int = 1, place: int | None = None
) -> dict[str, Any]:
    row = (
        conn.cursor(row_factory=dict_row)
        .execute(
            "SELECT id, fencing_token, token, holder, slot, max_holders"
            " FROM helix_acquire_job_lock('acme', 'report', %s, 30000, NULL, NULL, %s, %s, %s)",
            (holder, max_holders, place, mode),
        )
        .fetchone()
    )
    assert row is not None
    # Read apart: the statement that called the function does not see the hold it inserted.
    shared = conn.execute("SELECT shared FROM helix_holds WHERE id = %s", (row["id"],)).fetchone()
    assert shared is not None
    return {**row, "shared": shared[0]}


def refusal(
    conn: Conn, holder: str, mode: str = "exclusive", max_holders: int = 1, place: int | None = None
) -> dict[str, Any]:
    """The 23505 an acquire raises: its DETAIL, and its constraint."""
    with pytest.raises(psycopg.errors.UniqueViolation) as refused:
        acquire(conn, holder, mode, max_holders, place)
    detail: dict[str, Any] = json.loads(refused.value.diag.message_detail or "{}")
    detail["constraint"] = refused.value.diag.constraint_name
    return detail


def release(conn: Conn, lock: dict[str, Any]) -> None:
    conn.execute("SELECT helix_release_job_lock(%s, %s, 'acme')", (lock["id"], lock["token"]))


def lapse(conn: Conn, lock: dict[str, Any]) -> None:
    """The lock's lease ran out a second ago (its holder stopped renewing)."""
    conn.execute(
        "UPDATE helix_holds SET acquired_at = clock_timestamp() - interval '1 minute',"
        " expires_at = clock_timestamp() - interval '1 second' WHERE id = %s",
        (lock["id"],),
    )


def take_place(conn: Conn, holder: str, shared: bool) -> int:
    row = conn.execute(
        "SELECT helix_take_places('acme', ARRAY['report'], %s, ARRAY[1], 30, %s, %s, NULL, ARRAY[%s])",
        (holder, REPLICA, holder, shared),
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_shared_locks_are_held_together_each_its_own_and_exclusive_ones_alone(conn: Conn) -> None:
    readers = [acquire(conn, f"r{n}", "shared") for n in range(3)]
    assert [r["shared"] for r in readers] == [True, True, True]
    assert sorted(r["slot"] for r in readers) == [0, 1, 2], "a slot of its own each, under the key"
    assert all(r["max_holders"] == 1 for r in readers)
    tokens = [r["fencing_token"] for r in readers]
    assert tokens == sorted(tokens) and len(set(tokens)) == 3

    held = refusal(conn, "writer")
    assert held["constraint"] == "helix_holds_pkey" and held["mode"] == "shared", held
    assert held["holders_total"] == 3 and held["max_holders_in_force"] is None, held
    # One reader's end leaves the others' locks.
    release(conn, readers[0])
    assert refusal(conn, "writer")["holders_total"] == 2
    for reader in readers[1:]:
        release(conn, reader)
    writer = acquire(conn, "writer")
    assert writer["shared"] is False and writer["fencing_token"] > max(tokens)
    held = refusal(conn, "reader", "shared")
    assert held["mode"] == "exclusive" and held["holder"] == "writer", held
    assert refusal(conn, "another writer")["mode"] == "exclusive"


def test_a_shared_lock_has_max_holders_1_and_meets_a_semaphore_as_a_mismatch(conn: Conn) -> None:
    with pytest.raises(psycopg.errors.InvalidParameterValue) as refused:
        acquire(conn, "r", "shared", max_holders=3)
    assert refused.value.diag.column_name == "max_holders"
    with pytest.raises(psycopg.errors.InvalidParameterValue) as refused:
        acquire(conn, "r", "read")
    assert refused.value.diag.column_name == "mode"
    acquire(conn, "slot holder", max_holders=3)
    held = refusal(conn, "r", "shared")
    assert held["max_holders_in_force"] == 3 and held["mode"] == "exclusive", held


def test_a_thousand_readers_at_once_and_not_one_more(conn: Conn) -> None:
    for n in range(1000):
        acquire(conn, f"r{n}", "shared")
    assert refusal(conn, "r1000", "shared")["holders_total"] == 1000
    row = conn.execute("SELECT min(slot), max(slot), count(*) FROM helix_holds").fetchone()
    assert row == (0, 999, 1000)


def test_expired_locks_of_the_other_mode_are_reclaimed_by_the_grant(conn: Conn) -> None:
    readers = [acquire(conn, f"r{n}", "shared") for n in range(2)]
    lapse(conn, readers[0])
    assert refusal(conn, "writer")["holders_total"] == 1, "the other reader's lease is its own"
    lapse(conn, readers[1])
    writer = acquire(conn, "writer")
    reclaimed = conn.execute(
        "SELECT id, shared, release_reason FROM helix_lock_history ORDER BY id"
    ).fetchall()
    assert reclaimed == [(readers[0]["id"], True, "reclaimed"), (readers[1]["id"], True, "reclaimed")]
    lapse(conn, writer)
    reader = acquire(conn, "reader", "shared")
    assert reader["fencing_token"] > writer["fencing_token"]
    row = conn.execute("SELECT shared, release_reason FROM helix_lock_history WHERE id = %s", (writer["id"],))
    assert row.fetchone() == (False, "reclaimed")


def test_a_readers_grant_reclaims_every_expired_reader_so_dead_readers_do_not_pile_up(conn: Conn) -> None:
    """Migration 0032: before it, an expired reader stayed (a live lock against the quota) until a
    writer came or all 1000 slots had rows; a reader's grant now reclaims every expired lock."""
    readers = [acquire(conn, f"r{n}", "shared") for n in range(5)]
    for reader in readers[:3]:
        lapse(conn, reader)
    fresh = acquire(conn, "fresh", "shared")
    ended = conn.execute("SELECT id FROM helix_lock_history WHERE release_reason = 'reclaimed' ORDER BY id")
    assert [row[0] for row in ended.fetchall()] == [r["id"] for r in readers[:3]]
    live = conn.execute("SELECT id FROM helix_holds ORDER BY id").fetchall()
    assert [row[0] for row in live] == [r["id"] for r in readers[3:]] + [fresh["id"]]
    assert fresh["slot"] == 0, "the lowest slot the reclaims freed"


def test_a_semaphores_acquire_that_meets_readers_is_told_lock_held_not_a_mismatch(conn: Conn) -> None:
    acquire(conn, "r0", "shared")
    detail = refusal(conn, "wide", max_holders=5)
    assert detail["mode"] == "shared" and detail.get("max_holders_in_force") is None, detail
    acquire(conn, "r1", "shared")  # and readers go on


def test_a_repeat_naming_the_other_mode_is_refused_even_as_the_first_lease_runs_out(
    db_url: str, conn: Conn
) -> None:
    """An adversary's finding (fixed by 0032): the repeat claimed the reader's grant while its lease
    ran, and the check that followed looked only at leases still running, by then over: the
    reader's lock was answered as an exclusive one. The test holds the repeat up past the lease's
    end right after its claim (an AFTER trigger of its own database sleeps once the claim's
    statement is done), which the check must not mind; on 0031's check the repeat is answered."""
    conn.execute(
        "CREATE FUNCTION test_slow_claim() RETURNS trigger LANGUAGE plpgsql AS"
        " $$ BEGIN PERFORM pg_sleep(0.6); RETURN NEW; END $$;"
        " CREATE TRIGGER test_slow_claim AFTER UPDATE OF replayed ON helix_holds FOR EACH ROW"
        " WHEN (NEW.replayed AND NOT OLD.replayed) EXECUTE FUNCTION test_slow_claim()"
    )
    params: dict[str, Any] = {
        "holder": "w",
        "key": "k",
        "mode": "shared",
    }
    call = (
        "SELECT id FROM helix_acquire_job_lock_within_quota('acme', 'report', %(holder)s, %(ttl)s, NULL,"
        " %(key)s, 100, 1, NULL, %(mode)s)"
    )
    first = conn.execute(call, {**params, "ttl": 1000}).fetchone()
    assert first is not None
    # Its lease ends 0.3 s from now: the repeat claims it before, and is checked after.
    conn.execute(
        "UPDATE helix_holds SET expires_at = clock_timestamp() + interval '300 milliseconds' WHERE id = %s",
        (first[0],),
    )
    with pytest.raises(psycopg.errors.InvalidParameterValue) as refused:
        conn.execute(call, {**params, "ttl": 30_000, "mode": "exclusive"})
    assert refused.value.diag.column_name == "mode"
    assert conn.execute("SELECT id, shared FROM helix_holds").fetchall() == [(first[0], True)]


def test_a_retry_of_the_other_mode_does_not_take_over_the_place_of_the_try_it_repeats(conn: Conn) -> None:
    """An adversary's finding (fixed by 0032): a writer's retry with the key of a reader's waiting
    try took over that reader's place, which later readers then passed."""
    acquire(conn, "holder", "shared")
    reader_place = conn.execute(
        "SELECT helix_take_places('acme', ARRAY['report'], 'h', ARRAY[1], 30, %s, 'one', 'k', ARRAY[true])",
        (REPLICA,),
    ).fetchone()
    writer_place = conn.execute(
        "SELECT helix_take_places('acme', ARRAY['report'], 'h', ARRAY[1], 30, %s, 'two', 'k', ARRAY[false])",
        (REPLICA,),
    ).fetchone()
    assert reader_place is not None and writer_place is not None
    assert writer_place[0] > reader_place[0], "a place of its own, at the end"
    same = conn.execute(
        "SELECT helix_take_places('acme', ARRAY['report'], 'h', ARRAY[1], 30, %s, 'three', 'k',"
        " ARRAY[false])",
        (REPLICA,),
    ).fetchone()
    assert same == writer_place, "a retry of the same mode takes its place over, as before"
    modes = conn.execute("SELECT seq, shared FROM helix_lock_waiters ORDER BY seq").fetchall()
    assert modes == [(reader_place[0], True), (writer_place[0], False)]


def test_a_waiting_writer_goes_before_readers_that_come_after_it(conn: Conn) -> None:
    """Writers first: while an exclusive acquire has a place, a new shared one without a place,
    or with a later place, does not pass it, though the readers' locks have room."""
    reader = acquire(conn, "r0", "shared")
    place = take_place(conn, "writer", shared=False)
    assert refusal(conn, "writer", place=place)["mode"] == "shared"  # waits for the reader
    ahead = refusal(conn, "r1", "shared")
    assert ahead["constraint"] == "helix_lock_waiters_pkey" and ahead["waiting"] == 1, ahead
    later = take_place(conn, "r2", shared=True)
    assert refusal(conn, "r2", "shared", place=later)["ahead"] == 1
    release(conn, reader)
    writer = acquire(conn, "writer", place=place)
    assert writer["shared"] is False
    release(conn, writer)
    assert acquire(conn, "r2", "shared", place=later)["shared"] is True
    assert conn.execute("SELECT count(*) FROM helix_lock_waiters").fetchone() == (0,)


def test_readers_queued_together_are_granted_together(conn: Conn) -> None:
    writer = acquire(conn, "writer")
    places = [take_place(conn, f"r{n}", shared=True) for n in range(3)]
    release(conn, writer)
    granted = [acquire(conn, f"r{n}", "shared", place=place) for n, place in enumerate(places)]
    assert [g["shared"] for g in granted] == [True, True, True]
    assert conn.execute("SELECT count(*) FROM helix_holds").fetchone() == (3,)


def insert_hold(conn: Conn, shared: bool, slot: int, max_holders: int = 1) -> None:
    """A hold written straight into the table, past the acquire function."""
    conn.execute(
        "INSERT INTO helix_holds (organization_id, job_type, holder, token, fencing_token, acquired_at,"
        " expires_at, shared, slot, max_holders) VALUES ('acme', 'report', 'direct', 't', 1,"
        " clock_timestamp(), clock_timestamp() + interval '1 minute', %s, %s, %s)",
        (shared, slot, max_holders),
    )


def test_the_database_refuses_a_lock_beside_one_of_the_other_mode_whatever_writes_it(conn: Conn) -> None:
    acquire(conn, "r0", "shared")
    with pytest.raises(psycopg.errors.ExclusionViolation) as refused:
        insert_hold(conn, shared=False, slot=1, max_holders=2)  # a semaphore's slot beside a reader
    assert refused.value.diag.constraint_name == "helix_holds_modes_apart"
    insert_hold(conn, shared=True, slot=5)  # another reader is fine
    with pytest.raises(psycopg.errors.ExclusionViolation):
        conn.execute("UPDATE helix_holds SET shared = false, max_holders = 1000 WHERE slot = 5")
    conn.execute("DELETE FROM helix_holds")
    writer = acquire(conn, "writer")
    with pytest.raises(psycopg.errors.ExclusionViolation):
        insert_hold(conn, shared=True, slot=1)
    conn.execute(
        "INSERT INTO helix_holds (organization_id, job_type, holder, token, fencing_token, acquired_at,"
        " expires_at, shared, slot) VALUES ('acme', 'other', 'r', 't', 1, clock_timestamp(),"
        " clock_timestamp() + interval '1 minute', true, 3)"
    )
    with pytest.raises(psycopg.errors.ExclusionViolation):  # a reader of another pair moved onto it
        conn.execute("UPDATE helix_holds SET job_type = 'report' WHERE job_type = 'other'")
    assert conn.execute("SELECT id FROM helix_holds WHERE job_type = 'report'").fetchall() == [
        (writer["id"],)
    ]


def test_a_session_in_replica_mode_does_not_write_past_the_guarantee(conn: Conn) -> None:
    """session_replication_role = replica skips a table's ordinary triggers (logical replication's
    apply sets it): the guarantee fires always (migration 0031)."""
    acquire(conn, "r0", "shared")
    conn.execute("SET session_replication_role = replica")
    with pytest.raises(psycopg.errors.ExclusionViolation):
        insert_hold(conn, shared=False, slot=1, max_holders=2)
    conn.execute("RESET session_replication_role")
    assert conn.execute("SELECT count(*) FROM helix_holds").fetchone() == (1,)


@pytest.mark.parametrize("second", ISOLATIONS)
@pytest.mark.parametrize("first", ISOLATIONS)
def test_two_writers_of_the_two_modes_never_both_pass_whatever_their_isolation(
    db_url: str, first: str, second: str
) -> None:
    """A reader's hold inserted and not yet committed; a writer's hold inserted meanwhile on another
    connection waits for it, and is refused once it commits (23P01, or 40001 where the second
    transaction's snapshot is older than the first's commit). The check can fail: without the
    trigger both commit (test_without_the_trigger_both_would_pass)."""
    outcome = race(db_url, first, second)
    assert outcome["waited"], "the second waited for the first's commit"
    assert outcome["second"] in ("23P01", "40001"), outcome
    assert outcome["live"] == [True], outcome


def test_without_the_trigger_both_would_pass(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("ALTER TABLE helix_holds DISABLE TRIGGER helix_holds_modes_apart")
    outcome = race(db_url, "READ COMMITTED", "READ COMMITTED")
    assert outcome["second"] == "committed" and sorted(outcome["live"]) == [False, True], outcome


def race(db_url: str, first: str, second: str) -> dict[str, Any]:
    with psycopg.connect(db_url, autocommit=True) as conn:
        acquire(conn, "setup")  # the pair's row of helix_lock_keys exists
        conn.execute("DELETE FROM helix_holds")
    a, b = psycopg.connect(db_url), psycopg.connect(db_url)
    outcome: dict[str, Any] = {}
    try:
        a.execute(f"SET TRANSACTION ISOLATION LEVEL {first}")
        b.execute(f"SET TRANSACTION ISOLATION LEVEL {second}")
        a.execute("SELECT 1")  # each transaction's snapshot taken now
        b.execute("SELECT 1")
        insert_hold(a, shared=True, slot=0)

        def writer() -> None:
            try:
                insert_hold(b, shared=False, slot=1, max_holders=2)
                b.commit()
                outcome["second"] = "committed"
            except psycopg.Error as exc:
                outcome["second"] = exc.sqlstate
                b.rollback()

        thread = threading.Thread(target=writer)
        thread.start()
        deadline = time.monotonic() + 10
        while not blocked(db_url) and time.monotonic() < deadline and thread.is_alive():
            time.sleep(0.02)
        outcome["waited"] = thread.is_alive()
        a.commit()
        thread.join(timeout=30)
    finally:
        a.close()
        b.close()
    with psycopg.connect(db_url) as conn:
        outcome["live"] = [row[0] for row in conn.execute("SELECT shared FROM helix_holds ORDER BY slot")]
    return outcome


def blocked(db_url: str) -> bool:
    """Whether a backend of this database waits for a lock."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock'"
        ).fetchone()
    return bool(row and row[0])
