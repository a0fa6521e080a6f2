"""The waiter's timer (waiting.py): until the lease that refused it runs out, and backing off when
a lease already run out refuses again and again (a renewal of its session in flight, 0028)."""

import itertools

from helix_locks.server.waiting import EXPIRY_SLACK_SECONDS, sleep_for


def test_a_waiter_sleeps_until_the_lease_runs_out_and_never_past_its_wait() -> None:
    assert sleep_for(1500, 10, 0) == 1.5 + EXPIRY_SLACK_SECONDS
    assert sleep_for(None, 10, 5) == 0.0  # the lock just ended: at once
    assert sleep_for(60_000, 2.5, 0) == 2.5


def test_a_lease_run_out_that_refuses_again_is_asked_less_and_less_often_up_to_a_second() -> None:
    sleeps = [sleep_for(0, 30, again) for again in range(12)]
    assert sleeps[0] == EXPIRY_SLACK_SECONDS
    assert all(later == 2 * earlier for earlier, later in itertools.pairwise(sleeps[:10]))
    assert sleeps[9] == sleeps[11] == EXPIRY_SLACK_SECONDS * 512  # about a second, and no more
