"""Fuzzing the API with schemathesis, from the checked-in OpenAPI, against a real service with keys.

Every answer must conform to the schema (status, headers, body), no answer may be a 5xx, and
every error must be a problem+json. HELIX_FUZZ_EXAMPLES sets the random examples per operation
(default 50), on top of the cases schemathesis derives from the schema itself: about 540 requests
in all, the same on every run.
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

from harness.processes import ROOT, running_service
from helix_locks.server import keys
from helix_locks.server.problems import MEDIA_TYPE

# Not the event stream: it answers for as long as the client reads (tests/system/test_events.py checks
# its parameters and problems).
schema = schemathesis.openapi.from_path(ROOT / "openapi.json").exclude(path="/v1/events")
EXAMPLES = int(os.environ.get("HELIX_FUZZ_EXAMPLES", "50"))
# Where a schema-valid request may rightly be refused (below): a listing or a queue (a cursor),
# an acquire, an update, a session's opening or added locks.
VAGUE = {
    ("GET", "/v1/locks"),
    ("GET", "/v1/locks/queue"),
    ("POST", "/v1/locks"),
    ("PATCH", "/v1/locks/{lock_id}"),
    ("POST", "/v1/sessions"),
    ("POST", "/v1/sessions/{session_id}/locks"),
    ("POST", "/v1/locks/{lock_id}/revocation"),  # a reason or preferred holder with a NUL character
}


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
    positive = case.meta is None or case.meta.generation.mode.is_positive
    wait = case.body.get("wait_seconds") if isinstance(case.body, dict) else None
    valid_wait = isinstance(wait, int | float) and not isinstance(wait, bool) and 0.2 < wait <= 60
    if isinstance(case.body, dict) and valid_wait:
        case.body["wait_seconds"] = 0.2  # fuzzed locks stay held: a long wait would only wait
    response = case.call_and_validate(
        base_url=url,
        # A valid request gets a real key for its generated one; a malformed or missing key (a
        # negative case) is sent as generated, to be refused.
        headers={"Authorization": f"Bearer {admin}"} if positive else None,
        timeout=10,
        # Schema-valid but refused (422) is right where the schema cannot say what is valid: a
        # cursor this service never issued, or text with a NUL character (PostgreSQL cannot store
        # it, and JSON Schema cannot say so for metadata nested at any depth) in an acquire's or an
        # update's metadata or a revocation request's reason, or a session's locks naming one job
        # type twice (JSON Schema's uniqueItems compares whole items, not one field of them).
        excluded_checks=[positive_data_acceptance]
        if (case.operation.method.upper(), case.operation.path) in VAGUE
        else [],
    )
    if response.status_code >= 400:
        assert response.headers["content-type"] == [MEDIA_TYPE], response.text
        problem = response.json()
        assert problem["status"] == response.status_code
        assert problem["type"].startswith("urn:helix-locks:problem:")
        assert problem["title"] and problem["detail"]
