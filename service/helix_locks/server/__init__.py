"""The server: the HTTP service in front of PostgreSQL, and the `serve`, `migrate` and `keys`
commands (commands.py). It needs the `server` extra (FastAPI, uvicorn, psycopg); the SDK beside
this package (helix_locks.client, runner, cli) never imports it, so a worker's install has none of
them."""
