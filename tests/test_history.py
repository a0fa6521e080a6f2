"""The history checker catches each kind of broken history, and passes a sound one."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from tests.history import Grant, Renewed, Told, check

T0 = datetime(2026, 1, 1, tzinfo=UTC)
KEY = ("org", "job")


def at(ms: int) -> datetime:
    return T0 + timedelta(milliseconds=ms)


def sound() -> list[Grant]:
    """Released at 100, then a holder that crashed and was reclaimed at 1300 after expiry at 1200."""
    return [
        Grant(1, KEY, 1, at(0), at(1000), at(100), "released"),
        Grant(2, KEY, 2, at(200), at(1200), at(1300), "reclaimed"),
        Grant(3, KEY, 3, at(1300), at(2300), None, None),
        Grant(4, ("org", "other"), 1, at(50), at(1050), None, None),
    ]


def told_of(grants: list[Grant]) -> list[Told]:
    return [Told(g.lock_id, g.key, g.fencing_token, g.acquired_at) for g in grants]


def test_sound_history_passes() -> None:
    grants = sound()
    assert check(grants, told_of(grants), [Renewed(2, at(500), at(1200))]) == []


BROKEN: dict[str, tuple[list[Grant], list[Renewed], str]] = {
    "overlap": ([*sound()[:1], replace(sound()[1], acquired_at=at(50))], [], "overlap"),
    "token reused": ([sound()[0], replace(sound()[1], fencing_token=1)], [], "granted twice"),
    "tokens against time": (
        [replace(sound()[0], fencing_token=2), replace(sound()[1], fencing_token=1)],
        [],
        "do not follow grant order",
    ),
    "never released": ([replace(sound()[0], released_at=None, release_reason=None), sound()[1]], [], "never"),
    "early reclaim": ([replace(sound()[1], expires_at=at(5000)), sound()[2]], [], "before its lease expired"),
    "renewal after end": (sound(), [Renewed(1, at(150), at(1150))], "after it ended"),
    # Renewed at 900 until 1900, but the database kept 1200 (the renewal was lost) and the lock
    # was reclaimed at 1300: before the lease its holder was promised.
    "renewal lost": (sound(), [Renewed(2, at(900), at(1900))], "the database kept"),
    "reclaim before a renewed lease ended": (sound(), [Renewed(2, at(900), at(1900))], "before its lease"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_broken_history_is_caught(case: str) -> None:
    grants, renewals, expected = BROKEN[case]
    violations = check(grants, told_of(grants), renewals)
    assert any(expected in violation for violation in violations), violations


def test_a_grant_the_database_lost_is_caught() -> None:
    grants = sound()
    lost = Told(99, KEY, 4, at(2400))
    assert any("lost" in v for v in check(grants, [*told_of(grants), lost], []))
    wrong = replace(told_of(grants)[0], fencing_token=7)
    assert any("was told" in v for v in check(grants, [wrong], []))


def test_a_release_the_database_lost_is_caught() -> None:
    grants = sound()
    assert check(grants, told_of(grants), [], released=[1]) == []
    for lock_id, reason in ((2, "reclaimed"), (3, "not released"), (99, "lost")):
        violations = check(grants, told_of(grants), [], released=[lock_id])
        assert violations == [
            f"lock {lock_id}: a client was told it was released, the database says {reason}"
        ], violations


def test_a_lock_the_service_released_behind_its_holders_back_is_caught() -> None:
    """Issue 15, finding 2: a waiter's client left, its retry was handed the grant, and the
    service's clean-up then released it while the retry's holder believed it held the lock."""
    grants = sound()
    assert check(grants, told_of(grants), [], release_attempts=[1]) == []
    violations = check(grants, told_of(grants), [], release_attempts=[])
    assert violations == ["lock 1: released while its holder, told it held the lock, never released it"], (
        violations
    )
