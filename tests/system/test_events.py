"""GET /v1/events on real servers: every event type from real operations, resuming on another
replica, tenancy, revocation, the limits, and no reader while nobody watches."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from harness.watch import Event, Watch
from helix_locks.server import keys, queries, schemas
from helix_locks.server.db import Database, create_pool
from helix_locks.server.errors import EventsExpired
from helix_locks.server.events import EventHub, EventIds, Position, Window
from helix_locks.server.keys import ANONYMOUS, KeyRing
from tests.support import ROUTE, replicas

pytestmark = pytest.mark.anyio


def auth(key: str | None, token: str | None = None) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return headers | ({"Lock-Token": token} if token else {})


async def acquire(
    http: httpx.AsyncClient, key: str | None = None, org: str = "acme", job: str = "report", ttl: float = 30
) -> dict[str, Any]:
    body = {"organization_id": org, "job_type": job, "holder": "w", "ttl_seconds": ttl}
    response = await http.post("/v1/locks", json=body, headers=auth(key))
    assert response.status_code == 201, response.text
    granted: dict[str, Any] = response.json()
    return granted


async def release(http: httpx.AsyncClient, lock: dict[str, Any], key: str | None = None) -> None:
    response = await http.delete(f"/v1/locks/{lock['id']}", headers=auth(key, lock["token"]))
    assert response.status_code == 204, response.text


@asynccontextmanager
async def event_hub(db_url: str, statement_timeout_ms: int = 5000, **limits: int) -> AsyncIterator[EventHub]:
    """A process's event reader on the test's database, without the app around it; `limits`
    override EventHub's (a few watchers, a replay of 10, 1 MiB a stream, 64 MiB in all)."""
    settings = ROUTE.settings(db_url, allow_anonymous=True, statement_timeout_ms=statement_timeout_ms)
    pool = create_pool(settings)
    await pool.open()
    db = Database(pool, settings)
    given: dict[str, Any] = {
        "poll_seconds": 0.02,
        "max_watchers": 10,
        "max_per_organization": 10,
        "replay_limit": 10,
        "stream_bytes": 1024 * 1024,
        "memory_bytes": 64 * 1024 * 1024,
        "organization_bytes": 0,
        "keep": None,
        "keepalive_seconds": 1,
    }
    hub = EventHub(db, KeyRing(db, allow_anonymous=True), schemas.event_data, **(given | limits))
    try:
        yield hub
    finally:
        hub.close()
        await db.close()


def event_ids(db_url: str) -> EventIds:
    """Event ids as the service on this database signs and reads them."""
    with psycopg.connect(db_url) as conn:
        row = conn.execute(queries.EVENT_ID_KEY).fetchone()
    assert row is not None
    return EventIds(bytes(row[0]))


def per_key(events: list[Event]) -> dict[tuple[str, str], list[tuple[str, int]]]:
    keyed: dict[tuple[str, str], list[tuple[str, int]]] = {}
    for event in events:
        lock = event.data["lock"]
        keyed.setdefault((lock["organization_id"], lock["job_type"]), []).append((event.type, lock["id"]))
    return keyed


def moment(text: str) -> datetime:
    return datetime.fromisoformat(text)


