"""The `helix-locks` command line: serve and migrate."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import os
import re
import signal
import socket
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType

import psycopg
from pydantic import ValidationError

from service import embedded, keys, listener, logs, migrate, runner, telemetry
from service.client import ApiError, HelixError, LockClient, LockHeld, LockLost
from service.schemas import IDENTIFIER_PATTERN
from service.settings import EdgeSettings, Settings

logger = logging.getLogger("helix_locks")


def _stop(signum: int, frame: FrameType | None) -> None:
    # Unwind through the finally blocks, so an embedded PostgreSQL we started is stopped too.
    raise SystemExit(0)


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
        with _metrics_directory(args.workers):
            uvicorn.run(
                "service.app:create_app",
                factory=True,
                # uvicorn's httptools protocol, with bounds on a request's size and time.
                http="service.edge:GuardedHttpToolsProtocol",
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
        key = path.read_text().strip()
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


def _client(args: argparse.Namespace) -> LockClient:
    return LockClient(args.url, _api_key(args))


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key, or the first line of --api-key-file (which `ps` does not show), else None: the
    client then reads HELIX_LOCKS_API_KEY."""
    path: Path | None = args.api_key_file
    if path is None:
        key: str | None = args.api_key
        return key
    try:
        return path.read_text().strip().splitlines()[0].strip()
    except (OSError, IndexError, UnicodeDecodeError) as exc:
        raise SystemExit(f"helix-locks: cannot read an API key from {path}: {exc}") from exc


def _print_json(value: object) -> None:
    print(json.dumps(value, indent=2, sort_keys=True))


def client_command(args: argparse.Namespace) -> int:
    """acquire, renew, release, list: JSON on standard output, the problem on standard error."""
    with _client(args) as client:
        try:
            if args.command == "acquire":
                grant = client.acquire(args.org, args.job_type, args.ttl, args.holder, wait=args.wait)
                _print_json(grant.body)
            elif args.command == "renew":
                _print_json(client.renew(args.lock_id, args.token, args.ttl))
            elif args.command == "release":
                client.release(args.lock_id, args.token)
            else:
                params = {"organization_id": args.org, "job_type": args.job_type, "state": args.state}
                _print_json(client.list(**{k: v for k, v in params.items() if v is not None}))
        except LockHeld as held:
            print(f"helix-locks: held by {held.holder} until {held.expires_at}", file=sys.stderr)
            return runner.EXIT_HELD
        except LockLost as exc:
            print(f"helix-locks: the lock is not yours (any more): {exc}", file=sys.stderr)
            return runner.EXIT_LOST
        except ApiError as exc:
            print(f"helix-locks: {exc}", file=sys.stderr)
            return 1
        except HelixError as exc:
            print(f"helix-locks: {exc}", file=sys.stderr)
            return runner.EXIT_UNAVAILABLE
    return 0


