"""Revocation requests in SQL (migration 0035), where the stream's order is decided: a request on a
lease that ran out is sent after that expiry (of a lock alone or of a session's), and a request
that waited for a renewal in flight is dated and sent after it. (Both found by review: the request
came first.)"""

from __future__ import annotations

import threading
import time
from datetime import datetime

import psycopg

from tests.sql.test_session_lease import open_lapsed, snapshot
from tests.support import Conn

RANKS = {0: "acquired", 1: "expired", 2: "renewed", 3: "updated", 4: "released", 5: "revocation-requested"}


def window(conn: Conn, after: str, until: str) -> list[tuple[int, str]]:
    """What GET /v1/events sends between two snapshots, in stream order, every kind included."""
    rows = conn.execute(
        "SELECT w.id, w.rank FROM helix_window_events(%s::pg_snapshot, %s::pg_snapshot, 'acme', NULL, 5) AS w"
        " ORDER BY w.at, w.id, w.rank",
        (after, until),
    ).fetchall()
    return [(int(lock_id), RANKS[int(rank)]) for lock_id, rank in rows]


def request(conn: Conn, lock_id: int) -> datetime:
    row = conn.execute(
        "SELECT (revocation ->> 'requested_at')::timestamptz"
        " FROM helix_request_revocation(%s, 'acme', 'deploy', 60000, NULL, NULL)",
        (lock_id,),
    ).fetchone()
    assert row is not None and isinstance(row[0], datetime)
    return row[0]


def test_a_request_on_a_lease_that_ran_out_is_sent_after_its_expiry(conn: Conn) -> None:
    [(lock_id,)] = conn.execute(
        "SELECT id FROM helix_acquire_job_lock('acme', 'alone', 'w', 1000, NULL, NULL)"
    ).fetchall()
    session_id, _, [session_lock] = open_lapsed(conn, "of-a-session")
    deadline = time.monotonic() + 20
    while conn.execute(
        "SELECT clock_timestamp() <= expires_at FROM helix_holds WHERE id = %s", (lock_id,)
    ).fetchall() == [(True,)]:
        assert time.monotonic() < deadline, "the lease never ran out"
        time.sleep(0.02)
    before = snapshot(conn)
    request(conn, lock_id)
    request(conn, session_lock)  # its session's lease ran out too (open_lapsed)
    events = window(conn, before, snapshot(conn))
    for lock in (lock_id, session_lock):
        kinds = [kind for event_lock, kind in events if event_lock == lock]
        assert kinds == ["expired", "revocation-requested"], (lock, events)
    assert session_id is not None


def test_a_request_that_waited_for_a_renewal_is_dated_and_sent_after_it(conn: Conn, db_url: str) -> None:
    [(lock_id, token)] = conn.execute(
        "SELECT id, token FROM helix_acquire_job_lock('acme', 'busy', 'w', 30000, NULL, NULL)"
    ).fetchall()
    before = snapshot(conn)
    asked: dict[str, datetime] = {}
    with psycopg.connect(db_url) as renewing:
        renewing.execute("SELECT FROM helix_holds WHERE id = %s FOR UPDATE", (lock_id,))
        with psycopg.connect(db_url, autocommit=True) as asking:
            thread = threading.Thread(target=lambda: asked.setdefault("at", request(asking, lock_id)))
            thread.start()
            time.sleep(0.3)  # (order only: the request is let in by the renewal's commit either way)
            renewing.execute("SELECT FROM helix_renew_job_lock(%s, %s, 30000, 'acme')", (lock_id, token))
            renewing.commit()
            thread.join(timeout=20)
    [(renewed_at,)] = conn.execute("SELECT renewed_at FROM helix_holds WHERE id = %s", (lock_id,)).fetchall()
    assert asked["at"] > renewed_at, "the request is dated after the renewal it waited for"
    assert window(conn, before, snapshot(conn)) == [(lock_id, "renewed"), (lock_id, "revocation-requested")]
