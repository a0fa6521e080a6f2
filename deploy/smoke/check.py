"""Drives a running Helix Locks deployment through its balancer, as scripts/compose-smoke does,
then asks PostgreSQL, from inside a replica, what the replicas' database role may do.

    python3 deploy/smoke/check.py http://127.0.0.1:8080 KEY_FILE IN_REPLICA...

KEY_FILE holds the admin key compose stored. IN_REPLICA is a command that runs, in one of the
replicas, the Python program it reads on standard input (`podman exec -i CONTAINER python3 -`):
replica_role.py then connects with the replica's own DATABASE_URL, as the replica does.

Standard library only, so it runs before any virtual environment exists. Exits non-zero on the
first thing that is not as the contract says.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

if len(sys.argv) < 4:
    sys.exit(__doc__)
BASE = sys.argv[1].rstrip("/")
IN_REPLICA = sys.argv[3:]
# From a file: argv is for everyone to see in `ps`.
with open(sys.argv[2]) as key_file:
    KEY = key_file.read().strip()


def call(
    method: str,
    path: str,
    body: dict[str, Any] | None = None,
    token: str | None = None,
    key: str | None = None,
) -> tuple[int, Any, Any]:
    """(status, JSON body or None, headers) of one request; the key is the admin key unless given
    ("" for none)."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Lock-Token"] = token
    key = KEY if key is None else key
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(BASE + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, parsed(response.read(), response.headers), response.headers
    except urllib.error.HTTPError as error:
        return error.code, parsed(error.read(), error.headers), error.headers


def parsed(raw: bytes, headers: Any) -> Any:
    """The JSON body; None for an empty one, or for the balancer's own (HTML) answers."""
    return json.loads(raw) if raw and "json" in headers.get("Content-Type", "") else None


def expect(condition: bool, what: str) -> None:
    if not condition:
        sys.exit(f"compose-smoke: FAILED: {what}")
    print(f"compose-smoke: ok: {what}")


def lock(holder: str, ttl: float = 30, job_type: str = "nightly-report") -> dict[str, Any]:
    return {"organization_id": "acme", "job_type": job_type, "holder": holder, "ttl_seconds": ttl}


def never_open() -> None:
    """What the balancer publishes to anyone: no lock without a key, no metrics."""
    status, _, headers = call("GET", "/v1/locks", key="")
    expect(status == 401 and headers["WWW-Authenticate"] == "Bearer", "anonymous is 401 from the start")
    status, _, _ = call("POST", "/v1/locks", lock("anonymous"), key="")
    expect(status == 401, "an anonymous acquire is 401")
    status, _, _ = call("GET", "/v1/locks", key=KEY[:-1] + ("A" if KEY[-1] != "A" else "B"))
    expect(status == 401, "a key that is not the stored one is 401")
    for path in ("/metrics", "/metrics/", "//metrics"):
        status, _, _ = call("GET", path, key="")
        expect(status == 404, f"the balancer does not publish {path}")


class Stream:
    """GET /v1/events through the balancer, read by a thread of its own, so that each message can
    be waited for with a deadline and timed as it arrives."""

    def __init__(self, path: str) -> None:
        headers = {"Authorization": f"Bearer {KEY}", "Accept": "text/event-stream"}
        request = urllib.request.Request(BASE + path, headers=headers)
        self.response = urllib.request.urlopen(request, timeout=30)
        self.status: int = self.response.status
        self.headers = self.response.headers
        self._lines: queue.Queue[tuple[float, bytes | None]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True, name="events").start()

    def _read(self) -> None:
        try:
            for line in self.response:
                self._lines.put((time.monotonic(), line.rstrip(b"\r\n")))
        except (OSError, ValueError, AttributeError):  # closed under it: the checks are done
            pass
        self._lines.put((time.monotonic(), None))

    def message(self, within: float) -> tuple[float, str, Any]:
        """(when it arrived, its event type or its comment, its data) of the next message; fails
        the smoke unless it is all there within `within` seconds."""
        deadline = time.monotonic() + within
        kind, data, seen = "message", None, False
        while True:
            try:
                at, line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                sys.exit(f"compose-smoke: FAILED: the event stream sent nothing whole within {within} s")
            if line is None:
                sys.exit("compose-smoke: FAILED: the event stream ended")
            text = line.decode()
            if not text:
                if seen:
                    return at, kind, data
                continue
            if text.startswith("id: "):
                continue  # an id alone (as a stream joins) is no message, as EventSource has it
            seen = True
            if text.startswith(":"):
                kind = text
            elif text.startswith("event: "):
                kind = text.removeprefix("event: ")
            elif text.startswith("data: "):
                data = json.loads(text.removeprefix("data: "))

    def close(self) -> None:
        self.response.close()


def next_request_elsewhere(replica: str) -> None:
    """Asks /healthz until `replica` answers: round robin then hands the next request to another."""
    for _ in range(10):
        if call("GET", "/healthz")[2]["X-Helix-Upstream"] == replica:
            return
    sys.exit(f"compose-smoke: FAILED: {replica} answered none of 10 requests")


def events_across_replicas() -> None:
    """A watcher on one replica, through the balancer, sees what a worker does through another
    replica within moments, and the balancer passes each keep-alive on as it comes."""
    job_type = "events-smoke"  # its own job type: the locks above make no events on this stream
    opened = time.monotonic()
    stream = Stream(f"/v1/events?organization_id=acme&job_type={job_type}")
    watched = stream.headers["X-Helix-Upstream"]
    expect(
        stream.status == 200
        and stream.headers["Content-Type"].startswith("text/event-stream")
        and stream.headers["Cache-Control"] == "no-cache",
        f"an organization's event stream opens through the balancer, on {watched}",
    )
    at, kind, _ = stream.message(within=5)
    expect(kind == ": keep-alive", f"its first keep-alive came through {at - opened:.2f} s after the request")

    def change(method: str, path: str, body: dict[str, Any] | None = None, token: str | None = None) -> Any:
        """The answer of a change made through a replica other than the stream's."""
        next_request_elsewhere(watched)
        status, answer, headers = call(method, path, body, token=token)
        other = headers["X-Helix-Upstream"]
        expect(status in (201, 204) and other != watched, f"{method} {path} answered {status} on {other}")
        return answer

    def seen(what: str, lock_id: int) -> float:
        """When the stream delivered the event `what` of the lock, which must come next."""
        changed = time.monotonic()
        at, kind, data = stream.message(within=5)
        expect(
            kind == what and data["type"] == what and data["lock"]["id"] == lock_id,
            f"the stream on {watched} saw '{kind}' of lock {data and data['lock']['id']}"
            f" {at - changed:.2f} s after the change",
        )
        return at

    grant = change("POST", "/v1/locks", lock("watched-worker", job_type=job_type))
    seen("acquired", grant["id"])
    change("DELETE", f"/v1/locks/{grant['id']}", token=grant["token"])
    at = seen("released", grant["id"])

    # A quiet stream: each keep-alive must arrive when the replica sends it, not in a burst when
    # some buffer fills or the stream ends.
    last = at
    gaps = []
    for _ in range(2):
        at, kind, _ = stream.message(within=20)
        if kind != ": keep-alive":
            sys.exit(f"compose-smoke: FAILED: a quiet stream sent {kind}")
        gaps.append(at - last)
        last = at
    expect(
        all(gap >= 0.5 for gap in gaps),
        "a quiet stream's keep-alives came through one by one, "
        + " and ".join(f"{gap:.2f} s" for gap in gaps)
        + " apart",
    )
    stream.close()


def database_role() -> None:
    """The replicas' database role is no superuser, may create nothing (no DDL) and owns nothing;
    the schema belongs to another role, no superuser either (the one migrate runs as)."""
    program = Path(__file__).with_name("replica_role.py").read_text()
    for _ in range(10):
        ran = subprocess.run(IN_REPLICA, input=program, capture_output=True, text=True, timeout=60)
        # podman's DNS can fail a lookup for a moment (EAI_AGAIN, and EAI_NONAME "Name or service
        # not known", each seen once in a fresh-clone CI run) although the replica reached the
        # same host all along: ask again. Any other failure is the answer.
        if ran.returncode == 0 or "failed to resolve host" not in ran.stderr:
            break
        time.sleep(2)
    if ran.returncode != 0:
        sys.exit(f"compose-smoke: FAILED: asking PostgreSQL from a replica: {ran.stderr.strip()}")
    facts = json.loads(ran.stdout)
    user = facts["user"]
    expect(
        not facts["superuser"] and not facts["creates_roles_or_databases"],
        f"the replicas connect to PostgreSQL as {user}, "
        + ("a superuser" if facts["superuser"] else "no superuser")
        + (", who may create roles or databases" if facts["creates_roles_or_databases"] else ""),
    )
    expect(
        facts["create_table"].startswith("42501 "),
        f"CREATE TABLE in schema {facts['schema']} as {user}: {facts['create_table']}",
    )
    creates = ["schemas"] * facts["creates_schemas"] + [f"objects in {n}" for n in facts["creates_in"]]
    expect(
        not creates,
        f"{user} may create " + (", ".join(creates) or "no schema, and no object in any schema"),
    )
    expect(facts["owns"] == 0, f"{user} owns {facts['owns']} tables, functions or schemas")
    expect(
        facts["owner"] != user and not facts["owner_superuser"],
        f"schema {facts['schema']} belongs to {facts['owner']}, "
        + ("a superuser" if facts["owner_superuser"] else "no superuser"),
    )


def main() -> None:
    deadline = time.monotonic() + 120
    while True:
        try:
            if call("GET", "/readyz")[0] == 200:
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            sys.exit("compose-smoke: FAILED: the balancer never answered /readyz with 200")
        time.sleep(1)
    expect(True, "ready through the balancer")
    never_open()

    status, grant, headers = call("POST", "/v1/locks", lock("worker-1"))
    expect(status == 201 and headers["Location"] == f"/v1/locks/{grant['id']}", "acquire answers 201")
    status, problem, headers = call("POST", "/v1/locks", lock("worker-2"))
    expect(
        status == 409 and problem["holder"] == "worker-1" and int(headers["Retry-After"]) >= 1,
        "a second acquire answers 409 naming the holder",
    )
    status, _, _ = call("DELETE", f"/v1/locks/{grant['id']}", token=grant["token"])
    expect(status == 204, "release answers 204")
    status, problem, _ = call("DELETE", f"/v1/locks/{grant['id']}", token=grant["token"])
    expect(status == 410 and problem["release_reason"] == "released", "releasing again answers 410")

    status, crashed, _ = call("POST", "/v1/locks", lock("crashing-worker", ttl=1, job_type="reindex"))
    expect(status == 201, "a worker takes a 1 s lock and dies without releasing it")
    expect(
        call("POST", "/v1/locks", lock("successor", job_type="reindex"))[0] == 409, "refused before expiry"
    )
    deadline = time.monotonic() + 15
    while True:
        status, successor, _ = call("POST", "/v1/locks", lock("successor", job_type="reindex"))
        if status != 409 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    expect(
        status == 201
        and successor["reclaimed"]["lock_id"] == crashed["id"]
        and successor["fencing_token"] == crashed["fencing_token"] + 1,
        "after expiry the next acquire reclaims it, with the next fencing token",
    )

    upstreams = {call("GET", "/healthz")[2]["X-Helix-Upstream"] for _ in range(20)}
    expect(len(upstreams) >= 2, f"requests were answered by {len(upstreams)} replicas: {sorted(upstreams)}")
    events_across_replicas()
    database_role()


if __name__ == "__main__":
    main()
