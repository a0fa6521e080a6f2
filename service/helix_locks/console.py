"""The operator's console: one page and its files, served from the package under a strict policy.

The page is static: its script asks the API for everything it shows, with the operator's key,
so /console itself needs no key (like /docs) and holds no data.
"""

from __future__ import annotations

import os
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response
from fastapi.staticfiles import StaticFiles
from starlette.staticfiles import PathLike
from starlette.types import Scope

ASSETS = Path(__file__).with_name("console")

# No inline script or style anywhere: the page's code and looks come from its own files only.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # The page is small and changes with the service: never serve an old one from a cache.
    "Cache-Control": "no-cache",
}


class _Assets(StaticFiles):
    """The console's files, with the page's headers on each, so that none is read as another type."""

    def file_response(
        self, full_path: PathLike, stat_result: os.stat_result, scope: Scope, status_code: int = 200
    ) -> Response:
        response = super().file_response(full_path, stat_result, scope, status_code)
        response.headers.update(HEADERS)
        return response


def mount(app: FastAPI) -> None:
    """Serve the console at /console and its files under /console/assets, outside the API's
    document."""
    page = (ASSETS / "index.html").read_bytes()
    app.mount("/console/assets", _Assets(directory=ASSETS), name="console-assets")

    @app.get("/console", include_in_schema=False)
    async def console() -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=HEADERS)
