"""Helix Locks: a lock authority for background workers, in front of PostgreSQL.

The SDK for workers (httpx its only dependency). The server is helix_locks.server, which needs
the `server` extra and which nothing here imports:

    from helix_locks import LockClient

    with LockClient("http://127.0.0.1:8080") as client:
        with client.lock("acme", "nightly-report", ttl=30) as lease:
            ...  # the job; lease.lost tells whether the lock may have been lost
"""

from importlib.metadata import version

from helix_locks.client import (
    ApiError,
    AsyncLease,
    AsyncLockClient,
    ClosedUntil,
    Grant,
    HelixError,
    InvalidURL,
    Lease,
    LockClient,
    LockHeld,
    LockLost,
    MaxHoldersMismatch,
    NotHelixLocks,
    Reserved,
    SessionGrant,
    SessionLease,
    SyncLease,
    Unavailable,
)
from helix_locks.results import (
    Acquired,
    Lock,
    LockEvent,
    LockState,
    OpenedSession,
    Page,
    Place,
    QueuePage,
    Reclaimed,
    Renewed,
    Revocation,
    SessionBody,
)

# The one version, pyproject.toml's, as installed (clients/node/package.json says the same: a test
# holds them together).
__version__ = version("helix-locks")

__all__ = [
    "Acquired",
    "ApiError",
    "AsyncLease",
    "AsyncLockClient",
    "ClosedUntil",
    "Grant",
    "HelixError",
    "InvalidURL",
    "Lease",
    "Lock",
    "LockClient",
    "LockEvent",
    "LockHeld",
    "LockLost",
    "LockState",
    "MaxHoldersMismatch",
    "NotHelixLocks",
    "OpenedSession",
    "Page",
    "Place",
    "QueuePage",
    "Reclaimed",
    "Renewed",
    "Reserved",
    "Revocation",
    "SessionBody",
    "SessionGrant",
    "SessionLease",
    "SyncLease",
    "Unavailable",
]
