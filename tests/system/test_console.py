"""/console, the operator's console: its headers, and the page in a real browser (Debian's
chromium) that can reach nothing but the service, against a real service process and real locks."""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from asgi_lifespan import LifespanManager
from selenium.common.exceptions import ElementNotInteractableException, StaleElementReferenceException
from selenium.webdriver import Chrome
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from harness.browser import offline_chromium
from harness.processes import running_service
from helix_locks.server import keys
from helix_locks.server.app import create_app
from helix_locks.server.console import ASSETS, CONTENT_SECURITY_POLICY
from tests.support import ROUTE, needs_chromium

HOSTILE = "<img src=x onerror=alert(1)>"
EXACT_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


@pytest.fixture(scope="module")
def chromium() -> Iterator[Chrome]:
    """One headless chromium for the module, its console log kept, every name but 127.0.0.1 unresolvable."""
    driver: Chrome = offline_chromium(console_log=True)
    driver.set_window_size(1280, 800)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def browser(chromium: Chrome) -> Chrome:
    """The module's chromium on a blank page, its log emptied: an earlier test's page, whose service
    has gone, no longer runs and can write no error into this test's log."""
    chromium.get("about:blank")
    console_log(chromium)
    return chromium


@pytest.fixture
def artifacts(tmp_path: Path) -> Path:
    """Where screenshots go: $HELIX_TEST_ARTIFACTS when set, else the test's own directory."""
    given = os.environ.get("HELIX_TEST_ARTIFACTS")
    folder = Path(given) if given else tmp_path
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def acquire(url: str, job_type: str, holder: str, key: str | None = None, **more: Any) -> dict[str, Any]:
    body = {"organization_id": "acme", "job_type": job_type, "holder": holder, "ttl_seconds": 300, **more}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    answer = httpx.post(f"{url}/v1/locks", json=body, headers=headers, timeout=10)
    assert answer.status_code == 201, answer.text
    lock: dict[str, Any] = answer.json()
    return lock


def holders(browser: Chrome) -> list[str]:
    found: list[str] = browser.execute_script(
        "return [...document.querySelectorAll('#lock-rows td.holder')].map(cell => cell.textContent)"
    )
    return found


def wait_for(browser: Chrome, condition: Any, within: float = 10) -> Any:
    """condition's first true answer; the page redraws as events come, so a stale element is retried,
    and so is one not yet interactable (a row's button drawn but not laid out yet: seen in CI)."""
    retried = (StaleElementReferenceException, ElementNotInteractableException)
    waiting = WebDriverWait(browser, within, 0.05, ignored_exceptions=retried)
    return waiting.until(condition)


def click(browser: Chrome, selector: str) -> None:
    """Click the element the selector finds now, again if a redraw replaced it meanwhile."""
    wait_for(browser, lambda b: b.find_element(By.CSS_SELECTOR, selector).click() or True)


def span(browser: Chrome) -> float:
    """The seconds the timeline shows, from its label."""
    seconds: float = browser.execute_script(
        "const label = document.querySelector('#timeline-chart svg').getAttribute('aria-label');"
        "const [, start, end] = / from (\\S+) to (\\S+)$/.exec(label);"
        "return (Date.parse(end) - Date.parse(start)) / 1000"
    )
    return seconds


def bar(browser: Chrome, kind: str) -> dict[str, Any] | None:
    """The facts of the timeline's first bar of this kind, read at once (a redraw replaces it)."""
    found: dict[str, Any] | None = browser.execute_script(
        "const bar = document.querySelector(`#timeline-chart g.lock[data-kind=${arguments[0]}]`);"
        "return bar && {id: bar.dataset.lockId, marks: [...bar.querySelectorAll('[data-mark]')]"
        ".map(mark => mark.dataset.mark), title: bar.querySelector('title').textContent}",
        kind,
    )
    return found


def open_console(browser: Chrome, url: str, key: str | None = None) -> None:
    """Load the console, sign in with the key if given, and wait until it follows the events."""
    browser.get(f"{url}/console")
    if key is not None:
        field = wait_for(browser, lambda b: b.find_element(By.ID, "api-key"))
        wait_for(browser, lambda b: field.is_displayed())
        field.send_keys(key)
        browser.find_element(By.CSS_SELECTOR, "#sign-in-form button[type=submit]").click()
    wait_for(browser, lambda b: b.find_element(By.ID, "stream-state").text.startswith("Live"))


def console_log(browser: Chrome) -> list[dict[str, Any]]:
    """What the page wrote to its console since the last call."""
    entries: list[dict[str, Any]] = browser.get_log("browser")  # type: ignore[no-untyped-call]
    return entries


def errors(browser: Chrome, allowed: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The console's errors, but those whose message holds an allowed text."""
    return [
        entry
        for entry in console_log(browser)
        if entry["level"] == "SEVERE" and not any(text in entry["message"] for text in allowed)
    ]


class FaultyProxy:
    """An HTTP front for the service that streams its answers through (the event stream too), and
    injects the faults a console must survive: `cut_stream` cuts the next event stream inside its
    first event; `gone_resume` answers the next resume (a request with Last-Event-ID) `410`;
    `hold_join` holds back each join (an event stream request without Last-Event-ID) that long;
    `fail[prefix]` answers that many of the next requests whose path starts with prefix `503`.
    `arrived` lists (path, whether it carried Last-Event-ID) in the order they came."""

    def __init__(self, target: str) -> None:
        self.cut_stream = False
        self.gone_resume = False
        self.hold_join = 0.0
        self.fail: dict[str, int] = {}
        self.cuts = 0
        self.arrived: list[tuple[str, bool]] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def _problem(self, status: int, kind: str) -> None:
                content = json.dumps(
                    {"type": f"urn:helix-locks:problem:{kind}", "title": kind, "status": status}
                )
                self.send_response(status)
                self.send_header("Content-Type", "application/problem+json")
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content.encode())

            def do_GET(self) -> None:
                resume = self.headers.get("Last-Event-ID") is not None
                proxy.arrived.append((self.path, resume))
                failing = next((p for p, n in proxy.fail.items() if n > 0 and self.path.startswith(p)), None)
                if failing is not None:
                    proxy.fail[failing] -= 1
                    return self._problem(503, "database-unavailable")
                stream = self.path.startswith("/v1/events")
                if stream and resume and proxy.gone_resume:
                    proxy.gone_resume = False
                    return self._problem(410, "events-expired")
                if stream and not resume:
                    time.sleep(proxy.hold_join)
                cut = stream and proxy.cut_stream
                if cut:
                    proxy.cut_stream = False
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                with httpx.stream("GET", proxy.target + self.path, headers=headers, timeout=None) as answer:
                    self.send_response(answer.status_code)
                    for name in ("content-type", "cache-control"):
                        if name in answer.headers:
                            self.send_header(name, answer.headers[name])
                    self.end_headers()  # HTTP/1.0: the body ends when the connection closes
                    for chunk in answer.iter_raw():
                        if cut and b"data:" in chunk:
                            self.wfile.write(chunk[: chunk.index(b"data:") + 8])  # half an event
                            proxy.cuts += 1
                            return
                        self.wfile.write(chunk)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.target = target
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FaultyProxy:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def live_ids(browser: Chrome) -> set[int]:
    """The ids of the locks the page holds as live."""
    return set(browser.execute_script("return [...live.keys()]"))


