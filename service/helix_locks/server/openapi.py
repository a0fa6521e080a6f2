"""The app's OpenAPI document, checked in as openapi.json: `python -m helix_locks.server.openapi`
rewrites it."""

from __future__ import annotations

import json
from pathlib import Path

from helix_locks.server.app import create_app
from helix_locks.server.settings import Settings

PATH = Path(__file__).resolve().parents[3] / "openapi.json"  # at the source tree's root


def document() -> str:
    """The schema as the app serves it, as stable pretty JSON; building the app does not connect."""
    schema = create_app(Settings(database_url="postgresql://unused")).openapi()
    return json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    PATH.write_text(document(), encoding="utf-8")
    print(f"wrote {PATH}")
