"""Rolling upgrades from builds that users may run: the earlier build (its service/ and migrations/,
exported from git) migrates a database and serves it; workers cycle through it while this build
migrates the database further and a replica of this build joins. Live locks and history made
before the upgrade are kept, both builds answer correctly throughout, and the grants of both are
one lock's history.

BUILDS are landed builds, named by commit. When a migration lands, add the build it upgrades from
(main's head before it)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from contextlib import ExitStack
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from harness.builds import git, previous_build, served_from
from harness.history import Told, check, database_history
from harness.processes import run_helix, running_service
from helix_locks.server.migrate import EARLIER_CHECKSUMS, Migration, load, migrations_in
from tests.support import ROUTE

pytestmark = pytest.mark.slow

HOT = ("acme", "upgrade-hot")
BUILDS = {
    # Migrations 0001 to 0018: the upgrade applies 0019 to 0022 while it serves.
    "a1f1632": "before the exact event stream and quota (issue 34)",
    # Every migration, two of them as the server's move left their comments (EARLIER_CHECKSUMS).
    "020073f": "tests in layers (issue 36)",
    # Migrations 0001 to 0022: the upgrade applies 0023, the lean data model, while it serves.
    "57528db": "before the lean data model (issue 37)",
    # Migrations 0001 to 0027: the upgrade applies 0028 (a session's lease in its row) while it serves.
    "c1948e5": "before a session's renewal wrote one row (issue 38)",
    # Migrations 0001 to 0030: the upgrade applies 0031 and 0032 (the mode through the API) while it serves.
    "2f9d640": "before shared locks reached the API (issue 40)",
}


def applied(db_url: str) -> list[tuple[str, str]]:
    """The database's migrations, each with the checksum it was applied with."""
    with psycopg.connect(db_url) as conn:
        rows = conn.execute("SELECT name, checksum FROM helix_schema_migrations ORDER BY 1").fetchall()
    return [(str(name), str(checksum)) for name, checksum in rows]


