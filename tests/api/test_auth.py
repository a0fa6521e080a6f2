"""API keys and tenancy: every endpoint against every kind of caller, protected mode, revocation."""

from __future__ import annotations

import asyncio
import hashlib
import re
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import psycopg
import pytest

from helix_locks.server import keys
from helix_locks.server.app import create_app
from helix_locks.server.settings import Settings
from tests.support import in_process

pytestmark = pytest.mark.anyio
# Every test of `client` runs on the thin path of acquire, release and renew and on FastAPI's
# routes (conftest.py): the two must answer alike.
BOTH_PATHS = True
KEY_PATTERN = re.compile(r"^hlk_[0-9a-f]{12}_[A-Za-z0-9_-]{43}$")


@dataclass
class Keys:
    own: str  # acme's
    other: str  # globex's
    admin: str
    revoked: str
    unknown: str


@pytest.fixture
def api_keys(db_url: str) -> Keys:
    revoked = keys.create(db_url, "acme")
    keys.revoke(db_url, keys.key_id(revoked) or "")
    unknown = f"hlk_{secrets.token_hex(6)}_{secrets.token_urlsafe(32)}"
    return Keys(
        keys.create(db_url, "acme"),
        keys.create(db_url, "globex"),
        keys.create(db_url, None),
        revoked,
        unknown,
    )


@pytest.fixture
async def app_client(db_url: str, api_keys: Keys) -> AsyncIterator[httpx.AsyncClient]:
    # allow_anonymous as on loopback: keys exist, so anonymous requests must still be refused.
    app = create_app(Settings(database_url=db_url, allow_anonymous=True))
    async with in_process(app) as http:
        yield http


def bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def held_lock(client: httpx.AsyncClient, admin: str, job_type: str) -> dict[str, Any]:
    body = {"organization_id": "acme", "job_type": job_type, "holder": "w", "ttl_seconds": 60}
    response = await client.post("/v1/locks", json=body, headers=bearer(admin))
    assert response.status_code == 201, response.text
    grant: dict[str, Any] = response.json()
    return grant


CALLERS = ["none", "unknown", "revoked", "own", "other", "admin"]
# Expected status per endpoint and caller; a lock of organization acme, "own" is acme's key.
MATRIX: dict[str, list[int]] = {
    "acquire": [401, 401, 401, 201, 403, 201],
    "list": [401, 401, 401, 200, 200, 200],
    "current": [401, 401, 401, 200, 404, 200],
    "get": [401, 401, 401, 200, 404, 200],
    "renew": [401, 401, 401, 200, 404, 200],
    "update": [401, 401, 401, 200, 404, 200],
    "release": [401, 401, 401, 204, 404, 204],
    "force": [401, 401, 401, 403, 403, 204],
    # Any key of the lock's organization may ask its holder to let go; another's finds no lock.
    "revocation": [401, 401, 401, 202, 404, 202],
}


async def call(
    client: httpx.AsyncClient, endpoint: str, lock: dict[str, Any], headers: dict[str, str]
) -> httpx.Response:
    url = f"/v1/locks/{lock['id']}"
    with_token = {**headers, "Lock-Token": lock["token"]}
    if endpoint == "acquire":
        body = {
            "organization_id": "acme",
            "job_type": f"{lock['job_type']}-new",
            "holder": "w",
            "ttl_seconds": 5,
        }
        return await client.post("/v1/locks", json=body, headers=headers)
    if endpoint == "list":
        return await client.get("/v1/locks", headers=headers)
    if endpoint == "current":
        params = {"organization_id": "acme", "job_type": lock["job_type"]}
        return await client.get("/v1/locks/current", params=params, headers=headers)
    if endpoint == "get":
        return await client.get(url, headers=headers)
    if endpoint == "renew":
        return await client.post(f"{url}/renew", json={"ttl_seconds": 30}, headers=with_token)
    if endpoint == "update":
        return await client.patch(url, json={"metadata": {"done": 1}}, headers=with_token)
    if endpoint == "release":
        return await client.delete(url, headers=with_token)
    if endpoint == "revocation":
        return await client.post(f"{url}/revocation", json={"reason": "deploy"}, headers=headers)
    return await client.delete(url, params={"force": "true"}, headers=headers)


