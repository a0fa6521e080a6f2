"""What became of one request: filled by its route and by the problem it was answered with, read
by its log line and its metrics (telemetry.Observe)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.types import Scope

from helix_locks.server import logs

_KEY = "helix_locks.outcome"


@dataclass
class Outcome:
    result: str | None = None  # what it did: granted, reclaimed, released, forced, renewed, updated
    problem: str | None = None  # the problem type it was answered with
    organization_id: str | None = None  # the lock's organization and job type, once known
    job_type: str | None = None

    def about(self, organization_id: str | None, job_type: str | None) -> None:
        """The lock's organization and job type: for the metrics, and every log line from now on."""
        self.organization_id, self.job_type = organization_id, job_type
        logs.bind(organization_id=organization_id, job_type=job_type)

    def fields(self) -> dict[str, Any]:
        """For the request's log line."""
        return {name: value for name, value in (("outcome", self.result), ("problem", self.problem)) if value}


def outcome(scope: Scope) -> Outcome:
    """The request's outcome, kept in its ASGI scope."""
    found: Outcome = scope.setdefault(_KEY, Outcome())
    return found
