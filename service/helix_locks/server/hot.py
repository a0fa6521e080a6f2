"""The thin path of the requests a worker sends most: acquire (without waiting), release and renew.

FastAPI's routing and parameter solving cost more CPU than the rest of such a request (issue 19,
docs/performance.md). Here, a request of one of these routes has its parameters read exactly as
FastAPI reads them for that route, and then the very route function of api.py answers it: the
same code, the same models, the same answers. What this path does not read with certainty (a
body that does not validate, another content type, a query string, a waiting acquire, a root
path...) goes on to FastAPI unchanged, which answers it as it always has. The OpenAPI document
still comes from the routes in api.py; the schemathesis run and every route's tests go through
here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from helix_locks.server import api
from helix_locks.server.errors import LockError
from helix_locks.server.schemas import AcquireRequest, RenewRequest

LOCKS = "/v1/locks"
# api.acquire's Idempotency-Key header, as its Header(pattern=...) reads it (fullmatch: pydantic's
# $ is the end of the text, Python's also matches before a final newline).
_IDEMPOTENCY_KEY = re.compile(api.IDEMPOTENCY_KEY_PATTERN)
# A path parameter as Starlette reads one: anything but a slash, at least one character.
_LOCK_ID = re.compile(r"[^/]+")


@dataclass(frozen=True)
class Route:
    """What the request's scope says of its route (Observe reads the path for its metrics)."""

    path: str


# What each route takes, all read here: a query string (force, on release) goes to FastAPI.
# tests/api/test_hot.py holds these to the OpenAPI document, so that a parameter added to one of these
# routes cannot go unread here.
PARAMETERS = {
    "acquireLock": ({"header Idempotency-Key"}, AcquireRequest),
    "releaseLock": ({"path lock_id", "header Lock-Token", "query force"}, None),
    "renewLock": ({"path lock_id", "header Lock-Token"}, RenewRequest),
}
ACQUIRE, RELEASE, RENEW = Route(LOCKS), Route(f"{LOCKS}/{{lock_id}}"), Route(f"{LOCKS}/{{lock_id}}/renew")
Answer = Callable[[Request, bytes, Headers], Awaitable[Response | None]]


def _json(body: bytes, headers: Headers) -> Any:
    """The body as FastAPI reads it for a JSON body parameter; None where FastAPI would answer
    anything but a validated body (no body, not JSON, another content type)."""
    content_type = headers.get("content-type")
    if not body or (content_type and content_type.split(";")[0].strip().lower() != "application/json"):
        return None
    try:
        return json.loads(body)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, nested too deep: FastAPI says which
        return None


async def _acquire(request: Request, body: bytes, headers: Headers) -> Response | None:
    try:
        parsed = AcquireRequest.model_validate(_json(body, headers))
    except ValidationError:
        return None
    if parsed.wait_seconds > 0:
        return None  # a waiting acquire watches for the client's leaving: FastAPI's path
    idempotency_key = headers.get("idempotency-key")
    if idempotency_key is not None and not _IDEMPOTENCY_KEY.fullmatch(idempotency_key):
        return None
    return await api.acquire(parsed, request, idempotency_key)


async def _release(request: Request, body: bytes, headers: Headers) -> Response:
    return await api.release(request, request.scope["path"][len(LOCKS) + 1 :], headers.get("lock-token"))


async def _renew(request: Request, body: bytes, headers: Headers) -> Response | None:
    token = headers.get("lock-token")
    try:
        parsed = RenewRequest.model_validate(_json(body, headers))
    except ValidationError:
        return None
    if token is None:
        return None
    return await api.renew(request, request.scope["path"][len(LOCKS) + 1 : -len("/renew")], token, parsed)


def _route(scope: Scope) -> tuple[Route, Answer] | None:
    if scope["query_string"] or scope.get("root_path"):
        return None
    method, path = scope["method"], scope["path"]
    if method == "POST" and path == LOCKS:
        return ACQUIRE, _acquire
    if not path.startswith(f"{LOCKS}/"):
        return None
    rest = path[len(LOCKS) + 1 :]
    if method == "DELETE" and _LOCK_ID.fullmatch(rest):
        return RELEASE, _release
    if method == "POST" and rest.endswith("/renew") and _LOCK_ID.fullmatch(rest[: -len("/renew")]):
        return RENEW, _renew
    return None


class HotRoutes:
    """Answers the hot routes' requests itself, and passes every other request on. Sits inside
    BodyLimit, so a body reaches it whole and within bounds."""

    def __init__(self, app: ASGIApp, on_error: Callable[[Request, Exception], Awaitable[Response]]) -> None:
        self.app = app
        self.on_error = on_error  # the app's handler of domain errors

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        found = _route(scope) if scope["type"] == "http" else None
        if found is None:
            await self.app(scope, receive, send)
            return
        route, answer = found
        message = await receive()
        if message["type"] != "http.request" or message.get("more_body", False):
            # Gone, or a body in parts (BodyLimit hands over one whole): FastAPI reads it.
            await self.app(scope, replaying(message, receive), send)
            return
        body = message.get("body", b"")
        request = Request(scope, receive)
        scope["route"] = route
        try:
            response = await answer(request, body, Headers(scope=scope))
        except LockError as exc:
            response = await self.on_error(request, exc)
        if response is None:
            await self.app(scope, replaying(message, receive), send)
            return
        await response(scope, receive, send)


def replaying(first: Message, receive: Receive) -> Receive:
    """`receive` that gives `first` once, then goes on with `receive` (a body read ahead of the app)."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return first

    return replay
