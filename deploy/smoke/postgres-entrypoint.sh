#!/bin/sh
# Initialise on first start like the official image, running /docker-entrypoint-initdb.d's *.sh
# (as the postgres user, with the container's environment) and *.sql (through psql, as
# POSTGRES_USER into POSTGRES_DB) in order; then run PostgreSQL in the foreground.
set -eu
mkdir -p "$PGDATA" /run/postgresql
chown -R postgres:postgres "$PGDATA" /run/postgresql
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    printf '%s' "$POSTGRES_PASSWORD" > /tmp/pwfile
    chown postgres /tmp/pwfile
    su postgres -c "initdb -D '$PGDATA' -U '$POSTGRES_USER' --encoding=UTF8 --locale=C.UTF-8 --pwfile=/tmp/pwfile --auth-host=scram-sha-256 --auth-local=trust"
    rm /tmp/pwfile
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    su postgres -c "pg_ctl -D '$PGDATA' -w start -o '-c listen_addresses='"
    su postgres -c "psql -U '$POSTGRES_USER' -d postgres -c 'CREATE DATABASE \"$POSTGRES_DB\"'"
    as_postgres="env HOME=/var/lib/postgresql setpriv --reuid=postgres --regid=postgres --init-groups"
    for script in /docker-entrypoint-initdb.d/*; do
        case "$script" in
            *.sh) echo "running $script"; $as_postgres sh "$script" ;;
            *.sql) echo "running $script"
                $as_postgres psql -v ON_ERROR_STOP=1 --no-psqlrc -U "$POSTGRES_USER" -d "$POSTGRES_DB" -f "$script" ;;
        esac
    done
    su postgres -c "pg_ctl -D '$PGDATA' -w stop"
fi
exec setpriv --reuid=postgres --regid=postgres --init-groups postgres -D "$PGDATA" -c listen_addresses="*"