@pytest.mark.anyio
async def test_the_page_is_served_with_a_strict_policy_and_no_key(client: httpx.AsyncClient) -> None:
    page = await client.get("/console")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["content-security-policy"] == EXACT_POLICY == CONTENT_SECURITY_POLICY
    assert page.headers["x-content-type-options"] == "nosniff"
    assert page.headers["referrer-policy"] == "no-referrer"
    assert "<script>" not in page.text and "style=" not in page.text and "<style" not in page.text
    for asset, kind in (("console.js", "javascript"), ("console.css", "text/css")):
        answer = await client.get(f"/console/assets/{asset}")
        assert answer.status_code == 200 and kind in answer.headers["content-type"], asset
        assert answer.headers["x-content-type-options"] == "nosniff"
    script = (await client.get("/console/assets/console.js")).text
    assert "innerHTML" not in script and "insertAdjacentHTML" not in script and "eval(" not in script
    assert (await client.get("/console/assets/nothing.js")).status_code == 404
    # Every answer under /console carries the page's headers: a 404, a 405, a redirect too.
    for method, path, status in (
        ("GET", "/console/assets/nothing.js", 404),
        ("GET", "/console/assets/console.js/", 404),  # a trailing slash names no file
        ("GET", "/console/assets/", 404),
        ("POST", "/console", 405),
        ("POST", "/console/assets/console.js", 405),
        ("GET", "/console/", None),
        ("GET", "/console/assets", None),
    ):
        answer = await client.request(method, path)
        assert status is None or answer.status_code == status, (method, path, answer.status_code)
        assert answer.status_code != 200, (method, path)
        assert answer.headers.get("content-security-policy") == EXACT_POLICY, (
            method,
            path,
            answer.status_code,
        )
        assert answer.headers.get("x-content-type-options") == "nosniff", (method, path)
        assert answer.headers.get("referrer-policy") == "no-referrer", (method, path)
        if status == 405:  # the methods the page and its files do answer
            assert answer.headers["allow"] == "GET, HEAD", (method, path)
    document = (await client.get("/openapi.json")).json()
    assert not [path for path in document["paths"] if path.startswith("/console")]


@pytest.mark.anyio
async def test_the_service_s_root_leads_to_the_console(client: httpx.AsyncClient) -> None:
    """Not a JSON 404 to whoever opens the service's address in a browser."""
    for method in ("GET", "HEAD"):
        root = await client.request(method, "/")
        assert (root.status_code, root.headers.get("location")) == (307, "/console"), (method, root)
    unknown = await client.get("/?org=acme")  # the root declares no query parameter either
    assert unknown.status_code == 422 and unknown.json()["errors"][0]["field"] == "org", unknown.text
    assert "/" not in (await client.get("/openapi.json")).json()["paths"]


@pytest.mark.anyio
async def test_every_module_of_the_page_is_served_as_javascript_under_the_policy(
    client: httpx.AsyncClient,
) -> None:
    """The page loads one module, which imports the rest: each file it reaches, and every .js file
    in the package, comes as JavaScript with the page's headers, and none makes HTML from text."""
    page = (await client.get("/console")).text
    assert '<script type="module" src="/console/assets/console.js"></script>' in page
    shipped = {path.name for path in ASSETS.glob("*.js")}
    reached: set[str] = set()
    waiting = ["console.js"]
    while waiting:
        name = waiting.pop()
        if name in reached:
            continue
        reached.add(name)
        answer = await client.get(f"/console/assets/{name}")
        assert answer.status_code == 200, name
        assert answer.headers["content-type"] == "text/javascript; charset=utf-8", name
        assert answer.headers["content-security-policy"] == EXACT_POLICY, name
        assert answer.headers["x-content-type-options"] == "nosniff", name
        assert answer.headers["cache-control"] == "no-cache", name
        assert "etag" in answer.headers, name  # so that no-cache costs a 304, not the file again
        again = await client.get(f"/console/assets/{name}", headers={"If-None-Match": answer.headers["etag"]})
        assert again.status_code == 304, name
        script = answer.text
        assert "innerHTML" not in script and "insertAdjacentHTML" not in script and "eval(" not in script
        assert script.startswith("// "), f"{name} opens with a comment on its job"
        waiting += re.findall(r"^import .* from '\./([\w-]+\.js)';$", script, re.MULTILINE)
    assert reached == shipped, (reached, shipped)


@pytest.mark.anyio
async def test_head_of_the_page_is_its_get_without_the_body(db_url: str) -> None:
    """HEAD /console: 200 and the GET's headers (its Content-Length included), and the app sends
    no body at all, whatever the server would do with one."""
    app = create_app(ROUTE.settings(db_url, allow_anonymous=True))
    bodies: list[bytes] = []
    async with LifespanManager(app) as manager:

        async def recording(scope: Any, receive: Any, send: Any) -> None:
            async def keep(message: Any) -> None:
                if message["type"] == "http.response.body" and scope["method"] == "HEAD":
                    bodies.append(message.get("body", b""))
                await send(message)

            await manager.app(scope, receive, keep)

        transport = httpx.ASGITransport(app=recording)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            page, head = await client.get("/console"), await client.head("/console")
            refused = await client.post("/console")
    assert head.status_code == 200 and head.content == b"" and bodies and b"".join(bodies) == b""
    varying = {"x-request-id", "date"}
    assert {k: v for k, v in head.headers.items() if k not in varying} == {
        k: v for k, v in page.headers.items() if k not in varying
    }
    assert int(head.headers["content-length"]) == len(page.content) > 0
    assert refused.status_code == 405 and refused.headers["allow"] == "GET, HEAD"


def test_head_of_the_page_leaves_a_real_connection_ready_for_the_next_request(
    db_url: str, tmp_path: Path
) -> None:
    with running_service(env=ROUTE.env(db_url), log=tmp_path / "s.log") as (url, _):
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(
                b"HEAD /console HTTP/1.1\r\nHost: localhost\r\n\r\n"
                b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
            )
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), head
    assert b"content-type: text/html" in head.lower() and b"content-security-policy" in head.lower()
    assert rest.startswith(b"HTTP/1.1 200 ") and rest.endswith(b'{"status":"ok"}'), rest


@needs_chromium
def test_the_live_table_follows_the_event_stream_and_shows_data_as_text(
    db_url: str, tmp_path: Path, artifacts: Path, browser: Chrome
) -> None:
    with running_service(env=ROUTE.env(db_url), log=tmp_path / "s.log") as (url, _):
        acquire(url, "nightly-report", "worker-1", metadata={"run": "2026-12-01"})
        open_console(browser, url)  # anonymous mode: no key exists, so no sign-in
        wait_for(browser, lambda b: "worker-1" in holders(b))
        browser.execute_script("window.sameDocument = true")
        listings = (
            "return performance.getEntriesByType('resource')"
            ".filter(entry => entry.name.includes('/v1/locks?')).length"
        )
        listed = browser.execute_script(listings)

        # Changes made after the page loaded arrive through the event stream, not a reload or a poll.
        acquire(url, "export", HOSTILE, metadata={"note": "<script>alert(2)</script>"})
        started = time.monotonic()
        wait_for(browser, lambda b: HOSTILE in holders(b), within=5)
        print(f"\nan acquire reached the table in {time.monotonic() - started:.2f} s")
        assert browser.execute_script("return window.sameDocument") is True
        assert browser.execute_script(listings) == listed

        # A lock of a session says so, where its holder is named.
        opened = httpx.post(
            f"{url}/v1/sessions",
            json={
                "organization_id": "acme",
                "holder": "session-worker",
                "ttl_seconds": 60,
                "locks": [{"job_type": "p1"}],
            },
            timeout=10,
        ).json()
        wait_for(browser, lambda b: "session-worker" in holders(b), within=5)
        cell = browser.find_element(
            By.CSS_SELECTOR, f"#lock-rows tr[data-lock-id='{opened['locks'][0]['id']}'] td.holder"
        )
        assert cell.get_attribute("title") == f"in session {opened['id']}, whose lease it shares"

        # The hostile holder and metadata are text: no element was made from them.
        assert browser.find_elements(By.CSS_SELECTOR, "#lock-table img, #lock-table script") == []
        metadata = [cell.text for cell in browser.find_elements(By.CSS_SELECTOR, "#lock-rows td.metadata")]
        assert '{"note":"<script>alert(2)</script>"}' in metadata

        # Anonymous mode may read /metrics, but only an admin key may force: no Force button.
        assert browser.find_elements(By.CSS_SELECTOR, "button.force") == []
        assert "Conflicts (409)" in browser.find_element(By.ID, "conflicts").text
        assert browser.find_element(By.ID, "sign-out").is_displayed() is False

        resources = browser.execute_script(
            "return performance.getEntriesByType('resource').map(entry => entry.name)"
        )
        assert resources and all(name.startswith(url) for name in resources), resources
        assert errors(browser) == []
        browser.save_screenshot(str(artifacts / "console-live-table.png"))

        browser.set_window_size(390, 800)
        try:
            time.sleep(0.3)
            widths = browser.execute_script(
                "const wrap = document.querySelector('.table-wrap'), page = document.documentElement;"
                "return [page.scrollWidth, innerWidth, wrap.scrollWidth, wrap.clientWidth]"
            )
            page_width, window_width, table_width, shown_width = widths
            assert page_width <= window_width, widths  # the page itself does not scroll sideways
            assert table_width > shown_width, widths  # the table scrolls in its own container
            browser.save_screenshot(str(artifacts / "console-390px.png"))
        finally:
            browser.set_window_size(1280, 800)


