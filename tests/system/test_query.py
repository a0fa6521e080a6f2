"""An unknown query parameter is 422 naming it, on every route, as an unknown body field is: in
process, through the thin path's routes, and from a raw socket against a real `serve`."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute

from harness.processes import running_service
from helix_locks.server import api, query
from helix_locks.server.app import create_app
from helix_locks.server.settings import Settings
from tests.support import ROUTE, acquire, assert_problem, lock_body

UNKNOWN = [{"field": "org", "message": "Extra inputs are not permitted"}]


@pytest.mark.anyio
async def test_a_typo_in_a_listing_is_422_naming_it_not_every_organization(client: httpx.AsyncClient) -> None:
    await acquire(client, organization_id="acme")
    await acquire(client, organization_id="globex")
    typo = assert_problem(await client.get("/v1/locks?org=acme"), 422)
    field = assert_problem(await client.post("/v1/locks", json=lock_body(org="acme")), 422)
    # The same problem as an unknown body field: its type, its detail, the name in `errors`.
    said = {"type": "urn:helix-locks:problem:invalid-request", "detail": "Invalid: org.", "errors": UNKNOWN}
    for answer in (typo, field):
        assert {name: answer[name] for name in said} == said
    # Each unknown name once, in order, beside declared ones; the declared alone are served.
    several = assert_problem(await client.get("/v1/locks?organization_id=acme&org=a&org=b&zz"), 422)
    assert [error["field"] for error in several["errors"]] == ["org", "zz"]
    listed = await client.get("/v1/locks?organization_id=acme")
    assert [lock["organization_id"] for lock in listed.json()["items"]] == ["acme"]


@pytest.mark.anyio
async def test_every_route_refuses_a_query_parameter_it_does_not_declare(client: httpx.AsyncClient) -> None:
    """Every operation of the document, the console and its files, the documents: 422 naming
    `org`, before the route does anything."""
    lock = await acquire(client)
    at, token = f"/v1/locks/{lock['id']}", {"Lock-Token": lock["token"]}
    opening = {"organization_id": "acme", "holder": "w1", "ttl_seconds": 30}
    session = (await client.post("/v1/sessions", json=opening)).json()
    sat, stoken = f"/v1/sessions/{session['id']}", {"Lock-Token": session["token"]}
    key = "organization_id=acme&job_type=nightly-report"
    requests: list[tuple[str, str, dict[str, Any]]] = [
        ("POST", "/v1/locks?org=acme", {"json": lock_body(job_type="not-granted")}),
        ("GET", "/v1/locks?org=acme", {}),
        ("GET", f"/v1/locks/current?{key}&org=acme", {}),
        ("GET", f"/v1/locks/queue?{key}&org=acme", {}),
        ("GET", f"{at}?org=acme", {}),
        ("DELETE", f"{at}?org=acme", {"headers": token}),
        ("POST", f"{at}/renew?org=acme", {"headers": token, "json": {"ttl_seconds": 1}}),
        ("POST", f"{at}/revocation?org=acme", {"json": {"reason": "deploy"}}),
        ("PATCH", f"{at}?org=acme", {"headers": token, "json": {"metadata": {"changed": True}}}),
        ("GET", "/v1/events?org=acme", {}),
        ("POST", "/v1/sessions?org=acme", {"json": opening}),
        ("GET", f"{sat}?org=acme", {}),
        ("DELETE", f"{sat}?org=acme", {"headers": stoken}),
        ("POST", f"{sat}/renew?org=acme", {"headers": stoken, "json": {"ttl_seconds": 1}}),
        ("POST", f"{sat}/locks?org=acme", {"headers": stoken, "json": {"locks": [{"job_type": "x"}]}}),
        ("GET", "/healthz?org=acme", {}),
        ("GET", "/readyz?org=acme", {}),
        ("GET", "/metrics?org=acme", {}),
        ("GET", "/openapi.json?org=acme", {}),
        ("GET", "/docs?org=acme", {}),
        ("GET", "/docs/assets/swagger-ui.css?org=acme", {}),
        ("GET", "/console?org=acme", {}),
        ("HEAD", "/console?org=acme", {}),
        ("GET", "/console/assets/console.js?org=acme", {}),
    ]
    for method, path, kwargs in requests:
        answer = await client.request(method, path, **kwargs)
        assert answer.status_code == 422, (method, path, answer.status_code)
        if method != "HEAD":
            assert assert_problem(answer, 422)["errors"] == UNKNOWN, (method, path)
    document = (await client.get("/openapi.json")).json()
    bare = [path.split("?")[0] for _, path, _ in requests]
    templates = [
        "/v1/locks/{lock_id}" + path[len(at) :]
        if path.startswith(at)
        else "/v1/sessions/{session_id}" + path[len(sat) :]
        if path.startswith(sat)
        else path
        for path in bare
    ]
    sent = {(method.lower(), template) for (method, _, _), template in zip(requests, templates, strict=True)}
    assert {(method, path) for path, item in document["paths"].items() for method in item} <= sent
    # Nothing was done: no grant, no renewal, no update, no release.
    assert [found["id"] for found in (await client.get("/v1/locks")).json()["items"]] == [lock["id"]]
    now = (await client.get(at)).json()
    assert (now["state"], now["metadata"], now["expires_at"]) == ("held", None, lock["expires_at"])
    assert now["revocation"] is None, "nobody was asked to let go"
    kept = (await client.get(sat)).json()
    assert (kept["state"], kept["expires_at"], kept["locks"]) == ("held", session["expires_at"], [])
    assert (await client.get("/v1/locks", params={"job_type": "x"})).json()["items"] == []


def test_each_route_declares_the_query_parameters_the_document_names() -> None:
    """What a route accepts is what openapi.json tells clients they may send, no more."""
    app = create_app(Settings(database_url="postgresql://unused"))
    document = app.openapi()
    routes = [*api.router.routes, *api.health.routes, *app.router.routes]
    checked = 0
    for route in routes:
        if not isinstance(route, APIRoute):
            continue
        assert isinstance(route, query.Route), route.path
        for method in route.methods or ():
            operation = document["paths"].get(route.path, {}).get(method.lower(), {})
            named = {p["name"] for p in operation.get("parameters", []) if p["in"] == "query"}
            assert route.query_parameters == named, (method, route.path)
            checked += 1
    assert checked >= 14


def test_a_raw_request_with_an_unknown_query_parameter_is_422_from_a_real_server(
    db_url: str, tmp_path: Path
) -> None:
    with running_service(env=ROUTE.env(db_url), log=tmp_path / "s.log") as (url, _):
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /v1/locks?org=acme HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 422 "), head
    assert b"content-type: application/problem+json" in head.lower()
    assert b'"errors":[{"field":"org","message":"Extra inputs are not permitted"}]' in body