async def test_every_event_type_comes_from_real_operations(db_url: str, tmp_path: Path) -> None:
    admin = keys.create(db_url, None)
    with replicas(db_url, tmp_path) as [url]:
        async with httpx.AsyncClient(base_url=url) as http, Watch(url, key=admin) as watch:
            first = await acquire(http, admin, ttl=1)
            renewed = await http.post(
                f"/v1/locks/{first['id']}/renew", json={"ttl_seconds": 1}, headers=auth(admin, first["token"])
            )
            assert renewed.status_code == 200
            patched = await http.patch(
                f"/v1/locks/{first['id']}",
                json={"metadata": {"step": 2}},
                headers=auth(admin, first["token"]),
            )
            assert patched.status_code == 200
            # Nobody renews it again: it runs out with no request at that moment.
            events = await watch.until(4, within=5)
            expired = events[3]
            assert expired.type == "expired"
            assert expired.data["at"] == renewed.json()["expires_at"] == expired.data["lock"]["expires_at"]
            late = expired.arrived - moment(renewed.json()["expires_at"]).timestamp()
            # Not before the lease ran out; soon after it, with no request to prompt it (polls are 20 ms).
            assert 0 <= late < 3, f"expired came {late:.3f} s after the lease ran out"

            second = await acquire(http, admin)  # reclaims the first
            forced = await http.delete(f"/v1/locks/{second['id']}?force=true", headers=auth(admin))
            assert forced.status_code == 204
            third = await acquire(http, admin, job="other")
            asked = await http.post(
                f"/v1/locks/{third['id']}/revocation", json={"reason": "deploy"}, headers=auth(admin)
            )
            assert asked.status_code == 202, asked.text
            await release(http, third, admin)
            await watch.until(10)

    assert watch.kinds() == [
        ("acquired", first["id"]),
        ("renewed", first["id"]),
        ("updated", first["id"]),
        ("expired", first["id"]),
        ("reclaimed", first["id"]),
        ("acquired", second["id"]),
        ("forced", second["id"]),
        ("acquired", third["id"]),
        ("revocation-requested", third["id"]),
        ("released", third["id"]),
    ]
    by_kind = {event.type: event.data for event in watch.events}
    assert by_kind["updated"]["lock"]["metadata"] == {"step": 2}
    assert watch.events[5].data["reclaimed"] == {
        "lock_id": first["id"],
        "holder": "w",
        "expired_at": renewed.json()["expires_at"],
    }
    assert watch.events[0].data["reclaimed"] is None
    assert "reclaimed" not in by_kind["released"]
    assert all("token" not in event.data["lock"] for event in watch.events)
    assert by_kind["forced"]["at"] == by_kind["forced"]["lock"]["released_at"]
    assert by_kind["forced"]["lock"]["forced_by"] == keys.key_id(admin)
    assert watch.events[0].data["lock"]["forced_by"] is None
    assert len({event.id for event in watch.events}) == 10
    revocation = by_kind["revocation-requested"]
    assert (
        revocation["at"]
        == revocation["lock"]["revocation"]["requested_at"]
        == asked.json()["revocation"]["requested_at"]
    )
    assert revocation["lock"]["revocation"]["by"] == keys.key_id(admin)


async def test_a_watcher_resumes_on_another_replica_missing_and_repeating_nothing(
    db_url: str, tmp_path: Path
) -> None:
    with replicas(db_url, tmp_path, count=2) as [one, two]:
        async with httpx.AsyncClient(base_url=one) as http, Watch(one) as whole:
            async with Watch(one) as cut:
                locks = [await acquire(http, job=f"job-{n}") for n in range(3)]
                await cut.until(3)
            # The connection is gone; changes go on meanwhile.
            for lock in locks:
                await release(http, lock)
            more = await acquire(http, job="job-9")
            await whole.until(7)
            for n in range(3):  # resume from each of the events the cut watcher had
                async with Watch(two, last_event_id=cut.events[n].id) as resumed:
                    await resumed.until(7 - n - 1)
                    await asyncio.sleep(0.3)  # nothing more comes
                    # Each key's events in commit order; keys may interleave differently.
                    assert per_key(resumed.events) == per_key(whole.events[n + 1 :])
    assert whole.kinds()[-1] == ("acquired", more["id"])


async def test_an_event_id_from_before_retention_is_410_and_a_made_up_one_is_422(
    db_url: str, tmp_path: Path
) -> None:
    with replicas(db_url, tmp_path) as [url]:
        async with httpx.AsyncClient(base_url=url) as http, Watch(url) as watch:
            await acquire(http)
            [event] = await watch.until(1)
        ids = event_ids(db_url)
        position = ids.decode(event.id)
        # The window it was read in opened long ago.
        window = replace(position.window, after_at=datetime(2020, 1, 1, tzinfo=UTC))
        old = ids.encode(replace(position, window=window))
        async with Watch(url, last_event_id=old) as refused:
            assert refused.status == 410
            assert refused.problem is not None
            assert refused.problem["type"] == "urn:helix-locks:problem:events-expired"
        for made_up in ("garbage", base64.urlsafe_b64encode(b'["1:1:",1]').decode(), "x" * 5000):
            async with Watch(url, last_event_id=made_up) as invalid:
                assert invalid.status in (422, 431), invalid.problem
        async with Watch(url, last_event_id_query="nope") as invalid:
            assert invalid.status == 422  # an unknown query parameter, as elsewhere
            assert invalid.problem is not None
            assert invalid.problem["errors"][0]["field"] == "last_event_id_query"
        async with httpx.AsyncClient(base_url=url) as http:
            response = await http.get("/v1/events", params={"last_event_id": "garbage"})
            assert response.status_code == 422
            assert response.json()["errors"][0]["field"] == "Last-Event-ID"


