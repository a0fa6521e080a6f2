"""The operator's console: one page and its files, served from the package under a strict policy.

The page is static: its script asks the API for everything it shows, with the operator's key,
so /console itself needs no key (like /docs) and holds no data.
"""

from __future__ import annotations

import os
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import RedirectResponse, Response
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from helix_locks.server import query

ASSETS = Path(__file__).with_name("console")

# No inline script or style anywhere: the page's code and looks come from its own files only.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
MEDIA_TYPE = "text/html; charset=utf-8"
HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # The page is small and changes with the service: never serve an old one from a cache.
    "Cache-Control": "no-cache",
}


# A browser runs an ES module only when it comes as JavaScript: the types of the console's files
# are set here, not left to the host's mimetypes table (which on some hosts says text/plain).
ASSET_MEDIA_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}


class _Assets(query.Files):
    """The console's files. A path with a trailing slash names a folder, never a file."""

    def get_path(self, scope: Scope) -> str:
        if scope["path"].endswith("/"):
            raise HTTPException(status_code=404)
        return super().get_path(scope)

    def file_response(
        self,
        full_path: str | os.PathLike[str],
        stat_result: os.stat_result,
        scope: Scope,
        status_code: int = 200,
    ) -> Response:
        response = super().file_response(full_path, stat_result, scope, status_code)
        media_type = ASSET_MEDIA_TYPES.get(Path(full_path).suffix)
        if media_type and "content-type" in response.headers:
            response.headers["content-type"] = media_type
        return response


class _ConsoleHeaders:
    """Puts the page's headers on every answer under /console, whatever made it: the page, a
    file, a 404, a 405 or a redirect."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path != "/console" and not path.startswith("/console/"):
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in HEADERS.items():
                    headers[name] = value
            await send(message)

        await self.app(scope, receive, send_with_headers)


def mount(app: FastAPI) -> None:
    """Serve the console at /console and its files under /console/assets, and lead the service's
    root there, all outside the API's document."""
    page = (ASSETS / "index.html").read_bytes()
    app.mount("/console/assets", _Assets(directory=ASSETS), name="console-assets")
    app.add_middleware(_ConsoleHeaders)

    @app.api_route("/console", methods=["GET", "HEAD"], include_in_schema=False)
    async def console(request: Request) -> Response:
        """The page; to HEAD, the same answer without its body (its Content-Length included)."""
        if request.method == "HEAD":
            return Response(headers={"Content-Length": str(len(page))}, media_type=MEDIA_TYPE)
        return Response(page, media_type=MEDIA_TYPE)

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def root() -> RedirectResponse:
        """Whoever opens the service's address in a browser finds the console, not a 404; 307
        keeps the method, so a HEAD stays one."""
        return RedirectResponse("/console", status_code=307)
