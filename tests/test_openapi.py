"""The checked-in openapi.json, which other languages generate clients from, is the app's own."""

from __future__ import annotations

import json
import re
from typing import Any

from helix_locks import schemas
from helix_locks.openapi import PATH, document
from pydantic import BaseModel


def test_the_checked_in_document_is_the_apps() -> None:
    assert PATH.read_text(encoding="utf-8") == document(), (
        "openapi.json is out of date with the app: run `python -m helix_locks.openapi` and commit it"
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