@pytest.mark.parametrize("endpoint", MATRIX)
@pytest.mark.parametrize("caller", CALLERS)
async def test_every_endpoint_for_every_caller(
    app_client: httpx.AsyncClient, api_keys: Keys, endpoint: str, caller: str
) -> None:
    lock = await held_lock(app_client, api_keys.admin, f"job-{endpoint}")
    key = None if caller == "none" else getattr(api_keys, caller)
    response = await call(app_client, endpoint, lock, bearer(key))
    expected = MATRIX[endpoint][CALLERS.index(caller)]
    assert response.status_code == expected, response.text
    if expected == 401:
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.headers["content-type"] == "application/problem+json"
    if endpoint == "list" and expected == 200:
        visible = lock["id"] in [item["id"] for item in response.json()["items"]]
        assert visible == (caller != "other"), "another organization's locks are absent from lists"
    if endpoint == "revocation" and expected == 202:
        by = response.json()["revocation"]["by"]
        assert by == keys.key_id(key or ""), "the request names the key that made it"
    for secret in (api_keys.own, api_keys.other, api_keys.admin, api_keys.revoked, lock["token"]):
        assert secret not in response.text


async def test_an_org_key_cannot_list_another_org_even_by_asking(
    app_client: httpx.AsyncClient, api_keys: Keys
) -> None:
    await held_lock(app_client, api_keys.admin, "visible-to-acme-only")
    response = await app_client.get(
        "/v1/locks", params={"organization_id": "acme"}, headers=bearer(api_keys.other)
    )
    assert response.status_code == 200
    assert response.json() == {"items": [], "next_cursor": None}


@pytest.mark.parametrize("header", ["Basic dXNlcjpwYXNz", "Bearer", "Bearer not-a-key", "hlk_x"])
async def test_malformed_authorization_is_401(app_client: httpx.AsyncClient, header: str) -> None:
    response = await app_client.get("/v1/locks", headers={"Authorization": header})
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"


async def test_force_release_is_recorded_and_the_holder_learns_it(
    app_client: httpx.AsyncClient, api_keys: Keys, conn: psycopg.Connection[Any]
) -> None:
    lock = await held_lock(app_client, api_keys.own, "stuck-job")
    forced = await app_client.delete(
        f"/v1/locks/{lock['id']}", params={"force": "true"}, headers=bearer(api_keys.admin)
    )
    assert forced.status_code == 204
    admin_id = keys.key_id(api_keys.admin)
    row = conn.execute(
        "SELECT release_reason, forced_by FROM helix_job_locks WHERE id = %s", (lock["id"],)
    ).fetchone()
    assert row == ("forced", admin_id)
    # The lock object says who forced it, to every key that may see the lock.
    for key in (api_keys.own, api_keys.admin):
        got = await app_client.get(f"/v1/locks/{lock['id']}", headers=bearer(key))
        assert got.json()["forced_by"] == admin_id, got.json()
        params = {"organization_id": "acme", "job_type": "stuck-job", "state": "released"}
        listed = await app_client.get("/v1/locks", params=params, headers=bearer(key))
        assert [item["forced_by"] for item in listed.json()["items"]] == [admin_id], listed.json()
    assert lock["forced_by"] is None, "an acquire's answer: not forced"
    headers = {**bearer(api_keys.own), "Lock-Token": lock["token"]}
    gone = await app_client.delete(f"/v1/locks/{lock['id']}", headers=headers)
    assert gone.status_code == 410
    assert gone.json()["release_reason"] == "forced"
    assert gone.json()["forced_by"] == admin_id
    assert "administrator" in gone.json()["detail"]
    again = await app_client.delete(
        f"/v1/locks/{lock['id']}", params={"force": "true"}, headers=bearer(api_keys.admin)
    )
    assert again.status_code == 410


