#!/usr/bin/env bash
# The lean data model's hot path (lean.sql), measured as bench.ceiling measures the schema:
# pgbench, prepared, each call its own transaction, each client on a key of its own; WAL bytes,
# records and full-page images per call from pg_current_wal_lsn() and pg_stat_wal (PostgreSQL 14
# and later), around the measured window only. A prototype to decide the model by, not the
# service's schema: it has no events, quota, idempotency or semaphores.
#
#   bench/prototypes/lean.sh [DATABASE_URL]    # default postgresql://postgres@127.0.0.1:5432/postgres
#
# It creates and drops the database lean_proto on that server. CLIENTS (default "4 32") and
# SECONDS_MEASURED (default 10) choose the levels; LEAN_VARIANT, SQL run after lean.sql, measures
# a variant of the model. One line per level and call:
# call|clients|calls/s|calls|failed|WAL bytes/call|WAL records/call|full-page images/call.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
url=${1:-postgresql://postgres@127.0.0.1:5432/postgres}
db_url=$(python3 -c 'import sys, urllib.parse as u; p = u.urlsplit(sys.argv[1]); print(u.urlunsplit(p._replace(path="/lean_proto")))' "$url")
pgbench=$(command -v pgbench || ls /usr/lib/postgresql/*/bin/pgbench | head -1)
work=$(mktemp -d)
trap 'rm -rf "$work"; psql "$url" -X -q -c "DROP DATABASE IF EXISTS lean_proto" >/dev/null 2>&1 || true' EXIT
sql() { psql "$db_url" -X -q -At -v ON_ERROR_STOP=1 "$@"; }

psql "$url" -X -q -v ON_ERROR_STOP=1 -c "DROP DATABASE IF EXISTS lean_proto" -c "CREATE DATABASE lean_proto"
sql -f "$here/lean.sql"
# A variant of the model: SQL run after lean.sql (an index added, one dropped), as LEAN_VARIANT.
[ -z "${LEAN_VARIANT:-}" ] || sql -c "$LEAN_VARIANT"
# Ended locks of 100 other organizations, as bench.ceiling seeds its database.
sql -c "INSERT INTO lean_history (id, organization_id, job_type, slot, holder, fencing_token,
          acquired_at, expires_at, released_at, release_reason)
        SELECT g, 'org-' || (g % 100), 'job-' || g, 0, 'w', 1, now() - interval '2 h',
               now() - interval '1 h', now() - interval '1 h', 'released'
        FROM generate_series(1, 200000) g" -c "VACUUM ANALYZE"
cat > "$work/cycle.sql" <<'S'
SELECT id AS lid FROM lean_acquire('bench', 'job-' || :client_id, 'w', 30000) \gset
SELECT lean_release(:lid, 'bench', 'job-' || :client_id);
S
cat > "$work/renewal.sql" <<'S'
SELECT lean_renew('bench', 'renew-' || :level || '-' || :client_id, 86400000);
S
counters() { sql -c "SELECT pg_current_wal_lsn(), wal_records, wal_fpi FROM pg_stat_wal"; }
for call in cycle renewal; do
  for clients in ${CLIENTS:-4 32}; do
    if [ "$call" = renewal ]; then
      sql -c "SELECT count(*) FROM generate_series(0, $clients - 1) c,
              lean_acquire('bench', 'renew-$clients-' || c, 'w', 86400000)" >/dev/null
    fi
    run() { "$pgbench" -n -M prepared -c "$clients" -j 2 -D level="$clients" -T "$1" -f "$work/$call.sql" "$db_url" 2>&1; }
    run 2 >/dev/null
    before=$(counters)
    out=$(run "${SECONDS_MEASURED:-10}")
    after=$(counters)
    calls=$(sed -n 's/number of transactions actually processed: \([0-9]*\).*/\1/p' <<<"$out")
    rate=$(sed -n 's/tps = \([0-9.]*\) .*/\1/p' <<<"$out")
    failed=$(sed -n 's/number of failed transactions: \([0-9]*\).*/\1/p' <<<"$out")
    IFS='|' read -r lsn0 records0 fpi0 <<<"$before"
    IFS='|' read -r lsn1 records1 fpi1 <<<"$after"
    sql -c "SELECT '$call', $clients, round($rate), $calls, ${failed:-0},
            round(pg_wal_lsn_diff('$lsn1', '$lsn0') / $calls),
            round(($records1 - $records0)::numeric / $calls, 1),
            round(($fpi1 - $fpi0)::numeric / $calls, 2)"
  done
done
sql -c "SELECT 'HOT updates of lean_slots', n_tup_hot_upd, 'of', n_tup_upd FROM pg_stat_user_tables
        WHERE relname = 'lean_slots'"
