"""The sample answers in README.md and docs/*.md have the fields the service sends, and the lock
object's table in docs/api.md names every field of a lock: a real `helix-locks serve` is driven
once through each route that a sample shows, and the set of keys compared, level by level.

A code block that holds samples says which, in a comment just before it:
`<!-- samples: acquire, lock-held -->` names, in order, the JSON objects that begin a line of the
block (after a shell comment's `#` or an event's `data:`); each name is one of ANSWERS. `{...}`
in a sample stands for an object left out, and is not compared. A block with such an object and
no comment fails, so that a new sample cannot go unchecked."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import psycopg
import pytest
from psycopg import sql

from harness.processes import ROOT, running_service, url_for

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:<!-- samples: (?P<names>[^>]*) -->\n)?^```[^\n]*\n(?P<code>.*?)^```", re.S | re.M)
# Where a sample begins: `{"` at a line's start, or after a shell comment's `#` or an event's `data:`.
START = re.compile(r'^(?:#\s*|data:\s*)?(?=\{")', re.M)
ELIDED = "{...}"
KEY = {"organization_id": "acme", "job_type": "nightly-report"}


def _objects(code: str) -> Iterator[str]:
    """The JSON objects that begin a line of `code` (see START), with the `#` of a shell comment's
    continuation lines taken out."""
    for start in START.finditer(code):
        depth, quoted = 0, False
        for end in range(start.end(), len(code)):
            char = code[end]
            if quoted:
                quoted = char != '"' or code[end - 1] == "\\"
            elif char == '"':
                quoted = True
            elif char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    yield re.sub(r"\n#", "\n", code[start.end() : end + 1])
                    break


def samples() -> list[tuple[str, str, Any]]:
    """(where, name, sample) for every sample in the pages; an unnamed one has the name ''."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for block in BLOCK.finditer(text):
            objects = list(_objects(block["code"]))
            names = [name.strip() for name in (block["names"] or "").split(",") if name.strip()]
            line = text[: block.start("code")].count("\n")
            where = f"{page.relative_to(ROOT)}:{line}"
            assert not objects or len(names) == len(objects), (
                f"{where}: {len(objects)} samples, named {names} (name each in <!-- samples: … -->)"
            )
            for name, sample in zip(names, objects, strict=True):
                found.append((where, name, json.loads(sample.replace(ELIDED, json.dumps(ELIDED)))))
    return found


def differences(sample: Any, real: Any, path: str = "") -> list[str]:
    """Where the keys of `sample` and `real` differ, at any depth (of a list: its first item)."""
    if sample == ELIDED:
        return []
    if isinstance(sample, dict) and isinstance(real, dict):
        said = [f"{path}.{key}: not sent" for key in sample.keys() - real.keys()]
        said += [f"{path}.{key}: sent, not in the sample" for key in real.keys() - sample.keys()]
        for key in sample.keys() & real.keys():
            said += differences(sample[key], real[key], f"{path}.{key}")
        return said
    if isinstance(sample, list) and isinstance(real, list) and sample and real:
        return differences(sample[0], real[0], f"{path}[0]")
    return []


def _first_event(url: str) -> dict[str, Any]:
    """The data of the event that an acquire makes, read from GET /v1/events."""
    with (
        httpx.Client(base_url=url, timeout=httpx.Timeout(10)) as http,
        http.stream("GET", "/v1/events", params={"organization_id": "acme"}) as stream,
    ):
        lines = stream.iter_lines()
        # The first keep-alive comment says the stream has joined: every change from then on reaches it.
        while not next(lines).startswith(":"):
            pass
        http.post("/v1/locks", json={**KEY, "job_type": "watched", "holder": "w", "ttl_seconds": 30})
        for line in lines:
            if line.startswith("data:"):
                event: dict[str, Any] = json.loads(line.removeprefix("data:"))
                return event
    raise AssertionError("the stream ended before an event")


def _a_queue(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """GET /v1/locks/queue while one acquire waits for the held key (its 2 s wait runs out after)."""
    waiting = {**body, "holder": "worker-9@host-1", "wait_seconds": 2}
    with ThreadPoolExecutor(1) as pool:
        waiter = pool.submit(httpx.post, f"{url}/v1/locks", json=waiting, timeout=10)
        deadline = time.monotonic() + 10
        page: dict[str, Any] = {"items": []}
        while not page["items"]:
            page = httpx.get(f"{url}/v1/locks/queue", params=KEY, timeout=10).json()
            assert time.monotonic() < deadline, "the waiter never took its place"
            time.sleep(0.02)
        assert waiter.result().status_code == 409
    return page


@pytest.fixture(scope="module")
def answers(server_url: str, template_name: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What the service answers on each route a sample shows, by the samples' names."""
    name = f"helix_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(template_name)
            )
        )
    log = tmp_path_factory.mktemp("samples") / "serve.log"
    try:
        with running_service(env={"DATABASE_URL": url_for(server_url, name)}, log=log) as (url, _):
            body = {**KEY, "holder": "worker-7@host-3", "ttl_seconds": 30}
            acquired = httpx.post(f"{url}/v1/locks", json=body, timeout=10)
            held = httpx.post(f"{url}/v1/locks", json={**body, "holder": "worker-8"}, timeout=10)
            lock = httpx.get(f"{url}/v1/locks/{acquired.json()['id']}", timeout=10)
            document = httpx.get(f"{url}/openapi.json", timeout=10).json()
            assert (acquired.status_code, held.status_code, lock.status_code) == (201, 409, 200)
            request = document["components"]["schemas"]["AcquireRequest"]["properties"]
            return {
                "queue-page": _a_queue(url, body),
                "acquire": acquired.json(),
                "lock-held": held.json(),
                "lock": lock.json(),
                "event": _first_event(url),
                "acquire-request": dict.fromkeys(request),  # the fields an acquire may send
            }
    finally:
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


def test_the_samples_are_found_and_named() -> None:
    named = {name for _, name, _ in samples()}
    assert {"acquire", "lock-held", "event", "acquire-request"} <= named, named


def test_every_sample_answer_has_the_fields_the_service_sends(answers: dict[str, Any]) -> None:
    found = samples()
    unknown = {name for _, name, _ in found} - answers.keys()
    assert not unknown, f"samples named {unknown}: add them to the answers fixture"
    wrong = [
        f"{where} ({name}) {said}"
        for where, name, sample in found
        for said in differences(sample, answers[name])
    ]
    assert not wrong, "\n".join(wrong)


def test_the_lock_objects_table_names_every_field_of_a_lock(answers: dict[str, Any]) -> None:
    page = (ROOT / "docs" / "api.md").read_text()
    table = page.split("## The lock object", 1)[1].split("\n## ", 1)[0]
    named = {
        name for cell in re.findall(r"^\| (`.*?) \|", table, re.M) for name in re.findall(r"`(\w+)`", cell)
    }
    assert named == answers["lock"].keys(), {
        "not in the table": answers["lock"].keys() - named,
        "not sent": named - answers["lock"].keys(),
    }