@needs_chromium
def test_the_timeline_shows_a_reclaim_and_a_forced_release(
    db_url: str, tmp_path: Path, artifacts: Path, browser: Chrome
) -> None:
    admin = keys.create(db_url, None)
    with running_service(env=ROUTE.env(db_url), log=tmp_path / "s.log") as (url, _):
        crashed = acquire(url, "nightly-report", "crashed-worker", admin)
        # Its worker died 8 minutes into the job; the lease ran out 2 minutes ago.
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute(
                "UPDATE helix_job_locks SET acquired_at = clock_timestamp() - interval '10 minutes',"
                " expires_at = clock_timestamp() - interval '2 minutes' WHERE id = %s",
                (crashed["id"],),
            )
        successor = acquire(url, "nightly-report", "next-worker", admin)
        assert successor["reclaimed"]["lock_id"] == crashed["id"]
        late = {"organization_id": "acme", "job_type": "nightly-report", "holder": "late", "ttl_seconds": 5}
        conflict = httpx.post(f"{url}/v1/locks", json=late, headers={"Authorization": f"Bearer {admin}"})
        assert conflict.status_code == 409

        open_console(browser, url, admin)
        assert browser.execute_script("return sessionStorage.length") == 1
        wait_for(browser, lambda b: "next-worker" in holders(b))
        wait_for(browser, lambda b: "1 on plain locks" in b.find_element(By.ID, "conflicts").text)
        row = f"#lock-rows tr[data-lock-id='{successor['id']}']"
        click(browser, f"{row} button.key")
        reclaim = wait_for(browser, lambda b: bar(b, "reclaimed"))
        assert reclaim["id"] == str(crashed["id"]) and "reclaim" in reclaim["marks"], reclaim
        assert "crashed-worker" in reclaim["title"], reclaim
        assert "2 min 0" in reclaim["title"], reclaim  # the gap: from the lease's end to the reclaim
        assert "from the lease's end to the reclaim" in reclaim["title"], reclaim

        # Force the successor's release from its row, behind a dialog that names the holder.
        click(browser, f"{row} button.force")
        wait_for(browser, lambda b: b.find_element(By.ID, "force-dialog").is_displayed())
        assert "next-worker" in browser.find_element(By.ID, "force-text").text
        browser.find_element(By.ID, "force-confirm").click()
        wait_for(browser, lambda b: "next-worker" not in holders(b))
        forced = wait_for(browser, lambda b: bar(b, "forced"))
        assert forced["id"] == str(successor["id"]) and "forced" in forced["marks"], forced
        assert f"forced by the admin key {keys.key_id(admin)}" in forced["title"], forced  # who forced it
        # The view zooms and pans: by its buttons, and by the mouse wheel. (The first view fits the
        # key's ten minutes of locks: the last hour is the viewer's choice.)
        assert span(browser) < 900
        click(browser, "button.window[data-window='3600000']")
        assert round(span(browser)) == 3600
        click(browser, "#zoom-in")
        assert round(span(browser)) == 1800
        browser.execute_script(
            "const svg = document.querySelector('#timeline-chart svg');"
            "svg.dispatchEvent(new WheelEvent('wheel', {deltaY: -100, clientX: 600, cancelable: true}))"
        )
        assert round(span(browser)) == 1440
        for control in ("#zoom-in", "#zoom-in", *["#later"] * 12):  # later stops at now
            click(browser, control)
        assert round(span(browser)) == 360
        assert bar(browser, "forced") and bar(browser, "reclaimed")

        ended = httpx.get(f"{url}/v1/locks/{successor['id']}", headers={"Authorization": f"Bearer {admin}"})
        assert ended.json()["release_reason"] == "forced"
        assert errors(browser, allowed=("401",)) == []  # the first listing, tried without a key
        browser.find_element(By.ID, "timeline").screenshot(str(artifacts / "console-timeline.png"))
        every_control_is_named_and_reached_by_tab(browser)


def every_control_is_named_and_reached_by_tab(browser: Chrome) -> None:
    """Every control the page shows (buttons, inputs, focusable bars) has a name in chromium's
    accessibility tree, and Tab, pressed again and again, reaches each of them."""
    nodes = browser.execute_cdp_cmd("Accessibility.getFullAXTree", {})["nodes"]
    roles = {"button", "textbox", "searchbox", "combobox", "checkbox", "link"}
    shown = [n for n in nodes if not n.get("ignored") and n["role"]["value"] in roles]
    unnamed = [n for n in shown if not n.get("name", {}).get("value")]
    assert unnamed == [], unnamed
    # The controls shown: enabled, and laid out (an SVG element has no offsetParent).
    controls = (
        "[...document.querySelectorAll('button:enabled, input:enabled, select:enabled, [tabindex=\"0\"]')]"
        ".filter(e => e.offsetParent !== null || e instanceof SVGElement)"
    )
    count: int = browser.execute_script(
        "window.reached = new Set();"
        "document.addEventListener('focusin', e => window.reached.add(e.target));"
        f"return {controls}.length"
    )
    browser.execute_script("document.activeElement.blur()")
    for _ in range(count + 5):
        ActionChains(browser).send_keys(Keys.TAB).perform()
    missed: list[str] = browser.execute_script(
        f"return {controls}.filter(e => !window.reached.has(e)).map(e => e.outerHTML.slice(0, 120))"
    )
    assert missed == [], missed


@needs_chromium
def test_an_organization_key_is_offered_no_force_and_the_service_refuses_it(
    db_url: str, tmp_path: Path, browser: Chrome
) -> None:
    acme = keys.create(db_url, "acme")
    with running_service(env=ROUTE.env(db_url), log=tmp_path / "s.log") as (url, _):
        lock = acquire(url, "nightly-report", "worker-1", acme)
        browser.get(f"{url}/console")
        field = wait_for(browser, lambda b: b.find_element(By.ID, "api-key"))
        wait_for(browser, lambda b: field.is_displayed())
        assert field.get_attribute("type") == "password"
        assert browser.find_element(By.CSS_SELECTOR, "label[for=api-key]").text == "API key"
        field.send_keys("hlk_000000000000_wrong")
        browser.find_element(By.CSS_SELECTOR, "#sign-in-form button[type=submit]").click()
        wait_for(browser, lambda b: "refused" in b.find_element(By.ID, "sign-in-error").text)

        open_console(browser, url, acme)
        wait_for(browser, lambda b: "worker-1" in holders(b))
        assert browser.find_elements(By.CSS_SELECTOR, "button.force") == []
        wait_for(browser, lambda b: "needs a key" in b.find_element(By.ID, "conflicts").text)

        forcing = f"{url}/v1/locks/{lock['id']}?force=true"
        refused = httpx.delete(forcing, headers={"Authorization": f"Bearer {acme}"})
        assert refused.status_code == 403 and refused.json()["type"] == "urn:helix-locks:problem:forbidden"

        browser.find_element(By.ID, "sign-out").click()
        wait_for(browser, lambda b: b.find_element(By.ID, "api-key").is_displayed())
        assert browser.execute_script("return sessionStorage.length") == 0
        assert not browser.find_element(By.ID, "locks").is_displayed()


