"""PostgreSQL failover under load: Patroni with two nodes in synchronous mode, its leader killed,
then a planned switchover, while racing clients take and give back locks through the service.

Needs Patroni, etcd and PostgreSQL 15 from Debian (`apt-get install -y patroni etcd-server
etcd-client`; .ci/run installs them) and root, since the servers run as the postgres user.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.history import check, database_history
from harness.load import KEYS, Load, Run
from harness.processes import running_service
from helix_locks.server import keys
from helix_locks.server.migrate import migrate
from tests.patroni_cluster import Cluster, patroni_cluster

# A fault test: run by `scripts/test -m fault`, after the default suite (docs/development.md).
pytestmark = pytest.mark.fault

SEMAPHORE = ("acme", "exports")

MISSING = [tool for tool in ("patroni", "etcd") if shutil.which(tool) is None]
if MISSING and not os.environ.get("CI"):
    pytest.skip(
        f"needs {' and '.join(MISSING)}: apt-get install -y patroni etcd-server etcd-client",
        allow_module_level=True,
    )


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    workdir = Path(tempfile.mkdtemp(prefix="helix-patroni-"))
    try:
        with patroni_cluster(workdir) as running:
            running.wait_healthy()
            yield running
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.timeout(300)  # the cluster's own waits report better than pytest-timeout would
def test_no_overlap_and_no_lost_grant_through_failover_and_switchover(
    cluster: Cluster, tmp_path: Path
) -> None:
    migrate(cluster.url)
    admin = keys.create(cluster.url, None)  # as deployed: keys required
    with (
        running_service(env={"DATABASE_URL": cluster.url}, log=tmp_path / "s.log") as (url, server),
        httpx.Client(base_url=url, timeout=15, headers={"Authorization": f"Bearer {admin}"}) as http,
    ):
        body = {"organization_id": "acme", "job_type": "long-job", "holder": "survivor", "ttl_seconds": 600}
        survivor = http.post("/v1/locks", json=body).json()

        # The racing clients' keys: locks, and a semaphore of 3.
        raced = {**dict.fromkeys(KEYS, 1), SEMAPHORE: 3}
        with Load([url], clients=8, ttl=1.0, api_key=admin, keys=raced) as load:
            time.sleep(3)
            old = cluster.kill_leader()
            killed_at = time.monotonic()  # its Patroni and PostgreSQL are dead
            cluster.wait_failover(old)
            time.sleep(3)
            # Served again by itself, on the new leader, before anyone touched the old node.
            failover_gap = load.run.longest_gap(killed_at, killed_at)
            cluster.restart(old)
            cluster.wait_healthy()
            time.sleep(2)
            switched_at = time.monotonic()
            cluster.switchover()
            switched = time.monotonic()  # the new leader takes writes
            time.sleep(3)
            switchover_gap = load.run.longest_gap(switched_at, switched)
            cluster.wait_healthy()
            time.sleep(2)
        run = load.run

        # The lock granted before both faults is intact and still its holder's.
        released = http.delete(f"/v1/locks/{survivor['id']}", headers={"Lock-Token": survivor["token"]})
        assert released.status_code == 204, released.text
        assert server.poll() is None, "the same service process all along"

    print_figures(run, failover_gap, switchover_gap)
    grants = database_history(cluster.url)
    violations = check(grants, run.told, run.renewed, run.released, run.release_attempts)
    assert violations == [], "\n".join(violations[:20])
    assert {g.max_holders for g in grants if g.key == SEMAPHORE} == {3}
    assert len({g.slot for g in grants if g.key == SEMAPHORE}) > 1, "the semaphore had several holders"
    assert run.errors() == {}, "only 503 while the database was away: never a 500"
    assert run.slowest < 10, f"a request took {run.slowest:.1f} s: nothing may hang"
    # The gaps were real and answered 503, every answer came back, and the gaps were bounded.
    assert run.answers["acquire 503"] > 0
    assert run.unknown == 0, "an answer was lost: a reset or a timeout"
    assert failover_gap < 20 and switchover_gap < 10


def print_figures(run: Run, failover_gap: float, switchover_gap: float) -> None:
    print(
        f"\nfailover: no grant for {failover_gap:.2f} s; switchover: no grant for {switchover_gap:.2f} s;"
        f" {len(run.told)} grants, {len(run.released)} releases, {len(run.renewed)} renewals,"
        f" {run.crashes} crashed holders; answers {run.snapshot()}; {run.unknown} unknown;"
        f" slowest answer {run.slowest:.2f} s"
    )
