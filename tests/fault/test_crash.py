"""A service replica SIGKILLed under load and started again, beside a replica that carries on."""

from __future__ import annotations

import signal
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from harness.history import check, database_history
from harness.load import KEYS, Load
from harness.processes import running_service

# A fault test: run by `scripts/test -m fault`, after the default suite (docs/development.md).
pytestmark = pytest.mark.fault

SEMAPHORE = ("acme", "exports")


def test_a_replica_crash_costs_only_its_own_clients_and_loses_no_lock(db_url: str, tmp_path: Path) -> None:
    env = {"DATABASE_URL": db_url}
    with ExitStack() as stack:
        doomed, doomed_process = stack.enter_context(running_service(env=env, log=tmp_path / "a.log"))
        steady, _ = stack.enter_context(running_service(env=env, log=tmp_path / "b.log"))
        http = stack.enter_context(httpx.Client(timeout=15))
        body = {"organization_id": "acme", "job_type": "long-job", "holder": "survivor", "ttl_seconds": 600}
        survivor = http.post(f"{doomed}/v1/locks", json=body).json()

        # Clients of the doomed replica, and clients of the steady one, on the same keys: locks,
        # and a semaphore of 3 (issue 21).
        doomed_urls = [doomed]
        keys = {**dict.fromkeys(KEYS, 1), SEMAPHORE: 3}
        with (
            Load(doomed_urls, clients=6, name="doomed", keys=keys) as on_doomed,
            Load([steady], clients=6, name="steady", keys=keys) as on_steady,
        ):
            time.sleep(2)
            doomed_process.send_signal(signal.SIGKILL)
            doomed_process.wait()
            time.sleep(1)
            restarted, _ = stack.enter_context(running_service(env=env, log=tmp_path / "a2.log"))
            doomed_urls[:] = [restarted]
            restarted_at = time.monotonic()
            time.sleep(2)

        # Its lock outlived the replica that granted it, and any replica serves its token.
        token = {"Lock-Token": survivor["token"]}
        renewal = http.post(
            f"{steady}/v1/locks/{survivor['id']}/renew", json={"ttl_seconds": 60}, headers=token
        )
        assert renewal.status_code == 200, renewal.text
        assert http.delete(f"{restarted}/v1/locks/{survivor['id']}", headers=token).status_code == 204

    steady_run, doomed_run = on_steady.run, on_doomed.run
    assert steady_run.errors() == {} and steady_run.unknown == 0, "the steady replica's clients saw errors"
    assert steady_run.unavailable() == 0
    assert doomed_run.unknown > 0, "the crash was felt by the doomed replica's clients"
    assert doomed_run.errors() == {}
    assert any(t > restarted_at for t in doomed_run.granted_at), "its clients were served after the restart"
    told = steady_run.told + doomed_run.told
    renewed = steady_run.renewed + doomed_run.renewed
    released = steady_run.released + doomed_run.released
    grants = database_history(db_url)
    violations = check(grants, told, renewed, released)
    assert violations == [], "\n".join(violations[:20])
    assert {g.max_holders for g in grants if g.key == SEMAPHORE} == {3}
    assert len({g.slot for g in grants if g.key == SEMAPHORE}) > 1, "the semaphore had several holders"