@needs_chromium
def test_ten_thousand_live_locks_render_a_first_page(db_url: str, tmp_path: Path, browser: Chrome) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "SELECT count(*) FROM generate_series(1, 10000) AS g, LATERAL helix_acquire_job_lock("
            "'bulk', 'job-' || g, 'worker-' || g, 3600000, jsonb_build_object('n', g), NULL) AS granted"
        )
    with running_service(env=ROUTE.env(db_url), log=tmp_path / "s.log") as (url, _):
        started = time.monotonic()
        browser.get(f"{url}/console")
        rows = "#lock-rows tr[data-lock-id]"
        wait_for(browser, lambda b: len(b.find_elements(By.CSS_SELECTOR, rows)) == 50, within=60)
        first_page = time.monotonic() - started
        wait_for(browser, lambda b: b.find_element(By.ID, "lock-count").text == "(10,000)", within=60)
        every_lock = time.monotonic() - started
        print(f"\n10,000 live locks: first page in {first_page:.2f} s, all listed in {every_lock:.2f} s")
        assert len(browser.find_elements(By.CSS_SELECTOR, rows)) == 50
        assert "Page 1 of 200" in browser.find_element(By.ID, "page-info").text
        first = holders(browser)
        browser.find_element(By.ID, "next-page").click()
        wait_for(browser, lambda b: "Page 2 of 200" in b.find_element(By.ID, "page-info").text)
        assert holders(browser) != first
        browser.find_element(By.ID, "filter").send_keys("worker-9999")
        wait_for(browser, lambda b: holders(b) == ["worker-9999"])


@needs_chromium
def test_without_the_event_stream_the_table_is_polled(db_url: str, tmp_path: Path, browser: Chrome) -> None:
    env = ROUTE.env(db_url, HELIX_LOCKS_MAX_WATCHERS="0")  # every stream is refused: 503
    with running_service(env=env, log=tmp_path / "s.log") as (url, _):
        browser.get(f"{url}/console")
        wait_for(browser, lambda b: "polling every 5 s" in b.find_element(By.ID, "stream-state").text)
        acquire(url, "nightly-report", "polled-worker")
        started = time.monotonic()
        wait_for(browser, lambda b: "polled-worker" in holders(b), within=8)
        took = time.monotonic() - started
        print(f"\nwithout the stream, an acquire reached the table in {took:.2f} s")
        assert "polled-worker" in holders(browser)
        assert "polling every 5 s" in browser.find_element(By.ID, "stream-state").text, "still polling"


@needs_chromium
def test_the_console_recovers_from_cut_streams_410s_and_failed_requests(
    db_url: str, tmp_path: Path, browser: Chrome
) -> None:
    admin = keys.create(db_url, None)
    auth = {"Authorization": f"Bearer {admin}"}
    with (
        running_service(env=ROUTE.env(db_url), log=tmp_path / "s.log") as (url, _),
        FaultyProxy(url) as proxy,
    ):
        acquire(url, "nightly-report", "worker-1", admin)
        browser.get(f"{proxy.url}/console")
        field = wait_for(browser, lambda b: b.find_element(By.ID, "api-key"))
        wait_for(browser, lambda b: field.is_displayed())

        # The database is away for the first listing and for /metrics, once each; and the first
        # stream is cut inside its first event, before any Last-Event-ID. The page tries again.
        proxy.fail = {"/v1/locks?limit=1": 1, "/metrics": 1}
        proxy.cut_stream = True
        field.send_keys(admin)
        browser.find_element(By.CSS_SELECTOR, "#sign-in-form button[type=submit]").click()
        wait_for(browser, lambda b: "trying again" in b.find_element(By.ID, "status").text)
        assert browser.find_element(By.ID, "sign-out").is_displayed()  # a stored key can be signed out
        wait_for(browser, lambda b: b.find_element(By.ID, "stream-state").text.startswith("Live"))
        # An admin gets Force once /metrics answers, after one failure.
        wait_for(browser, lambda b: b.find_elements(By.CSS_SELECTOR, "button.force"))
        assert "Conflicts (409)" in browser.find_element(By.ID, "conflicts").text

        # The change whose event was cut reaches the table: the rejoined stream lists again.
        acquire(url, "export", "cut-in-its-event", admin)
        wait_for(browser, lambda b: "cut-in-its-event" in holders(b))
        assert proxy.cuts == 1

        # A resume refused with 410: the page joins first, then lists, so a change made while it
        # joins is not lost.
        acquire(url, "import", "has-an-event-id", admin)
        wait_for(browser, lambda b: "has-an-event-id" in holders(b))
        assert browser.execute_script("return lastEventId") is not None
        proxy.gone_resume, proxy.hold_join = True, 2.0
        seen = len(proxy.arrived)
        browser.execute_script("streamAbort.abort()")
        wait_for(browser, lambda b: ("/v1/events", False) in proxy.arrived[seen:])
        acquire(url, "archive", "acquired-while-joining", admin)
        wait_for(browser, lambda b: "acquired-while-joining" in holders(b), within=8)
        proxy.hold_join = 0.0
        after = [path for path, _ in proxy.arrived[seen:]]
        assert ("/v1/events", True) in proxy.arrived[seen:]  # the resume, refused
        joined = after.index("/v1/events", after.index("/v1/events") + 1)
        listed = next(i for i, path in enumerate(after) if path.startswith("/v1/locks?limit=500"))
        assert joined < listed, after

        truth = {lock["id"] for lock in httpx.get(f"{url}/v1/locks", headers=auth).json()["items"]}
        wait_for(browser, lambda b: live_ids(b) == truth)
        assert errors(browser, allowed=("401", "503", "410")) == []


