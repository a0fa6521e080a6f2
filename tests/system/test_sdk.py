"""The SDK's promises, each checked on both clients (LockClient and AsyncLockClient) against a real
service: a lease lost on 403, 404 or 410 and by its own clock, waiting, a retry after a lost
answer that gets the same grant, a 503's Retry-After honoured, and semaphores (max_holders)."""

from __future__ import annotations

import contextlib
import inspect
import queue
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import psycopg
import pytest

from harness.processes import running_service
from harness.proxies import LyingProxy, plain_http_server
from helix_locks import (
    Acquired,
    ApiError,
    AsyncLockClient,
    HelixError,
    InvalidURL,
    Lease,
    Lock,
    LockClient,
    LockEvent,
    LockHeld,
    LockLost,
    MaxHoldersMismatch,
    NotHelixLocks,
    Page,
    Reclaimed,
    Renewed,
    Unavailable,
)
from helix_locks.client import _grant
from tests.support import either


@pytest.fixture(params=["sync", "async"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def service(db_url: str, tmp_path: Path) -> Iterator[tuple[str, Any]]:
    with running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "s.log") as started:
        yield started


def test_a_lease_renews_itself_well_past_its_ttl_and_is_released_at_the_end(
    kind: str, service: tuple[str, Any]
) -> None:
    url, _ = service
    with either(kind, url) as client:
        with client.lock("acme", "long-job", ttl=1) as lease:
            for _ in range(30):  # 3 s: three times the lease
                time.sleep(0.1)
                lease.check()
            current = client.current("acme", "long-job")
            assert current is not None and current["fencing_token"] == lease.fencing_token
            with pytest.raises(LockHeld) as held:
                client.acquire("acme", "long-job", ttl=1, holder="rival")
            assert held.value.retry_after >= 1
        assert client.current("acme", "long-job") is None, "released when the block ends"


def test_a_holder_publishes_progress_and_learns_when_the_lock_is_not_its_own(
    kind: str, service: tuple[str, Any]
) -> None:
    url, _ = service
    with either(kind, url) as client:
        grant = client.acquire("acme", "progress", ttl=30)
        updated = client.update(grant.id, grant.token, {"done": 40, "of": 100})
        assert updated["metadata"] == {"done": 40, "of": 100}
        assert client.get(grant.id)["metadata"] == {"done": 40, "of": 100}
        with pytest.raises(LockLost):
            client.update(grant.id, "0" * 32, {"done": 41})  # 403: not this holder's token
        client.release(grant.id, grant.token)
        with pytest.raises(LockLost):
            client.update(grant.id, grant.token, {"done": 100})  # 410: released


# What makes a holder's renewal answer each status: the lock ended, vanished, or has another token.
BREAKS = {
    410: "UPDATE helix_job_locks SET released_at = clock_timestamp(), release_reason = 'forced'"
    " WHERE id = %s",
    404: "DELETE FROM helix_job_locks WHERE id = %s",
    403: "UPDATE helix_job_locks SET token = 'not-yours' WHERE id = %s",
}


@pytest.mark.parametrize("status", sorted(BREAKS))
def test_a_renewal_refused_marks_the_lease_lost_at_once(
    kind: str, status: int, service: tuple[str, Any], db_url: str
) -> None:
    url, _ = service
    with either(kind, url) as client, client.lock("acme", f"refused-{status}", ttl=1.5) as lease:
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute(BREAKS[status], (lease.grant.id,))
        deadline = time.monotonic() + 1.2  # one renewal period (ttl/3) and a margin
        while not lease.lost:
            assert time.monotonic() < deadline, "lost at the first refused renewal"
            time.sleep(0.02)
        assert str(status) in (lease.lost_reason or ""), lease.lost_reason
        with pytest.raises(LockLost):
            lease.check()


def test_a_session_holds_all_its_locks_renews_them_with_one_request_and_ends_them_at_the_end(
    kind: str, service: tuple[str, Any]
) -> None:
    url, _ = service
    with either(kind, url) as client:
        with client.session("acme", ["part-2", "part-1"], ttl=1) as session:
            assert sorted(session.locks) == ["part-1", "part-2"]
            assert session.fencing_tokens == {"part-1": 1, "part-2": 1}
            for _ in range(30):  # 3 s: three times the lease
                time.sleep(0.1)
                session.check()
            for job_type in ("part-1", "part-2"):
                current = client.current("acme", job_type)
                assert current is not None and current["session_id"] == session.id
                with pytest.raises(LockHeld) as held:
                    client.acquire("acme", job_type, ttl=1, holder="rival")
            # A set that overlaps it is refused whole, naming the first pair held.
            with pytest.raises(LockHeld) as held:
                client.open_session("acme", ["part-3", "part-2"], ttl=1)
            assert held.value.job_type == "part-2"
        assert client.current("acme", "part-1") is None and client.current("acme", "part-2") is None
        # part-3 was never granted: its first grant is token 1.
        assert client.acquire("acme", "part-3", ttl=1).fencing_token == 1


def test_locks_added_to_a_held_session_are_renewed_with_it_and_a_held_one_refuses_them_all(
    kind: str, service: tuple[str, Any]
) -> None:
    url, _ = service
    with either(kind, url) as client:
        rival = client.acquire("acme", "added-b", ttl=30, holder="rival")
        with client.session("acme", ["added-a"], ttl=1) as session:
            with pytest.raises(LockHeld) as held:
                client.add_session_locks(session, ["added-c", "added-b"])
            assert held.value.job_type == "added-b"
            assert client.current("acme", "added-c") is None  # all or none: c was not kept
            client.release(rival.id, rival.token)
            added = client.add_session_locks(session, ["added-c", "added-b"], wait=5)
            assert [lock["job_type"] for lock in added] == ["added-b", "added-c"]
            assert session.fencing_tokens == {"added-a": 1, "added-b": 2, "added-c": 1}
            for _ in range(20):  # 2 s: twice the lease, all three renewed with the session
                time.sleep(0.1)
                session.check()
            current = client.current("acme", "added-c")
            assert current is not None and current["session_id"] == session.id
        assert client.current("acme", "added-b") is None and client.current("acme", "added-c") is None


def test_a_session_that_lost_a_lock_is_lost_at_its_next_renewal(
    kind: str, service: tuple[str, Any], db_url: str
) -> None:
    url, _ = service
    with either(kind, url) as client, client.session("acme", ["a", "b"], ttl=1.5) as session:
        with psycopg.connect(db_url, autocommit=True) as conn:  # an admin's force, of b alone
            conn.execute(
                "SELECT helix_end_holds(ARRAY[%s]::bigint[], clock_timestamp(), 'forced', 'admin')",
                (session.locks["b"]["id"],),
            )
        deadline = time.monotonic() + 1.2  # one renewal period (ttl/3) and a margin
        while not session.lost:
            assert time.monotonic() < deadline, "lost at the first refused renewal"
            time.sleep(0.02)
        assert "410" in (session.lost_reason or ""), session.lost_reason
        with pytest.raises(LockLost):
            session.check()
        assert client.current("acme", "a") is None  # the renewal that found the loss released a


def test_a_lease_counts_as_lost_by_its_own_clock_before_it_could_lapse(
    kind: str, service: tuple[str, Any]
) -> None:
    url, server = service
    with either(kind, url) as client, client.lock("acme", "clock", ttl=2) as lease:
        server.send_signal(signal.SIGKILL)  # renewals fail from now on, without an answer
        server.wait()
        lapse = lease.grant.sent_at + lease.grant.ttl
        while not lease.lost:
            assert time.monotonic() < lapse, "the lease must count as lost before it could lapse"
            time.sleep(0.02)
        assert "lapse" in (lease.lost_reason or "")


def test_a_waiting_acquire_is_granted_when_the_holder_releases(kind: str, service: tuple[str, Any]) -> None:
    url, _ = service
    with either(kind, url) as holder, either(kind, url) as waiter:
        held = holder.acquire("acme", "wait", ttl=60)
        granted: list[Any] = []
        thread = threading.Thread(
            target=lambda: granted.append(waiter.acquire("acme", "wait", ttl=60, wait=30))
        )
        thread.start()
        time.sleep(0.5)
        assert not granted, "waits while the lock is held"
        released_at = time.monotonic()
        holder.release(held.id, held.token)
        thread.join(timeout=30)
        assert granted and granted[0].fencing_token == held.fencing_token + 1
        assert time.monotonic() - released_at < 5, "woken by the release, not by its wait running out"


def test_an_acquire_whose_answer_was_lost_is_retried_and_gets_the_same_grant(
    kind: str, service: tuple[str, Any]
) -> None:
    """The service granted the first attempt, but its answer became a 503 on the way back: the
    retry carries the same Idempotency-Key and is answered that same grant, not 409."""
    url, _ = service
    with LyingProxy(url, [("POST", "/v1/locks")]) as proxy, either(kind, proxy.url) as client:
        started = time.monotonic()
        grant = client.acquire("acme", "lost-answer", ttl=30)
        took = time.monotonic() - started
        lock = client.current("acme", "lost-answer")
    assert [status for method, _, status in proxy.told if method == "POST"] == [503, 201]
    assert lock is not None and (lock["id"], lock["fencing_token"]) == (grant.id, grant.fencing_token)
    assert took >= 1.0, "the retry waited the 503's Retry-After (1 s)"


def test_a_lease_counts_from_the_acquire_s_send_not_from_its_late_answer(
    kind: str, service: tuple[str, Any]
) -> None:
    url, _ = service
    with (
        LyingProxy(url, [], delays=[("POST", "/v1/locks", 0.6)]) as proxy,
        either(kind, proxy.url) as client,
        client.lock("acme", "late-answer", ttl=3) as lease,
    ):
        ends = time.monotonic() + lease.remaining
        arrivals = [at for method, path, at in proxy.arrived if method == "POST"]
    # The request arrived after it was sent: the lease may last no longer from there.
    assert ends <= arrivals[0] + 3 - 0.3 + 0.01, ends - arrivals[0]
    assert len(arrivals) == 1, "no renewal was needed before the block"


def test_after_an_acquire_longer_than_a_renewal_period_the_block_starts_on_a_renewal(
    kind: str, service: tuple[str, Any]
) -> None:
    url, _ = service
    with (
        LyingProxy(url, [], delays=[("POST", "/v1/locks", 1.5)]) as proxy,
        either(kind, proxy.url) as client,
        client.lock("acme", "long-acquire", ttl=3) as lease,
    ):
        ends = time.monotonic() + lease.remaining
        renewals = [at for method, path, at in proxy.arrived if path.endswith("/renew")]
        assert not lease.lost
    assert len(renewals) == 1, "renewed once before the block"
    assert ends <= renewals[0] + 3 - 0.3 + 0.01, ends - renewals[0]


def test_renewals_go_every_ttl_3_from_the_previous_send_even_when_answered_slowly(
    kind: str, service: tuple[str, Any]
) -> None:
    url, _ = service
    slow = [("POST", "/v1/locks/", 0.7)] * 3
    with (
        LyingProxy(url, [], delays=slow) as proxy,
        either(kind, proxy.url) as client,
        client.lock("acme", "slow-renewals", ttl=3) as lease,
    ):
        time.sleep(2.6)
        assert not lease.lost, lease.lost_reason
    at = [at for method, path, at in proxy.arrived if path.endswith("/renew")]
    assert len(at) >= 2, at
    # Answered after 0.7 s each: a period counted from the answer would put 1.7 s between them.
    assert at[1] - at[0] < 1.3, at[1] - at[0]


def test_a_release_retried_after_a_503_counts_as_released(kind: str, service: tuple[str, Any]) -> None:
    url, _ = service
    with LyingProxy(url, [("DELETE", "/v1/locks/")]) as proxy, either(kind, proxy.url) as client:
        grant = client.acquire("acme", "lost-release", ttl=30)
        client.release(grant.id, grant.token)  # the retry finds it released by itself: no LockLost
        assert client.current("acme", "lost-release") is None
    assert [status for method, _, status in proxy.told if method == "DELETE"] == [503, 410]


# --- semaphores (max_holders) ---------------------------------------------------------------------


def test_a_semaphore_of_three_gives_each_lease_its_slot_and_a_fourth_is_told_every_holder(
    kind: str, service: tuple[str, Any]
) -> None:
    url, _ = service
    with either(kind, url) as client:
        with contextlib.ExitStack() as held:
            leases = [
                held.enter_context(client.lock("acme", "export", ttl=30, holder=f"w{n}", max_holders=3))
                for n in range(3)
            ]
            assert sorted(lease.slot for lease in leases) == [0, 1, 2]
            assert {lease.max_holders for lease in leases} == {3}
            tokens = [lease.fencing_token for lease in leases]
            assert tokens == sorted(set(tokens)), "distinct, increasing across the slots"
            for lease in leases:
                in_slot = client.current("acme", "export", slot=lease.slot)
                assert in_slot is not None and in_slot["id"] == lease.grant.id
            newest = client.current("acme", "export")
            assert newest is not None and newest["fencing_token"] == tokens[-1]

            fourth = client.lock("acme", "export", holder="w3", max_holders=3)
            with pytest.raises(LockHeld) as full, fourth:
                pass
            assert full.value.max_holders == 3 and full.value.retry_after >= 1
            assert len(full.value.holders) == full.value.holders_total == 3
            assert {(h["lock_id"], h["slot"]) for h in full.value.holders} == {
                (lease.grant.id, lease.slot) for lease in leases
            }

            started = time.monotonic()
            wrong = client.lock("acme", "export", holder="w4", max_holders=2, wait=20)
            with pytest.raises(MaxHoldersMismatch) as mismatch, wrong:
                pass
            assert time.monotonic() - started < 5, "a mismatch is not waited for"
            assert mismatch.value.max_holders == 3 and isinstance(mismatch.value, HelixError)
        assert client.current("acme", "export") is None, "every block released its slot"


def test_a_waiting_lock_on_a_full_semaphore_is_granted_when_one_holder_releases(
    kind: str, service: tuple[str, Any]
) -> None:
    url, _ = service
    with either(kind, url) as holder, either(kind, url) as waiter:
        grants = [holder.acquire("acme", "upstream", ttl=60, max_holders=2) for _ in range(2)]
        granted: list[tuple[int, int, float]] = []

        def wait_for_a_slot() -> None:
            with waiter.lock("acme", "upstream", ttl=60, wait=30, max_holders=2) as lease:
                granted.append((lease.slot, lease.fencing_token, time.monotonic()))

        thread = threading.Thread(target=wait_for_a_slot)
        thread.start()
        time.sleep(0.5)
        assert not granted, "waits while every slot is held"
        released_at = time.monotonic()
        holder.release(grants[1].id, grants[1].token)
        thread.join(timeout=30)
        assert granted, "granted within its wait"
        slot, token, at = granted[0]
        assert slot == grants[1].slot and token == grants[1].fencing_token + 1
        assert at - released_at < 5, "woken by the release, not by a lease's expiry (60 s)"
        holder.release(grants[0].id, grants[0].token)


# --- shared locks (mode) -------------------------------------------------------------------------


def test_readers_hold_together_and_a_writer_is_told_it_met_readers(
    kind: str, service: tuple[str, Any]
) -> None:
    url, _ = service
    with either(kind, url) as client:
        with (
            client.lock("acme", "dataset", holder="r1", mode="shared") as first,
            client.lock("acme", "dataset", holder="r2", mode="shared") as second,
        ):
            assert (first.mode, second.mode) == ("shared", "shared")
            assert second.fencing_token > first.fencing_token and first.slot != second.slot
            with pytest.raises(LockHeld) as held, client.lock("acme", "dataset", holder="writer"):
                pass
            assert held.value.mode == "shared" and held.value.holders_total == 2
        with client.lock("acme", "dataset", holder="writer") as writer:
            assert writer.mode == "exclusive" and writer.fencing_token > second.fencing_token
        with client.session("acme", ["dataset", "log"], holder="s", shared=["dataset"]) as session:
            assert (
                session.locks["dataset"]["mode"] == "shared" and session.locks["log"]["mode"] == "exclusive"
            )
            reader = client.acquire("acme", "dataset", holder="r3", mode="shared")
            assert reader.mode == "shared"
            client.release(reader.id, reader.token)
        with pytest.raises(ValueError, match="shared names job types"):
            client.open_session("acme", ["a"], shared=["b"])


def test_an_older_service_without_semaphores_reads_as_one_slot() -> None:
    body = {"id": 7, "organization_id": "acme", "job_type": "x", "fencing_token": 3, "token": "t"}
    grant = _grant(cast(Acquired, {**body, "ttl_remaining_ms": 30_000}), 30, time.monotonic())
    assert (grant.max_holders, grant.slot) == (1, 0)
    assert (Lease(grant).max_holders, Lease(grant).slot) == (1, 0)
    held = LockHeld({"lock_id": 7, "holder": "w", "expires_at": "2026-12-01T00:00:00Z"}, 1.0)
    assert held.max_holders == 1
    assert held.holders == [{"lock_id": 7, "holder": "w", "slot": 0, "expires_at": "2026-12-01T00:00:00Z"}]
    assert held.holders_total == 1


# --- a wrong address -----------------------------------------------------------------------------


@pytest.mark.parametrize("client_class", [LockClient, AsyncLockClient])
@pytest.mark.parametrize("url", ["localhost:8080", "127.0.0.1:8080", "ftp://example.com", "http://"])
def test_a_url_that_cannot_be_the_service_s_is_refused_when_the_client_is_made(
    client_class: type[LockClient | AsyncLockClient], url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="http:// or https://") as refused:
        client_class(url)
    assert isinstance(refused.value, InvalidURL) and repr(url) in str(refused.value)
    monkeypatch.setenv("HELIX_LOCKS_URL", url)
    with pytest.raises(InvalidURL):
        client_class()


def test_nothing_listening_an_unknown_name_and_no_answer_are_each_said_at_once(kind: str) -> None:
    """Not 15 s of retries that end in "no answer" whatever the cause: a refused connection and
    a name that does not resolve are said within about a second, and a silent service after the
    client's own timeout."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel accepts connections that nobody answers
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
            cases = [
                (f"http://127.0.0.1:{closed.getsockname()[1]}", "connection refused by"),
                ("http://helix-locks.invalid:8080", "'helix-locks.invalid' does not resolve"),
                (f"http://127.0.0.1:{silent.getsockname()[1]}", "(timed out)"),
            ]
            for url, says in cases:
                with either(kind, url, timeout=0.5) as client:
                    started = time.monotonic()
                    with pytest.raises(Unavailable) as unavailable:
                        client.acquire("acme", "nowhere", ttl=2)
                    took = time.monotonic() - started
                assert says in str(unavailable.value), (url, str(unavailable.value))
                assert url in str(unavailable.value)
                assert took < 5, f"{url}: took {took:.1f} s"


def test_a_refusal_names_each_field_and_the_rule_it_broke(kind: str, service: tuple[str, Any]) -> None:
    with either(kind, service[0]) as client, pytest.raises(ApiError) as refused:
        client.acquire("ac me", "x", ttl=0)
    assert refused.value.status == 422
    lines = str(refused.value).splitlines()
    assert lines[0] == "422: Invalid: organization_id, ttl_seconds.", lines
    assert lines[1].startswith("  organization_id: String should match pattern"), lines
    assert lines[2].startswith("  ttl_seconds: Input should be greater than"), lines


def test_a_path_under_the_service_s_root_is_not_taken_for_the_service(
    kind: str, service: tuple[str, Any]
) -> None:
    """Its 404s are the routes', not locks': no "none is held", no lost lock."""
    url = service[0]
    with either(kind, f"{url}/v1") as client:
        for method, args in (("current", ("acme", "x")), ("acquire", ("acme", "x")), ("release", (1, "t"))):
            with pytest.raises(NotHelixLocks) as wrong:
                getattr(client, method)(*args)
            assert wrong.value.status == 404
            assert f"{url}/v1 does not look like a Helix Locks service" in str(wrong.value)
            assert f"such as {url})" in str(wrong.value)
    with either(kind, url) as client:
        assert client.current("acme", "x") is None
        with pytest.raises(LockLost):
            client.release(12345, "token")


def test_a_server_that_is_not_helix_locks_is_said_so(kind: str, tmp_path: Path) -> None:
    with plain_http_server(tmp_path) as url, either(kind, url) as client:
        with pytest.raises(NotHelixLocks, match="does not look like a Helix Locks service: POST /v1/locks"):
            client.acquire("acme", "x")
        with pytest.raises(NotHelixLocks, match="GET /v1/locks answered 404"):
            client.list()


def _fields(declared: Any) -> tuple[set[str], set[str]]:
    """A TypedDict's required keys, and every key it declares."""
    return set(declared.__required_keys__), set(declared.__required_keys__ | declared.__optional_keys__)


def test_the_sdk_s_result_types_name_every_field_the_service_sends_and_no_other(
    service: tuple[str, Any],
) -> None:
    """results.py is what a type checker trusts: each answer of a real service has its type's
    required keys and nothing it does not declare, nested objects too."""

    def conforms(value: dict[str, Any], declared: Any, what: str) -> None:
        required, known = _fields(declared)
        assert required <= value.keys(), f"{what} lacks {sorted(required - value.keys())}"
        assert value.keys() <= known, f"{what} has undeclared {sorted(value.keys() - known)}"

    url, _ = service
    with LockClient(url) as client, LockClient(url) as rival:
        first = client.acquire("acme", "typed", ttl=1, metadata={"step": 1})
        conforms(dict(first.body), Acquired, "an acquire")
        time.sleep(1.2)  # its lease runs out: the next grant reclaims it
        grant = rival.acquire("acme", "typed", ttl=30)
        conforms(dict(grant.body), Acquired, "an acquire that reclaimed")
        assert grant.body["reclaimed"] is not None
        conforms(dict(grant.body["reclaimed"]), Reclaimed, "its reclaimed lock")
        conforms(dict(rival.renew(grant.id, grant.token, 30)), Renewed, "a renewal")
        conforms(dict(rival.update(grant.id, grant.token, {"step": 2})), Lock, "an update")
        conforms(dict(rival.get(grant.id)), Lock, "a lock")
        page = rival.list(organization_id="acme", limit=1)
        conforms(dict(page), Page, "a page")
        conforms(dict(page["items"][0]), Lock, "a listed lock")
        held = rival.current("acme", "typed")
        assert held is not None
        conforms(dict(held), Lock, "the current lock")
        rival.release(grant.id, grant.token)
    # A watch joins when it is first read: grants go on beside it until it hands one over.
    taken: queue.Queue[LockEvent] = queue.Queue()

    def watch() -> None:
        with LockClient(url) as watcher:
            taken.put(next(watcher.watch("acme", "typed-watched", within=30)))

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    with LockClient(url) as client:
        for _ in range(300):
            granted = client.acquire("acme", "typed-watched", ttl=30)
            client.release(granted.id, granted.token)
            if not thread.is_alive():
                break
            thread.join(timeout=0.1)
    event = taken.get(timeout=10)
    conforms(dict(event), LockEvent, "an event")
    conforms(dict(event["lock"]), Lock, "an event's lock")


def test_every_public_name_of_the_sdk_says_what_it_does() -> None:
    """help() on any public class, method or function of helix_locks gives its docstring."""
    import helix_locks

    missing = []
    for name in helix_locks.__all__:
        value = getattr(helix_locks, name)
        if not inspect.isclass(value):
            continue
        if not inspect.getdoc(value):
            missing.append(name)
        for attribute, member in vars(value).items():
            function = member.fget if isinstance(member, property) else member
            if attribute.startswith("_") or not callable(function):
                continue
            if not inspect.getdoc(function):
                missing.append(f"{name}.{attribute}")
    assert not missing, f"no docstring: {missing}"
