"""History retention on a large synthetic history: old ended rows go, everything else stays."""

from __future__ import annotations

from datetime import timedelta

import psycopg
import pytest

from helix_locks.server.db import Database, create_pool
from helix_locks.server.retention import Pruner
from helix_locks.server.settings import Settings
from tests.support import Conn, insert_ended

pytestmark = pytest.mark.anyio


def seed(conn: Conn) -> None:
    """200,000 ended locks 8 to 30 days old on 500 keys, 100 ended yesterday, 10 live."""
    insert_ended(
        conn,
        "SELECT 'acme', 'job-' || (n % 500), 'w', md5(n::text), NULL::jsonb, n / 500 + 1,"
        "  now() - make_interval(days => 8 + n % 22) - interval '1 minute',"
        "  now() - make_interval(days => 8 + n % 22),"
        "  now() - make_interval(days => 8 + n % 22), 'released'"
        " FROM generate_series(0, 199999) AS n",
    )
    insert_ended(
        conn,
        "SELECT 'acme', 'recent-' || n, 'w', md5(n::text), NULL::jsonb, 1, now() - interval '1 day',"
        "  now() - interval '23 hours', now() - interval '23 hours', 'released'"
        " FROM generate_series(1, 100) AS n",
    )
    conn.execute(
        "INSERT INTO helix_lock_keys SELECT 'acme', 'job-' || n, 1000 FROM generate_series(0, 499) AS n"
    )
    for n in range(10):
        conn.execute("SELECT helix_acquire_job_lock('acme', %s, 'live', 60000, NULL, NULL)", (f"job-{n}",))


async def test_old_ended_locks_are_pruned_in_batches_and_nothing_else(db_url: str, conn: Conn) -> None:
    seed(conn)
    settings = Settings(database_url=db_url, statement_timeout_ms=29_000)
    pool = create_pool(settings)
    await pool.open(wait=True)
    try:
        pruner = Pruner(Database(pool, settings), timedelta(days=7), batch=5000, interval=60)
        assert await pruner.prune() == 200_000
        assert await pruner.prune() == 0
    finally:
        await pool.close()
    left = conn.execute(
        "SELECT count(*) FILTER (WHERE released_at IS NULL), count(*) FILTER (WHERE released_at IS NOT NULL)"
        " FROM helix_job_locks"
    ).fetchone()
    assert left == (10, 100)
    tokens = conn.execute("SELECT fencing_token FROM helix_job_locks WHERE holder = 'live'").fetchall()
    assert {t for (t,) in tokens} == {1001}, "fencing counters survive the pruning"


async def test_only_one_replica_prunes_at_a_time(db_url: str, conn: Conn) -> None:
    seed(conn)
    with psycopg.connect(db_url) as other:
        other.execute("SELECT pg_advisory_xact_lock(hashtext('helix_prune_history'))")  # another replica
        settings = Settings(database_url=db_url)
        pool = create_pool(settings)
        await pool.open(wait=True)
        try:
            assert await Pruner(Database(pool, settings), timedelta(days=7), 5000, 60).prune() == 0
        finally:
            await pool.close()


def test_a_prune_with_nothing_to_delete_reads_almost_nothing(conn: Conn) -> None:
    """The retained history is not read to find that nothing in it is old enough."""
    insert_ended(
        conn,
        "SELECT 'acme', 'recent-' || n, 'w', md5(n::text), NULL::jsonb, 1, now() - interval '1 day',"
        "  now() - interval '23 hours', now() - interval '23 hours', 'released'"
        " FROM generate_series(1, 20000) AS n",
    )
    conn.execute("ANALYZE helix_lock_history")
    with conn.transaction():
        deleted = conn.execute("SELECT helix_prune_history(interval '7 days', 1000)").fetchone()
        read = conn.execute(
            "SELECT seq_tup_read + coalesce(idx_tup_fetch, 0) FROM pg_stat_xact_user_tables"
            " WHERE relname = 'helix_lock_history'"
        ).fetchone()
    assert deleted == (0,)
    assert read is not None
    assert read[0] < 10, f"{read[0]} rows read to delete none"


async def test_locks_whose_lease_ended_before_the_window_are_pruned_and_their_counters_stay(
    db_url: str, conn: Conn
) -> None:
    """A holder that vanished, on a key nobody acquired again: its lock goes once its lease has
    been over for longer than the window, and the next grant of the key still fences it out."""
    conn.execute(
        "INSERT INTO helix_job_locks (organization_id, job_type, holder, token, metadata, fencing_token,"
        " acquired_at, expires_at)"
        " SELECT 'acme', 'gone-' || n, 'w', md5(n::text), jsonb_build_object('pad', repeat('x', 8000)), 7,"
        "  now() - make_interval(days => 8 + n % 3) - interval '1 minute',"
        "  now() - make_interval(days => 8 + n % 3)"
        " FROM generate_series(0, 2499) AS n"
    )
    conn.execute(
        "INSERT INTO helix_job_locks (organization_id, job_type, holder, token, fencing_token,"
        " acquired_at, expires_at)"
        " SELECT 'acme', 'lapsed-yesterday-' || n, 'w', md5(n::text), 1,"
        "  now() - interval '1 day' - interval '1 minute', now() - interval '1 day'"
        " FROM generate_series(1, 10) AS n"
    )
    # The pairs' counters: made by the holds' inserts (helix_holds_modes_apart), at their token.
    counters = conn.execute(
        "SELECT count(*) FROM helix_lock_keys WHERE job_type LIKE 'gone-%' AND last_fencing_token = 7"
    )
    assert counters.fetchone() == (2500,)
    settings = Settings(database_url=db_url)
    pool = create_pool(settings)
    await pool.open(wait=True)
    try:
        assert (
            await Pruner(Database(pool, settings), timedelta(days=7), batch=1000, interval=60).prune() == 2500
        )
    finally:
        await pool.close()
    left = conn.execute("SELECT job_type FROM helix_job_locks ORDER BY job_type").fetchall()
    assert [job_type for (job_type,) in left] == sorted(f"lapsed-yesterday-{n}" for n in range(1, 11))
    token = conn.execute(
        "SELECT fencing_token FROM helix_acquire_job_lock('acme', 'gone-5', 'next', 60000, NULL, NULL)"
    )
    assert token.fetchone() == (8,), "the key's fencing counter survived its lock"
