"""`helix-locks keys` and protected mode, with real processes: revocation reaches every replica."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import httpx

from service import keys
from tests.support import ROOT, helix_command, running_service

KEY_PATTERN = re.compile(r"^hlk_([0-9a-f]{12})_[A-Za-z0-9_-]{43}$")


def helix(*args: str, database_url: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DATABASE_URL": database_url}
    return subprocess.run(helix_command(*args), env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_create_prints_the_key_alone_list_never_shows_it_revoke_by_id(db_url: str) -> None:
    created = helix("keys", "create", "--org", "acme", database_url=db_url)
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip()
    match = KEY_PATTERN.match(key)
    assert match, created.stdout
    assert created.stdout == key + "\n"
    admin = helix("keys", "create", "--admin", database_url=db_url).stdout.strip()

    listed = helix("keys", "list", database_url=db_url)
    assert listed.returncode == 0
    assert match.group(1) in listed.stdout
    assert "org:acme" in listed.stdout
    assert "admin" in listed.stdout
    assert key not in listed.stdout
    assert admin not in listed.stdout

    assert (
        helix("keys", "revoke", match.group(1), database_url=db_url).stdout.strip()
        == f"revoked {match.group(1)}"
    )
    revoked_line = next(
        line
        for line in helix("keys", "list", database_url=db_url).stdout.splitlines()
        if match.group(1) in line
    )
    assert revoked_line.split()[-1] != "-", "the list shows when it was revoked"
    unknown = helix("keys", "revoke", "000000000000", database_url=db_url)
    assert unknown.returncode == 1
    assert "no API key" in unknown.stderr


def test_create_refuses_a_bad_organization_and_needs_a_scope(db_url: str) -> None:
    assert helix("keys", "create", "--org", "no spaces", database_url=db_url).returncode == 2
    assert helix("keys", "create", database_url=db_url).returncode == 2


def test_revocation_reaches_every_replica_at_once(db_url: str, tmp_path: Path) -> None:
    env = {"DATABASE_URL": db_url}
    key = keys.create(db_url, "acme")
    with (
        running_service(env=env, log=tmp_path / "a.log") as (first, _),
        running_service(env=env, log=tmp_path / "b.log") as (second, _),
    ):
        headers = {"Authorization": f"Bearer {key}"}
        body = {"organization_id": "acme", "job_type": "j", "holder": "w", "ttl_seconds": 30}
        grant = httpx.post(f"{first}/v1/locks", json=body, headers=headers, timeout=10)
        assert grant.status_code == 201
        for base in (first, second):
            assert httpx.get(f"{base}/v1/locks", headers=headers, timeout=10).status_code == 200
        revoked = helix("keys", "revoke", keys.key_id(key) or "", database_url=db_url)
        assert revoked.returncode == 0
        started = time.monotonic()
        for base in (first, second):
            while httpx.get(f"{base}/v1/locks", headers=headers, timeout=10).status_code != 401:
                assert time.monotonic() - started < 2, f"{base} still honours a revoked key"
                time.sleep(0.01)
    for log in ("a.log", "b.log"):
        text = (tmp_path / log).read_text()
        assert key not in text
        assert grant.json()["token"] not in text


def test_a_public_address_serves_once_a_key_exists_and_never_anonymously(db_url: str, tmp_path: Path) -> None:
    key = keys.create(db_url, None)
    with running_service("--host", "0.0.0.0", env={"DATABASE_URL": db_url}, log=tmp_path / "s.log") as (
        url,
        _,
    ):
        assert httpx.get(f"{url}/v1/locks", timeout=10).status_code == 401
        ok = httpx.get(f"{url}/v1/locks", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        assert ok.status_code == 200


def test_insecure_serves_anonymously_on_a_public_address_with_a_warning(db_url: str, tmp_path: Path) -> None:
    log = tmp_path / "s.log"
    with running_service("--host", "0.0.0.0", "--insecure", env={"DATABASE_URL": db_url}, log=log) as (
        url,
        _,
    ):
        assert httpx.get(f"{url}/v1/locks", timeout=10).status_code == 200
    assert "--insecure" in log.read_text()
