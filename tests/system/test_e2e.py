"""End to end: the real `helix-locks serve` on its embedded PostgreSQL, and a worker that dies."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx

from harness.processes import running_service

WORKER = """
import json, sys, time, httpx
grant = httpx.post(sys.argv[1] + "/v1/locks", json={
    "organization_id": "acme", "job_type": "reindex", "holder": "doomed-worker", "ttl_seconds": 1})
print(json.dumps({"status": grant.status_code, **grant.json()}), flush=True)
time.sleep(600)  # "working" until killed; it never releases
"""


def acquire(base_url: str) -> httpx.Response:
    body = {"organization_id": "acme", "job_type": "reindex", "holder": "successor", "ttl_seconds": 30}
    return httpx.post(f"{base_url}/v1/locks", json=body, timeout=10)


def test_lock_of_a_killed_worker_is_refused_until_expiry_then_reclaimed(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    env = {"DATABASE_URL": None}  # the embedded default
    with running_service("--data-dir", str(data_dir), env=env, log=tmp_path / "serve.log") as (url, server):
        with subprocess.Popen(
            [sys.executable, "-c", WORKER, url], stdout=subprocess.PIPE, text=True
        ) as worker:
            assert worker.stdout is not None
            grant = json.loads(worker.stdout.readline())
            worker.send_signal(signal.SIGKILL)
        assert worker.returncode == -signal.SIGKILL
        assert grant["status"] == 201

        refused = acquire(url)
        assert refused.status_code == 409, refused.text
        assert refused.json()["lock_id"] == grant["id"]
        assert refused.json()["holder"] == "doomed-worker"

        deadline = time.monotonic() + 10
        answer = acquire(url)
        while answer.status_code == 409 and time.monotonic() < deadline:
            assert answer.json()["lock_id"] == grant["id"]
            time.sleep(0.1)
            answer = acquire(url)
        assert answer.status_code == 201, answer.text
        successor = answer.json()
        assert successor["reclaimed"] == {
            "lock_id": grant["id"],
            "holder": "doomed-worker",
            "expired_at": grant["expires_at"],
        }
        assert datetime.fromisoformat(successor["acquired_at"]) >= datetime.fromisoformat(grant["expires_at"])
        assert successor["fencing_token"] == grant["fencing_token"] + 1

        server.send_signal(signal.SIGINT)  # Ctrl-C
        assert server.wait(timeout=30) == 0
    assert not (data_dir / "pgdata" / "postmaster.pid").exists(), "the embedded PostgreSQL was left running"