async def test_keys_are_stored_only_as_hashes(db_url: str, conn: psycopg.Connection[Any]) -> None:
    key = keys.create(db_url, "acme")
    assert KEY_PATTERN.match(key)
    rows = conn.execute("SELECT t::text, key_hash FROM helix_api_keys AS t").fetchall()
    assert len(rows) == 1
    text, key_hash = rows[0]
    secret = key.rsplit("_", 1)[1]
    assert secret not in text
    assert key_hash == hashlib.sha256(key.encode()).digest()


async def test_last_use_is_recorded(db_url: str, api_keys: Keys, conn: psycopg.Connection[Any]) -> None:
    app = create_app(Settings(database_url=db_url))
    async with in_process(app) as http:
        assert (await http.get("/v1/locks", headers=bearer(api_keys.own))).status_code == 200
    # Flushed at the latest when the process stops.
    used = conn.execute("SELECT id FROM helix_api_keys WHERE last_used_at IS NOT NULL").fetchall()
    assert used == [(keys.key_id(api_keys.own),)]


async def test_anonymous_is_served_only_while_allowed_and_no_key_exists(db_url: str) -> None:
    body = {"organization_id": "acme", "job_type": "j", "holder": "w", "ttl_seconds": 5}
    for allowed in (False, True):
        app = create_app(Settings(database_url=db_url, allow_anonymous=allowed))
        async with in_process(app) as c:
            response = await c.get("/v1/locks")
            assert response.status_code == (200 if allowed else 401)
            if allowed:
                assert (await c.post("/v1/locks", json=body)).status_code == 201
                keys.create(db_url, "acme")  # the first key ends anonymous access, at once
                assert await eventually_status(c, "/v1/locks", {}, 401)


async def eventually_status(
    client: httpx.AsyncClient, path: str, headers: dict[str, str], status: int
) -> bool:
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        if (await client.get(path, headers=headers)).status_code == status:
            return True
        await anyio.sleep(0.02)
    return False


async def test_an_idempotency_key_replays_only_to_the_same_api_key(db_url: str, api_keys: Keys) -> None:
    second_acme = keys.create(db_url, "acme")
    app = create_app(Settings(database_url=db_url))
    async with in_process(app) as c:
        body = {"organization_id": "acme", "job_type": "idem", "holder": "w", "ttl_seconds": 30}
        first = await c.post("/v1/locks", json=body, headers={**bearer(api_keys.own), "Idempotency-Key": "k"})
        assert first.status_code == 201
        other = await c.post("/v1/locks", json=body, headers={**bearer(second_acme), "Idempotency-Key": "k"})
        assert other.status_code == 409
        again = await c.post("/v1/locks", json=body, headers={**bearer(api_keys.own), "Idempotency-Key": "k"})
        assert again.json()["token"] == first.json()["token"]


async def until_answered(client: httpx.AsyncClient, key: str, status: int) -> None:
    """Until a listing with the key is answered `status`: the service hears of a key's creation
    (200) or revocation (401) by NOTIFY, which a loaded machine took over 2 s to deliver."""
    deadline = time.monotonic() + 30
    while (answer := await client.get("/v1/locks", headers=bearer(key))).status_code != status:
        assert time.monotonic() < deadline, f"still {answer.status_code}, not {status}, after 30 s"
        await anyio.sleep(0.02)


async def test_a_key_revoked_while_its_acquire_waits_gets_no_grant(
    app_client: httpx.AsyncClient, api_keys: Keys, db_url: str
) -> None:
    """The key is checked again before each attempt of a waiting acquire: revoked meanwhile, the
    waiter is refused (401) when the lock comes free, not granted it."""
    body = {"organization_id": "acme", "job_type": "report", "holder": "h", "ttl_seconds": 30}
    held = await app_client.post("/v1/locks", json=body, headers=bearer(api_keys.own))
    assert held.status_code == 201
    waiting_key = keys.create(db_url, "acme")
    await until_answered(app_client, waiting_key, 200)
    waiter = asyncio.create_task(
        app_client.post(
            "/v1/locks", json={**body, "holder": "w", "wait_seconds": 10}, headers=bearer(waiting_key)
        )
    )
    with psycopg.connect(db_url) as conn:
        deadline = time.monotonic() + 30
        while conn.execute("SELECT count(*) FROM helix_lock_waiters").fetchone() != (1,):
            assert not waiter.done(), (await waiter).text
            assert time.monotonic() < deadline, "the acquire never took its place"
            await anyio.sleep(0.02)
    assert not waiter.done(), (await waiter).text
    keys.revoke(db_url, keys.key_id(waiting_key) or "")
    await until_answered(app_client, waiting_key, 401)  # the service has heard of it (NOTIFY)
    gone = await app_client.delete(
        f"/v1/locks/{held.json()['id']}", headers={**bearer(api_keys.own), "Lock-Token": held.json()["token"]}
    )
    assert gone.status_code == 204
    answer = await waiter
    assert answer.status_code == 401, answer.text
    free = await app_client.post("/v1/locks", json=body, headers=bearer(api_keys.own))
    assert free.status_code == 201, "nobody holds the lock for the revoked key"


