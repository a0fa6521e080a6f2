"""The schema is ready to shard by organization (issue 25, docs/scaling.md), read from the catalog of
the migrated schema:

- every unique index and primary key (and exclusion constraint) has `organization_id` among its key
  columns, which a distributed table by organization requires;
- no foreign key between two tables that both have `organization_id` leaves it out, so none can
  point from one organization's row to another's;
- every `helix_*` function that acts on locks takes the organization as an argument (named
  `p_organization_id`, or a row that carries it), so a call can go to the one node that holds it.

What does not hold is listed below with its reason, and the lists must be exact: an exception that
a migration removes must leave the list too. docs/scaling.md says which are cheap to remove.
"""

from __future__ import annotations

# Unique indexes and primary keys without organization_id: index name -> why.
from tests.support import Conn

UNIQUE_EXCEPTIONS = {
    "helix_holds_id": "lock ids are global today: (id) alone; GET /v1/locks/{id} names no"
    " organization (docs/scaling.md, 'Lock ids')",
    "helix_lock_history_pkey": "lock ids are global today, live (helix_holds_id) or ended",
    "helix_expiry_sweep_pkey": "one row, when the event readers last swept for due expiries, for the"
    " whole deployment: on Citus each node's readers sweep their node (docs/scaling.md, 'Events')",
    "helix_lock_waiters_pkey": "a waiter's registration is deleted by its id alone (helix_stop_waiting);"
    " cheap to make (id, organization_id) (docs/scaling.md)",
    "helix_api_keys_pkey": "API keys stay a plain table on the coordinator, never distributed: key ids"
    " are global by design, and an admin key has no organization (docs/scaling.md, 'Reference tables')",
    "helix_schema_migrations_pkey": "the migration runner's bookkeeping, not tenant data: no"
    " organization_id, never distributed",
    "helix_event_id_key_pkey": "one row, the key that signs event ids, for the whole deployment: a"
    " reference table on Citus (docs/scaling.md, 'Events')",
    "helix_sessions_pkey": "session ids are global, as lock ids are: /v1/sessions/{id} names no"
    " organization (docs/scaling.md, 'Lock ids')",
}

# Foreign keys between two tables with organization_id that leave it out: constraint name -> why.
FOREIGN_KEY_EXCEPTIONS: dict[str, str] = {}

# helix_* functions that act on locks without taking the organization: signature -> why.
FUNCTION_EXCEPTIONS = {
    "helix_force_release_job_lock(bigint,text)": "an admin's release by force names a lock id alone, and"
    " an admin key has no organization: on Citus the service first finds the lock's organization"
    " (docs/scaling.md, 'Lock ids'), then passes it",
    "helix_prune_history(interval,integer)": "retention sweeps every organization's history at once; on"
    " Citus it runs shard by shard (docs/scaling.md, 'Retention')",
    "helix_stop_waiting(bigint)": "deletes a waiter's registration by its id alone; cheap to add the"
    " organization (docs/scaling.md)",
    "helix_hold_changed()": "a row trigger on helix_holds: its argument is the row (NEW), which carries"
    " organization_id, and it runs where the row is",
    "helix_lock_released()": "a row trigger on helix_lock_history and helix_holds: reads"
    " helix_lock_waiters of NEW's own organization and job type, a colocated shard",
    "helix_metadata_bounded()": "a row trigger on helix_holds: its argument is the row (NEW), and it"
    " runs where the row is",
    "helix_holds_modes_apart()": "a row trigger on helix_holds: its argument is the row (NEW), and it"
    " reads the holds and the helix_lock_keys row of NEW's own organization and job type, a colocated"
    " shard",
    "helix_job_locks_written()": "the trigger that takes writes through the view helix_job_locks: its"
    " argument is the row (NEW, OLD), which carries organization_id",
    "helix_raise_held(helix_holds[],timestamp with time zone,integer)": "raises the acquire's conflict"
    " from the pair's holds, which its caller read by the organization and passes, each with it",
    "helix_prune_sessions(interval,integer)": "retention of sessions, as of the history: every"
    " organization's at once",
    "helix_session_lease_shortened()": "a row trigger on helix_sessions: its argument is the row (NEW),"
    " which carries organization_id, and it reads that organization's holds and waiters",
    "helix_announce_expiries(integer)": "the event reader's sweep of every organization's due expiries,"
    " as retention's; on Citus each node's reader runs it on its node (docs/scaling.md, 'Events')",
}

