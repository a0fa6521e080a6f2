#!/bin/sh
# Run by the postgres image, as its superuser, once: when it initialises an empty data volume
# (docker-compose.yml mounts it into /docker-entrypoint-initdb.d). It makes the two roles of
# docs/operations.md, "Roles, schema and grants": helix_owner owns the schema helix, and migrate
# runs as it; helix_app, which the replicas run as, may read the tables and call the functions
# that helix_owner makes there, and create nothing. Their passwords come from compose.
set -eu
psql -v ON_ERROR_STOP=1 --no-psqlrc --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
    -v owner_password="$HELIX_OWNER_PASSWORD" -v app_password="$HELIX_APP_PASSWORD" <<'SQL'
CREATE ROLE helix_owner LOGIN PASSWORD :'owner_password';
CREATE ROLE helix_app LOGIN PASSWORD :'app_password';
-- PostgreSQL 15's default; before it, every role may create objects in public.
REVOKE CREATE ON SCHEMA public FROM PUBLIC;
CREATE SCHEMA helix AUTHORIZATION helix_owner;
ALTER ROLE helix_owner SET search_path = helix;
ALTER ROLE helix_app SET search_path = helix;
GRANT USAGE ON SCHEMA helix TO helix_app;
ALTER DEFAULT PRIVILEGES FOR ROLE helix_owner IN SCHEMA helix GRANT SELECT ON TABLES TO helix_app;
ALTER DEFAULT PRIVILEGES FOR ROLE helix_owner IN SCHEMA helix GRANT EXECUTE ON FUNCTIONS TO helix_app;
SQL