@needs_chromium
def test_the_force_dialog_keyboard_sign_out_bad_keys_and_long_values(
    db_url: str, tmp_path: Path, artifacts: Path, browser: Chrome
) -> None:
    admin = keys.create(db_url, None)
    with running_service(env=ROUTE.env(db_url), log=tmp_path / "s.log") as (url, _):
        target = acquire(url, "target", "the-target", admin, organization_id="mmm")
        long_org, long_job = "O" * 128, "J" * 128
        long = acquire(url, long_job, "H" * 256, admin, organization_id=long_org, metadata={"k": "v" * 3000})
        reversing = acquire(url, "bidi", "\u202eevil\u202c", admin, organization_id="mmm")

        # A pasted key with a character no header can carry is refused at once, and kept nowhere.
        browser.get(f"{url}/console")
        field = wait_for(browser, lambda b: b.find_element(By.ID, "api-key"))
        wait_for(browser, lambda b: field.is_displayed())
        browser.execute_script("arguments[0].value = arguments[1]", field, admin + "\u200b")
        browser.find_element(By.CSS_SELECTOR, "#sign-in-form button[type=submit]").click()
        wait_for(browser, lambda b: "printable ASCII" in b.find_element(By.ID, "sign-in-error").text)
        assert browser.execute_script("return sessionStorage.length") == 0
        assert "cannot be reached" not in browser.find_element(By.ID, "status").text

        open_console(browser, url, admin)
        force = f"#lock-rows tr[data-lock-id='{target['id']}'] button.force"
        wait_for(browser, lambda b: b.find_element(By.CSS_SELECTOR, force).send_keys(Keys.ENTER) or True)
        wait_for(browser, lambda b: b.find_element(By.ID, "force-dialog").is_displayed())
        # The rows are drawn again under the dialog; Escape brings the focus back to the same lock's button.
        acquire(url, "shifter", "shifter-1", admin, organization_id="aaa")
        wait_for(browser, lambda b: "shifter-1" in holders(b))
        browser.switch_to.active_element.send_keys(Keys.ESCAPE)
        focused = f"force-{target['id']}"
        wait_for(
            browser, lambda b: b.execute_script("return document.activeElement.dataset.focus") == focused
        )

        # The table and each timeline bar have an accessible name; bars take the keyboard's focus.
        click(browser, f"#lock-rows tr[data-lock-id='{reversing['id']}'] button.key")
        wait_for(browser, lambda b: b.find_elements(By.CSS_SELECTOR, "#timeline-chart g.lock[tabindex='0']"))
        nodes = browser.execute_cdp_cmd("Accessibility.getFullAXTree", {})["nodes"]
        names = {
            (n["role"]["value"], (n.get("name") or {}).get("value", ""))
            for n in nodes
            if not n.get("ignored")
        }
        assert ("table", "Live locks") in names, [n for n in names if n[0] == "table"]
        assert any(name.startswith(f"lock {reversing['id']}: held") for _, name in names), names

        # A holder with a right-to-left override sits in its own <bdi>: it cannot reverse the sentence.
        browser.execute_script("askForce(arguments[0])", reversing["id"])
        parts = browser.execute_script(
            "return [...document.getElementById('force-text').childNodes]"
            ".map(n => [n.nodeName, n.textContent])"
        )
        assert ["BDI", "\u202eevil\u202c"] in parts, parts
        assert parts[0][0] == "#text" and parts[0][1].startswith(f"Break lock {reversing['id']} of "), parts
        browser.execute_script("document.getElementById('force-dialog').close()")

        # At 390 px, long values wrap: the page never scrolls sideways, with the timeline or the dialog open.
        browser.set_window_size(390, 800)
        try:
            browser.execute_script("openTimeline(arguments[0], arguments[1])", long_org, long_job)
            wait_for(browser, lambda b: bar(b, "held"))
            width = "return [document.documentElement.scrollWidth, innerWidth]"
            page_width, window_width = browser.execute_script(width)
            assert page_width <= window_width <= 390, (page_width, window_width)
            browser.execute_script("askForce(arguments[0])", long["id"])
            wait_for(browser, lambda b: b.find_element(By.ID, "force-dialog").is_displayed())
            page_width, window_width = browser.execute_script(width)
            assert page_width <= window_width, (page_width, window_width)
            dialog = browser.execute_script(
                "const d = document.getElementById('force-dialog'); return [d.scrollWidth, d.clientWidth]"
            )
            assert dialog[0] <= dialog[1], dialog
            browser.save_screenshot(str(artifacts / "console-390px-long-values.png"))

            # Signed out (a key refused later, say) with the dialog open: the dialog closes and the
            # sign-in form is usable; nothing is forced.
            browser.execute_script("signOut('The service refused this key (401): sign in again.')")
            assert browser.execute_script("return document.getElementById('force-dialog').open") is False
            field = wait_for(browser, lambda b: b.find_element(By.ID, "api-key"))
            field.send_keys("x")
            assert field.get_attribute("value") == "x"
        finally:
            browser.set_window_size(1280, 800)
        held = httpx.get(f"{url}/v1/locks/{long['id']}", headers={"Authorization": f"Bearer {admin}"})
        assert held.json()["state"] == "held"
        assert errors(browser, allowed=("401",)) == []


@needs_chromium
def test_a_busy_week_is_read_in_bounded_pages_and_drawn_quickly(
    db_url: str, tmp_path: Path, browser: Chrome
) -> None:
    # 50,000 ended locks of one key over the week before the last hour, one every 10 s.
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO helix_job_locks (organization_id, job_type, holder, token, metadata, acquired_at,"
            " expires_at, released_at, release_reason, fencing_token)"
            " SELECT 'acme', 'busy-key', 'w-' || g, md5(g::text), NULL,"
            " now() - interval '1 hour' - g * interval '10 s' - interval '4 s',"
            " now() - interval '1 hour' - g * interval '10 s' + interval '30 s',"
            " now() - interval '1 hour' - g * interval '10 s',"
            " CASE WHEN g % 50 = 0 THEN 'reclaimed' ELSE 'released' END, 1000000 - g"
            " FROM generate_series(1, 50000) AS g"
        )
    with running_service(env=ROUTE.env(db_url), log=tmp_path / "s.log") as (url, _):
        acquire(url, "busy-key", "the-live-one")
        open_console(browser, url)
        wait_for(browser, lambda b: "the-live-one" in holders(b))
        requests = (
            "return performance.getEntriesByType('resource').filter(e => e.name.includes('busy-key')).length"
        )

        # Opening and closing at once stops the reading.
        browser.execute_script("openTimeline('acme', 'busy-key')")
        click(browser, "button.window[data-window='604800000']")
        click(browser, "#close-timeline")
        time.sleep(0.5)
        stopped = browser.execute_script(requests)
        time.sleep(1)
        assert browser.execute_script(requests) == stopped

        started = time.monotonic()
        browser.execute_script("openTimeline('acme', 'busy-key')")
        click(browser, "button.window[data-window='604800000']")
        state = By.ID, "timeline-state"
        wait_for(browser, lambda b: "older ones were not loaded" in b.find_element(*state).text, within=60)
        read = browser.execute_script(requests) - stopped
        print(f"\nthe busy week: {read} listing requests in {time.monotonic() - started:.1f} s")
        assert read <= 2 * 20 + 4, read  # at most 20 pages per state, and the live locks

        # Drawing 50,000 locks of the week (those read, and made-up ones for the rest).
        drawn = browser.execute_script(
            "const locks = [...known.values()]"
            ".filter(lock => lock.job_type === 'busy-key' && lock.released_at);"
            "const week = 7 * 24 * HOUR, now = serverNow();"
            "for (let i = 0; known.size < 50000 + 10; i++) {"
            "  const lock = Object.assign({}, locks[i % locks.length], {id: -1 - i});"
            "  const at = now - HOUR - Math.random() * (week - HOUR);"
            "  lock.acquired_at = new Date(at - 4000).toISOString();"
            "  lock.released_at = new Date(at).toISOString(); known.set(lock.id, lock); }"
            "let t = performance.now(); drawTimeline(); const first = performance.now() - t;"
            "t = performance.now(); drawTimeline(); const again = performance.now() - t;"
            "return [first, again, document.querySelectorAll('#timeline-chart g.lock').length, known.size]"
        )
        first, again, bars, locks = drawn
        print(f"drawTimeline() of {locks:,} locks: {first:.0f} ms, again {again:.0f} ms, {bars:,} bars")
        assert drawn[0] < 2000 and drawn[1] < 2000 and drawn[2] < 10000, drawn

        # Closing the timeline forgets the ended locks no view needs any more.
        click(browser, "#close-timeline")
        known = browser.execute_script("return known.size")
        assert known < 100, known
        assert browser.execute_script("return document.activeElement.id") == "filter"
        assert errors(browser) == []


def lines_of(browser: Chrome, selector: str, text: str) -> int:
    """How many lines `text` takes inside the first element the selector finds, as laid out: the
    distinct tops of its characters' boxes (0 when the text is not there)."""
    lines: int = browser.execute_script(
        "const root = document.querySelector(arguments[0]), text = arguments[1];"
        "const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT), nodes = [];"
        "let whole = '';"
        "for (let node; (node = walker.nextNode()); whole += node.data) nodes.push([node, whole.length]);"
        "const at = whole.indexOf(text);"
        "if (at < 0) return 0;"
        "const tops = new Set(), range = document.createRange();"
        "for (let i = at; i < at + text.length; i++) {"
        "  const [node, from] = nodes.filter(([, from]) => from <= i).pop();"
        "  range.setStart(node, i - from); range.setEnd(node, i - from + 1);"
        "  const box = range.getBoundingClientRect();"
        "  if (box.width > 0) tops.add(Math.round(box.top)); }"
        "return tops.size",
        selector,
        text,
    )
    return lines


def at_widths(browser: Chrome, check: Any, artifacts: Path, name: str, shown: str = "#locks") -> None:
    """Run check(browser) at 1280 and at 390 px wide, with a screenshot of each, `shown` in view."""
    try:
        for width in (1280, 390):
            browser.set_window_size(width, 800)
            time.sleep(0.3)
            browser.execute_script(
                "document.querySelector(arguments[0]).scrollIntoView({inline: 'end'})", shown
            )
            check(browser)
            browser.save_screenshot(str(artifacts / f"{name}-{width}.png"))
    finally:
        browser.set_window_size(1280, 800)