# The project's tables: those in the schema migrations created helix_job_locks in.
_SCHEMA = "(SELECT c.relnamespace FROM pg_catalog.pg_class AS c WHERE c.oid = 'helix_job_locks'::regclass)"

_UNIQUE = f"""
SELECT i.relname AS index_name, t.relname AS table_name
FROM pg_catalog.pg_index AS x
JOIN pg_catalog.pg_class AS i ON i.oid = x.indexrelid
JOIN pg_catalog.pg_class AS t ON t.oid = x.indrelid
WHERE t.relnamespace = {_SCHEMA} AND t.relkind IN ('r', 'p')
  AND (x.indisunique OR x.indisexclusion)
  AND NOT EXISTS (
      SELECT FROM generate_series(1, x.indnkeyatts) AS k
      WHERE pg_catalog.pg_get_indexdef(x.indexrelid, k, true) = 'organization_id'
  )
ORDER BY 1
"""

# A foreign key keeps to one organization when organization_id is paired with organization_id.
_FOREIGN_KEYS = f"""
SELECT k.conname AS constraint_name, t.relname AS table_name
FROM pg_catalog.pg_constraint AS k
JOIN pg_catalog.pg_class AS t ON t.oid = k.conrelid
JOIN pg_catalog.pg_attribute AS child ON child.attrelid = k.conrelid AND child.attname = 'organization_id'
JOIN pg_catalog.pg_attribute AS parent ON parent.attrelid = k.confrelid AND parent.attname = 'organization_id'
WHERE k.contype = 'f' AND t.relnamespace = {_SCHEMA}
  AND NOT child.attisdropped AND NOT parent.attisdropped
  AND NOT EXISTS (
      SELECT FROM unnest(k.conkey, k.confkey) AS pair (child_column, parent_column)
      WHERE pair.child_column = child.attnum AND pair.parent_column = parent.attnum
  )
ORDER BY 1
"""

# Functions that act on locks: their body names a lock table or the view, they take a lock row, or
# they are a trigger's on a lock table.
_LOCK_TABLES = (
    "helix_(job_locks|job_lock_views|holds|lock_history|held_locks|ended_locks|lock_keys|lock_waiters"
    "|quota_shares)"
)
_FUNCTIONS = f"""
SELECT p.oid::pg_catalog.regprocedure::text AS signature,
       p.pronargs, p.proargnames, p.proargmodes::text[] AS proargmodes,
       p.prorettype = 'pg_catalog.trigger'::pg_catalog.regtype AS is_trigger,
       EXISTS (
           SELECT FROM unnest(p.proargtypes) AS a (type)
           JOIN pg_catalog.pg_type AS y ON y.oid = a.type
           JOIN pg_catalog.pg_attribute AS c ON c.attrelid = y.typrelid AND c.attname = 'organization_id'
       ) AS takes_a_row_with_organization
FROM pg_catalog.pg_proc AS p
WHERE p.pronamespace = {_SCHEMA} AND p.proname LIKE 'helix\\_%'
  AND (p.prosrc ~ '{_LOCK_TABLES}\\M'
       OR EXISTS (
           SELECT FROM pg_catalog.pg_trigger AS g JOIN pg_catalog.pg_class AS t ON t.oid = g.tgrelid
           WHERE g.tgfoid = p.oid AND t.relname ~ '^{_LOCK_TABLES}$'
       )
       OR EXISTS (
           SELECT FROM unnest(p.proargtypes) AS a (type)
           JOIN pg_catalog.pg_type AS y ON y.oid = a.type
           WHERE y.typrelid IN ('helix_holds'::regclass, 'helix_lock_history'::regclass)
       ))
ORDER BY 1
"""


