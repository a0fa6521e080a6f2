"""`helix-locks run`: hold a lock while a command runs; stop the command before the lease could lapse.
With several job types, it holds all their locks at once, in one session (granted together or
not at all, renewed with one request).

The command runs in a process group of its own, so that stopping it stops everything it started
(a shell wrapper's children included). Exit statuses: the command's own, or 128+N if signal N
ended it; EXIT_HELD when another holder has the lock (every slot, for a semaphore), or it is closed;
with at_most_once_per, the skip status instead (0 by default: the interval's run is elsewhere); EXIT_LOST
when the lock was lost and the command stopped; EXIT_REFUSED when the service refused the acquire
as it was asked (an invalid organization id, a bad key, a max_holders other than the held
locks') or the URL is not the service's; EXIT_UNAVAILABLE when the service could not be reached
to acquire, or could not serve it (503 until the retries ran out, 429, 500).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from types import FrameType

from helix_locks.client import (
    ApiError,
    ClosedUntil,
    Grant,
    HelixError,
    Lease,
    LockClient,
    LockHeld,
    LockLost,
    NotHelixLocks,
    Reserved,
    SessionGrant,
    SessionLease,
)

EXIT_REFUSED = 64  # EX_USAGE: the request, as made, was refused; asking again will not help
EXIT_UNAVAILABLE = 69  # EX_UNAVAILABLE: the service could not be reached or could not serve
EXIT_HELD = 75  # EX_TEMPFAIL: try again later
EXIT_LOST = 76  # the lock was lost while the command ran; the command was stopped
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
POLL_SECONDS = 0.05
API_KEY_VARIABLE = "HELIX_LOCKS_API_KEY"


def exit_status(error: HelixError) -> int:
    """The status a client command exits with for an error: EXIT_HELD, EXIT_LOST, EXIT_REFUSED
    for a refusal that trying again will not cure (a 4xx, but 429's "too many", or a URL that is
    not the service's), EXIT_UNAVAILABLE for the rest, which a wrapper may retry."""
    if isinstance(error, LockHeld):
        return EXIT_HELD
    if isinstance(error, LockLost):
        return EXIT_LOST
    if isinstance(error, NotHelixLocks):
        return EXIT_REFUSED
    if isinstance(error, ApiError) and 400 <= error.status < 500 and error.status != 429:
        return EXIT_REFUSED
    return EXIT_UNAVAILABLE


def say(message: str) -> None:
    print(f"helix-locks run: {message}", file=sys.stderr, flush=True)


def signal_group(process: subprocess.Popen[bytes], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signum)


def grace_seconds(ttl: float) -> float:
    """How long the command gets between SIGTERM and SIGKILL when the lock is being lost."""
    return min(5.0, max(0.2, ttl * 0.2))


def stop_before_lapse(process: subprocess.Popen[bytes], lease: Lease | SessionLease, grace: float) -> None:
    """SIGTERM the group now; SIGKILL it after the grace, or sooner if the lease would lapse."""
    signal_group(process, signal.SIGTERM)
    kill_at = time.monotonic() + grace
    while process.poll() is None and time.monotonic() < kill_at and lease.remaining > 0:
        time.sleep(POLL_SECONDS)
    signal_group(process, signal.SIGKILL)
    process.wait()


class Interrupted(Exception):
    """A forwarded signal arrived before there was a command to forward it to."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signum)


def run(
    client: LockClient,
    organization_id: str,
    job_types: list[str],
    ttl: float,
    wait: float,
    command: list[str],
    pass_api_key: bool = False,
    max_holders: int = 1,
    shared: bool = False,
    max_hold: float | None = None,
    at_most_once_per: float | None = None,
    skip_status: int = 0,
) -> int:
    """Run `command` under the lock; its status, or one of the module's. With `at_most_once_per`
    seconds, the lock closes its key for that long from its grant (hold_at_least), and a key held
    or closed is this interval's run done or under way elsewhere: `skip_status`, without running
    the command."""
    # Until the command exists, a signal ends `run` itself (with 128+N, as the command would).
    previous = {signum: signal.signal(signum, _interrupt) for signum in FORWARDED}
    # The command gets no API key of ours unless asked: it holds the lock, not the key.
    env = {k: v for k, v in os.environ.items() if pass_api_key or k != API_KEY_VARIABLE}
    try:
        return _run(
            client, organization_id, job_types, ttl, wait, command, env, max_holders, shared, max_hold,
            at_most_once_per, skip_status,
        )  # fmt: skip
    except Interrupted as interrupted:
        say(f"interrupted by signal {interrupted.signum} before the command started")
        return 128 + interrupted.signum
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _held(client: LockClient, grant: Grant | SessionGrant) -> tuple[Lease | SessionLease, dict[str, str]]:
    """The lease to keep, and what the command finds in its environment to fence its writes (and
    to name the lock it runs under): of a semaphore, the slot it holds, by which it keys its
    fence; of a session, its id and each lock's id and fencing token by job type, as JSON."""
    if isinstance(grant, SessionGrant):
        locks = grant.body["locks"]
        return SessionLease(grant), {
            "HELIX_LOCKS_SESSION_ID": str(grant.id),
            "HELIX_LOCKS_LOCK_IDS": json.dumps({lock["job_type"]: lock["id"] for lock in locks}),
            "HELIX_LOCKS_FENCING_TOKENS": json.dumps(
                {lock["job_type"]: lock["fencing_token"] for lock in locks}
            ),
        }
    return Lease(grant), {
        "HELIX_LOCKS_LOCK_ID": str(grant.id),
        "HELIX_LOCKS_FENCING_TOKEN": str(grant.fencing_token),
        "HELIX_LOCKS_SLOT": str(grant.slot),
    }


def _let_go(client: LockClient, grant: Grant | SessionGrant) -> None:
    """Release the lock, or end the session (releasing all its locks)."""
    if isinstance(grant, SessionGrant):
        client.end_session(grant.id, grant.token)
    else:
        client.release(grant.id, grant.token)


def _run(
    client: LockClient,
    organization_id: str,
    job_types: list[str],
    ttl: float,
    wait: float,
    command: list[str],
    env: dict[str, str],
    max_holders: int = 1,
    shared: bool = False,
    max_hold: float | None = None,
    at_most_once_per: float | None = None,
    skip_status: int = 0,
) -> int:
    job_type = job_types[0]
    grant: Grant | SessionGrant
    try:
        if len(job_types) == 1:
            mode = "shared" if shared else "exclusive"
            grant = client.acquire(
                organization_id,
                job_type,
                ttl,
                wait=wait,
                max_holders=max_holders,
                mode=mode,
                max_hold=max_hold,
                hold_at_least=at_most_once_per,
            )
        else:
            grant = client.open_session(
                organization_id,
                job_types,
                ttl,
                wait=wait,
                shared=job_types if shared else (),
                max_hold=max_hold,
            )
    except LockHeld as held:
        job_type = held.job_type or job_type
        if at_most_once_per is not None:
            why = (
                f"closed until {held.closed_until}"
                if isinstance(held, ClosedUntil)
                else f"held by {held.holder} until {held.expires_at}"
            )
            say(
                f"{organization_id}/{job_type} is {why}: this interval's run is elsewhere;"
                " not running the command"
            )
            return skip_status
        if isinstance(held, ClosedUntil | Reserved):
            say(f"{organization_id}/{job_type} is {held}")
        elif held.max_holders > 1:
            say(
                f"all {held.max_holders} slots of {organization_id}/{job_type} are held;"
                f" the first lease ends at {held.expires_at}"
            )
        elif held.mode == "shared":
            say(
                f"{organization_id}/{job_type} is held by {held.holders_total} shared lock(s);"
                f" the first lease ends at {held.expires_at}"
            )
        else:
            say(f"{organization_id}/{job_type} is held by {held.holder} until {held.expires_at}")
        return EXIT_HELD
    except HelixError as exc:
        say(f"could not acquire: {exc}")
        return exit_status(exc)
    # From here a signal is kept, then forwarded once the command's group exists: never lost,
    # never ending `run` while a command it started runs unwatched.
    pending: list[int] = []
    for signum in FORWARDED:
        signal.signal(signum, lambda signum, frame: pending.append(signum))
    lease, fences = _held(client, grant)
    stop = threading.Event()
    renewer = threading.Thread(target=client.keep_alive, args=(lease, stop), daemon=True)
    renewer.start()
    env = {**env, **fences}
    try:
        process = subprocess.Popen(command, start_new_session=True, env=env)
    except OSError as exc:
        say(f"cannot run {command[0]}: {exc}")
        stop.set()
        renewer.join()
        _let_go(client, grant)
        return 127

    def forward(signum: int, frame: FrameType | None) -> None:
        signal_group(process, signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    for kept in pending:
        signal_group(process, kept)
    grace = grace_seconds(ttl)
    lost = False
    asked = False  # someone asked the holder to let go, and COMMAND was told (SIGTERM)
    try:
        while process.poll() is None:
            if lease.revocation is not None and not asked:
                asked = True
                asker, reason = lease.revocation["by"] or "an anonymous caller", lease.revocation["reason"]
                say(
                    f"asked to let go by {asker} ({reason!r}, by {lease.revocation['deadline']}):"
                    " sending COMMAND SIGTERM; the lock is released when it ends"
                )
                signal_group(process, signal.SIGTERM)
            definitive = lease.lost_reason is not None and lease.remaining > 0
            if definitive or lease.remaining <= grace:
                if lease.at_hold_limit and not definitive:
                    limit = lease.grant.body.get("hold_limit_at")
                    say(f"the lock's hold limit comes at {limit}: stopping the command")
                else:
                    say(f"lock lost ({lease.lost_reason or 'renewals are failing'}): stopping the command")
                lost = True
                stop_before_lapse(process, lease, grace)
                break
            time.sleep(POLL_SECONDS)
        status = process.returncode
        # Whatever the command left running in its group must not outlive the lock.
        signal_group(process, signal.SIGTERM)
    finally:
        stop.set()
        # A renewal still retrying against an unreachable service is not worth waiting for once
        # the lock is lost (the thread is a daemon); otherwise let the last renewal finish.
        renewer.join(timeout=0.2 if lost else None)
    if not lost and not lease.lost:
        try:
            _let_go(client, grant)
        except LockLost as exc:
            say(f"the lock had been lost before the command ended: {exc}")
            return EXIT_LOST
        except HelixError as exc:
            say(f"could not release (the lease will lapse by itself): {exc}")
    if lost or lease.lost:
        return EXIT_LOST
    return status if status >= 0 else 128 - status