async def test_a_replay_longer_than_its_limit_is_410(db_url: str, tmp_path: Path) -> None:
    with replicas(db_url, tmp_path, HELIX_LOCKS_EVENTS_REPLAY_LIMIT="3") as [url]:
        async with httpx.AsyncClient(base_url=url) as http, Watch(url) as watch:
            first = await acquire(http)
            [event] = await watch.until(1)
            await release(http, first)
            async with Watch(url, last_event_id=event.id) as short:
                assert short.status == 200
                await short.until(1)
                assert short.kinds() == [("released", first["id"])]
            for n in range(2):
                await release(http, await acquire(http, job=f"more-{n}"))
            async with Watch(url, last_event_id=event.id) as long:
                assert long.status == 410
                assert long.problem is not None and "REPLAY_LIMIT" in long.problem["detail"]


async def test_an_organization_key_sees_only_its_organization(db_url: str, tmp_path: Path) -> None:
    acme, globex, admin = (
        keys.create(db_url, "acme"),
        keys.create(db_url, "globex"),
        keys.create(db_url, None),
    )
    with replicas(db_url, tmp_path) as [url]:
        async with (
            httpx.AsyncClient(base_url=url) as http,
            Watch(url, key=acme) as mine,
            Watch(url, key=acme, job_type="report") as one_job,
            Watch(url, key=admin) as everything,
            Watch(url, key=admin, organization_id="globex") as theirs,
        ):
            async with Watch(url, key=acme, organization_id="globex") as trespass:
                assert trespass.status == 403
            async with Watch(url) as nobody:
                assert nobody.status == 401
            ours = await acquire(http, acme)
            other_job = await acquire(http, acme, job="other")
            foreign = await acquire(http, globex, org="globex")
            await everything.until(3)
            await asyncio.sleep(0.3)
        assert mine.kinds() == [("acquired", ours["id"]), ("acquired", other_job["id"])]
        assert one_job.kinds() == [("acquired", ours["id"])]
        assert theirs.kinds() == [("acquired", foreign["id"])]
        assert sorted(everything.kinds()) == sorted(mine.kinds() + theirs.kinds())


async def test_a_stream_ends_when_its_key_is_revoked(db_url: str, tmp_path: Path) -> None:
    acme = keys.create(db_url, "acme")
    other = keys.create(db_url, "acme")
    with replicas(db_url, tmp_path) as [url]:
        async with Watch(url, key=acme) as revoked, Watch(url, key=other) as kept:
            assert keys.revoke(db_url, keys.key_id(acme) or "")
            started = time.monotonic()
            await asyncio.wait_for(revoked.ended.wait(), timeout=10)
            assert time.monotonic() - started < 5
            await asyncio.sleep(1.5)
            assert not kept.ended.is_set()
            async with Watch(url, key=acme) as again:
                assert again.status == 401


async def test_an_organization_past_its_watcher_limit_gets_429_and_another_is_unaffected(
    db_url: str, tmp_path: Path
) -> None:
    acme, globex = keys.create(db_url, "acme"), keys.create(db_url, "globex")
    with replicas(db_url, tmp_path, HELIX_LOCKS_MAX_WATCHERS_PER_ORGANIZATION="2") as [url]:
        async with Watch(url, key=acme) as first, Watch(url, key=acme) as second:
            assert first.status == second.status == 200
            async with Watch(url, key=acme) as third:
                assert third.status == 429
                assert third.problem is not None
                assert third.problem["type"] == "urn:helix-locks:problem:too-many-watchers-in-organization"
            async with Watch(url, key=globex) as theirs:
                assert theirs.status == 200
        async with Watch(url, key=acme) as later:  # the first two left: room again
            assert later.status == 200