def unique_without_organization(conn: Conn) -> dict[str, str]:
    """Unique indexes, primary keys and exclusion constraints of the project's tables whose key
    columns leave out organization_id: index -> table."""
    return {str(row[0]): str(row[1]) for row in conn.execute(_UNIQUE)}


def foreign_keys_across_organizations(conn: Conn) -> dict[str, str]:
    """Foreign keys between two tables with organization_id that do not pair it: constraint -> table."""
    return {str(row[0]): str(row[1]) for row in conn.execute(_FOREIGN_KEYS)}


def _input_names(pronargs: int, names: list[str] | None, modes: list[str] | None) -> list[str]:
    if names is None:
        return []
    if modes is None:  # every argument is an input
        return names[:pronargs]
    return [name for name, mode in zip(names, modes, strict=True) if mode in ("i", "b", "v")]


def functions_without_organization(conn: Conn) -> list[str]:
    """Signatures of helix_* functions that act on locks and take neither p_organization_id nor a row
    that carries organization_id (trigger functions take no arguments: all of them are listed)."""
    found = []
    for signature, pronargs, names, modes, is_trigger, takes_row in conn.execute(_FUNCTIONS):
        takes_organization = "p_organization_id" in _input_names(pronargs, names, modes) or takes_row
        if is_trigger or not takes_organization:
            found.append(str(signature))
    return found


def test_unique_indexes_include_the_organization(conn: Conn) -> None:
    assert unique_without_organization(conn).keys() == UNIQUE_EXCEPTIONS.keys()


def test_no_foreign_key_crosses_organizations(conn: Conn) -> None:
    assert foreign_keys_across_organizations(conn).keys() == FOREIGN_KEY_EXCEPTIONS.keys()


def test_lock_functions_take_the_organization(conn: Conn) -> None:
    assert sorted(functions_without_organization(conn)) == sorted(FUNCTION_EXCEPTIONS)


def test_the_checks_see_what_breaks_the_property(conn: Conn) -> None:
    """In this test's own database: a unique index, a foreign key and a lock function without the
    organization are each reported; with it, none is."""
    conn.execute("CREATE UNIQUE INDEX helix_holds_by_token ON helix_holds (token)")
    conn.execute("CREATE UNIQUE INDEX helix_holds_by_org_token ON helix_holds (organization_id, token)")
    # An expression of organization_id is not organization_id: a shard key must be the column itself.
    conn.execute(
        "CREATE UNIQUE INDEX helix_lock_keys_by_lower ON helix_lock_keys (lower(organization_id), job_type)"
    )
    conn.execute("""
        CREATE TABLE helix_lock_notes (
            organization_id text NOT NULL,
            job_type text NOT NULL,
            lock_id bigint NOT NULL,
            CONSTRAINT helix_lock_notes_lock FOREIGN KEY (lock_id) REFERENCES helix_lock_history (id),
            CONSTRAINT helix_lock_notes_key FOREIGN KEY (organization_id, job_type)
                REFERENCES helix_lock_keys (organization_id, job_type)
        )
    """)
    conn.execute("""
        CREATE FUNCTION helix_peek_job_lock(p_lock_id bigint) RETURNS bigint LANGUAGE sql
        AS 'SELECT l.fencing_token FROM helix_job_locks AS l WHERE l.id = p_lock_id'
    """)
    conn.execute("""
        CREATE FUNCTION helix_peek_job_lock_of(p_lock_id bigint, p_organization_id text) RETURNS bigint
        LANGUAGE sql AS $$
            SELECT l.fencing_token FROM helix_job_locks AS l
            WHERE l.id = p_lock_id AND l.organization_id = p_organization_id
        $$
    """)

    unique = unique_without_organization(conn)
    added = {"helix_holds_by_token", "helix_lock_keys_by_lower"}
    assert unique.keys() - UNIQUE_EXCEPTIONS.keys() == added
    assert unique["helix_holds_by_token"] == "helix_holds"
    assert foreign_keys_across_organizations(conn) == {"helix_lock_notes_lock": "helix_lock_notes"}
    functions = set(functions_without_organization(conn)) - FUNCTION_EXCEPTIONS.keys()
    assert functions == {"helix_peek_job_lock(bigint)"}
