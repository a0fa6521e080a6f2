"""The query string: every route refuses a parameter it does not declare, as a body refuses a field
its model does not have, so that a typo (`?org=acme` for `?organization_id=acme`) is a 422 naming
it, never a silently wider answer.

FastAPI reads the parameters a route declares and ignores the rest. Here, every route of the app
is a `Route`, which checks the query string's names against those its dependant declares before
FastAPI reads anything; static files declare none. The refusal is a RequestValidationError worded
as pydantic words an unknown body field, so the app's one handler of those answers both alike. A
request without a query string (the thin path's, hot.py) costs one test of its scope.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Coroutine
from typing import Any

from fastapi import params
from fastapi.dependencies.utils import get_flat_params
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from fastapi.staticfiles import StaticFiles
from starlette.datastructures import QueryParams
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Scope

Handler = Callable[[Request], Coroutine[Any, Any, Response]]


def refuse_unknown(scope: Scope, declared: Collection[str]) -> None:
    """RequestValidationError naming each query parameter of the request that is not declared."""
    if not scope["query_string"]:
        return
    received = QueryParams(scope["query_string"])
    unknown = dict.fromkeys(name for name in received if name not in declared)
    if unknown:
        raise RequestValidationError(
            [
                # As pydantic reports a body field that a model with extra="forbid" lacks.
                {
                    "type": "extra_forbidden",
                    "loc": ("query", name),
                    "msg": "Extra inputs are not permitted",
                    "input": received[name],
                }
                for name in unknown
            ]
        )


class Route(APIRoute):
    """A FastAPI route that answers 422 to a query parameter it does not declare."""

    @property
    def query_parameters(self) -> frozenset[str]:
        """The names of the query parameters it declares, as the OpenAPI document gives them."""
        return frozenset(
            field.alias
            for field in get_flat_params(self.dependant)
            if isinstance(field.field_info, params.Query)
        )

    def get_route_handler(self) -> Handler:
        handler, declared = super().get_route_handler(), self.query_parameters

        async def checked(request: Request) -> Response:
            refuse_unknown(request.scope, declared)
            return await handler(request)

        return checked


class Files(StaticFiles):
    """Static files, which take no query parameter; a 405 names the methods they answer."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        if scope["method"] not in ("GET", "HEAD"):
            raise HTTPException(status_code=405, headers={"Allow": "GET, HEAD"})
        refuse_unknown(scope, ())
        return await super().get_response(path, scope)