def run_command(args: argparse.Namespace) -> int:
    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        print("helix-locks run: no command given (helix-locks run ... -- COMMAND [ARGS...])", file=sys.stderr)
        return 2
    with _client(args) as client:
        return runner.run(
            client, args.org, args.job_type, args.ttl, args.wait, command, pass_api_key=args.pass_api_key
        )


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(
        prog="helix-locks", description="Helix Locks: a lock authority for workers."
    )
    commands = root.add_subparsers(dest="command", required=True)

    def data_dir_option(command: argparse.ArgumentParser) -> None:
        command.add_argument(
            "--data-dir",
            type=Path,
            default=None,
            help="where the embedded PostgreSQL keeps its data when DATABASE_URL is unset "
            f"(default: {embedded.default_data_dir()})",
        )

    serve_cmd = commands.add_parser("serve", help="run the HTTP service")
    serve_cmd.add_argument("--host", default="127.0.0.1")
    serve_cmd.add_argument("--port", type=int, default=8080)
    serve_cmd.add_argument("--workers", type=int, default=1, help="worker processes")
    serve_cmd.add_argument("--insecure", action="store_true", help="serve anonymous requests off loopback")
    data_dir_option(serve_cmd)
    serve_cmd.set_defaults(handler=serve)

    migrate_cmd = commands.add_parser("migrate", help="apply pending migrations")
    data_dir_option(migrate_cmd)
    migrate_cmd.set_defaults(handler=run_migrate)

    keys_cmd = commands.add_parser("keys", help="create, list and revoke API keys")
    keys_commands = keys_cmd.add_subparsers(dest="keys_command", required=True)
    create_cmd = keys_commands.add_parser("create", help="create a key and print it, once")
    scope = create_cmd.add_mutually_exclusive_group(required=True)
    scope.add_argument("--org", help="the organization the key acts in")
    scope.add_argument("--admin", action="store_true", help="a key that acts in every organization")
    create_cmd.add_argument(
        "--from-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="store the key this file holds (one line, as `keys new` prints) instead of a new one; "
        "prints its id, never the key",
    )
    create_cmd.add_argument(
        "--if-none",
        action="store_true",
        help="store nothing, and succeed, when any key exists already (a revoked one included)",
    )
    data_dir_option(create_cmd)
    create_cmd.set_defaults(handler=keys_create)
    new_cmd = keys_commands.add_parser(
        "new", help="print a fresh key without storing it (for keys create --from-file)"
    )
    new_cmd.set_defaults(handler=keys_new)
    list_cmd = keys_commands.add_parser("list", help="list keys (never the keys themselves)")
    data_dir_option(list_cmd)
    list_cmd.set_defaults(handler=keys_list)
    revoke_cmd = keys_commands.add_parser("revoke", help="revoke a key by its id, at once everywhere")
    revoke_cmd.add_argument("key_id")
    data_dir_option(revoke_cmd)
    revoke_cmd.set_defaults(handler=keys_revoke)

    def client_options(command: argparse.ArgumentParser) -> None:
        command.add_argument(
            "--url", default=None, help="the service (default: $HELIX_LOCKS_URL or http://127.0.0.1:8080)"
        )
        key = command.add_mutually_exclusive_group()
        key.add_argument(
            "--api-key", default=None, help="API key (default: $HELIX_LOCKS_API_KEY); `ps` shows it"
        )
        key.add_argument(
            "--api-key-file", type=Path, default=None, help="read the API key from this file's first line"
        )

    def lock_options(command: argparse.ArgumentParser, ttl_help: str) -> None:
        command.add_argument("--org", required=True, help="organization id")
        command.add_argument("--job-type", required=True, help="job type")
        command.add_argument("--ttl", type=float, default=30.0, help=ttl_help)
        command.add_argument("--wait", type=float, default=0.0, help="seconds to wait for a held lock")

    run_cmd = commands.add_parser(
        "run",
        help="hold a lock while a command runs",
        description="Hold the lock while COMMAND runs, renewing it, and release it when COMMAND ends. "
        f"Exit status: COMMAND's (128+N if signal N ended it); {runner.EXIT_HELD} if the lock is held "
        f"elsewhere; {runner.EXIT_LOST} if the lock was lost and COMMAND stopped; "
        f"{runner.EXIT_UNAVAILABLE} if the service could not be reached.",
    )
    lock_options(run_cmd, "lease in seconds, renewed every ttl/3 (default 30)")
    client_options(run_cmd)
    run_cmd.add_argument(
        "--pass-api-key",
        action="store_true",
        help="leave HELIX_LOCKS_API_KEY in COMMAND's environment (by default it is taken out)",
    )
    run_cmd.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARGS...]")
    run_cmd.set_defaults(handler=run_command)

    acquire_cmd = commands.add_parser("acquire", help="acquire a lock; prints it with its token")
    lock_options(acquire_cmd, "lease in seconds (default 30)")
    acquire_cmd.add_argument("--holder", default=None, help="who holds it (default: user@host:pid)")
    client_options(acquire_cmd)
    acquire_cmd.set_defaults(handler=client_command)
    for name, help_text in (("renew", "extend a lease"), ("release", "release a lock")):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("lock_id", type=int)
        command.add_argument("--token", required=True, help="the Lock-Token the acquire printed")
        if name == "renew":
            command.add_argument("--ttl", type=float, default=30.0, help="new lease in seconds")
        client_options(command)
        command.set_defaults(handler=client_command)
    list_cmd = commands.add_parser("list", help="list locks as JSON")
    list_cmd.add_argument("--org", default=None)
    list_cmd.add_argument("--job-type", default=None)
    list_cmd.add_argument("--state", default=None, choices=["held", "expired", "released", "reclaimed"])
    client_options(list_cmd)
    list_cmd.set_defaults(handler=client_command)
    return root


def main(argv: list[str] | None = None) -> int:
    try:
        logs.configure()
    except ValidationError as exc:
        return _bad_setting(exc)
    args = parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        code: int = args.handler(args)
    except migrate.MigrationError as exc:
        print(f"helix-locks: {exc}", file=sys.stderr)
        return 1
    except psycopg.OperationalError as exc:
        print(f"helix-locks: cannot reach the database: {exc}", file=sys.stderr)
        return 1
    except ValidationError as exc:
        return _bad_setting(exc)
    return code


def _bad_setting(exc: ValidationError) -> int:
    """A HELIX_LOCKS_* variable that does not parse: say which, without a traceback."""
    prefix = "HELIX_LOCKS_LOG_" if exc.title == logs.LogSettings.__name__ else "HELIX_LOCKS_"
    for error in exc.errors():
        name = prefix + "_".join(str(part) for part in error["loc"]).upper()
        print(f"helix-locks: {name}: {error['msg']}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
