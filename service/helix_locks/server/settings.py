"""Service settings, read from the environment when the app is built (never at import)."""

from __future__ import annotations

from typing import Self

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """What the service needs to run; every field can be set as HELIX_LOCKS_<NAME>."""

    model_config = SettingsConfigDict(
        env_prefix="HELIX_LOCKS_", extra="ignore", frozen=True, populate_by_name=True
    )

    database_url: str = Field(validation_alias=AliasChoices("DATABASE_URL", "HELIX_LOCKS_DATABASE_URL"))
    # A direct, session-capable connection (in the manner of Prisma's directUrl) for what needs a
    # session: LISTEN and migrations. Setting it says that database_url goes through a transaction
    # pooler (PgBouncer's pool_mode = transaction, say): no prepared statements, and every
    # statement runs in a transaction of its own that sets what the lock functions rely on.
    direct_database_url: str | None = None
    pool_min_size: int = Field(default=2, ge=1)
    pool_max_size: int = Field(default=10, ge=1)
    # How long a request waits for a pooled connection before it answers 503.
    pool_timeout_seconds: float = Field(default=2.0, gt=0)
    # A statement that runs longer is cancelled and answered with 503: nothing hangs.
    statement_timeout_ms: int = Field(default=5000, ge=100)
    # Serve requests without an API key while no key exists at all. `serve` sets it when it
    # listens on loopback only, or with --insecure; once any key exists, keys are required.
    allow_anonymous: bool = False
    # Anonymous requests must name a loopback host (Host: localhost, 127.0.0.1, [::1]), which
    # defeats DNS rebinding; --insecure, off loopback, sets this to accept any Host.
    anonymous_any_host: bool = False
    # Ended locks are kept this many days, then deleted in batches (0 keeps them for ever).
    retention_days: float = Field(default=7.0, ge=0)
    retention_batch: int = Field(default=1000, ge=1, le=100_000)
    retention_interval_seconds: float = Field(default=60.0, gt=0)
    # On SIGTERM, requests in flight get this long to finish before the service stops anyway.
    shutdown_timeout_seconds: int = Field(default=10, gt=0)
    # Label the lock counters by organization: one series per organization, so only with few.
    metrics_organization_label: bool = False
    # Acquires waiting for a held lock (wait_seconds) in one process; beyond it, 503.
    max_waiters: int = Field(default=10_000, ge=0)
    # Of those, one organization's at most; beyond it, 429 for that organization alone.
    max_waiters_per_organization: int = Field(default=1_000, ge=0)
    # GET /v1/events: one reader per process asks the database this often what changed, while
    # anyone watches (nothing at all while nobody does).
    events_poll_ms: int = Field(default=50, ge=10, le=5000)
    # A comment line this often keeps proxies from cutting a quiet stream.
    events_keepalive_seconds: float = Field(default=15.0, gt=0, le=15.0)
    # Event streams open at once in one process, and of those one organization's at most.
    max_watchers: int = Field(default=10_000, ge=0)
    max_watchers_per_organization: int = Field(default=1_000, ge=0)
    # A resume (Last-Event-ID) replays at most this many events; more are refused with 410.
    events_replay_limit: int = Field(default=10_000, ge=1)
    # Bytes of events one stream may hold unsent; a watcher that falls further behind is ended
    # with `retry:`, and resumes with Last-Event-ID (a page at a time).
    events_stream_bytes: int = Field(default=1024 * 1024, ge=64 * 1024)
    # Bytes of events every stream of one process may hold together, and one organization's
    # streams at most (0, and never more than: this divided among the organizations streaming);
    # past its share, an organization's new streams get 429 and its streams that fall behind end.
    events_memory_bytes: int = Field(default=256 * 1024 * 1024, ge=1024 * 1024)
    events_organization_bytes: int = Field(default=0, ge=0)
    # Live locks (held, or lapsed and not yet reclaimed) of one organization; beyond it, 429
    # (locks.py, LiveLockQuota: shares of the room far from it, one at a time near it; never past).
    max_live_locks_per_organization: int = Field(default=10_000, ge=1)
    # Sessions (POST /v1/sessions) open at once in one organization (ended or lapsed ones do not
    # count), and locks one session may hold; beyond either, 429 / 409.
    max_sessions_per_organization: int = Field(default=1_000, ge=1)
    max_locks_per_session: int = Field(default=1_000, ge=1)

    @property
    def through_pooler(self) -> bool:
        """Whether database_url goes through a transaction pooler (a direct URL is set)."""
        return bool(self.direct_database_url)

    @property
    def session_database_url(self) -> str:
        """Where LISTEN and migrations go: the direct URL if set, else database_url."""
        return self.direct_database_url or self.database_url

    @property
    def query_deadline_seconds(self) -> float:
        """How long a request waits for PostgreSQL's answer: a little past statement_timeout."""
        return self.statement_timeout_ms / 1000 + 1.0

    @model_validator(mode="after")
    def _pool_sizes(self) -> Self:
        if self.pool_max_size < self.pool_min_size:
            raise ValueError("pool_max_size must be at least pool_min_size")
        return self


class EdgeSettings(BaseSettings):
    """The HTTP server's bounds on clients (edge.py); each can be set as HELIX_LOCKS_<NAME>."""

    model_config = SettingsConfigDict(env_prefix="HELIX_LOCKS_", extra="ignore", frozen=True)

    # A request's line and headers together; nginx allows 8 KiB a line and 32 KiB in all.
    max_head_bytes: int = Field(default=32 * 1024, ge=1024, le=1024 * 1024)
    # From a connection's opening (or its last answer) to its request's complete head.
    head_timeout_seconds: float = Field(default=10.0, gt=0)
    # From a request's head to the end of its body.
    body_timeout_seconds: float = Field(default=10.0, gt=0)
    # An answer the client does not read: over each such span it must take 64 KiB a second of it
    # (or all of it), or the connection is aborted.
    write_timeout_seconds: float = Field(default=10.0, gt=0)
    # Connections open at once in one worker process; more are closed as they come. The process's
    # nofile limit must be above it (plus the pool's connections and a few files).
    max_connections: int = Field(default=4096, ge=1)
