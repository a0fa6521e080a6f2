"""A session's lease in its row (migration 0028), in SQL: each lapse of a session is one `expired`
event per lock of it, however its locks' ends, updates and acquires of their pairs interleave with
the sweep, and across the upgrade from 0027, which announced the holds of a session one by one."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

from helix_locks.server import migrate
from tests.support import Conn

RANKS = {0: "acquired", 1: "expired", 2: "renewed", 3: "updated", 4: "released"}


def snapshot(conn: Conn) -> str:
    row = conn.execute("SELECT pg_current_snapshot()::text").fetchone()
    assert row is not None
    return str(row[0])


def window(conn: Conn, after: str, until: str) -> list[tuple[int, str]]:
    """The events GET /v1/events sends between two snapshots: (lock id, kind), in stream order."""
    rows = conn.execute(
        "SELECT w.id, w.rank FROM helix_window_events(%s::pg_snapshot, %s::pg_snapshot, 'acme', NULL) AS w"
        " ORDER BY w.at, w.id, w.rank",
        (after, until),
    ).fetchall()
    return [(int(lock_id), RANKS[int(rank)]) for lock_id, rank in rows]


def sweep(conn: Conn, limit: int = 100) -> None:
    """The event readers' sweep for due expiries, now (not waiting for its second)."""
    conn.execute("UPDATE helix_expiry_sweep SET swept_at = '-infinity'")
    conn.execute("SELECT helix_announce_expiries(%s)", (limit,))


def open_lapsed(conn: Conn, *job_types: str, max_holders: int = 1) -> tuple[int, str, list[int]]:
    rows = conn.execute(
        "SELECT session_id, session_token, id FROM helix_open_session('acme', 'w', 1000, NULL, NULL, %s, %s,"
        " 1000, NULL, 100, 100)",
        (list(job_types), [max_holders] * len(job_types)),
    ).fetchall()
    session_id, token = int(rows[0][0]), str(rows[0][1])
    conn.execute(
        "UPDATE helix_sessions SET expires_at = clock_timestamp() - interval '1 millisecond' WHERE id = %s",
        (session_id,),
    )
    return session_id, token, [int(row[2]) for row in rows]


@pytest.mark.parametrize("ender", ["release", "force"])
@pytest.mark.parametrize("announcer", ["sweep", "acquire"])
def test_a_lapsed_sessions_lock_ended_while_another_announces_the_lapse_expires_once(
    conn: Conn, db_url: str, ender: str, announcer: str
) -> None:
    """The end of a lock of a lapsed session holds the session's row while it copies the lease:
    the sweep, or an acquire leaving that session's other lock in its slot, passes the row by
    meanwhile instead of announcing the same lapse in another transaction (which streamed a
    second `expired`); the end announces it for its lock, the next sweep for the rest."""
    _, token, (a, b) = open_lapsed(conn, "a", "b", max_holders=2)
    before = snapshot(conn)
    with psycopg.connect(db_url, autocommit=False) as ending:
        if ender == "release":
            ending.execute("SELECT id FROM helix_release_job_lock(%s, %s, 'acme')", (a, token)).fetchall()
        else:
            ending.execute("SELECT id FROM helix_force_release_job_lock(%s, 'admin')", (a,)).fetchall()
        if announcer == "sweep":
            sweep(conn)
        else:  # the pair's free slot: the session's lock of b stays, its lapse unannounced
            conn.execute("SELECT id FROM helix_acquire_job_lock('acme', 'b', 'other', 60000, NULL, NULL, 2)")
        during = snapshot(conn)
        events = window(conn, before, during)  # a live stream's poll, the end still in flight
        ending.commit()
    sweep(conn)
    events += window(conn, during, snapshot(conn))
    assert [kind for lock_id, kind in events if lock_id == a] == ["expired", "released"]
    assert [kind for lock_id, kind in events if lock_id == b] == ["expired"]


def test_an_update_of_a_lock_whose_session_lapsed_while_it_waited_sends_the_expiry_first(
    conn: Conn, db_url: str
) -> None:
    """The expiry is judged by the update's own clock, after any wait for the hold (here behind an
    acquire of the pair's other slot), and announced in the update's transaction."""
    rows = conn.execute(
        "SELECT session_id, session_token, id FROM helix_open_session('acme', 'w', 1000, NULL, NULL,"
        " ARRAY['p'], ARRAY[2], 1000, NULL, 100, 100)"
    ).fetchall()
    token, lock_id = str(rows[0][1]), int(rows[0][2])
    before = snapshot(conn)
    with psycopg.connect(db_url, autocommit=False) as other:
        other.execute("SELECT id FROM helix_acquire_job_lock('acme', 'p', 'other', 60000, NULL, NULL, 2)")
        updated: list[object] = []

        def update() -> None:
            with psycopg.connect(db_url, autocommit=True) as patcher:
                updated.extend(
                    patcher.execute(
                        "SELECT id FROM helix_update_job_lock(%s, %s, '{\"step\": 2}', 'acme')",
                        (lock_id, token),
                    ).fetchall()
                )

        patch = threading.Thread(target=update)
        patch.start()
        time.sleep(1.3)  # the session's lease runs out while the update waits for the hold
        other.commit()
        patch.join(timeout=10)
    assert updated == [(lock_id,)]
    polled = snapshot(conn)
    events = window(conn, before, polled)  # a live stream's poll, before any sweep
    sweep(conn)
    events += window(conn, polled, snapshot(conn))
    assert [kind for found, kind in events if found == lock_id] == ["expired", "updated"]