@needs_chromium
def test_a_viewer_who_cannot_force_sees_no_action_column_and_one_note_why(
    db_url: str, tmp_path: Path, artifacts: Path, browser: Chrome
) -> None:
    with running_service(env=ROUTE.env(db_url), log=tmp_path / "s.log") as (url, _):
        acquire(url, "nightly-report", "worker-1")
        open_console(browser, url)  # anonymous mode: the service refuses force without an admin key
        wait_for(browser, lambda b: "worker-1" in holders(b))
        wait_for(browser, lambda b: b.find_element(By.ID, "force-note").is_displayed())
        note = browser.find_element(By.ID, "force-note")

        def no_action_column(b: Chrome) -> None:
            heads = [th.text for th in b.find_elements(By.CSS_SELECTOR, "#lock-head th")]
            assert "Action" not in heads and len(heads) == 10, heads
            cells = b.execute_script("return document.querySelector('#lock-rows tr').children.length")
            assert cells == 10, cells
            assert note.is_displayed() and "needs an admin key" in note.text, note.text
            said = b.execute_script(
                "return [...document.querySelectorAll('body *')].filter(e => e.children.length === 0"
                " && e.offsetParent !== null && e.textContent.includes('needs an admin key')).length"
            )
            assert said == 1, said  # said once, not per row

        at_widths(browser, no_action_column, artifacts, "console-anonymous")
        assert errors(browser) == []

    admin = keys.create(db_url, None)
    with running_service(env=ROUTE.env(db_url), log=tmp_path / "s2.log") as (url, _):
        open_console(browser, url, admin)
        wait_for(browser, lambda b: b.find_elements(By.CSS_SELECTOR, "button.force"))
        heads = [th.text for th in browser.find_elements(By.CSS_SELECTOR, "#lock-head th")]
        assert heads[-1] == "Action", heads
        assert not browser.find_element(By.ID, "force-note").is_displayed()


@needs_chromium
def test_the_first_view_of_a_timeline_fits_its_data_and_a_chosen_view_stays(
    db_url: str, tmp_path: Path, artifacts: Path, browser: Chrome
) -> None:
    with running_service(env=ROUTE.env(db_url), log=tmp_path / "s.log") as (url, _):
        # A new server: its first lock was acquired 3 minutes ago and is released now; a second follows.
        first = acquire(url, "nightly-report", "first-worker")
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute(
                "UPDATE helix_job_locks SET acquired_at = clock_timestamp() - interval '3 minutes',"
                " expires_at = clock_timestamp() + interval '2 minutes' WHERE id = %s",
                (first["id"],),
            )
        released = httpx.delete(f"{url}/v1/locks/{first['id']}", headers={"Lock-Token": first["token"]})
        assert released.status_code == 204, released.text
        acquire(url, "nightly-report", "second-worker")
        open_console(browser, url)
        wait_for(browser, lambda b: "second-worker" in holders(b))
        click(browser, "#lock-rows button.key")
        wait_for(browser, lambda b: bar(b, "released") and bar(b, "held"))

        def spread(b: Chrome) -> float:
            """The share of the plot's width between the first bar's start and the last one's end."""
            share: float = b.execute_script(
                "const svg = document.querySelector('#timeline-chart svg');"
                "const boxes = [...svg.querySelectorAll('g.lock rect.bar')].map(r => r.getBBox());"
                "const from = Math.min(...boxes.map(b => b.x));"
                "const to = Math.max(...boxes.map(b => b.x + b.width));"
                "return (to - from) / (Number(svg.getAttribute('width')) - 72)"
            )
            return share

        def fitted(b: Chrome) -> None:
            b.execute_script("drawTimeline()")
            assert spread(b) > 0.5, spread(b)
            assert 180 < span(b) < 600, span(b)  # from the first lock's start to now, and a margin

        wait_for(browser, lambda b: spread(b) > 0.5)
        at_widths(browser, fitted, artifacts, "console-timeline-fitted", "#timeline")

        # The viewer's own choice stays, as locks come and the view is drawn again.
        click(browser, "#zoom-out")
        chosen = span(browser)
        acquire(url, "nightly-report", "third-worker", organization_id="other")
        browser.execute_script("drawTimeline()")
        assert abs(span(browser) - chosen) < 2, (span(browser), chosen)
        click(browser, "button.window[data-window='3600000']")
        assert round(span(browser)) == 3600
        assert errors(browser) == []


@needs_chromium
def test_lease_left_reads_in_minutes_and_hours(
    db_url: str, tmp_path: Path, artifacts: Path, browser: Chrome
) -> None:
    with running_service(env=ROUTE.env(db_url), log=tmp_path / "s.log") as (url, _):
        for holder, ttl in (("short", 42), ("minutes", 2967), ("hours", 3930)):
            acquire(url, "nightly-report", holder, ttl_seconds=ttl, organization_id=holder)
        open_console(browser, url)
        wait_for(browser, lambda b: len(holders(b)) == 3)

        def ttl_of(b: Chrome, holder: str) -> str:
            text: str = b.execute_script(
                "return [...document.querySelectorAll('#lock-rows tr')]"
                ".find(row => row.querySelector('td.holder').textContent === arguments[0])"
                ".querySelector('td.ttl').textContent",
                holder,
            )
            return text

        def readable(b: Chrome) -> None:
            assert re.fullmatch(r"(3\d|4[0-2]) s", ttl_of(b, "short")), ttl_of(b, "short")
            assert re.fullmatch(r"49 min [0-2]?\d s", ttl_of(b, "minutes")), ttl_of(b, "minutes")
            assert ttl_of(b, "hours") == "1 h 5 min", ttl_of(b, "hours")

        at_widths(browser, readable, artifacts, "console-ttl", "#lock-rows td.ttl")


@needs_chromium
def test_a_lock_s_hold_limit_and_closed_key_show_beside_its_lease_and_in_its_details_only_when_set(
    db_url: str, tmp_path: Path, artifacts: Path, browser: Chrome
) -> None:
    """A lock acquired with max_hold_seconds: its row counts down to its hold limit under its lease
    left, and its timeline bar names hold_limit_at; one acquired with hold_at_least_seconds: likewise
    to closed_until, when its key opens again; a lock without either shows neither."""
    with running_service(env=ROUTE.env(db_url), log=tmp_path / "s.log") as (url, _):
        limited = acquire(url, "nightly-report", "limited-worker", max_hold_seconds=3930)
        closing = acquire(url, "hourly-sync", "closing-worker", hold_at_least_seconds=3930)
        plain = acquire(url, "export", "plain-worker")
        assert limited["hold_limit_at"] and plain["hold_limit_at"] is None
        assert closing["closed_until"] and limited["closed_until"] is None and plain["closed_until"] is None
        open_console(browser, url)
        everyone = ["closing-worker", "limited-worker", "plain-worker"]
        wait_for(browser, lambda b: sorted(holders(b)) == everyone)

        def marks(b: Chrome, lock: dict[str, Any], kind: str) -> list[dict[str, str]]:
            found: list[dict[str, str]] = b.execute_script(
                "return [...document.querySelectorAll(`#lock-rows tr[data-lock-id='${arguments[0]}'] td.ttl"
                " [data-mark=${arguments[1]}]`)].map(mark => ({text: mark.textContent, title: mark.title}))",
                lock["id"],
                kind,
            )
            return found

        def shown(b: Chrome) -> None:
            [mark] = marks(b, limited, "hold-limit")
            assert mark["text"] == "hold limit in 1 h 5 min", mark  # 3930 s, counted down from the grant
            assert mark["title"].startswith(f"hold limit {limited['hold_limit_at']}"), mark
            assert marks(b, plain, "hold-limit") == marks(b, closing, "hold-limit") == [], "only with a limit"
            [closed] = marks(b, closing, "closed-until")
            assert closed["text"] == "key closed for 1 h 5 min", closed  # 3930 s, counted down from the grant
            assert closed["title"].startswith(f"closed until {closing['closed_until']}:"), closed
            assert marks(b, limited, "closed-until") == marks(b, plain, "closed-until") == []
            ttl: str = b.execute_script(
                "const cell = document.querySelector(`#lock-rows tr[data-lock-id='${arguments[0]}'] td.ttl`);"
                "return cell.firstChild.textContent",
                limited["id"],
            )
            assert re.fullmatch(r"4 min [0-5]?\d s|5 min 0 s", ttl), ttl  # the lease left, as before

        at_widths(browser, shown, artifacts, "console-hold-limit", "#lock-rows td.ttl")

        # The lock's details (its timeline bar) name the limit, or the closing; the plain lock's neither.
        click(browser, f"#lock-rows tr[data-lock-id='{limited['id']}'] button.key")
        held = wait_for(browser, lambda b: bar(b, "held"))
        assert held["id"] == str(limited["id"]), held
        assert f"\nhold limit {limited['hold_limit_at']}: no lease runs past it" in held["title"], held
        assert "closed until" not in held["title"], held
        click(browser, f"#lock-rows tr[data-lock-id='{closing['id']}'] button.key")
        closed = wait_for(
            browser, lambda b: (found := bar(b, "held")) and found["id"] == str(closing["id"]) and found
        )
        named = f"\nclosed until {closing['closed_until']}: no other lock of the key before it"
        assert named in closed["title"], closed
        assert "hold limit" not in closed["title"], closed
        click(browser, f"#lock-rows tr[data-lock-id='{plain['id']}'] button.key")
        other = wait_for(
            browser, lambda b: (found := bar(b, "held")) and found["id"] == str(plain["id"]) and found
        )
        assert "hold limit" not in other["title"] and "closed until" not in other["title"], other
        assert errors(browser) == []


