"""A model of the lock API as docs/api.md describes it, for the stateful fuzz (test_stateful.py).

The model knows every lock granted in a run and its state, and predicts the answer of each call
before it is made: the status, the problem kind, and what a grant, a renewal or a refusal must
say. It has no clock: leases are long enough never to run out on their own within an example, and
a lease runs out only when the test says so (`expire`, done in the database). Leases run out in
the order the model counts in `Lock.lease`, since every grant and renewal asks for the same
`ttl_seconds`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# A 409 lock-held lists at most this many holders, those whose leases run out first.
HOLDERS_LISTED = 20
ORGANIZATIONS = ("acme", "globex")
ADMIN = "admin"


def key_names() -> dict[str, str | None]:
    """The API keys a run uses, by name, each with its organization (None: the admin key)."""
    names: dict[str, str | None] = {ADMIN: None}
    for organization in ORGANIZATIONS:
        names[f"{organization}-1"] = organization
        names[f"{organization}-2"] = organization
    return names


@dataclass
class Lock:
    """One grant as the model knows it."""

    id: int
    organization_id: str
    job_type: str
    holder: str
    token: str
    fencing_token: int
    slot: int
    max_holders: int
    metadata: dict[str, Any] | None
    api_key: str  # the name of the key that acquired it
    idempotency_key: str | None
    reclaimed: dict[str, Any] | None  # as the grant answered it, for a replay
    lease: int  # leases run out in this order (both held and expired ones)
    expired: bool = False
    ended: str | None = None  # release_reason once ended

    @property
    def key(self) -> tuple[str, str]:
        return (self.organization_id, self.job_type)

    @property
    def live(self) -> bool:
        return self.ended is None

    @property
    def held(self) -> bool:
        return self.ended is None and not self.expired

    @property
    def state(self) -> str:
        if self.ended == "reclaimed":
            return "reclaimed"
        if self.ended is not None:
            return "released"
        return "expired" if self.expired else "held"


@dataclass(frozen=True)
class Expected:
    """A predicted answer: status, problem kind, and what else the model knows of it."""

    status: int
    problem: str | None = None
    lock: Lock | None = None  # the lock the answer is about (a replay's, a holder's)
    slot: int | None = None  # of a new grant
    reclaimed: Lock | None = None  # the lock a new grant reclaims, named in its answer
    ends: tuple[Lock, ...] = ()  # every lock the grant reclaims
    holders: tuple[Lock, ...] = ()  # of a 409 lock-held: those listed, the first leases to run out
    first: Lock | None = None  # of a 409 lock-held: the lease that ends first
    holders_total: int | None = None  # of a 409 lock-held: every holder, listed or not
    max_holders: int | None = None  # of a 409: the value in force
    release_reason: str | None = None  # of a 410
    lapsed: bool | None = None  # of a renewal

    def __str__(self) -> str:
        return f"{self.status} {self.problem}" if self.problem else str(self.status)


@dataclass
class Model:
    """Every lock of the run, and the API keys' organizations."""

    api_keys: dict[str, str | None] = field(default_factory=key_names)
    locks: dict[int, Lock] = field(default_factory=dict)
    leases: int = 0

    def live(self, key: tuple[str, str]) -> list[Lock]:
        return sorted(
            (lock for lock in self.locks.values() if lock.live and lock.key == key), key=lambda x: x.slot
        )

    def next_lease(self) -> int:
        self.leases += 1
        return self.leases

    # Acquire: POST /v1/locks

    def acquire(
        self,
        api_key: str,
        organization_id: str,
        job_type: str,
        holder: str,
        max_holders: int,
        idempotency_key: str | None,
    ) -> Expected:
        scope = self.api_keys[api_key]
        if scope not in (None, organization_id):
            return Expected(403, "forbidden")
        key = (organization_id, job_type)
        live = self.live(key)
        if idempotency_key is not None:
            # A repeat while the lock it got is live (and its lease runs) answers that grant.
            repeats = [
                lock
                for lock in live
                if lock.held
                and (lock.holder, lock.api_key, lock.idempotency_key) == (holder, api_key, idempotency_key)
            ]
            if repeats:
                # Two can match only after a repeat of a lapsed grant took another slot and the
                # lapsed one was renewed: then the answer is either of them.
                return Expected(201, lock=repeats[0], holders=tuple(repeats))
        held = [lock for lock in live if lock.held]
        if held:
            in_force = held[0].max_holders
            if in_force != max_holders:
                return Expected(409, "max-holders-mismatch", max_holders=in_force)
            if len(held) >= max_holders:
                listed = sorted(held, key=lambda lock: (lock.lease, lock.slot))[:HOLDERS_LISTED]
                return Expected(
                    409,
                    "lock-held",
                    holders=tuple(listed),
                    first=listed[0],
                    max_holders=in_force,
                    holders_total=len(held),
                )
        # The live locks of a key share one max_holders: expired ones of another value all end.
        others = [lock for lock in live if lock.max_holders != max_holders]
        assert all(lock.expired for lock in others)
        reclaimed = min(others, key=lambda lock: lock.lease) if others else None
        taken = {lock.slot for lock in live if lock.max_holders == max_holders}
        free = [slot for slot in range(max_holders) if slot not in taken]
        if free:
            return Expected(201, slot=free[0], reclaimed=reclaimed, ends=tuple(others))
        # Every slot taken, none of them held by all: the lease that ran out first is reclaimed.
        expired = [lock for lock in live if lock.expired]
        oldest = min(expired, key=lambda lock: (lock.lease, lock.slot))
        return Expected(201, slot=oldest.slot, reclaimed=oldest, ends=(oldest,))

    def granted(self, expected: Expected, lock: Lock) -> None:
        """A new grant the model predicted (not a replay): record it, end what it reclaimed."""
        for reclaimed in expected.ends:
            reclaimed.ended = "reclaimed"
        self.locks[lock.id] = lock

    # The holder's calls: release, renew, update (PATCH) by token; and force, get

    def by_holder(self, api_key: str, lock: Lock, token_matches: bool) -> Expected:
        """Release, renew or update: who may see the lock, then the token, then whether it ended."""
        if self.api_keys[api_key] not in (None, lock.organization_id):
            return Expected(404, "lock-not-found")
        if not token_matches:
            return Expected(403, "token-mismatch")
        if lock.ended is not None:
            return Expected(410, "lock-ended", lock=lock, release_reason=lock.ended)
        return Expected(200, lock=lock, lapsed=lock.expired)

    def release(self, api_key: str, lock: Lock, token_matches: bool) -> Expected:
        expected = self.by_holder(api_key, lock, token_matches)
        if expected.status == 200:
            lock.ended = "released"
            return Expected(204, lock=lock)
        return expected

    def renew(self, api_key: str, lock: Lock, token_matches: bool) -> Expected:
        expected = self.by_holder(api_key, lock, token_matches)
        if expected.status == 200:
            lock.expired = False
            lock.lease = self.next_lease()
        return expected

    def update(
        self, api_key: str, lock: Lock, token_matches: bool, metadata: dict[str, Any] | None
    ) -> Expected:
        expected = self.by_holder(api_key, lock, token_matches)
        if expected.status == 200:
            lock.metadata = metadata
        return expected

    def force(self, api_key: str, lock: Lock) -> Expected:
        if self.api_keys[api_key] is not None:
            return Expected(403, "forbidden")
        if lock.ended is not None:
            return Expected(410, "lock-ended", lock=lock, release_reason=lock.ended)
        lock.ended = "forced"
        return Expected(204, lock=lock)

    def get(self, api_key: str, lock: Lock) -> Expected:
        if self.api_keys[api_key] not in (None, lock.organization_id):
            return Expected(404, "lock-not-found")
        return Expected(200, lock=lock)

    def current(self, api_key: str, key: tuple[str, str]) -> Expected:
        """GET /v1/locks/current: the held lock with the highest fencing token; a lapsed one is not."""
        if self.api_keys[api_key] not in (None, key[0]):
            return Expected(404, "lock-not-found")
        held = [lock for lock in self.live(key) if lock.held]
        if not held:
            return Expected(404, "lock-not-found")
        return Expected(200, lock=max(held, key=lambda lock: lock.fencing_token))

    def expire(self, lock: Lock) -> None:
        """The lease ran out (the test moved expires_at to the database's now)."""
        assert lock.live
        lock.expired = True
        lock.lease = self.next_lease()