def test_a_session_lapsed_across_the_upgrade_expires_once_per_lock(
    empty_db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before 0028 the sweep announced a session's holds one by one (at most its limit a run): at
    the upgrade, one lock of a lapsed session may be announced and the other not. Each keeps what
    it had: the announced one is not announced again, the other is, once."""
    everything = migrate.load()
    monkeypatch.setattr(migrate, "load", lambda: [m for m in everything if m.name < "0028"])
    migrate.migrate(empty_db_url)
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        _, _, locks = open_lapsed(conn, "a", "b")
        # As 0027 kept them: every hold of a session with the session's expiry.
        conn.execute("UPDATE helix_holds SET expires_at = (SELECT s.expires_at FROM helix_sessions AS s)")
        before = snapshot(conn)
        sweep(conn, limit=1)  # 0027's sweep: one hold this run
        swept = snapshot(conn)
        events = window(conn, before, swept)  # what a stream sent before the upgrade
        assert len(events) == 1, events
        monkeypatch.setattr(migrate, "load", lambda: everything)
        migrate.migrate(empty_db_url)
        sweep(conn)
        events += window(conn, swept, snapshot(conn))
        assert sorted(events) == [(lock_id, "expired") for lock_id in sorted(locks)], events
        # Renewed after its lapse, each lock's lapse keeps the transaction that announced it: a
        # replay from before the upgrade sends each once.
        conn.execute(
            "SELECT 1 FROM helix_sessions AS s, helix_renew_session(s.id, s.token, 60000, 'acme', 100) AS r"
        )
        replay = [kind for _, kind in window(conn, before, snapshot(conn))]
        assert replay.count("expired") == 2 and replay.count("renewed") == 2, replay


def test_a_release_waiting_for_a_writers_fencing_check_holds_up_nothing_else_of_its_session(
    conn: Conn, db_url: str
) -> None:
    """A writer's open fencing check keeps lock a's hold (KEY SHARE) for its whole transaction, and
    the holder's release of a waits for it; meanwhile the session's renewal and an update of its
    lock b go through: the release waits for the hold without holding the session's row."""
    rows = conn.execute(
        "SELECT session_id, session_token, id, fencing_token FROM helix_open_session('acme', 'w', 30000,"
        " NULL, NULL, ARRAY['a', 'b'], ARRAY[1, 1], 1000, NULL, 100, 100)"
    ).fetchall()
    session_id, token = int(rows[0][0]), str(rows[0][1])
    (a, a_token), (b, _) = [(int(row[2]), int(row[3])) for row in rows]
    done: dict[str, float] = {}

    def call(name: str, statement: str, args: tuple[object, ...]) -> None:
        with psycopg.connect(db_url, autocommit=True) as caller:
            caller.execute(statement, args).fetchall()
            done[name] = time.monotonic()

    with psycopg.connect(db_url, autocommit=False) as writer:
        current = writer.execute(
            "SELECT helix_fencing_token_is_current('acme', 'a', %s)", (a_token,)
        ).fetchone()
        assert current == (True,)
        release = threading.Thread(
            target=call, args=("release", "SELECT id FROM helix_release_job_lock(%s, %s, 'acme')", (a, token))
        )
        release.start()
        time.sleep(0.3)  # the release is waiting for the writer
        others = [
            threading.Thread(
                target=call,
                args=(
                    "renew",
                    "SELECT 1 FROM helix_renew_session(%s, %s, 30000, 'acme', 100)",
                    (session_id, token),
                ),
            ),
            threading.Thread(
                target=call,
                args=("update", "SELECT id FROM helix_update_job_lock(%s, %s, '{}', 'acme')", (b, token)),
            ),
        ]
        for thread in others:
            thread.start()
        for thread in others:
            thread.join(timeout=10)
        assert set(done) == {"renew", "update"}, done  # answered while the writer still writes
        writer.commit()
        release.join(timeout=10)
    assert "release" in done
    assert conn.execute("SELECT release_reason FROM helix_lock_history WHERE id = %s", (a,)).fetchone() == (
        "released",
    )