async def test_a_key_cannot_queue_in_another_organizations_wait(db_url: str, api_keys: Keys) -> None:
    """Refused before it waits: not in line behind the other organization's waiter, and in none
    of that organization's waiting slots (two here)."""
    app = create_app(Settings(database_url=db_url, max_waiters_per_organization=2))
    async with in_process(app, timeout=60) as client:

        async def acquire(key: str, job_type: str, wait: float = 0) -> httpx.Response:
            body = {"organization_id": "globex", "job_type": job_type, "holder": "w", "ttl_seconds": 60}
            return await client.post("/v1/locks", json={**body, "wait_seconds": wait}, headers=bearer(key))

        for job_type in ("busy", "also-busy"):
            assert (await acquire(api_keys.other, job_type)).status_code == 201
        waiters = [asyncio.create_task(acquire(api_keys.other, "busy", wait=30))]
        await anyio.sleep(0.3)
        started = time.monotonic()
        refused = await acquire(api_keys.own, "busy", wait=20)
        assert refused.status_code == 403, refused.text
        assert refused.json()["type"].endswith(":forbidden")
        assert time.monotonic() - started < 10, "it waited in line before it was refused"
        # globex's second waiting slot is still free for globex's own waiter.
        waiters.append(asyncio.create_task(acquire(api_keys.other, "also-busy", wait=30)))
        await anyio.sleep(0.5)
        assert not any(waiter.done() for waiter in waiters), [w.result().text for w in waiters if w.done()]
        for waiter in waiters:
            waiter.cancel()


async def test_a_key_served_before_is_refused_once_revoked(
    app_client: httpx.AsyncClient, api_keys: Keys, db_url: str
) -> None:
    """A key that was served (and so is remembered as checked) is refused as soon as its service
    hears of the revocation; another organization's key goes on being served."""
    key = keys.create(db_url, "acme")
    body = {"organization_id": "acme", "job_type": "cached", "holder": "h", "ttl_seconds": 30}
    await until_answered(app_client, key, 200)

    async def cycle() -> int:
        """Acquire with the key (released at once, by the admin key, when granted); its status."""
        granted = await app_client.post("/v1/locks", json=body, headers=bearer(key))
        if granted.status_code == 201:
            token = {**bearer(api_keys.admin), "Lock-Token": granted.json()["token"]}
            released = await app_client.delete(f"/v1/locks/{granted.json()['id']}", headers=token)
            assert released.status_code == 204
        return granted.status_code

    assert [await cycle() for _ in range(3)] == [201, 201, 201]
    keys.revoke(db_url, keys.key_id(key) or "")
    statuses = [await cycle()]
    deadline = time.monotonic() + 30  # the service hears of the revocation by NOTIFY
    while statuses[-1] != 401 and time.monotonic() < deadline:
        await anyio.sleep(0.02)
        statuses.append(await cycle())
    assert statuses[-1] == 401, statuses
    for _ in range(3):
        assert (await app_client.post("/v1/locks", json=body, headers=bearer(key))).status_code == 401
    other = {**body, "organization_id": "globex"}
    assert (await app_client.post("/v1/locks", json=other, headers=bearer(api_keys.other))).status_code == 201
