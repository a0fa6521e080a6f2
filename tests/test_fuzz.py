"""Fuzzing the API with schemathesis, from the checked-in OpenAPI, against a real service with keys.

Every answer must conform to the schema (status, headers, body), no answer may be a 5xx, and
every error must be a problem+json. HELIX_FUZZ_EXAMPLES sets the examples per operation (CI: 50).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import positive_data_acceptance

from service import keys
from service.problems import MEDIA_TYPE
from tests.support import ROOT, running_service

schema = schemathesis.openapi.from_path(ROOT / "openapi.json")
EXAMPLES = int(os.environ.get("HELIX_FUZZ_EXAMPLES", "50"))


@pytest.fixture
def service(db_url: str, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """The service, its base URL and an admin key: the real configuration, keys required."""
    admin = keys.create(db_url, None)
    with running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "s.log") as (url, _):
        yield url, admin


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,  # the same examples on every run: CI must not fail by luck
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def test_every_answer_conforms_and_no_error_is_a_5xx(
    case: schemathesis.Case[Any], service: tuple[str, str]
) -> None:
    url, admin = service
    wait = case.body.get("wait_seconds") if isinstance(case.body, dict) else None
    if isinstance(case.body, dict) and isinstance(wait, int | float) and not isinstance(wait, bool):
        case.body["wait_seconds"] = min(wait, 0.2)  # fuzzed locks stay held: a long wait only waits
    response = case.call_and_validate(
        base_url=url,
        # The generated key, when there is one, is replaced by a real one; a request made without
        # one (to see it refused) stays without.
        headers={"Authorization": f"Bearer {admin}"} if "Authorization" in (case.headers or {}) else None,
        timeout=10,
        # Schema-valid but refused (422) is right for what a schema cannot express: a cursor
        # this service never issued, text with a NUL character (PostgreSQL cannot store it).
        excluded_checks=[positive_data_acceptance],
    )
    if response.status_code >= 400:
        assert response.headers["content-type"] == [MEDIA_TYPE], response.text
        problem = response.json()
        assert problem["status"] == response.status_code
        assert problem["type"].startswith("urn:helix-locks:problem:")
        assert problem["title"] and problem["detail"]