@needs_chromium
def test_identifiers_never_break_inside(
    db_url: str, tmp_path: Path, artifacts: Path, browser: Chrome
) -> None:
    with running_service(env=ROUTE.env(db_url), log=tmp_path / "s.log") as (url, _):
        lock = acquire(url, "nightly-report", "report-worker-7", metadata={"run": "2026-12-01"})
        acquire(url, "long-values", "H" * 200, metadata={"k": "v" * 500})  # long ones may still wrap
        open_console(browser, url)
        wait_for(browser, lambda b: "report-worker-7" in holders(b))
        row = f"#lock-rows tr[data-lock-id='{lock['id']}']"

        def unbroken(b: Chrome) -> None:
            assert lines_of(b, f"{row} button.key", "nightly-report") == 1
            assert lines_of(b, f"{row} td.holder", "report-worker-7") == 1
            assert lines_of(b, f"{row} td.org", "acme") == 1
            widths = b.execute_script("return [document.documentElement.scrollWidth, innerWidth]")
            assert widths[0] <= widths[1], widths  # the table scrolls in its box, not the page

        at_widths(browser, unbroken, artifacts, "console-identifiers")


@needs_chromium
def test_metadata_breaks_only_between_its_entries(
    db_url: str, tmp_path: Path, artifacts: Path, browser: Chrome
) -> None:
    metadata = {
        "run": "2026-12-01",
        "region": "eu-west-1",
        "owner": "nightly-team",
        "attempt": 3,
        "note": "rebuild  the index",
    }
    with running_service(env=ROUTE.env(db_url), log=tmp_path / "s.log") as (url, _):
        lock = acquire(url, "nightly-report", "report-worker-7", metadata=metadata)
        acquire(url, "long-values", "long-metadata", metadata={"k": "v" * 500})  # a long one may wrap
        open_console(browser, url)
        wait_for(browser, lambda b: "report-worker-7" in holders(b))
        cell = f"#lock-rows tr[data-lock-id='{lock['id']}'] td.metadata"
        as_json = json.dumps(lock["metadata"], separators=(",", ":"), ensure_ascii=False)  # jsonb's order

        def between_entries(b: Chrome) -> None:
            assert b.find_element(By.CSS_SELECTOR, cell).text == as_json  # the same text as before
            for key, value in metadata.items():
                entry = f'"{key}":{json.dumps(value)}'
                assert lines_of(b, cell, entry) == 1, entry
            assert lines_of(b, cell, as_json) > 1  # it does break, between entries
            widths = b.execute_script("return [document.documentElement.scrollWidth, innerWidth]")
            assert widths[0] <= widths[1], widths

        at_widths(browser, between_entries, artifacts, "console-metadata", cell)


def queue_rows(browser: Chrome) -> list[list[str]]:
    """The timeline's queue as its cells' text, row by row (an empty queue has one row that says so)."""
    rows: list[list[str]] = browser.execute_script(
        "return [...document.querySelectorAll('#queue-rows tr')]"
        ".map(row => [...row.children].map(cell => cell.textContent))"
    )
    return rows


@needs_chromium
def test_the_timeline_shows_the_queue_of_its_key_in_order_as_it_moves(
    db_url: str, tmp_path: Path, artifacts: Path, browser: Chrome
) -> None:
    """Two acquires wait for a held key, the second with a hostile holder: the key's timeline lists
    them in the order they came, the holder as text; when the lock is released the first is
    granted and leaves the list, and the second moves up to position 1."""
    with running_service(env=ROUTE.env(db_url), log=tmp_path / "s.log") as (url, _):
        held = acquire(url, "nightly-report", "holder-now")
        answers: dict[str, httpx.Response] = {}

        def wait(holder: str) -> None:
            body = {
                "organization_id": "acme",
                "job_type": "nightly-report",
                "holder": holder,
                "ttl_seconds": 300,
            }
            answers[holder] = httpx.post(f"{url}/v1/locks", json={**body, "wait_seconds": 60}, timeout=90)

        def places() -> list[str]:
            query = {"organization_id": "acme", "job_type": "nightly-report"}
            page = httpx.get(f"{url}/v1/locks/queue", params=query, timeout=10).json()
            return [place["holder"] for place in page["items"]]

        waiters = [threading.Thread(target=wait, args=(holder,)) for holder in ("first-waiter", HOSTILE)]
        try:
            for number, thread in enumerate(waiters, start=1):
                thread.start()
                deadline = time.monotonic() + 30
                while len(places()) < number and time.monotonic() < deadline:
                    time.sleep(0.05)
            assert places() == ["first-waiter", HOSTILE]

            open_console(browser, url)
            click(browser, "#lock-rows button.key")
            wait_for(
                browser,
                lambda b: (
                    [row[:4] for row in queue_rows(b)]
                    == [["1", "first-waiter", "exclusive", "1"], ["2", HOSTILE, "exclusive", "1"]]
                ),
            )
            assert browser.find_element(By.ID, "queue-heading").text == "Waiting for this key (2)"
            assert browser.execute_script("return document.querySelectorAll('#queue-rows img').length") == 0
            at_widths(browser, lambda b: None, artifacts, "console-queue", "#queue-table")

            released = httpx.delete(f"{url}/v1/locks/{held['id']}", headers={"Lock-Token": held["token"]})
            assert released.status_code == 204, released.text
            wait_for(browser, lambda b: [row[:2] for row in queue_rows(b)] == [["1", HOSTILE]])
            waiters[0].join(timeout=30)
            assert answers["first-waiter"].status_code == 201, answers["first-waiter"].text
        finally:
            # The second waiter is granted once the first lets go, so that its thread ends.
            first = answers.get("first-waiter")
            if first is not None and first.status_code == 201:
                lock = first.json()
                httpx.delete(f"{url}/v1/locks/{lock['id']}", headers={"Lock-Token": lock["token"]})
            for thread in waiters:
                thread.join(timeout=90)
        assert answers[HOSTILE].status_code == 201, answers[HOSTILE].text
        wait_for(browser, lambda b: queue_rows(b) == [["Nobody is waiting for this key."]])
        assert errors(browser) == []