async def test_a_quiet_stream_gets_keep_alive_comments(db_url: str, tmp_path: Path) -> None:
    with replicas(db_url, tmp_path) as [url]:
        async with Watch(url) as watch:
            await asyncio.sleep(2.5)
        assert len(watch.comments) >= 3  # one on joining, then one a second
        assert watch.events == []


async def test_nobody_watching_costs_no_reader_and_no_statement(db_url: str) -> None:
    """The reader runs only while someone watches: before the first watcher and after the last
    one left, the process sends the database nothing for events."""
    sent: list[str] = []
    async with event_hub(db_url) as hub:
        fetch_all = hub.db.fetch_all

        async def counted(query: Any, params: Any) -> Any:
            sent.append(query)
            return await fetch_all(query, params)

        hub.db.fetch_all = counted  # type: ignore[method-assign]
        await asyncio.sleep(0.3)
        assert sent == []
        watcher = await hub.watch(ANONYMOUS, None, None, None, None)
        deadline = time.monotonic() + 30  # a loaded machine polls slower; the count is what matters
        while len(sent) < 5:
            assert time.monotonic() < deadline, f"one reader polls while someone watches: {len(sent)}"
            await asyncio.sleep(0.05)
        hub.leave(watcher)
        await asyncio.sleep(0.1)
        quiet = len(sent)
        await asyncio.sleep(0.5)
        assert len(sent) == quiet, "nobody watches: nothing is read"
        again = await hub.watch(ANONYMOUS, None, None, None, None)  # and it starts again
        while len(sent) == quiet:
            assert time.monotonic() < deadline + 30, "the reader did not start again"
            await asyncio.sleep(0.05)
        hub.leave(again)


async def test_when_the_database_history_goes_back_every_stream_ends(db_url: str) -> None:
    """A failover to a standby that lacked the last transactions (asynchronous replication) puts
    the database's transaction ids behind the reader's window, which would take new changes for
    seen: the reader ends every stream instead (each resumes), and a resume from an id of the
    lost history is 410."""
    async with event_hub(db_url) as hub:
        watcher = await hub.watch(ANONYMOUS, None, None, None, None)
        ahead = "4000000000:4000000000:"  # a window read on the lost history
        await hub._next((ahead, datetime.now(UTC)))
        assert watcher.ended
        assert hub.watching == 0
        now = datetime.now(UTC)
        lost = (await hub._event_ids()).encode(Position(Window(ahead, now, ahead, now), (now, 1, 0)))
        with pytest.raises(EventsExpired):
            await hub.watch(ANONYMOUS, None, None, None, lost)


async def test_a_stream_cut_before_its_first_event_resumes_from_where_it_joined(
    db_url: str, tmp_path: Path
) -> None:
    """A stream is sent an id as it joins (no event: EventSource and the SDKs keep it as the last
    id), so that a client cut before any event came resumes without losing what came meanwhile."""
    with replicas(db_url, tmp_path, count=2) as [one, two]:
        host, port = one.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"GET /v1/events HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        seen = b""
        while b"\nid: " not in seen or not seen.endswith(b"\n\n\r\n"):
            seen += await asyncio.wait_for(reader.read(4096), 10)
        writer.close()
        joined = seen.split(b"\nid: ", 1)[1].split(b"\n", 1)[0].decode()
        async with httpx.AsyncClient(base_url=two) as http:
            lock = await acquire(http, job="meanwhile")
            async with Watch(two, last_event_id=joined) as resumed:
                await resumed.until(1)
                await resumed.quiet(0.5)
    assert b"\nevent: " not in seen, seen
    assert resumed.kinds() == [("acquired", lock["id"])]


