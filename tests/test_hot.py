"""The thin path of acquire, release and renew (helix_locks.hot) answers as FastAPI's routes do.

Every request here is sent twice: as it is, which the thin path answers, and with a query string
that nothing reads, which sends it to FastAPI's route. The two answers must agree in status,
problem type, headers and body shape. That the thin path really answered is checked too, from the
route it leaves in the request's scope.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from asgi_lifespan import LifespanManager

from helix_locks import hot
from helix_locks.app import create_app
from tests.support import ROUTE

pytestmark = pytest.mark.anyio
BODY = {"organization_id": "acme", "job_type": "report", "holder": "w1", "ttl_seconds": 30}
# Fields whose values differ between two grants; their presence and type must still agree.
VARYING = {"id", "token", "fencing_token", "acquired_at", "expires_at", "ttl_remaining_ms", "released_at"}


@pytest.fixture
async def routes(db_url: str) -> AsyncIterator[tuple[httpx.AsyncClient, list[object]]]:
    """A client of the app, and the route each request's scope named when it was answered."""
    app = create_app(ROUTE.settings(db_url, allow_anonymous=True))
    seen: list[object] = []

    async with LifespanManager(app) as manager:

        async def recording(scope: Any, receive: Any, send: Any) -> None:
            await manager.app(scope, receive, send)
            if scope["type"] == "http":
                seen.append(scope.get("route"))

        transport = httpx.ASGITransport(app=recording)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            yield client, seen


def shape(response: httpx.Response) -> dict[str, Any]:
    """What must agree: status, the headers a client reads, and the body without its varying values."""
    body: Any = None
    if response.content:
        body = json.loads(response.content)
        if isinstance(body, dict):
            body = {k: (type(v).__name__ if k in VARYING else v) for k, v in body.items() if k != "instance"}
            for name in ("lock_id",):
                body.pop(name, None)
    headers = {
        name: response.headers.get(name)
        for name in ("content-type", "retry-after", "www-authenticate", "allow")
        if name in response.headers
    }
    if "location" in response.headers:
        headers["location"] = "/v1/locks/" if response.headers["location"].startswith("/v1/locks/") else "?"
    return {"status": response.status_code, "headers": headers, "body": body}


async def both(
    client: httpx.AsyncClient, seen: list[object], method: str, path: str, **kwargs: Any
) -> tuple[httpx.Response, httpx.Response, object]:
    """The request by the thin path (asserted to have been taken), then by FastAPI's route."""
    thin = await client.request(method, path, **kwargs)
    taken = seen[-1]
    slow = await client.request(method, f"{path}?by=fastapi", **kwargs)
    assert not isinstance(seen[-1], hot.Route), "the query string sends a request to FastAPI"
    return thin, slow, taken


async def test_an_acquire_answers_alike_on_both_paths(routes: tuple[httpx.AsyncClient, list[object]]) -> None:
    client, seen = routes
    thin, slow, taken = await both(client, seen, "POST", "/v1/locks", json=BODY)
    assert taken is hot.ACQUIRE
    assert thin.status_code == 201 and slow.status_code == 409
    # The conflict, by both paths; then each path's grant of a free key.
    conflict, conflict_slow, _ = await both(client, seen, "POST", "/v1/locks", json=BODY)
    assert shape(conflict) == shape(conflict_slow) and conflict.status_code == 409
    other = {**BODY, "job_type": "other"}
    granted = await client.post("/v1/locks", json=other)
    granted_slow = await client.post("/v1/locks?by=fastapi", json={**other, "job_type": "third"})
    assert granted.status_code == granted_slow.status_code == 201
    assert shape(granted)["headers"] == shape(granted_slow)["headers"]
    assert set(granted.json()) == set(granted_slow.json())


