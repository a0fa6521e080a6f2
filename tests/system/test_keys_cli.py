"""`helix-locks keys` and protected mode, with real processes: revocation reaches every replica."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import httpx
import psycopg

from harness.processes import ROOT, helix_command, running_service
from helix_locks.server import keys

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
                assert time.monotonic() - started < 5, f"{base} still honours a revoked key"
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


def stored_keys(database_url: str) -> dict[str, tuple[str | None, bytes]]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        rows = conn.execute("SELECT id, organization_id, key_hash FROM helix_api_keys").fetchall()
    return {row[0]: (row[1], row[2]) for row in rows}


def key_file(tmp_path: Path, name: str, database_url: str) -> tuple[Path, str]:
    made = helix("keys", "new", database_url=database_url)
    assert made.returncode == 0, made.stderr
    path = tmp_path / name
    path.write_text(made.stdout)
    return path, made.stdout.strip()


def test_new_prints_a_fresh_key_and_needs_no_database() -> None:
    nowhere = "postgresql://nobody@127.0.0.1:1/nothing"
    first, second = (helix("keys", "new", database_url=nowhere) for _ in range(2))
    assert first.returncode == second.returncode == 0, first.stderr
    assert KEY_PATTERN.match(first.stdout.strip()) and first.stdout.endswith("\n")
    assert first.stdout != second.stdout


def test_create_from_file_stores_that_key_and_never_prints_it(db_url: str, tmp_path: Path) -> None:
    path, key = key_file(tmp_path, "admin-key", db_url)
    created = helix("keys", "create", "--admin", "--from-file", str(path), database_url=db_url)
    assert created.returncode == 0, created.stderr
    key_id = keys.key_id(key)
    assert created.stdout == f"stored key {key_id}\n"
    assert key not in created.stdout + created.stderr
    assert stored_keys(db_url) == {key_id: (None, keys.digest(key))}

    again = helix("keys", "create", "--admin", "--from-file", str(path), database_url=db_url)
    assert again.returncode == 1
    assert f"a key with id {key_id} exists already" in again.stderr
    assert "Traceback" not in again.stderr


def test_if_none_bootstraps_a_fresh_database_once(empty_db_url: str, tmp_path: Path) -> None:
    first, first_key = key_file(tmp_path, "first", empty_db_url)
    second, _ = key_file(tmp_path, "second", empty_db_url)
    first_id = keys.key_id(first_key) or ""
    bootstrap = ("keys", "create", "--admin", "--if-none", "--from-file")
    created = helix(*bootstrap, str(first), database_url=empty_db_url)
    assert created.returncode == 0, created.stderr
    assert stored_keys(empty_db_url) == {first_id: (None, keys.digest(first_key))}

    for state in ("live", "revoked"):  # revoking every key must not reopen the bootstrap either
        if state == "revoked":
            assert helix("keys", "revoke", first_id, database_url=empty_db_url).returncode == 0
        skipped = helix(*bootstrap, str(second), database_url=empty_db_url)
        assert skipped.returncode == 0, skipped.stderr
        assert skipped.stdout == ""
        assert "an API key exists already" in skipped.stderr
        assert list(stored_keys(empty_db_url)) == [first_id], state


def test_create_from_file_refuses_what_is_not_a_key(db_url: str, tmp_path: Path) -> None:
    _, key = key_file(tmp_path, "good", db_url)
    contents = {
        "empty": "",
        "short": "hlk_0123456789ab_tooshort\n",
        "uppercase-id": key.replace(key[4:16], "0123456789AB") + "\n",
        "two-keys": f"{key}\n{key}\n",
        "trailing": key + "=\n",
    }
    for name, content in contents.items():
        (tmp_path / name).write_text(content)
    paths = {tmp_path / name: "does not hold an API key" for name in contents}
    paths |= {tmp_path / "missing": "cannot read an API key", tmp_path: "cannot read an API key"}
    for path, reason in paths.items():
        refused = helix("keys", "create", "--admin", "--from-file", str(path), database_url=db_url)
        assert refused.returncode != 0, path
        assert reason in refused.stderr, (path, refused.stderr)
        assert "Traceback" not in refused.stderr, path
        assert refused.stdout == "", path
        assert key not in refused.stderr, path
    assert stored_keys(db_url) == {}