async def test_a_sessions_renewals_and_lapse_are_events_of_each_of_its_locks(
    db_url: str, tmp_path: Path
) -> None:
    """A session's lease is its row alone (migration 0028), yet each of its locks reports it: a
    renewal is a renewed event of each lock, a lapse an expired event of each, in the live stream
    and in a replay; a lock added after a lapse reports neither that lapse nor earlier renewals."""
    with replicas(db_url, tmp_path) as [url]:
        async with httpx.AsyncClient(base_url=url) as http, Watch(url) as watch:
            body = {
                "organization_id": "acme",
                "holder": "w",
                "ttl_seconds": 1,
                "locks": [{"job_type": "a"}, {"job_type": "b"}],
            }
            opened = (await http.post("/v1/sessions", json=body)).json()
            a, b = (lock["id"] for lock in opened["locks"])
            token = {"Lock-Token": opened["token"]}
            renew = f"/v1/sessions/{opened['id']}/renew"
            first = await http.post(renew, headers=token, json={"ttl_seconds": 1})
            assert first.status_code == 200
            patched = await http.patch(f"/v1/locks/{a}", headers=token, json={"metadata": {"step": 2}})
            assert patched.status_code == 200
            await watch.until(7, within=10)  # nobody renews: both lapse
            again = await http.post(renew, headers=token, json={"ttl_seconds": 30})
            assert again.status_code == 200 and again.json()["lapsed"] is True
            # Each change is seen before the next: a poll folds renewals of one lock that commit
            # within it, as a lock's own do.
            await watch.until(9)
            added = await http.post(
                f"/v1/sessions/{opened['id']}/locks", headers=token, json={"locks": [{"job_type": "c"}]}
            )
            assert added.status_code == 201, added.text
            c = added.json()["locks"][0]["id"]
            await watch.until(10)
            assert (await http.post(renew, headers=token, json={"ttl_seconds": 30})).status_code == 200
            await watch.until(13)
            assert (await http.delete(f"/v1/sessions/{opened['id']}", headers=token)).status_code == 204
            await watch.until(16)
            await watch.quiet()
            async with Watch(url, last_event_id=watch.events[0].id) as replay:
                await replay.quiet()

    def of(events: list[Event], lock_id: int) -> list[str]:
        return [event.type for event in events if event.data["lock"]["id"] == lock_id]

    assert of(watch.events, a) == [
        "acquired",
        "renewed",
        "updated",
        "expired",
        "renewed",
        "renewed",
        "released",
    ]
    assert of(watch.events, b) == ["acquired", "renewed", "expired", "renewed", "renewed", "released"]
    assert of(watch.events, c) == ["acquired", "renewed", "released"]
    lapse = [event for event in watch.events if event.type == "expired"]
    assert {event.data["at"] for event in lapse} == {first.json()["expires_at"]}
    # A replay folds renewals and updates, never a state change; a's acquired was the start.
    changes = {"acquired", "expired", "reclaimed", "released", "forced"}
    assert [kind for kind in of(replay.events, a) if kind in changes] == ["expired", "released"]
    assert [kind for kind in of(replay.events, b) if kind in changes] == ["acquired", "expired", "released"]
    assert [kind for kind in of(replay.events, c) if kind in changes] == ["acquired", "released"]


async def test_events_say_each_locks_mode(db_url: str, tmp_path: Path) -> None:
    """Issue 40: the lock object of an event says its mode, as every answer does."""
    with replicas(db_url, tmp_path) as [url]:
        async with httpx.AsyncClient(base_url=url) as http, Watch(url) as watch:
            body = {"organization_id": "acme", "job_type": "dataset", "holder": "r", "ttl_seconds": 30}
            readers = [
                (await http.post("/v1/locks", json=body | {"mode": "shared"})).json() for _ in range(2)
            ]
            for reader in readers:
                await release(http, reader)
            writer = await acquire(http, job="dataset")
            await release(http, writer)
            await watch.until(6, within=10)
    modes = [(event.type, event.data["lock"]["id"], event.data["lock"]["mode"]) for event in watch.events]
    assert modes == [
        ("acquired", readers[0]["id"], "shared"),
        ("acquired", readers[1]["id"], "shared"),
        ("released", readers[0]["id"], "shared"),
        ("released", readers[1]["id"], "shared"),
        ("acquired", writer["id"], "exclusive"),
        ("released", writer["id"], "exclusive"),
    ]