@pytest.mark.parametrize(
    ("content", "headers", "status"),
    [
        (b'{"organization_id": "acme"}', {}, 422),  # invalid: FastAPI's answer, by both
        (json.dumps({**BODY, "ttl_seconds": -1}).encode(), {}, 422),
        (json.dumps(BODY).encode(), {"content-type": "text/plain"}, 415),
        (json.dumps(BODY).encode(), {"content-type": "application/json; charset=utf-8"}, 409),
        (json.dumps(BODY).encode(), {"idempotency-key": "with space"}, 422),  # against its pattern
        (json.dumps({**BODY, "job_type": "k2"}).encode(), {"idempotency-key": "retry-1"}, 201),  # replayed
        (json.dumps({**BODY, "job_type": "k3"}).encode(), {"authorization": "Bearer nope"}, 401),
        (json.dumps({**BODY, "wait_seconds": 0.2}).encode(), {}, 409),  # waits on FastAPI's path
        # 8,127 bytes as sent, 360,767 as stored (1e308 is stored as 309 digits): over 8 KiB.
        (json.dumps({**BODY, "job_type": "k4", "metadata": {"a": [1e308] * 1160}}).encode(), {}, 422),
        (b"[" * 5000, {}, 422),
        (b"\xff\xfe", {}, 422),
        (b"", {}, 422),
    ],
)
async def test_every_odd_acquire_answers_alike(
    routes: tuple[httpx.AsyncClient, list[object]], content: bytes, headers: dict[str, str], status: int
) -> None:
    client, seen = routes
    await client.post("/v1/locks", json=BODY)  # holds the key of the valid bodies
    headers = {"content-type": "application/json", **headers}
    thin, slow, _ = await both(client, seen, "POST", "/v1/locks", content=content, headers=headers)
    assert thin.status_code == status
    assert shape(thin) == shape(slow)


async def test_release_and_renew_answer_alike(routes: tuple[httpx.AsyncClient, list[object]]) -> None:
    client, seen = routes
    first = (await client.post("/v1/locks", json=BODY)).json()
    second = (await client.post("/v1/locks", json={**BODY, "job_type": "second"})).json()
    wrong = {"Lock-Token": "x"}
    cases: list[tuple[str, str, dict[str, Any]]] = [
        ("DELETE", f"/v1/locks/{first['id']}", {"headers": {"Lock-Token": "wrong"}}),  # 403
        ("DELETE", f"/v1/locks/{first['id']}", {}),  # no token: 422
        ("DELETE", "/v1/locks/99999999", {"headers": {"Lock-Token": "x"}}),  # 404
        ("DELETE", "/v1/locks/current", {"headers": {"Lock-Token": "x"}}),
        ("DELETE", "/v1/locks/-1", {"headers": {"Lock-Token": "x"}}),
        ("POST", f"/v1/locks/{first['id']}/renew", {"json": {"ttl_seconds": 0}}),  # no token, bad body
        ("POST", f"/v1/locks/{first['id']}/renew", {"json": {"ttl_seconds": 5}, "headers": wrong}),
        ("POST", "/v1/locks/abc/renew", {"json": {"ttl_seconds": 5}, "headers": wrong}),
        ("POST", f"/v1/locks/{first['id']}/renew", {"content": b"{", "headers": {"Lock-Token": "x"}}),
    ]
    for method, path, kwargs in cases:
        thin, slow, _ = await both(client, seen, method, path, **kwargs)
        assert shape(thin) == shape(slow), (method, path, kwargs)
    token = {"Lock-Token": first["token"]}
    renewed = await client.post(f"/v1/locks/{first['id']}/renew", json={"ttl_seconds": 60}, headers=token)
    assert seen[-1] is hot.RENEW
    second_token = {"Lock-Token": second["token"]}
    renewed_slow = await client.post(
        f"/v1/locks/{second['id']}/renew?by=fastapi", json={"ttl_seconds": 60}, headers=second_token
    )
    assert renewed.status_code == renewed_slow.status_code == 200
    assert set(renewed.json()) == set(renewed_slow.json()) and renewed.json()["lapsed"] is False
    released = await client.delete(f"/v1/locks/{first['id']}", headers=token)
    assert seen[-1] is hot.RELEASE
    released_slow = await client.delete(f"/v1/locks/{second['id']}?by=fastapi", headers=second_token)
    assert released.status_code == released_slow.status_code == 204
    again, again_slow, _ = await both(client, seen, "DELETE", f"/v1/locks/{first['id']}", headers=token)
    assert again.status_code == 410 and shape(again) == shape(again_slow)


def test_the_thin_path_reads_every_parameter_the_routes_declare(db_url: str) -> None:
    """A parameter added to acquire, release or renew must be read by hot.py too."""
    document = create_app(ROUTE.settings(db_url)).openapi()
    operations = {op["operationId"]: op for path in document["paths"].values() for op in path.values()}
    for operation_id, (parameters, body) in hot.PARAMETERS.items():
        operation = operations[operation_id]
        assert {f"{p['in']} {p['name']}" for p in operation.get("parameters", [])} == parameters, operation_id
        schema = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
        expected = None if body is None else {"$ref": f"#/components/schemas/{body.__name__}"}
        assert schema == expected, operation_id
