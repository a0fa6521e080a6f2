"""The checked-in openapi.json, which other languages generate clients from, is the app's own."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from harness.processes import running_service
from helix_locks.server import keys, schemas
from helix_locks.server.openapi import PATH, document
from tests.support import ROUTE


def test_the_checked_in_document_is_the_apps() -> None:
    assert PATH.read_text(encoding="utf-8") == document(), (
        "openapi.json is out of date with the app: run `python -m helix_locks.server.openapi` and commit it"
    )


def test_every_schema_and_field_is_described_and_every_ref_resolves() -> None:
    spec = json.loads(document())
    components: dict[str, Any] = spec["components"]["schemas"]
    undescribed = [name for name, schema in components.items() if not schema.get("description")]
    undescribed += [
        f"{name}.{field}"
        for name, schema in components.items()
        for field, prop in schema.get("properties", {}).items()
        if not prop.get("description")
    ]
    assert undescribed == []
    refs = set(re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(spec)))
    assert refs <= set(components)


def test_every_model_example_is_a_valid_body() -> None:
    """FastAPI drops nulls from example objects (fastapi#5559), so check them as published."""
    components: dict[str, Any] = json.loads(document())["components"]["schemas"]
    checked = 0
    for name, schema in components.items():
        model = getattr(schemas, name)
        assert issubclass(model, BaseModel)
        for example in schema.get("examples", []):
            model.model_validate_json(json.dumps(example))
            checked += 1
    assert checked >= 6


def test_a_client_generated_from_the_document_acquires_conflicts_renews_and_releases(
    db_url: str, tmp_path: Path
) -> None:
    """openapi-python-client's client from openapi.json, against a real service: the operation
    names read as they should (acquire_lock, renew_lock, …), and every answer parses."""
    generator = str(Path(sys.executable).with_name("openapi-python-client"))
    subprocess.run(
        [generator, "generate", "--path", str(PATH), "--output-path", str(tmp_path / "generated")],
        check=True,
        capture_output=True,
        timeout=120,
        env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"},
    )
    sys.path.insert(0, str(tmp_path / "generated"))
    try:
        from helix_locks_client import AuthenticatedClient  # type: ignore[import-not-found]
        from helix_locks_client.api.locks import (  # type: ignore[import-not-found]
            acquire_lock,
            release_lock,
            renew_lock,
        )
        from helix_locks_client.models import AcquireRequest, RenewRequest  # type: ignore[import-not-found]

        key = keys.create(db_url, "acme")
        with (
            contextlib.ExitStack() as stack,
            running_service(env=ROUTE.env(db_url), log=tmp_path / "s.log") as (url, _),
        ):
            client = stack.enter_context(AuthenticatedClient(base_url=url, token=key))
            body = AcquireRequest(organization_id="acme", job_type="generated", holder="gen", ttl_seconds=30)
            granted = acquire_lock.sync_detailed(client=client, body=body)
            assert granted.status_code == 201, granted.content
            grant = granted.parsed
            held = acquire_lock.sync_detailed(client=client, body=body)
            assert held.status_code == 409 and held.parsed.type_ == "urn:helix-locks:problem:lock-held"
            renewed = renew_lock.sync_detailed(
                str(grant.id), client=client, body=RenewRequest(ttl_seconds=60), lock_token=grant.token
            )
            assert renewed.status_code == 200 and renewed.parsed.lapsed is False
            released = release_lock.sync_detailed(str(grant.id), client=client, lock_token=grant.token)
            assert released.status_code == 204
    finally:
        sys.path.remove(str(tmp_path / "generated"))