def mode_of(browser: Chrome, holder: str) -> list[str]:
    """The Mode and Slot / max cells of the live table's row of this holder ([] when it has none)."""
    cells: list[str] = browser.execute_script(
        "const row = [...document.querySelectorAll('#lock-rows tr')]"
        ".find(row => row.querySelector('td.holder')?.textContent === arguments[0]);"
        "if (!row) return [];"
        "const heads = [...document.querySelectorAll('#lock-head th')].map(th => th.textContent);"
        "const cell = (name) => row.children[heads.findIndex(h => h.startsWith(name))].textContent;"
        "return [cell('Mode'), cell('Slot / max')]",
        holder,
    )
    return cells


def lanes(browser: Chrome) -> list[str]:
    """The timeline's lane labels, top to bottom."""
    labels: list[str] = browser.execute_script(
        "return [...document.querySelectorAll('#timeline-chart text.lane-label')].map(t => t.textContent)"
    )
    return labels


def bars_by_holder(browser: Chrome) -> dict[str, list[Any]]:
    """Each holder's timeline bars as [lane, mode, the bar's top], read at once (a redraw replaces them)."""
    found: dict[str, list[Any]] = browser.execute_script(
        "const bars = {};"
        "for (const g of document.querySelectorAll('#timeline-chart g.lock[data-lock-id]')) {"
        "  const holder = /^holder: (.*)$/m.exec(g.querySelector('title').textContent)[1];"
        "  (bars[holder] = bars[holder] || []).push("
        "    [g.dataset.lane, g.dataset.mode, Number(g.querySelector('rect.bar').getAttribute('y'))]); }"
        "return bars"
    )
    return found


@needs_chromium
def test_shared_locks_show_their_mode_in_the_table_in_reader_lanes_and_in_the_queue(
    db_url: str, tmp_path: Path, artifacts: Path, browser: Chrome
) -> None:
    """Two readers hold a pair together: the table says shared beside each (exclusive beside a
    plain lock), the timeline draws each in a reader lane of its own slot; a writer and then a
    reader wait, and the queue says each one's mode. Once the readers go, the writer is granted and
    drawn in the writer lane above the readers'."""
    with running_service(env=ROUTE.env(db_url), log=tmp_path / "s.log") as (url, _):
        readers = [acquire(url, "nightly-report", f"reader-{n}", mode="shared") for n in (1, 2)]
        assert [(r["mode"], r["slot"]) for r in readers] == [("shared", 0), ("shared", 1)]
        with psycopg.connect(db_url, autocommit=True) as conn:  # held for a while: bars wide enough to name
            for lock, seconds in zip(readers, (50, 40), strict=True):
                conn.execute(
                    "UPDATE helix_job_locks SET acquired_at = clock_timestamp() - make_interval(secs => %s)"
                    " WHERE id = %s",
                    (seconds, lock["id"]),
                )
        acquire(url, "export", "plain-worker")
        answers: dict[str, httpx.Response] = {}

        def wait(holder: str, mode: str) -> None:
            body = {
                "organization_id": "acme",
                "job_type": "nightly-report",
                "holder": holder,
                "ttl_seconds": 300,
                "mode": mode,
                "wait_seconds": 60,
            }
            answers[holder] = httpx.post(f"{url}/v1/locks", json=body, timeout=90)

        def places() -> list[tuple[str, str]]:
            query = {"organization_id": "acme", "job_type": "nightly-report"}
            page = httpx.get(f"{url}/v1/locks/queue", params=query, timeout=10).json()
            return [(place["holder"], place["mode"]) for place in page["items"]]

        def release(lock: dict[str, Any]) -> int:
            answer = httpx.delete(f"{url}/v1/locks/{lock['id']}", headers={"Lock-Token": lock["token"]})
            return answer.status_code

        waiters = [
            threading.Thread(target=wait, args=args)
            for args in (("writer-1", "exclusive"), ("reader-3", "shared"))
        ]
        try:
            for number, thread in enumerate(waiters, start=1):
                thread.start()
                deadline = time.monotonic() + 30
                while len(places()) < number and time.monotonic() < deadline:
                    time.sleep(0.05)
            assert places() == [("writer-1", "exclusive"), ("reader-3", "shared")]  # writers first

            open_console(browser, url)
            wait_for(browser, lambda b: len(holders(b)) == 3)
            heads = [th.text for th in browser.find_elements(By.CSS_SELECTOR, "#lock-head th")]
            assert heads[2:4] == ["Holder", "Mode"], heads
            assert mode_of(browser, "reader-1") == ["shared", "0"]
            assert mode_of(browser, "reader-2") == ["shared", "1"]
            assert mode_of(browser, "plain-worker") == ["exclusive", "0 / 1"]
            browser.find_element(By.ID, "filter").send_keys("shared")
            wait_for(browser, lambda b: sorted(holders(b)) == ["reader-1", "reader-2"])
            browser.execute_script(
                "const filter = document.getElementById('filter');"
                "filter.value = ''; filter.dispatchEvent(new Event('input'))"
            )
            wait_for(browser, lambda b: len(holders(b)) == 3)
            browser.find_element(By.ID, "locks").screenshot(str(artifacts / "console-shared-table.png"))

            # Each reader in a lane of its own, by its slot, labelled as a reader.
            row = f"#lock-rows tr[data-lock-id='{readers[0]['id']}']"
            click(browser, f"{row} button.key")
            wait_for(browser, lambda b: len(bars_by_holder(b)) == 2)
            assert lanes(browser) == ["reader 0", "reader 1"]
            drawn = bars_by_holder(browser)
            assert [bar[:2] for bar in drawn["reader-1"]] == [["reader 0", "shared"]], drawn
            assert [bar[:2] for bar in drawn["reader-2"]] == [["reader 1", "shared"]], drawn
            assert drawn["reader-1"][0][2] < drawn["reader-2"][0][2], drawn  # two lanes, not one
            reader = bar(browser, "held")
            assert reader and "shared (a reader), reader slot " in reader["title"], reader

            # The queue says each place's mode: the writer first, the reader behind it.
            wait_for(
                browser,
                lambda b: (
                    [row[:4] for row in queue_rows(b)]
                    == [["1", "writer-1", "exclusive", "1"], ["2", "reader-3", "shared", "1"]]
                ),
            )
            browser.execute_script("document.getElementById('timeline').scrollIntoView()")
            browser.find_element(By.ID, "timeline").screenshot(str(artifacts / "console-shared-readers.png"))

            # The readers go: the writer is granted, in the writer lane above the readers'.
            assert [release(lock) for lock in readers] == [204, 204]
            waiters[0].join(timeout=30)
            assert answers["writer-1"].status_code == 201, answers["writer-1"].text
            wait_for(browser, lambda b: "writer-1" in bars_by_holder(b))
            wait_for(browser, lambda b: lanes(b) == ["writer", "reader 0", "reader 1"])
            drawn = bars_by_holder(browser)
            assert [bar[:2] for bar in drawn["writer-1"]] == [["writer", "exclusive"]], drawn
            assert drawn["writer-1"][0][2] < drawn["reader-1"][0][2] < drawn["reader-2"][0][2], drawn
            wait_for(browser, lambda b: [row[:3] for row in queue_rows(b)] == [["1", "reader-3", "shared"]])
            assert mode_of(browser, "writer-1") == ["exclusive", "0 / 1"]
            at_widths(browser, lambda b: None, artifacts, "console-shared-timeline", "#timeline")
            browser.find_element(By.ID, "timeline").screenshot(str(artifacts / "console-shared-timeline.png"))
            assert errors(browser) == []
        finally:
            writer = answers.get("writer-1")
            if writer is not None and writer.status_code == 201:
                release(writer.json())
            else:
                for lock in readers:
                    release(lock)
            for thread in waiters:
                thread.join(timeout=90)
        assert answers["reader-3"].status_code == 201, answers["reader-3"].text
