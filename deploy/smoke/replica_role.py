"""Run inside a replica by check.py: prints, as JSON, what the replica's database role is and may
do, connecting with the DATABASE_URL that compose gave the replica. It judges nothing (check.py
does), and leaves nothing behind: its CREATE TABLE is rolled back even where it succeeds."""

import json
import os

import psycopg
from psycopg import sql

FACTS = """
SELECT current_user AS user, r.rolsuper AS superuser,
       r.rolcreaterole OR r.rolcreatedb AS creates_roles_or_databases,
       has_database_privilege(current_database(), 'CREATE') AS creates_schemas,
       ARRAY(SELECT nspname FROM pg_namespace
             WHERE has_schema_privilege(oid, 'CREATE') AND nspname !~ '^pg_') AS creates_in,
       (SELECT count(*) FROM pg_class WHERE relowner = r.oid)
         + (SELECT count(*) FROM pg_proc WHERE proowner = r.oid)
         + (SELECT count(*) FROM pg_namespace WHERE nspowner = r.oid) AS owns,
       n.nspname AS schema, o.rolname AS owner, o.rolsuper AS owner_superuser
FROM pg_roles AS r,
     pg_class AS c
     JOIN pg_namespace AS n ON n.oid = c.relnamespace
     JOIN pg_roles AS o ON o.oid = n.nspowner
WHERE r.rolname = current_user AND c.oid = to_regclass('helix_schema_migrations')
"""

with psycopg.connect(os.environ["DATABASE_URL"], autocommit=True) as conn:
    cursor = conn.execute(FACTS)
    row = cursor.fetchone()
    assert row is not None and cursor.description, "no helix_schema_migrations on the search_path"
    facts = {column.name: value for column, value in zip(cursor.description, row, strict=True)}
    create = sql.SQL("CREATE TABLE {}.helix_smoke_ddl (id integer)").format(sql.Identifier(facts["schema"]))
    try:
        with conn.transaction():
            conn.execute(create)
            facts["create_table"] = "created"
            raise psycopg.Rollback()
    except psycopg.Error as exc:
        facts["create_table"] = f"{exc.sqlstate} {type(exc).__name__}"
print(json.dumps(facts))
