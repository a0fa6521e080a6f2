"""Every status code of the HTTP contract, driven in-process against a real database."""

from __future__ import annotations

import asyncio
import base64
import gc
import json
import time
import weakref
from datetime import datetime
from typing import Any

import httpx
import pytest

from harness.proxies import TcpProxy
from helix_locks.server import keys, schemas
from helix_locks.server.app import create_app
from helix_locks.server.settings import Settings
from tests.support import (
    ROUTE,
    SWOLLEN,
    Conn,
    acquire,
    assert_problem,
    exactly,
    expire,
    in_process,
    lock_body,
)

pytestmark = pytest.mark.anyio
# Every test of `client` runs on the thin path of acquire, release and renew and on FastAPI's
# routes (conftest.py): the two must answer alike.
BOTH_PATHS = True


# --- acquire -----------------------------------------------------------------------------------


async def test_acquire_grants_201_with_location_token_and_database_times(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/locks", json=lock_body(metadata={"run": 7, "tags": ["a"]}))
    assert response.status_code == 201
    grant = response.json()
    assert response.headers["location"] == f"/v1/locks/{grant['id']}"
    assert grant["state"] == "held" and grant["reclaimed"] is None and grant["fencing_token"] == 1
    assert grant["metadata"] == {"run": 7, "tags": ["a"]}
    assert grant["acquired_at"].endswith("Z") and grant["expires_at"].endswith("Z")
    assert 29_000 < grant["ttl_remaining_ms"] <= 30_000
    assert len(grant["token"]) >= 32
    shown = (await client.get(response.headers["location"])).json()
    assert "token" not in shown and shown["id"] == grant["id"]


async def test_acquire_409_names_the_holder_with_retry_after(client: httpx.AsyncClient) -> None:
    first = await acquire(client, holder="worker-7@host-3", ttl_seconds=90)
    response = await client.post("/v1/locks", json=lock_body(holder="w2"))
    problem = assert_problem(response, 409)
    assert problem["lock_id"] == first["id"]
    assert problem["holder"] == "worker-7@host-3"
    assert problem["expires_at"] == first["expires_at"]
    assert 89 <= int(response.headers["retry-after"]) <= 90


async def test_acquire_reclaims_an_expired_lock(client: httpx.AsyncClient, conn: Conn) -> None:
    stale = await acquire(client, holder="crashed")
    expire(conn, stale["id"])
    fresh = await acquire(client, holder="next")
    assert fresh["fencing_token"] == stale["fencing_token"] + 1
    assert fresh["reclaimed"]["lock_id"] == stale["id"]
    assert fresh["reclaimed"]["holder"] == "crashed"
    old = (await client.get(f"/v1/locks/{stale['id']}")).json()
    assert old["state"] == "reclaimed" and old["release_reason"] == "reclaimed"
    assert old["released_at"] == fresh["acquired_at"]
    assert fresh["reclaimed"]["expired_at"] == old["expires_at"]


async def test_fractional_ttl_is_kept_to_the_nearest_millisecond(client: httpx.AsyncClient) -> None:
    grant = await acquire(client, ttl_seconds=1.2346)
    lock = (await client.get(f"/v1/locks/{grant['id']}")).json()
    span = datetime.fromisoformat(lock["expires_at"]) - datetime.fromisoformat(lock["acquired_at"])
    assert span.total_seconds() == 1.235


INVALID_BODIES: list[tuple[dict[str, Any], str]] = [
    (lock_body(organization_id="-leading-dash"), "organization_id"),
    (lock_body(organization_id="a" * 129), "organization_id"),
    (lock_body(organization_id="has space"), "organization_id"),
    (lock_body(organization_id="nul\x00"), "organization_id"),
    (lock_body(organization_id=""), "organization_id"),
    (lock_body(organization_id=42), "organization_id"),
    (lock_body(job_type="ünïcode"), "job_type"),
    (lock_body(job_type="trailing-newline\n"), "job_type"),
    (lock_body(holder=""), "holder"),
    (lock_body(holder="h" * 257), "holder"),
    (lock_body(holder="nul\x00byte"), "holder"),
    (lock_body(holder="\ud800"), "holder"),
    (lock_body(ttl_seconds=0.5), "ttl_seconds"),
    (lock_body(ttl_seconds=86400.5), "ttl_seconds"),
    (lock_body(ttl_seconds="30"), "ttl_seconds"),
    (lock_body(ttl_seconds=True), "ttl_seconds"),
    (lock_body(metadata=[1, 2]), "metadata"),
    (lock_body(metadata={"big": "x" * 9000}), "metadata"),
    (lock_body(metadata={"nul": "\x00"}), "metadata"),
    (lock_body(metadata={"\x00": 1}), "metadata"),
    (lock_body(metadata={"deep": json.loads("[" * 40 + "]" * 40)}), "metadata"),
    (lock_body(metadata={"inf": float("inf")}), "metadata"),
    (lock_body(wait_for_it=1), "wait_for_it"),
    ({"organization_id": "acme"}, "job_type"),
]


@pytest.mark.parametrize(("body", "field"), INVALID_BODIES)
async def test_acquire_invalid_field_is_422_naming_it(
    client: httpx.AsyncClient, body: dict[str, Any], field: str
) -> None:
    # json.dumps escapes what httpx would refuse to encode (a lone surrogate), as a raw client can.
    raw = json.dumps(body).encode()
    response = await client.post("/v1/locks", content=raw, headers={"content-type": "application/json"})
    problem = assert_problem(response, 422)
    assert field in [error["field"] for error in problem["errors"]]
    assert all(error["message"] for error in problem["errors"])


@pytest.mark.parametrize(
    "raw",
    [b"{not json", b"", b"[]", b'{"organization_id": "acme", "ttl_seconds": NaN}', b"\xff\xfe", b"[" * 20000],
)
async def test_malformed_json_is_422(client: httpx.AsyncClient, raw: bytes) -> None:
    response = await client.post("/v1/locks", content=raw, headers={"content-type": "application/json"})
    problem = assert_problem(response, 422)
    assert problem["errors"]


async def test_body_without_content_type_is_read_as_json_from_a_key_holder(
    client: httpx.AsyncClient, db_url: str
) -> None:
    """Anonymous callers must declare JSON (test_abuse.py: a web page could send it otherwise)."""
    raw = json.dumps(lock_body()).encode()
    assert_problem(await client.post("/v1/locks", content=raw), 415)
    key = keys.create(db_url, "acme")
    auth = {"Authorization": f"Bearer {key}"}
    deadline = time.monotonic() + 10
    while (await client.get("/v1/locks", headers=auth)).status_code == 401:  # the key's NOTIFY
        assert time.monotonic() < deadline, "the new key never reached the service"
        await asyncio.sleep(0.01)
    response = await client.post("/v1/locks", content=raw, headers=auth)
    assert response.status_code == 201


async def test_body_of_another_media_type_is_415(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/locks", data={"organization_id": "acme"})
    assert_problem(response, 415)


async def test_body_over_64_kib_is_413(client: httpx.AsyncClient) -> None:
    huge = lock_body(metadata={"x": "y" * 70_000})
    assert_problem(await client.post("/v1/locks", json=huge), 413)

    async def chunks() -> Any:
        for _ in range(70):
            yield b" " * 1024

    streamed = await client.post("/v1/locks", content=chunks(), headers={"content-type": "application/json"})
    assert_problem(streamed, 413)


async def test_text_is_stored_and_returned_literally(client: httpx.AsyncClient) -> None:
    nasty = '\'); DROP TABLE helix_job_locks; -- "quoted" \\ back % %s {}'
    grant = await acquire(client, holder=nasty, metadata={nasty: nasty})
    lock = (await client.get(f"/v1/locks/{grant['id']}")).json()
    assert lock["holder"] == nasty and lock["metadata"] == {nasty: nasty}


# --- release -----------------------------------------------------------------------------------


async def test_release_204_then_410_saying_released(client: httpx.AsyncClient) -> None:
    grant = await acquire(client)
    url = f"/v1/locks/{grant['id']}"
    response = await client.delete(url, headers={"Lock-Token": grant["token"]})
    assert response.status_code == 204 and response.content == b""
    again = assert_problem(await client.delete(url, headers={"Lock-Token": grant["token"]}), 410)
    assert again["release_reason"] == "released" and again["lock_id"] == grant["id"]
    assert again["released_at"].endswith("Z")
    lock = (await client.get(url)).json()
    assert lock["state"] == "released" and lock["released_at"] == again["released_at"]


async def test_release_of_a_lapsed_unreclaimed_lease_is_204(client: httpx.AsyncClient, conn: Conn) -> None:
    grant = await acquire(client)
    expire(conn, grant["id"])
    assert (await client.get(f"/v1/locks/{grant['id']}")).json()["state"] == "expired"
    response = await client.delete(f"/v1/locks/{grant['id']}", headers={"Lock-Token": grant["token"]})
    assert response.status_code == 204


async def test_release_after_reclaim_is_410_saying_reclaimed(client: httpx.AsyncClient, conn: Conn) -> None:
    grant = await acquire(client)
    expire(conn, grant["id"])
    await acquire(client, holder="successor")
    response = await client.delete(f"/v1/locks/{grant['id']}", headers={"Lock-Token": grant["token"]})
    assert assert_problem(response, 410)["release_reason"] == "reclaimed"


async def test_release_with_wrong_token_is_403_whatever_the_state(client: httpx.AsyncClient) -> None:
    grant = await acquire(client)
    url = f"/v1/locks/{grant['id']}"
    assert_problem(await client.delete(url, headers={"Lock-Token": "wrong"}), 403)
    await client.delete(url, headers={"Lock-Token": grant["token"]})
    assert_problem(await client.delete(url, headers={"Lock-Token": "wrong"}), 403)


@pytest.mark.parametrize(
    "lock_id", ["999999", "abc", "0", "-1", "9223372036854775808", "99999999999999999999", "9" * 5000, "١٢"]
)
async def test_unknown_lock_is_404(client: httpx.AsyncClient, lock_id: str) -> None:
    headers = {"Lock-Token": "t"}
    assert_problem(await client.delete(f"/v1/locks/{lock_id}", headers=headers), 404)
    assert_problem(await client.get(f"/v1/locks/{lock_id}"), 404)
    renew = await client.post(f"/v1/locks/{lock_id}/renew", headers=headers, json={"ttl_seconds": 5})
    assert_problem(renew, 404)


async def test_missing_lock_token_is_422(client: httpx.AsyncClient) -> None:
    grant = await acquire(client)
    problem = assert_problem(await client.delete(f"/v1/locks/{grant['id']}"), 422)
    assert problem["errors"][0]["field"] == "Lock-Token"
    renew = await client.post(f"/v1/locks/{grant['id']}/renew", json={"ttl_seconds": 5})
    assert "Lock-Token" in [e["field"] for e in assert_problem(renew, 422)["errors"]]


# --- renew -------------------------------------------------------------------------------------


async def test_renew_200_extends_from_database_now(client: httpx.AsyncClient) -> None:
    grant = await acquire(client, ttl_seconds=5)
    response = await client.post(
        f"/v1/locks/{grant['id']}/renew", headers={"Lock-Token": grant["token"]}, json={"ttl_seconds": 120}
    )
    assert response.status_code == 200
    renewed = response.json()
    assert renewed["lapsed"] is False and renewed["state"] == "held"
    assert datetime.fromisoformat(renewed["expires_at"]) > datetime.fromisoformat(grant["expires_at"])
    assert 119_000 < renewed["ttl_remaining_ms"] <= 120_000
    assert "token" not in renewed


async def test_renew_of_lapsed_lease_says_lapsed(client: httpx.AsyncClient, conn: Conn) -> None:
    grant = await acquire(client)
    expire(conn, grant["id"])
    response = await client.post(
        f"/v1/locks/{grant['id']}/renew", headers={"Lock-Token": grant["token"]}, json={"ttl_seconds": 30}
    )
    assert response.status_code == 200
    assert response.json()["lapsed"] is True and response.json()["state"] == "held"


async def test_renew_403_410_and_422(client: httpx.AsyncClient, conn: Conn) -> None:
    grant = await acquire(client)
    url = f"/v1/locks/{grant['id']}/renew"
    good = {"Lock-Token": grant["token"]}
    assert_problem(await client.post(url, headers={"Lock-Token": "x"}, json={"ttl_seconds": 30}), 403)
    invalid = assert_problem(await client.post(url, headers=good, json={"ttl_seconds": 0}), 422)
    assert invalid["errors"][0]["field"] == "ttl_seconds"
    assert_problem(await client.post(url, headers=good, json={}), 422)
    expire(conn, grant["id"])
    await acquire(client, holder="successor")
    gone = assert_problem(await client.post(url, headers=good, json={"ttl_seconds": 30}), 410)
    assert gone["release_reason"] == "reclaimed"


async def test_update_replaces_metadata_and_leaves_the_lease(client: httpx.AsyncClient, conn: Conn) -> None:
    grant = await acquire(client, metadata={"run": "2026-11-30"})
    url, token = f"/v1/locks/{grant['id']}", {"Lock-Token": grant["token"]}
    response = await client.patch(url, headers=token, json={"metadata": {"done": 40, "of": 100}})
    assert response.status_code == 200, response.text
    updated = response.json()
    assert updated["metadata"] == {"done": 40, "of": 100}  # replaced, not merged
    assert (updated["expires_at"], updated["fencing_token"]) == (grant["expires_at"], grant["fencing_token"])
    assert "token" not in updated
    assert (await client.get(url)).json()["metadata"] == {"done": 40, "of": 100}
    # A lapsed lease nobody reclaimed may still be updated; it stays lapsed.
    expire(conn, grant["id"])
    lapsed = await client.patch(url, headers=token, json={"metadata": None})
    assert lapsed.status_code == 200, lapsed.text
    assert (lapsed.json()["metadata"], lapsed.json()["state"]) == (None, "expired")


async def test_update_403_404_410_and_422(client: httpx.AsyncClient, conn: Conn) -> None:
    grant = await acquire(client)
    url, good = f"/v1/locks/{grant['id']}", {"Lock-Token": grant["token"]}
    assert_problem(await client.patch(url, headers={"Lock-Token": "x"}, json={"metadata": {}}), 403)
    assert_problem(await client.patch("/v1/locks/999999", headers=good, json={"metadata": {}}), 404)
    missing = assert_problem(await client.patch(url, headers=good, json={}), 422)
    assert missing["errors"][0]["field"] == "metadata"
    too_big = {"metadata": {"blob": "x" * 9000}}
    assert assert_problem(await client.patch(url, headers=good, json=too_big), 422)["errors"][0]["field"] == (
        "metadata"
    )
    not_json = await client.patch(url, headers={**good, "Content-Type": "text/plain"}, content=b"{}")
    assert_problem(not_json, 415)
    assert (await client.get(url)).json()["metadata"] is None  # none of them changed it
    expire(conn, grant["id"])
    await acquire(client, holder="successor")
    gone = assert_problem(await client.patch(url, headers=good, json={"metadata": {"late": True}}), 410)
    assert gone["release_reason"] == "reclaimed"
    assert (await client.get(url)).json()["metadata"] is None


# --- metadata as stored (issue 34, item 7) ------------------------------------------------------


def refused_for_metadata(response: httpx.Response) -> str:
    problem = assert_problem(response, 422)
    assert [error["field"] for error in problem["errors"]] == ["metadata"], problem
    message: str = problem["errors"][0]["message"]
    assert "8192" in message, message
    return message


async def test_metadata_is_bounded_as_stored_not_as_sent(client: httpx.AsyncClient, conn: Conn) -> None:
    """At acquire and at update, 422 naming metadata for what is over 8 KiB as stored, however
    small it was as sent; nothing is stored. 8 KiB exactly as stored is kept, and answered intact
    by the grant, the lock, the listing and an update."""
    for metadata in [*SWOLLEN, exactly(conn, 8193)]:
        assert len(json.dumps(metadata, separators=(",", ":"))) < 8192, "small as sent"
        refused_for_metadata(await client.post("/v1/locks", json=lock_body(metadata=metadata)))
    assert conn.execute("SELECT count(*) FROM helix_job_locks").fetchone() == (0,)

    fits = exactly(conn, 8192)
    grant = await acquire(client, metadata=fits)
    url, token = f"/v1/locks/{grant['id']}", {"Lock-Token": grant["token"]}
    assert grant["metadata"] == fits
    assert (await client.get(url)).json()["metadata"] == fits
    assert [lock["metadata"] for lock in (await client.get("/v1/locks")).json()["items"]] == [fits]

    for metadata in [*SWOLLEN, exactly(conn, 8193)]:
        refused_for_metadata(await client.patch(url, headers=token, json={"metadata": metadata}))
    assert (await client.get(url)).json()["metadata"] == fits
    updated = await client.patch(url, headers=token, json={"metadata": {**fits, "pad": fits["pad"][1:]}})
    assert updated.status_code == 200, updated.text
    assert updated.json()["metadata"]["n"] == fits["n"]


async def test_metadata_the_database_refuses_is_a_422_naming_it_never_a_500(
    db_url: str, conn: Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database bounds what it stores, whatever the edge lets through: with the edge's own
    check out of the way, its refusal is still a 422 naming metadata, at acquire (by the count,
    at the quota, waiting) and at update, and nothing is stored."""
    monkeypatch.setattr(schemas, "METADATA_MAX_BYTES", 10**9)
    swollen = SWOLLEN[0]
    for quota, wait in ((10_000, 0), (1, 0), (10_000, 0.5)):
        settings = ROUTE.settings(db_url, allow_anonymous=True, max_live_locks_per_organization=quota)
        async with in_process(create_app(settings)) as client:
            body = lock_body(metadata=swollen, wait_seconds=wait, job_type=f"q{quota}-{wait}")
            refused_for_metadata(await client.post("/v1/locks", json=body))
    assert conn.execute("SELECT count(*) FROM helix_job_locks").fetchone() == (0,)
    async with in_process(create_app(ROUTE.settings(db_url, allow_anonymous=True))) as client:
        grant = await acquire(client, metadata={"run": 1})
        url, token = f"/v1/locks/{grant['id']}", {"Lock-Token": grant["token"]}
        refused_for_metadata(await client.patch(url, headers=token, json={"metadata": swollen}))
        assert (await client.get(url)).json()["metadata"] == {"run": 1}


# --- inspect -----------------------------------------------------------------------------------


async def test_get_shows_every_state(client: httpx.AsyncClient, conn: Conn) -> None:
    held = await acquire(client, job_type="a")
    assert (await client.get(f"/v1/locks/{held['id']}")).json()["state"] == "held"
    expire(conn, held["id"])
    expired = (await client.get(f"/v1/locks/{held['id']}")).json()
    assert expired["state"] == "expired" and expired["ttl_remaining_ms"] == 0
    await acquire(client, job_type="a")
    assert (await client.get(f"/v1/locks/{held['id']}")).json()["state"] == "reclaimed"


async def test_current_is_the_held_lock_or_404(client: httpx.AsyncClient, conn: Conn) -> None:
    params = {"organization_id": "acme", "job_type": "nightly-report"}
    assert_problem(await client.get("/v1/locks/current", params=params), 404)
    grant = await acquire(client)
    current = (await client.get("/v1/locks/current", params=params)).json()
    assert current["id"] == grant["id"] and current["fencing_token"] == grant["fencing_token"]
    expire(conn, grant["id"])
    assert_problem(await client.get("/v1/locks/current", params=params), 404)
    assert_problem(await client.get("/v1/locks/current", params={"organization_id": "acme"}), 422)
    assert_problem(await client.get("/v1/locks/current", params={**params, "job_type": "bad type"}), 422)


async def test_list_filters_by_state_and_pages_with_a_cursor(client: httpx.AsyncClient, conn: Conn) -> None:
    grants = [await acquire(client, job_type=f"job-{n:02d}") for n in range(7)]
    expire(conn, grants[0]["id"])
    expire(conn, grants[1]["id"])
    for grant in grants[2:4]:
        await client.delete(f"/v1/locks/{grant['id']}", headers={"Lock-Token": grant["token"]})
    await acquire(client, job_type="job-00")  # reclaims grants[0]

    async def all_pages(**params: Any) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        cursor = None
        while True:
            query = {**params, "limit": 2, **({"cursor": cursor} if cursor else {})}
            response = await client.get("/v1/locks", params=query)
            assert response.status_code == 200, response.text
            page = response.json()
            assert len(page["items"]) <= 2
            items += page["items"]
            cursor = page["next_cursor"]
            if cursor is None:
                return items

    live = await all_pages()
    assert [lock["job_type"] for lock in live] == ["job-00", "job-01", "job-04", "job-05", "job-06"]
    assert all("token" not in lock for lock in live)
    assert [lock["job_type"] for lock in await all_pages(state="expired")] == ["job-01"]
    assert len(await all_pages(state="held")) == 4
    released = await all_pages(state="released")
    assert [lock["id"] for lock in released] == [grants[3]["id"], grants[2]["id"]]  # newest first
    assert [lock["id"] for lock in await all_pages(state="reclaimed")] == [grants[0]["id"]]
    assert [lock["job_type"] for lock in await all_pages(job_type="job-05")] == ["job-05"]
    assert await all_pages(organization_id="other") == []


def history_cursor(moment: str) -> str:
    raw = json.dumps({"s": "released", "k": [moment, 1]}).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


@pytest.mark.parametrize(
    "params",
    [
        {"limit": 0},
        {"limit": 501},
        {"limit": "many"},
        {"state": "alive"},
        {"cursor": "garbage!"},
        {"cursor": "eyJzIjpudWxsLCJrIjpbMSwyXX0"},  # {"s":null,"k":[1,2]}: not a key of ours
        {"cursor": base64.urlsafe_b64encode(b"[" * 1500).decode()},  # too deep to parse
        {"cursor": history_cursor("2026-11-30T02:44:41"), "state": "released"},  # no time zone
        {"cursor": history_cursor("0001-01-01T00:00:00+14:00"), "state": "released"},  # before year 1 in UTC
        {"organization_id": "no spaces"},
    ],
)
async def test_list_rejects_bad_parameters_with_422(
    client: httpx.AsyncClient, params: dict[str, Any]
) -> None:
    problem = assert_problem(await client.get("/v1/locks", params=params), 422)
    assert problem["errors"][0]["field"] == next(iter(params))


async def test_a_history_cursor_in_any_time_zone_python_reads_is_read(client: httpx.AsyncClient) -> None:
    """PostgreSQL takes offsets up to 15:59, Python up to 23:59: the cursor's time goes in UTC
    (through a pooler it is written into the statement as text)."""
    answer = await client.get(
        "/v1/locks", params={"state": "released", "cursor": history_cursor("2026-11-30T02:44:41+23:59")}
    )
    assert answer.status_code == 200, answer.text


async def test_a_cursor_only_fits_its_own_listing(client: httpx.AsyncClient) -> None:
    for n in range(3):
        await acquire(client, job_type=f"j{n}")
    cursor = (await client.get("/v1/locks", params={"limit": 1})).json()["next_cursor"]
    assert cursor
    assert (await client.get("/v1/locks", params={"limit": 1, "cursor": cursor})).status_code == 200
    other = await client.get("/v1/locks", params={"cursor": cursor, "state": "released"})
    assert_problem(other, 422)


# --- service endpoints and failures ------------------------------------------------------------


async def test_health_ready_openapi_and_docs(client: httpx.AsyncClient) -> None:
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    assert (await client.get("/readyz")).json() == {"status": "ready"}
    spec = (await client.get("/openapi.json")).json()
    assert {"/v1/locks", "/v1/locks/{lock_id}", "/v1/locks/{lock_id}/renew", "/v1/locks/current"} <= set(
        spec["paths"]
    )
    assert (await client.get("/docs")).status_code == 200


async def test_unknown_route_and_method_are_problems(client: httpx.AsyncClient) -> None:
    assert_problem(await client.get("/v2/nothing"), 404)
    assert_problem(await client.put("/v1/locks"), 405)
    # Allow names every method of the path, not only those of the first route that matched it.
    not_allowed = await client.put("/v1/locks/1")
    assert_problem(not_allowed, 405)
    assert not_allowed.headers["Allow"] == "DELETE, GET, PATCH"
    assert (await client.put("/v1/locks/current")).headers["Allow"] == "GET"


async def test_a_database_that_stops_answering_is_503_not_a_hang(db_url: str) -> None:
    proxy = TcpProxy(db_url)
    await proxy.start()
    settings = Settings(
        database_url=proxy.url(db_url),
        pool_timeout_seconds=1.0,
        statement_timeout_ms=500,
        allow_anonymous=True,
    )
    app = create_app(settings)
    async with in_process(app) as c:
        await acquire(c)
        proxy.freeze()
        try:
            for path, body in (("/v1/locks", lock_body(job_type="other")), ("/readyz", None)):
                started = time.monotonic()
                response = await (c.post(path, json=body) if body else c.get(path))
                assert time.monotonic() - started < 5, "a silent database must not make requests hang"
                assert_problem(response, 503)
        finally:
            await proxy.cut()


async def test_readyz_is_503_until_migrated(empty_db_url: str) -> None:
    app = create_app(Settings(database_url=empty_db_url, allow_anonymous=True))
    async with in_process(app) as c:
        problem = assert_problem(await c.get("/readyz"), 503)
        assert "0001_job_locks.sql" in problem["detail"]


async def test_database_unreachable_is_503_with_retry_after_quickly(db_url: str) -> None:
    proxy = TcpProxy(db_url)
    await proxy.start()
    app = create_app(Settings(database_url=proxy.url(db_url), pool_timeout_seconds=1.0, allow_anonymous=True))
    async with in_process(app) as c:
        grant = await acquire(c)
        await proxy.cut()
        for path, body in (
            ("/v1/locks", lock_body(job_type="other")),
            (f"/v1/locks/{grant['id']}", None),
            ("/readyz", None),
        ):
            started = time.monotonic()
            response = await (c.post(path, json=body) if body else c.get(path))
            assert time.monotonic() - started < 5, "a dead database must not make requests hang"
            assert_problem(response, 503)
            assert int(response.headers["retry-after"]) >= 1
        assert (await c.get("/healthz")).status_code == 200


# --- Idempotency-Key ---------------------------------------------------------------------------


async def test_a_repeated_acquire_with_its_idempotency_key_answers_the_same_grant(
    client: httpx.AsyncClient, conn: Conn
) -> None:
    stale = await acquire(client, holder="crashed")
    expire(conn, stale["id"])
    key = {"Idempotency-Key": "retry-7f3a"}
    first = await client.post("/v1/locks", json=lock_body(holder="w1"), headers=key)
    again = await client.post("/v1/locks", json=lock_body(holder="w1"), headers=key)
    assert first.status_code == again.status_code == 201
    for field in ("id", "token", "fencing_token", "acquired_at", "expires_at", "reclaimed"):
        assert again.json()[field] == first.json()[field]
    assert again.json()["reclaimed"]["lock_id"] == stale["id"]
    other_key = await client.post(
        "/v1/locks", json=lock_body(holder="w2"), headers={"Idempotency-Key": "other"}
    )
    assert_problem(other_key, 409)
    no_key = await client.post("/v1/locks", json=lock_body(holder="w3"))
    assert_problem(no_key, 409)
    grants = conn.execute("SELECT count(*) FROM helix_job_locks").fetchone()
    assert grants == (2,)


async def test_an_idempotency_key_ends_with_its_lock_and_is_scoped_to_the_key(
    client: httpx.AsyncClient, conn: Conn
) -> None:
    key = {"Idempotency-Key": "k"}
    first = (await client.post("/v1/locks", json=lock_body(), headers=key)).json()
    elsewhere = await client.post("/v1/locks", json=lock_body(organization_id="globex"), headers=key)
    assert elsewhere.status_code == 201
    assert elsewhere.json()["id"] != first["id"]
    await client.delete(f"/v1/locks/{first['id']}", headers={"Lock-Token": first["token"]})
    after_release = (await client.post("/v1/locks", json=lock_body(), headers=key)).json()
    assert after_release["id"] != first["id"]
    expire(conn, after_release["id"])
    after_expiry = (await client.post("/v1/locks", json=lock_body(), headers=key)).json()
    assert after_expiry["id"] != after_release["id"]
    assert after_expiry["reclaimed"]["lock_id"] == after_release["id"]


@pytest.mark.parametrize("value", ["", "has space", "x" * 256, "ünï"])
async def test_a_malformed_idempotency_key_is_422(client: httpx.AsyncClient, value: str) -> None:
    response = await client.post("/v1/locks", json=lock_body(), headers={b"Idempotency-Key": value.encode()})
    assert assert_problem(response, 422)["errors"][0]["field"] == "Idempotency-Key"


async def test_an_idempotency_key_replays_only_to_the_same_holder(client: httpx.AsyncClient) -> None:
    key = {"Idempotency-Key": "nightly-2026-11-30"}
    first = await client.post("/v1/locks", json=lock_body(holder="worker-A"), headers=key)
    assert first.status_code == 201
    intruder = await client.post("/v1/locks", json=lock_body(holder="worker-B"), headers=key)
    assert_problem(intruder, 409)
    assert first.json()["token"] not in intruder.text


async def test_an_app_that_stopped_can_be_collected(db_url: str) -> None:
    """Startup freezes the heap for the garbage collector; the end of the lifespan thaws it, or
    every app that a process ran one after another would live on."""
    app = create_app(ROUTE.settings(db_url, allow_anonymous=True))
    async with app.router.lifespan_context(app):
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    gone = weakref.ref(app)
    del app
    gc.collect()
    assert gone() is None
