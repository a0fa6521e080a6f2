"""The server's commands of `helix-locks`: serve, migrate and keys. They need the `server` extra
(pip install '.[server]' in a clone of the repository); cli.py loads this module only for them."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import re
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import psycopg
from pydantic import ValidationError

from helix_locks.server import embedded, keys, listener, logs, migrate, telemetry
from helix_locks.server.schemas import IDENTIFIER_PATTERN
from helix_locks.server.settings import EdgeSettings, Settings

logger = logging.getLogger("helix_locks")


def run(handler: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """One of the commands below, with logging set up and its expected failures said in a line."""
    try:
        logs.configure()
        return handler(args)
    except migrate.MigrationError as exc:
        print(f"helix-locks: {exc}", file=sys.stderr)
        return 1
    except psycopg.OperationalError as exc:
        print(f"helix-locks: cannot reach the database: {exc}", file=sys.stderr)
        return 1
    except ValidationError as exc:
        return _bad_setting(exc)


def is_loopback(host: str) -> bool:
    """True when every address `host` names is a loopback address."""
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    loopback = is_loopback(args.host)
    data = embedded.pgdata(args.data_dir)  # before DATABASE_URL is set below, for the workers
    with embedded.database_url(args.data_dir) as url:
        direct = embedded.session_url(url)
        applied = migrate.migrate(direct)
        logger.info("migrations applied: %s", ", ".join(applied) or "none pending")
        try:
            asyncio.run(listener.check_notifications(direct, url))
        except listener.NotHeard as exc:
            print(f"helix-locks: refusing to start: {exc}.", file=sys.stderr)
            return 2
        if not loopback and not keys.any_keys(direct):
            if not args.insecure:
                print(
                    f"helix-locks: refusing to listen on {args.host}: no API key exists yet, so anyone "
                    "who can reach it could take or break locks. Create an admin key first with\n"
                    "    helix-locks keys create --admin\n"
                    "(with the same DATABASE_URL or --data-dir) and send it as Authorization: Bearer "
                    "<key>. Or listen on 127.0.0.1, or pass --insecure to serve anonymous requests "
                    "on this address anyway.",
                    file=sys.stderr,
                )
                return 2
            logger.warning("serving anonymous requests on %s until a key exists (--insecure)", args.host)
        # For the app factory, in every worker process.
        os.environ["DATABASE_URL"] = url
        os.environ["HELIX_LOCKS_ALLOW_ANONYMOUS"] = str(loopback or args.insecure).lower()
        # Off loopback, --insecure is asked for requests addressed by other names.
        os.environ["HELIX_LOCKS_ANONYMOUS_ANY_HOST"] = str(args.insecure and not loopback).lower()
        settings = Settings()  # type: ignore[call-arg]  # from the environment, as the workers read it
        EdgeSettings()  # a bad bound is said now, not by every worker
        _say_where(args, data)
        with _metrics_directory(args.workers):
            uvicorn.run(
                "helix_locks.server.app:create_app",
                factory=True,
                # uvicorn's httptools protocol, with bounds on a request's size and time.
                http="helix_locks.server.edge:GuardedHttpToolsProtocol",
                host=args.host,
                port=args.port,
                workers=args.workers,
                server_header=False,
                log_config=logs.config(),
                log_level=logs.LogSettings().level.lower(),
                access_log=False,  # the app logs each request itself, with its request id
                # SIGTERM: stop accepting, let requests in flight finish for this long, then stop.
                timeout_graceful_shutdown=settings.shutdown_timeout_seconds,
            )
    return 0


def _say_where(args: argparse.Namespace, data: Path | None) -> None:
    """Where to look: the console and the API's reference, and the embedded database's data
    (which a backup, or a fresh start, needs to find)."""
    host = f"[{args.host}]" if ":" in args.host else args.host
    root = f"http://{host}:{args.port}"
    logger.info("the console: %s/console; the API's reference: %s/docs", root, root)
    if data is None:
        logger.info("the database: DATABASE_URL (no embedded PostgreSQL)")
    else:
        logger.info("the embedded PostgreSQL keeps its data in %s", data)


@contextmanager
def _metrics_directory(workers: int) -> Iterator[None]:
    """With several workers, a fresh directory where their metrics meet (unless one is given)."""
    if workers <= 1 or os.environ.get(telemetry.MULTIPROCESS_DIR):
        yield
        return
    with tempfile.TemporaryDirectory(prefix="helix-locks-metrics-") as directory:
        os.environ[telemetry.MULTIPROCESS_DIR] = directory
        try:
            yield
        finally:
            del os.environ[telemetry.MULTIPROCESS_DIR]


def run_migrate(args: argparse.Namespace) -> int:
    with embedded.database_url(args.data_dir) as url:
        applied = migrate.migrate(embedded.session_url(url))
    print("\n".join(applied) if applied else "no migrations pending")
    return 0


def keys_create(args: argparse.Namespace) -> int:
    if args.org is not None and not re.match(IDENTIFIER_PATTERN, args.org):
        print(f"helix-locks: not an organization id: {args.org!r}", file=sys.stderr)
        return 2
    given = _key_from_file(args.from_file) if args.from_file else None
    key = given or keys.new_key()
    with embedded.database_url(args.data_dir) as database_url:
        url = embedded.session_url(database_url)
        migrate.migrate(url)
        try:
            stored = keys.store(url, key, args.org, unless_any=args.if_none)
        except psycopg.errors.UniqueViolation:
            print(f"helix-locks: a key with id {keys.key_id(key)} exists already", file=sys.stderr)
            return 1
    if not stored:
        # Not on standard output, where a script expects the key it asked for.
        print("helix-locks: an API key exists already; stored none (--if-none)", file=sys.stderr)
    elif given:
        # The caller holds the key already; logs (compose's, for one) must not.
        print(f"stored key {keys.key_id(key)}")
    else:
        print(key)  # alone on standard output, shown this once
    return 0


def _key_from_file(path: Path) -> str:
    """The well-formed key that is the whole of the file (one line). Its content is never echoed:
    it may be a key with a typo."""
    try:
        with path.open("rb") as file:
            key = file.read(1024).decode().strip()  # a key is 65 characters: never read /dev/zero
    except (OSError, UnicodeDecodeError) as exc:
        raise SystemExit(f"helix-locks: cannot read an API key from {path}: {exc}") from exc
    if keys.key_id(key) is None:
        raise SystemExit(
            f"helix-locks: {path} does not hold an API key: it must hold one line, "
            f"{keys.PREFIX}<12 hex digits>_<43 characters of A-Z a-z 0-9 - _> "
            "(`helix-locks keys new` prints one)"
        )
    return key


def keys_new(args: argparse.Namespace) -> int:
    print(keys.new_key())
    return 0


def keys_list(args: argparse.Namespace) -> int:
    with embedded.database_url(args.data_dir) as database_url:
        url = embedded.session_url(database_url)
        migrate.migrate(url)
        found = keys.listing(url)
    rows: list[tuple[str, ...]] = [("ID", "SCOPE", "CREATED", "LAST USED", "REVOKED")]
    for key in found:
        scope = f"org:{key.organization_id}" if key.organization_id else "admin"
        rows.append((key.id, scope, *(_when(t) for t in (key.created_at, key.last_used_at, key.revoked_at))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return 0


def _when(moment: datetime | None) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ") if moment else "-"


def keys_revoke(args: argparse.Namespace) -> int:
    with embedded.database_url(args.data_dir) as database_url:
        url = embedded.session_url(database_url)
        migrate.migrate(url)
        found = keys.revoke(url, args.key_id)
    if not found:
        print(f"helix-locks: no API key with id {args.key_id}", file=sys.stderr)
        return 1
    print(f"revoked {args.key_id}")
    return 0


def _bad_setting(exc: ValidationError) -> int:
    """A HELIX_LOCKS_* variable that does not parse: say which, without a traceback."""
    prefix = "HELIX_LOCKS_LOG_" if exc.title == logs.LogSettings.__name__ else "HELIX_LOCKS_"
    for error in exc.errors():
        name = prefix + "_".join(str(part) for part in error["loc"]).upper()
        print(f"helix-locks: {name}: {error['msg']}", file=sys.stderr)
    return 2
