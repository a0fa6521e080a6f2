"""The thin path of acquire, release and renew (helix_locks.server.hot) answers as FastAPI's routes do.

Every request here is sent twice, on one database: to the app, whose thin path answers it, and to
the same app built without the thin path (HotRoutes taken out of its middleware), where FastAPI's
route answers it. The two answers must agree in status, problem type, headers and body shape. That
the thin path really answered is checked too, from the route it leaves in the request's scope.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from asgi_lifespan import LifespanManager

from helix_locks.server import hot
from helix_locks.server.app import create_app
from tests.support import ROUTE, without_thin_path

pytestmark = pytest.mark.anyio
BODY = {"organization_id": "acme", "job_type": "report", "holder": "w1", "ttl_seconds": 30}
# Fields whose values differ between two grants; their presence and type must still agree.
VARYING = {"id", "token", "fencing_token", "acquired_at", "expires_at", "ttl_remaining_ms", "released_at"}


@dataclass
class Routes:
    """A client of the app (thin path on) and one of the app without it, and the route each
    request's scope named when it was answered, on either."""

    thin: httpx.AsyncClient
    fastapi: httpx.AsyncClient
    seen: list[object]


@pytest.fixture
async def routes(db_url: str) -> AsyncIterator[Routes]:
    settings = ROUTE.settings(db_url, allow_anonymous=True)
    app, without = create_app(settings), without_thin_path(create_app(settings))
    seen: list[object] = []

    async with LifespanManager(app) as manager, LifespanManager(without) as other:

        def recording(asgi: Any) -> Any:
            async def recorded(scope: Any, receive: Any, send: Any) -> None:
                await asgi(scope, receive, send)
                if scope["type"] == "http":
                    seen.append(scope.get("route"))

            return recorded

        def client(asgi: Any) -> httpx.AsyncClient:
            transport = httpx.ASGITransport(app=recording(asgi))
            return httpx.AsyncClient(transport=transport, base_url="http://localhost")

        async with client(manager.app) as thin, client(other.app) as slow:
            yield Routes(thin, slow, seen)


def shape(response: httpx.Response) -> dict[str, Any]:
    """What must agree: status, the headers a client reads, and the body without its varying values."""
    body: Any = None
    if response.content:
        body = json.loads(response.content)
        if isinstance(body, dict):
            body = {k: (type(v).__name__ if k in VARYING else v) for k, v in body.items() if k != "instance"}
            for name in ("lock_id",):
                body.pop(name, None)
    headers: dict[str, Any] = {
        name: response.headers.get(name)
        for name in ("content-type", "retry-after", "www-authenticate", "allow")
        if name in response.headers
    }
    if "retry-after" in headers:  # whole seconds counted down: both paths' answers may straddle one
        headers["retry-after"] = "an integer" if headers["retry-after"].isdigit() else headers["retry-after"]
    if "location" in response.headers:
        headers["location"] = "/v1/locks/" if response.headers["location"].startswith("/v1/locks/") else "?"
    return {"status": response.status_code, "headers": headers, "body": body}


async def both(
    routes: Routes, method: str, path: str, **kwargs: Any
) -> tuple[httpx.Response, httpx.Response, object]:
    """The request by the thin path (asserted to have been taken), then by FastAPI's route."""
    thin = await routes.thin.request(method, path, **kwargs)
    taken = routes.seen[-1]
    slow = await routes.fastapi.request(method, path, **kwargs)
    assert not isinstance(routes.seen[-1], hot.Route), "the app without the thin path"
    return thin, slow, taken


async def test_an_acquire_answers_alike_on_both_paths(routes: Routes) -> None:
    thin, slow, taken = await both(routes, "POST", "/v1/locks", json=BODY)
    assert taken is hot.ACQUIRE
    assert thin.status_code == 201 and slow.status_code == 409
    # The conflict, by both paths; then each path's grant of a free key.
    conflict, conflict_slow, _ = await both(routes, "POST", "/v1/locks", json=BODY)
    assert shape(conflict) == shape(conflict_slow) and conflict.status_code == 409
    other = {**BODY, "job_type": "other"}
    granted = await routes.thin.post("/v1/locks", json=other)
    granted_slow = await routes.fastapi.post("/v1/locks", json={**other, "job_type": "third"})
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
    routes: Routes, content: bytes, headers: dict[str, str], status: int
) -> None:
    await routes.thin.post("/v1/locks", json=BODY)  # holds the key of the valid bodies
    headers = {"content-type": "application/json", **headers}
    thin, slow, _ = await both(routes, "POST", "/v1/locks", content=content, headers=headers)
    assert thin.status_code == status
    assert shape(thin) == shape(slow)


async def test_release_and_renew_answer_alike(routes: Routes) -> None:
    client, seen = routes.thin, routes.seen
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
        thin, slow, _ = await both(routes, method, path, **kwargs)
        assert shape(thin) == shape(slow), (method, path, kwargs)
    token = {"Lock-Token": first["token"]}
    renewed = await client.post(f"/v1/locks/{first['id']}/renew", json={"ttl_seconds": 60}, headers=token)
    assert seen[-1] is hot.RENEW
    second_token = {"Lock-Token": second["token"]}
    renewed_slow = await routes.fastapi.post(
        f"/v1/locks/{second['id']}/renew", json={"ttl_seconds": 60}, headers=second_token
    )
    assert renewed.status_code == renewed_slow.status_code == 200
    assert set(renewed.json()) == set(renewed_slow.json()) and renewed.json()["lapsed"] is False
    released = await client.delete(f"/v1/locks/{first['id']}", headers=token)
    assert seen[-1] is hot.RELEASE
    released_slow = await routes.fastapi.delete(f"/v1/locks/{second['id']}", headers=second_token)
    assert released.status_code == released_slow.status_code == 204
    again, again_slow, _ = await both(routes, "DELETE", f"/v1/locks/{first['id']}", headers=token)
    assert again.status_code == 410 and shape(again) == shape(again_slow)


async def test_an_unknown_query_parameter_is_refused_alike_on_both_paths(routes: Routes) -> None:
    """The thin path hands a request with a query string to FastAPI, whose route refuses a
    parameter it does not declare, 422 naming it, before anything is granted, renewed or released."""
    lock = (await routes.thin.post("/v1/locks", json={**BODY, "job_type": "kept"})).json()
    token = {"Lock-Token": lock["token"]}
    at = f"/v1/locks/{lock['id']}"
    for method, path, name, kwargs in (
        ("POST", "/v1/locks?org=acme", "org", {"json": BODY}),
        ("POST", f"{at}/renew?ttl=5", "ttl", {"json": {"ttl_seconds": 5}, "headers": token}),
        ("DELETE", f"{at}?forse=true", "forse", {"headers": token}),
    ):
        thin, slow, taken = await both(routes, method, path, **kwargs)
        assert not isinstance(taken, hot.Route), "a query string goes to FastAPI"
        assert thin.status_code == 422 and shape(thin) == shape(slow), (method, path)
        assert thin.json()["errors"] == [{"field": name, "message": "Extra inputs are not permitted"}]
    listed = (await routes.thin.get("/v1/locks")).json()["items"]
    assert [(found["id"], found["expires_at"]) for found in listed] == [(lock["id"], lock["expires_at"])]


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
