"""CPU per call of two layers, in one process, where the HTTP layer bench (bench.layers) is too
noisy to tell them apart: the statement deadline (db.Database.fetch_all against the same statement
run bare) and the request log line (the standard library's path through our formatter, against
structlog's own path writing the same fields).

    python -m bench.micro          # 3 rounds of 3,000 statements and 20,000 log lines

(from the repository root). Process CPU time (time.process_time), so a busy machine inflates
both sides alike. The database is a throwaway one, as for bench.run.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import logging.config
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, LiteralString

import structlog
from psycopg.rows import DictRow

from bench import log, said_and_stopped
from bench.database import bench_database
from bench.layers import without_deadline
from helix_locks.server import logs
from helix_locks.server.db import Database, create_pool
from helix_locks.server.settings import Settings

Fetch = Callable[[Database, LiteralString, dict[str, Any]], Awaitable[list[DictRow]]]
FIELDS = {"method": "POST", "path": "/v1/locks", "status": 201, "duration_ms": 1.23, "outcome": "granted"}


async def statement_cpu_us(url: str, statements: int, rounds: int) -> list[dict[str, float]]:
    """µs of CPU per `SELECT 1`, four at once, with the deadline and without, by round."""
    settings = Settings(database_url=url, pool_min_size=4, pool_max_size=4)
    pool = create_pool(settings)
    await pool.open(wait=True)
    db = Database(pool, settings)

    async def cpu(fetch: Fetch) -> float:
        async def client() -> None:
            for _ in range(statements // 4):
                await fetch(db, "SELECT 1", {})

        started = time.process_time()
        await asyncio.gather(*(client() for _ in range(4)))
        return (time.process_time() - started) / statements * 1e6

    try:
        return [
            {"deadline": await cpu(Database.fetch_all), "bare": await cpu(without_deadline)}
            for _ in range(rounds)
        ]
    finally:
        await db.close()


def log_line_cpu_us(lines: int, rounds: int) -> list[dict[str, float]]:
    """µs of CPU per request line (JSON, to /dev/null), as the service logs it and by structlog's
    own path with the same fields, by round."""
    logging.config.dictConfig(logs.config(logs.LogSettings(format="json")))
    with open(os.devnull, "w") as devnull:
        handler = logging.getLogger().handlers[0]
        assert isinstance(handler, logging.StreamHandler)
        handler.setStream(devnull)
        stdlib = logging.getLogger("helix_locks.requests")
        native = structlog.wrap_logger(
            structlog.WriteLogger(devnull),
            processors=[
                structlog.processors.TimeStamper(fmt="iso", utc=True, key="time"),
                structlog.processors.add_log_level,
                structlog.processors.JSONRenderer(),
            ],
            wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        )
        found = []
        with logs.request(request_id="0" * 32, key_id="k", organization_id="acme", job_type="j"):
            for _ in range(rounds):
                started = time.process_time()
                for _ in range(lines):
                    stdlib.log(logging.INFO, "request", extra=FIELDS)
                middle = time.process_time()
                for _ in range(lines):
                    native.info("request", logger=stdlib.name, **FIELDS, **logs.request_fields())
                ended = time.process_time()
                found.append(
                    {"stdlib": (middle - started) / lines * 1e6, "structlog": (ended - middle) / lines * 1e6}
                )
        return found


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.micro", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--statements", type=int, default=3000)
    parser.add_argument("--lines", type=int, default=20000)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="helix-bench-"))
    with said_and_stopped():
        try:
            with bench_database(workdir) as (url, where):
                log(f"database: {where}")
                statements = asyncio.run(statement_cpu_us(url, args.statements, args.rounds))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        lines = log_line_cpu_us(args.lines, args.rounds)
    for name, rounds in (
        ("statement (SELECT 1), µs of CPU", statements),
        ("request log line, µs of CPU", lines),
    ):
        print(name + ": " + "; ".join(", ".join(f"{k} {v:.1f}" for k, v in r.items()) for r in rounds))


if __name__ == "__main__":
    main()