def migrate(env: dict[str, str | None]) -> None:
    done = run_helix("migrate", env=env, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def acquire(url: str, job_type: str, holder: str, ttl: float = 30) -> httpx.Response:
    body = {"organization_id": HOT[0], "job_type": job_type, "holder": holder, "ttl_seconds": ttl}
    return httpx.post(f"{url}/v1/locks", json=body, timeout=15)


def lock_call(method: str, url: str, lock: dict[str, Any], **kw: Any) -> httpx.Response:
    return httpx.request(
        method, f"{url}/v1/locks/{lock['id']}", headers={"Lock-Token": lock["token"]}, timeout=15, **kw
    )


# A call that failed, its statement rolled back: 500 when the earlier build's plan met the new
# tables, 503 when it waited past the statement timeout for the migration's locks.
FAILED = (500, 503)


class Workers:
    """Threads that acquire and release the hot key through the replicas they are given, until
    stopped: every answer counted by replica, every grant told to the checker."""

    def __init__(self) -> None:
        self.answers: Counter[str] = Counter()
        # Answered 500 or 503: (call, when it was sent, when it was answered), by monotonic time.
        self.failed: list[tuple[str, float, float]] = []
        self.told: list[Told] = []
        self.released: list[int] = []
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    def start(self, name: str, url: str, count: int) -> None:
        for n in range(count):
            thread = threading.Thread(target=self.cycle, args=(name, url, f"{name}-{n}"), daemon=True)
            thread.start()
            self.threads.append(thread)

    def cycle(self, name: str, url: str, holder: str) -> None:
        while not self.stop.is_set():
            try:
                sent = time.monotonic()
                got = acquire(url, HOT[1], holder)
                self.answers[f"{name} acquire {got.status_code}"] += 1
                if got.status_code in FAILED:
                    self.failed.append((f"{name} acquire", sent, time.monotonic()))
                if got.status_code != 201:
                    continue
                lock = got.json()
                at = datetime.fromisoformat(lock["acquired_at"])
                self.told.append(Told(lock["id"], HOT, lock["fencing_token"], at))
                released = 500
                while released in FAILED:  # a failed release changed nothing: the holder sends it again
                    sent = time.monotonic()
                    released = lock_call("DELETE", url, lock).status_code
                    self.answers[f"{name} release {released}"] += 1
                    if released in FAILED:
                        self.failed.append((f"{name} release", sent, time.monotonic()))
                if released == 204:
                    self.released.append(lock["id"])
            except httpx.TransportError as exc:  # counted, and the test fails on it
                self.answers[f"{name} {type(exc).__name__}"] += 1
                time.sleep(0.1)

    def join(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=30)


# Earlier versions of migration files whose SQL differs from today's, which development builds of
# main applied before a1f1632 or in the middle of issue 34: migrate refuses their databases, naming
# the file (docs/operations.md). Nothing may join this list: a landed migration never changes.
REFUSED = {
    ("0005_idempotent_acquire.sql", "afe74d89061ebe3edca66659a20e2621ae96ead3b623ac88611fa681f6202d5a"),
    ("0007_history_retention.sql", "40bab2f3324468ad186dbd6eb97ee6bfe5fcfaf1b08f47787ce3aca8a956110a"),
    ("0008_notify_only_waiters.sql", "b0caa1268305c0788c64f657f3b6abe534e907c5b3b35f62636cbb394342c36e"),
    ("0010_exactly_once.sql", "ce0b9c584203979f9c4eb85a40270c2a5d01b76a5a1ae84665fecb5518fe388e"),
    ("0012_tokens_and_lapsed_locks.sql", "2a6206da79b25b0738b3beeb85016979413104e5c4acdd3c9637421ae51c55a3"),
    ("0016_lock_events.sql", "eda97142f604dcb4924f28ef7583e6e1d3d212a358a441d195658ddcb44fa163"),
    (
        "0018_replays_at_the_quota_and_shortened_leases.sql",
        "c66dc3125bfb42a7827982afff2cd8fd5b88788e53bac2995bb7013ae7b5c403",
    ),
    ("0019_expiries_announced.sql", "03dc05cc14995ba5607eb6ae42fe2cfa5d9bcf71684266fcf4211b6820cbe6ee"),
    ("0019_expiries_announced.sql", "dd16e2f8387a07c9fc3cc78f93abaed443b5d32a386335aefd7f48e52ad386b1"),
    ("0020_quota_exact.sql", "695cae423298080ece933e74302e57083575c0b30d7f0456927413577ff34800"),
    ("0020_quota_exact.sql", "a16fb679e2b9ebf8e40bae56919d5720c84bcd456dbd352550d07368ffa3416c"),
    (
        "0021_bounded_metadata_and_holders.sql",
        "4fff57257c3c42eb5386cca67136167263d3f8e09306fd0dde03e12e9cf1cb83",
    ),
    ("0022_grants_announce_expiries.sql", "b70916d077088a22587b5af84be2c7a0ad7cd4bc0cf7444474a5bad23c1145d4"),
    # Drafts of 0027 committed on main during the session that wrote it, before any of them
    # landed (no CI had passed on them): an adversary's review changed its functions.
    ("0027_sessions.sql", "867a58696c18434ba7b6c5b427321251af39d09e69d8d3a8cd18987b147dca1b"),
    ("0027_sessions.sql", "647c5a1da3da875d4fa2e6f7b3d88aac61707185c13e9e30b9ab94edca728d7d"),
    ("0027_sessions.sql", "67a5f4e8e1f97304ff16142aaffd1e2d9647ad38946418e728839e6a5bba817b"),
    # Drafts of 0028 committed on main before it landed (stop 53): reviews found its events doubled
    # or lost, then a release that held its session's row while it waited for a writer; the last
    # two read the hold's session before ending any lock, one on its own too.
    ("0028_a_session_renews_one_row.sql", "a139b42144f7add76e1298cfac149e73bea89c128169f8eadd932ce64cd5fcee"),
    ("0028_a_session_renews_one_row.sql", "524b62058b7a72dc4e497340845a5118acbc4ef2d62eb669d19ebe7169c170de"),
    ("0028_a_session_renews_one_row.sql", "15486fa96194821727c07de57ca9f0e3a4b327d0a1da6342861ca7a00f293c76"),
    ("0028_a_session_renews_one_row.sql", "dc1343e2324a857cf36a96d05f4530d0104b33b27b091f16cf8a03a38fcc4ace"),
    ("0029_a_fair_queue.sql", "58d5120cc0bf452e5a1d4adddf906d3d07470a9fdc2c953cea2e413131b789b2"),
    ("0029_a_fair_queue.sql", "f7179505f0c0d8ff9ead65b163867c7ba9b2051bffeb99ca3962a073c228121b"),
    ("0029_a_fair_queue.sql", "e5a0e9f684ab7b60523bafe74e1e32d567a206ea5b7b7f7a0a1bba2c87401b89"),
    # Never landed: the quota's acquires called the replay check without an Idempotency-Key too.
    ("0032_shared_locks_reviewed.sql", "b85eb4504ad79081f78f1e55ee2d799370e8026417ded349677b220bb5294c85"),
    # Never landed: hold limits of locks on their own only, before sessions had them.
    ("0033_hold_limits.sql", "ca26fac8b34b728bacb18bc0219ecb0285a0819b65403dde54a18efecf24d306"),
    # Never landed: a revocation request read its clock before waiting for the hold's row, and
    # one on a lease that had run out was sent before its expiry.
    ("0035_revocation_requests.sql", "628e26f5b3bbcedb51fa8f0ef34205f0d7c0aa6e66a8d728ae7bebe883c8756f"),
}


def versions(name: str) -> dict[str, bytes]:
    """Every version of a migration file in git's history, by checksum."""
    found = {}
    for commit in git("log", "--format=%H", "--", f"migrations/{name}").stdout.decode().split():
        with_it = git("show", f"{commit}:migrations/{name}", check=False)
        if with_it.returncode == 0:  # the commit that removed or renamed it has none
            found[Migration(name, with_it.stdout).checksum] = with_it.stdout
    return found


def sql(text: bytes) -> list[str]:
    """A migration's lines without their comments (a `--` in a string counts as one: close enough
    to compare two versions of one file)."""
    lines = (line.split("--", 1)[0].rstrip() for line in text.decode().splitlines())
    return [line for line in lines if line]


def test_every_version_a_migration_had_is_todays_accepted_as_it_or_refused_on_purpose() -> None:
    """A migration that changes after it landed strands every database that applied it: this fails
    on the commit that changes one, until the change is undone (or, for a change of comments alone,
    the old checksum joins EARLIER_CHECKSUMS)."""
    for migration in load():
        name = migration.name
        for checksum, text in versions(name).items():
            if checksum == migration.checksum:
                continue
            if checksum in EARLIER_CHECKSUMS.get(name, ()):
                assert sql(text) == sql(migration.sql), f"{name}: accepted {checksum} differs in SQL"
            else:
                assert (name, checksum) in REFUSED, f"{name} changed: {checksum} was in git"
                assert sql(text) != sql(migration.sql), f"{name}: {checksum} differs in comments alone"
    for name, checksums in EARLIER_CHECKSUMS.items():
        assert checksums <= set(versions(name)), f"{name}: an accepted checksum is no version in git"


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_a_rolling_upgrade_keeps_live_locks_and_history_while_an_earlier_build_serves(
    build: str, empty_db_url: str, tmp_path: Path
) -> None:
    base, commit = previous_build(tmp_path, build, None)
    env = ROUTE.env(empty_db_url)
    old_env = {**env, **served_from(base)}
    migrate(old_env)
    # The earlier build ran, not this one: it applied its own files, as its bytes are.
    built = [(m.name, m.checksum) for m in migrations_in(base / "migrations")]
    assert applied(empty_db_url) == built, commit

    workers = Workers()
    with ExitStack() as stack:
        stack.callback(workers.join)  # last, after the services stopped, should the test fail early
        old, _ = stack.enter_context(running_service(env=old_env, log=tmp_path / "old.log"))
        ended = []
        for n in range(3):
            lock = acquire(old, f"upgrade-ended-{n}", "before").json()
            assert lock_call("DELETE", old, lock).status_code == 204
            ended.append(lock)
        live = [acquire(old, f"upgrade-live-{n}", "before", ttl=300).json() for n in range(3)]
        assert all("token" in lock for lock in live), live
        # A session opened by a build that has them (0027 on) lives on across 0028, which moves its
        # locks' lease into the session's row.
        session = None
        if (base / "migrations" / "0027_sessions.sql").exists():
            pairs = [{"job_type": "upgrade-session-a"}, {"job_type": "upgrade-session-b"}]
            body = {"organization_id": HOT[0], "holder": "before", "ttl_seconds": 300, "locks": pairs}
            session = httpx.post(f"{old}/v1/sessions", json=body, timeout=15).json()
            assert len(session["locks"]) == 2, session

        workers.start("old", old, 4)
        time.sleep(0.5)
        answered = sum(workers.answers.values())
        migrating = time.monotonic()
        migrate(env)  # this build, while the earlier one serves
        migrated = time.monotonic()
        # The earlier build answered while this one migrated, or the upgrade was not rolling.
        assert sum(workers.answers.values()) > answered, workers.answers
        assert [name for name, _ in applied(empty_db_url)] == [m.name for m in load()]
        new, _ = stack.enter_context(running_service(env=env, log=tmp_path / "new.log"))
        workers.start("new", new, 4)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (
            workers.answers["old acquire 201"] > 0 and workers.answers["new acquire 201"] > 0
        ):
            time.sleep(0.2)
        time.sleep(2)
        workers.join()

        # What the earlier build granted lives on in this one, and the other way round.
        for lock in live:
            got = httpx.post(
                f"{new}/v1/locks/{lock['id']}/renew",
                headers={"Lock-Token": lock["token"]},
                json={"ttl_seconds": 60},
                timeout=15,
            )
            assert got.status_code == 200, got.text
            assert got.json()["fencing_token"] == lock["fencing_token"]
            assert lock_call("DELETE", old, lock).status_code == 204
        if session is not None:
            token = {"Lock-Token": session["token"]}
            renewed = httpx.post(
                f"{new}/v1/sessions/{session['id']}/renew",
                headers=token,
                json={"ttl_seconds": 60},
                timeout=15,
            )
            assert renewed.status_code == 200 and renewed.json()["state"] == "held", renewed.text
            for lock in session["locks"]:  # read where this build reads a lock: the session's lease
                got = httpx.get(f"{new}/v1/locks/{lock['id']}", timeout=15).json()
                assert (got["state"], got["expires_at"]) == ("held", renewed.json()["expires_at"]), got
            assert (
                httpx.delete(f"{old}/v1/sessions/{session['id']}", headers=token, timeout=15).status_code
                == 204
            )
        for lock in ended:
            got = httpx.get(f"{new}/v1/locks/{lock['id']}", timeout=15)
            assert got.status_code == 200, got.text
            assert got.json()["state"] == "released"
        after = acquire(old, "upgrade-after", "old-after")
        assert after.status_code == 201, after.text
        assert acquire(new, "upgrade-after", "new-after").status_code == 409

    answers = workers.answers
    # A call of the earlier build in flight while the migration replaced the tables it had
    # planned for fails (500, its statement rolled back: nothing granted, nothing released), and
    # one that waited for the migration's locks past the statement timeout answers 503 (a loaded
    # machine's run did), as docs/deployment.md says; any other 500 or 503 fails the upgrade.
    assert [
        (call, sent, answered)
        for call, sent, answered in workers.failed
        if not (call.startswith("old ") and sent <= migrated and answered >= migrating)
    ] == [], (workers.failed, migrating, migrated)
    assert set(answers) <= {
        f"{side} {call}"
        for side in ("old", "new")
        for call in (
            "acquire 201",
            "acquire 409",
            "release 204",
            *(f"acquire {s}" for s in FAILED),
            *(f"release {s}" for s in FAILED),
        )
    }, answers
    # Both builds granted the hot key while the other served it.
    assert answers["old acquire 201"] > 0 and answers["new acquire 201"] > 0, answers
    assert check(database_history(empty_db_url), workers.told, [], workers.released) == []
