"""Drives a running Helix Locks deployment through its balancer, as scripts/compose-smoke does.

    python3 deploy/smoke/check.py http://127.0.0.1:8080 KEY_FILE   # the admin key compose stored

Standard library only, so it runs before any virtual environment exists. Exits non-zero on the
first thing that is not as the contract says.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from typing import Any

if len(sys.argv) != 3:
    sys.exit(__doc__)
BASE = sys.argv[1].rstrip("/")
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


if __name__ == "__main__":
    main()
