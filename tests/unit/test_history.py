"""The history checker catches each kind of broken history, and passes a sound one."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from harness.history import Grant, Place, Renewed, Told, check, check_queue

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
    # Issue 41: lock 1 closed the pair until 1250, released at 100; lock 2 came at 200.
    "granted while closed": (
        [replace(sound()[0], closed_until=at(1250)), *sound()[1:]],
        [],
        "closed the pair until",
    ),
    "a lease past the hold limit": (
        [replace(sound()[0], hold_limit_at=at(90)), *sound()[1:]],
        [],
        "past its hold limit",
    ),
    "a renewal past the hold limit": (
        [replace(sound()[1], hold_limit_at=at(1200)), sound()[2]],
        [Renewed(2, at(500), at(1250))],
        "past its hold limit",
    ),
}


def test_a_reservation_kept_passes_and_one_passed_over_is_caught() -> None:
    asked = replace(sound()[0], reserved_for=("heir", at(5000)))
    heir = replace(sound()[1], holder="heir")
    assert check([asked, heir, *sound()[2:]], told_of(sound()), [Renewed(2, at(500), at(1200))]) == []
    other = replace(sound()[1], holder="other")
    [violation] = check([asked, other, *sound()[2:]], told_of(sound()), [Renewed(2, at(500), at(1200))])
    assert "reserved for heir" in violation
    late = replace(asked, reserved_for=("heir", at(150)))  # the deadline passed before lock 2's grant
    assert check([late, other, *sound()[2:]], told_of(sound()), [Renewed(2, at(500), at(1200))]) == []


def test_a_closing_and_a_hold_limit_kept_pass() -> None:
    grants = [replace(sound()[0], closed_until=at(200), hold_limit_at=at(1000)), *sound()[1:]]
    assert check(grants, told_of(grants), [Renewed(2, at(500), at(1200))]) == []


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


SEM = ("org", "exports")


def semaphore() -> list[Grant]:
    """A semaphore of 3, as the acquire function grants it (times in ms):
    A, B, C take slots 0, 1, 2; A is released at 400 and D takes its slot at 500; at 1300 the
    semaphore is full, so E reclaims B (the first to expire, at 1100) and takes slot 1; D and E
    are released after their leases lapsed (nobody reclaimed them); C crashed, and at 3000 F,
    with max_holders 2, finds none held: it reclaims C (slot 2) and starts the pair afresh in
    slot 0; G takes slot 1."""
    return [
        Grant(1, SEM, 1, at(0), at(1000), at(400), "released", 3, 0),
        Grant(2, SEM, 2, at(100), at(1100), at(1300), "reclaimed", 3, 1),
        Grant(3, SEM, 3, at(200), at(1200), at(3000), "reclaimed", 3, 2),
        Grant(4, SEM, 4, at(500), at(1500), at(1600), "released", 3, 0),
        Grant(5, SEM, 5, at(1300), at(2300), at(2400), "released", 3, 1),
        Grant(6, SEM, 6, at(3000), at(4000), None, None, 2, 0),
        Grant(7, SEM, 7, at(3100), at(4100), None, None, 2, 1),
    ]


def fourth(slot: int, max_holders: int = 3) -> Grant:
    """A grant at 300, while A, B and C all hold the semaphore of 3."""
    return Grant(8, SEM, 4, at(300), at(1300), at(350), "released", max_holders, slot)


def test_a_sound_semaphore_history_passes() -> None:
    grants = semaphore()
    told = [replace(t, slot=g.slot) for t, g in zip(told_of(grants), grants, strict=True)]
    assert check(grants, told, [Renewed(5, at(1400), at(2300))], released=[1, 4, 5]) == []
    # Its slots and max_holders are what it takes to pass: all in one slot, it is broken.
    violations = check([replace(g, max_holders=1, slot=0) for g in grants], told_of(grants), [])
    assert any("overlap" in v or "never released" in v for v in violations), violations


def test_four_live_at_once_on_a_semaphore_of_3_is_caught() -> None:
    """Issue 21: the checker fails a history with 4 live at once, in whichever slot the fourth is."""
    for slot in (3, 1):
        grants = sorted([*semaphore()[:3], fourth(slot)], key=lambda g: g.lock_id)
        violations = check(grants, told_of(grants), [])
        assert f"{SEM}: 4 grants live at once at {at(300)}, more than max_holders 3: locks [1, 2, 3, 8]" in (
            violations
        ), violations
    # A fourth that claims a max_holders of its own while the others hold 3 is no better.
    grants = [*semaphore()[:3], fourth(3, max_holders=4)]
    violations = check(grants, told_of(grants), [])
    assert any("4 grants live at once" in v and "max_holders 3" in v for v in violations), violations
    assert any("while locks of max_holders [3, 4] were live" in v for v in violations), violations


BROKEN_SEMAPHORE: dict[str, tuple[list[Grant], str]] = {
    # D takes slot 1 at 500 while B holds it until 1300: one slot held twice (three live).
    "slot held twice": (
        [*semaphore()[:3], replace(semaphore()[3], slot=1)],
        f"{SEM}: lock 2 (token 2) then 4 in slot 1: overlap, granted 0:00:00.800000 early",
    ),
    "slot held twice, never released": (
        [replace(semaphore()[0], released_at=None, release_reason=None), *semaphore()[1:4]],
        f"{SEM}: lock 1 (token 1) then 4 in slot 0: granted while its predecessor was never released",
    ),
    "slot overlap": (
        [*semaphore()[:3], replace(semaphore()[3], acquired_at=at(350))],
        "then 4 in slot 0: overlap, granted 0:00:00.050000 early",
    ),
    "slot out of range": (
        [*semaphore()[:2], replace(semaphore()[2], slot=3)],
        f"{SEM}: lock 3 in slot 3, outside its max_holders 3",
    ),
    "early reclaim in its slot": (
        [*semaphore()[:5], replace(semaphore()[1], expires_at=at(1400))],
        "then 5 in slot 1: reclaimed before its lease expired",
    ),
    # F starts the pair afresh at 3000, reclaiming C in slot 2: C's lease ran until 3500.
    "early reclaim from another slot": (
        [*semaphore()[:2], replace(semaphore()[2], expires_at=at(3500)), *semaphore()[3:]],
        f"{SEM}: lock 3 reclaimed at {at(3000)}, before its lease expired at {at(3500)}",
    ),
    "reclaimed by no grant": (
        [*semaphore()[:2], replace(semaphore()[2], released_at=at(2900)), *semaphore()[3:]],
        f"{SEM}: lock 3 reclaimed at {at(2900)}, when no grant was made",
    ),
    "token reused across slots": (
        [semaphore()[0], replace(semaphore()[1], fencing_token=1)],
        "fencing token 1 granted twice",
    ),
    "tokens against time across slots": (
        [semaphore()[0], replace(semaphore()[1], fencing_token=3), replace(semaphore()[2], fencing_token=2)],
        "do not follow grant order",
    ),
    # G joins with max_holders 3 while F holds the pair with 2: a mismatch granted.
    "two max_holders live at once": (
        [*semaphore()[:6], replace(semaphore()[6], max_holders=3)],
        f"{SEM}: lock 7 (max_holders 3) granted at {at(3100)} while locks of max_holders [2, 3] were live",
    ),
}


@pytest.mark.parametrize("case", BROKEN_SEMAPHORE)
def test_broken_semaphore_history_is_caught(case: str) -> None:
    grants, expected = BROKEN_SEMAPHORE[case]
    violations = check(grants, told_of(grants), [])
    assert any(expected in violation for violation in violations), violations


def test_a_slot_held_twice_is_caught_even_when_no_more_than_max_holders_are_live() -> None:
    grants = [*semaphore()[:3], replace(semaphore()[3], slot=1)]
    violations = check(grants, told_of(grants), [])
    assert any("in slot 1: overlap" in v for v in violations), violations
    assert not any("live at once" in v for v in violations), violations


def test_a_slot_the_client_was_not_told_is_caught() -> None:
    grants = semaphore()
    told = [replace(told_of(grants)[1], slot=2)]
    assert any(v.startswith("lock 2: the client was told") for v in check(grants, told, [])), told


# --- shared locks (issue 40) ----------------------------------------------------------------------


def readers_then_writer() -> list[Grant]:
    """Two readers together (slots 0 and 1), the second's lease lapsed and reclaimed by the writer
    after the first released: a sound history."""
    return [
        Grant(1, KEY, 1, at(0), at(1000), at(500), "released", shared=True),
        Grant(2, KEY, 2, at(100), at(600), at(700), "reclaimed", slot=1, shared=True),
        Grant(3, KEY, 3, at(700), at(1700), None, None),
    ]


def test_a_sound_history_of_readers_and_a_writer_passes() -> None:
    grants = readers_then_writer()
    assert check(grants, told_of(grants), []) == []


def test_a_writer_beside_a_reader_is_caught() -> None:
    grants = readers_then_writer()
    grants[2] = replace(grants[2], acquired_at=at(650))  # before the second reader was reclaimed
    grants[1] = replace(grants[1], released_at=at(800))
    violations = check(grants, told_of(grants), [])
    assert any("shared locks [2] and exclusive locks [3] were live at once" in v for v in violations), (
        violations
    )


def test_a_reader_outside_the_readers_room_or_with_max_holders_is_caught() -> None:
    grants = [
        Grant(1, KEY, 1, at(0), at(1000), None, None, slot=1000, shared=True),
        Grant(2, KEY, 2, at(10), at(1000), None, None, max_holders=2, slot=1, shared=True),
    ]
    violations = check(grants, told_of(grants), [])
    assert sum("outside its max_holders" in v for v in violations) == 2, violations


def test_the_queue_checker_finds_a_reader_that_passed_a_waiting_writer() -> None:
    """Writers first: a reader granted while a writer's place before its own waited is caught; a
    reader granted past another reader's place is not (readers are granted together)."""
    second = timedelta(seconds=1)
    places = [
        Place(1, KEY, T0, T0 + 60 * second, T0 + 10 * second, 101),  # the writer's, granted lock 3
        Place(2, KEY, T0 + second, T0 + 60 * second, T0 + 5 * second, 100, shared=True),
        Place(3, ("org", "r"), T0, T0 + 60 * second, shared=True),  # a reader's, never granted
    ]
    grants = [
        Grant(
            2, KEY, 2, T0 + 5 * second, T0, T0, "released", acquired_xid=100, shared=True
        ),  # passed place 1
        Grant(3, KEY, 3, T0 + 10 * second, T0, T0, "released", acquired_xid=101),
        Grant(4, ("org", "r"), 1, T0 + 5 * second, T0, None, None, acquired_xid=102, shared=True),
    ]
    violations = check_queue(grants, places)
    assert len(violations) == 1, violations
    assert "lock 2 of ('org', 'job')" in violations[0] and "passed place 1" in violations[0]
