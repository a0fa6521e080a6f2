"""Helpers shared by the tests and the benchmarks (bench/): connection strings, free ports, real
service processes, PgBouncer."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self

import httpx
import pytest
from asgi_lifespan import LifespanManager
from fastapi import FastAPI
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from helix_locks.client import EventDecoder
from helix_locks.server import hot
from helix_locks.server.embedded import DIRECT_DATABASE_URL
from helix_locks.server.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
needs_chromium = pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER), reason="needs Debian's chromium and chromium-driver (apt-get)"
)
NODE_CLIENT = ROOT / "clients" / "node"


def url_for(server_url: str, dbname: str) -> str:
    """The server's connection string, pointed at another database."""
    return make_conninfo(server_url, dbname=dbname)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def helix_command(*args: str) -> list[str]:
    """`helix-locks ARGS` run by this interpreter, so the tests need nothing on PATH."""
    return [sys.executable, "-m", "helix_locks.cli", *args]


class NotReady(RuntimeError):
    """A service process exited, or was not ready in time."""


def wait_ready(
    base_url: str, process: subprocess.Popen[bytes], log: Path | None = None, timeout: float = 60
) -> None:
    """Return once the service at base_url answers /readyz with 200; NotReady, with the tail of its
    output in `log` when given, if its process exits first or `timeout` s pass."""

    def said() -> str:  # read when it is raised: what the process wrote by then
        return f":\n{tail(log)}" if log else ""

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise NotReady(f"the service exited with {process.returncode} before it was ready{said()}")
        with suppress(httpx.TransportError):
            if httpx.get(f"{base_url}/readyz", timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise NotReady(f"{base_url} was not ready after {timeout:.0f} s{said()}")


def tail(path: Path, lines: int = 30) -> str:
    """The last lines of a log file."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@contextmanager
def running_service(
    *args: str, env: Mapping[str, str | None], log: Path, timeout: float = 60
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`helix-locks serve ARGS` on a free port, ready; SIGTERMed (then killed) on exit.

    `env` is laid over this process's environment; a None value removes the variable.
    """
    port = free_port()
    environment = {key: value for key, value in {**os.environ, **env}.items() if value is not None}
    with log.open("wb") as out:
        process = subprocess.Popen(
            helix_command("serve", "--port", str(port), *args),
            env=environment,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base_url, process, log, timeout)
        yield base_url, process
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def children(pid: int) -> set[int]:
    """The processes whose parent is pid (read from /proc: Linux)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # pid (comm) state ppid ...: comm may hold spaces and parentheses, so split after it.
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def rss_mb(pid: int) -> float:
    """A process's resident memory (VmRSS), in MB; NaN when it is gone (read from /proc: Linux)."""
    with suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def logged_requests(log: Path) -> list[dict[str, Any]]:
    """The request lines of a service's JSON log (HELIX_LOCKS_LOG_FORMAT=json, or not a terminal)."""
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    for line in lines:
        assert {"time", "level", "event", "logger"} <= line.keys(), line
    return [line for line in lines if line["event"] == "request"]


class TcpProxy:
    """A TCP front for a PostgreSQL server that a test can cut, to make the database unreachable."""

    def __init__(self, target_url: str) -> None:
        params = conninfo_to_dict(target_url)
        host = str(params.get("host") or "localhost")
        self.target_port = int(params.get("port") or 5432)
        self.target_host = host
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()

    async def _open_target(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.target_host.startswith("/"):
            return await asyncio.open_unix_connection(f"{self.target_host}/.s.PGSQL.{self.target_port}")
        return await asyncio.open_connection(self.target_host, self.target_port)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        server_reader, server_writer = await self._open_target()
        self._writers.update((client_writer, server_writer))
        await asyncio.gather(
            self._pipe(client_reader, server_writer), self._pipe(server_reader, client_writer)
        )

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    def url(self, database_url: str) -> str:
        return make_conninfo(database_url, host="127.0.0.1", port=str(self.port))

    def freeze(self) -> None:
        """Keep every connection open but forward nothing: a server that went silent."""
        self._flowing.clear()

    async def cut(self) -> None:
        """Refuse new connections and reset every open one, as a dead database host would."""
        assert self._server is not None
        self._flowing.set()
        self._server.close()
        for writer in self._writers:
            writer.transport.abort()
        self._writers.clear()
        await self._server.wait_closed()


PGBOUNCER = "/usr/sbin/pgbouncer"


@dataclass(frozen=True)
class Pooler:
    """A running PgBouncer: its port, and its log file."""

    port: int
    log: Path


@contextmanager
def pgbouncer(server_url: str) -> Iterator[Pooler]:
    """Debian's PgBouncer in transaction pooling mode in front of server_url's server, for any
    database on it. It refuses to run as root: as root it runs as the owner of the server's
    socket directory (the embedded server's own user), so that it may connect there, or as
    nobody over TCP; its files are in a directory of its own under /tmp, which that user reaches."""
    params = conninfo_to_dict(server_url)
    host = str(params.get("host") or "127.0.0.1")
    target = f"host={host} port={params.get('port') or 5432} user={params.get('user') or 'postgres'}"
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="helix-pgbouncer-"))
    workdir.chmod(0o777)
    log = workdir / "pgbouncer.log"
    ini = workdir / "pgbouncer.ini"
    ini.write_text(
        f"[databases]\n* = {target}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        "auth_type = any\npool_mode = transaction\n"
        "max_client_conn = 2000\ndefault_pool_size = 40\n"
        f"logfile = {log}\npidfile = {workdir / 'pgbouncer.pid'}\n"
    )
    ini.chmod(0o644)
    owner = Path(host).stat().st_uid if host.startswith("/") else pwd.getpwnam("nobody").pw_uid
    user = ["-u", pwd.getpwuid(owner).pw_name] if os.geteuid() == 0 else []
    process = subprocess.Popen([PGBOUNCER, *user, str(ini)], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError as exc:
                if process.poll() is not None or time.monotonic() > deadline:
                    said = log.read_text() if log.exists() else ""
                    raise RuntimeError(f"pgbouncer did not start: {said}") from exc
                time.sleep(0.05)
        yield Pooler(port, log)
    finally:
        process.terminate()
        process.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


def through(port: int, database_url: str) -> str:
    """database_url, reached through the pooler listening on port."""
    return make_conninfo(database_url, host="127.0.0.1", port=str(port))


class Route:
    """How a service under test reaches its database: directly, or, when the session runs with
    HELIX_TEST_POOLER=pgbouncer, through PgBouncer in transaction mode, with the direct URL
    beside it (conftest sets pooler_port)."""

    pooler_port: int | None = None

    def database(self, db_url: str) -> dict[str, str]:
        if self.pooler_port is None:
            return {"database_url": db_url}
        return {"database_url": through(self.pooler_port, db_url), "direct_database_url": db_url}

    def settings(self, db_url: str, **overrides: Any) -> Settings:
        """The service's settings for a test's database."""
        return Settings(**{**self.database(db_url), **overrides})

    def env(self, db_url: str, **more: str) -> dict[str, str | None]:
        """The environment of a `serve` process for a test's database."""
        database = self.database(db_url)
        return {
            "DATABASE_URL": database["database_url"],
            DIRECT_DATABASE_URL: database.get("direct_database_url"),
            **more,
        }


ROUTE = Route()


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler that logs nothing to stderr."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


class LocalServer:
    """A handler class served on a free port of 127.0.0.1, from a thread, for a with block."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> Self:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


class LyingProxy(LocalServer):
    """An HTTP front for a service: it forwards every request, but answers 503 in place of the
    service's answer to the first request matching each lie (method, path prefix). The request
    took effect; its client was told it did not, as when a 503 came while the statement ran on.
    Each of `delays` (method, path prefix, seconds) holds back the answer to the first request
    that matches it, for that long."""

    def __init__(
        self, target: str, lies: list[tuple[str, str]], delays: Sequence[tuple[str, str, float]] = ()
    ) -> None:
        self.target = target
        self.lies = list(lies)
        self.delays = list(delays)
        self.told: list[tuple[str, str, int]] = []  # (method, path, status the client got)
        self.arrived: list[tuple[str, str, float]] = []  # (method, path, time.monotonic() on arrival)
        proxy = self

        class Handler(QuietHandler):
            def _forward(self) -> None:
                proxy.arrived.append((self.command, self.path, time.monotonic()))
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")
                }
                answer = httpx.request(
                    self.command, proxy.target + self.path, headers=headers, content=body, timeout=60
                )
                delay = next(
                    (x for x in proxy.delays if self.command == x[0] and self.path.startswith(x[1])), None
                )
                if delay is not None:
                    proxy.delays.remove(delay)
                    time.sleep(delay[2])
                lie = next(
                    (x for x in proxy.lies if self.command == x[0] and self.path.startswith(x[1])), None
                )
                if lie is not None:
                    proxy.lies.remove(lie)
                    status, content, out = 503, b'{"status": 503, "title": "lied"}', {"Retry-After": "1"}
                else:
                    status, content = answer.status_code, answer.content
                    out = {
                        k: v
                        for k, v in answer.headers.items()
                        if k.lower() in ("content-type", "retry-after", "location")
                    }
                proxy.told.append((self.command, self.path, status))
                self.send_response(status)
                for name, value in {"Content-Type": "application/problem+json", **out}.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            do_GET = do_POST = do_DELETE = do_PATCH = _forward

        super().__init__(Handler)


@asynccontextmanager
async def in_process(app: FastAPI, **client: Any) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the app in this process, inside its lifespan (whose state every request gets,
    as under uvicorn); base_url http://localhost unless given."""
    async with LifespanManager(app, startup_timeout=None, shutdown_timeout=None) as manager:
        transport = httpx.ASGITransport(app=manager.app)
        client.setdefault("base_url", "http://localhost")
        async with httpx.AsyncClient(transport=transport, **client) as http:
            yield http


def without_thin_path(app: FastAPI) -> FastAPI:
    """`app` with the thin path of acquire, release and renew (server/hot.py) taken out of its
    middleware, so that FastAPI's routes answer those too. Before the app first starts."""
    thin: object = hot.HotRoutes
    app.user_middleware = [middleware for middleware in app.user_middleware if middleware.cls is not thin]
    return app


@dataclass
class Event:
    """One Server-Sent Event as a watcher received it."""

    id: str
    type: str
    data: dict[str, Any]
    arrived: float  # time.time() when its blank line was read


class Watch:
    """GET /v1/events on a real server, read by a task into `events` as they arrive (parsed by the
    SDK's decoder).

    Entered (or opened), the stream is joined: the server sends its first keep-alive once every
    change that commits from then on will reach it; or it is refused (`status`, `problem`).
    `stop_after`: drop the connection right after reading that many events, even in the middle of
    what the server sent at once (`mid_window` says so). `outcome` is None while it is open, then
    "clean" (the body ended), "cut" (dropped by stop_after), "refused", or the transport error."""

    def __init__(
        self,
        base_url: str,
        key: str | None = None,
        *,
        last_event_id: str | None = None,
        stop_after: int | None = None,
        **params: str,
    ) -> None:
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        if last_event_id is not None:
            self.headers["Last-Event-ID"] = last_event_id
        self.base_url, self.params, self.stop_after = base_url, params, stop_after
        self.events: list[Event] = []
        self.comments: list[float] = []  # time.monotonic() of each keep-alive
        self.status = 0
        self.problem: dict[str, Any] | None = None
        self.outcome: str | None = None
        self.mid_window = False
        self.ended = asyncio.Event()

    async def open(self) -> Watch:
        self._client = httpx.AsyncClient(base_url=self.base_url, timeout=httpx.Timeout(10, read=60))
        joined = asyncio.Event()
        self._task = asyncio.create_task(self._read(joined))
        waiting = asyncio.create_task(joined.wait())
        await asyncio.wait([self._task, waiting], timeout=20, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        assert joined.is_set() or self.ended.is_set(), "the stream neither opened nor was refused in 20 s"
        return self

    async def close(self) -> None:
        """Drop the connection (as a client that dies does), if it is still open."""
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self._client.aclose()

    async def __aenter__(self) -> Watch:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _read(self, joined: asyncio.Event) -> None:
        try:
            async with self._client.stream(
                "GET", "/v1/events", params=self.params, headers=self.headers
            ) as response:
                self.status = response.status_code
                if response.status_code != 200:
                    self.problem = json.loads(await response.aread())
                    self.outcome = "refused"
                    return
                decoder, buffer = EventDecoder(), b""
                async for chunk in response.aiter_bytes():
                    buffer += chunk
                    while b"\n" in buffer:
                        raw, buffer = buffer.split(b"\n", 1)
                        line = raw.decode()
                        if line.startswith(":"):
                            self.comments.append(time.monotonic())
                            joined.set()
                        sent = decoder.feed(line)
                        if sent is None:
                            continue
                        assert sent.id is not None, sent
                        self.events.append(Event(sent.id, sent.event, json.loads(sent.data), time.time()))
                        if len(self.events) == self.stop_after:
                            # Leaving the response unread closes its connection.
                            self.mid_window = b"id:" in buffer
                            self.outcome = "cut"
                            return
            self.outcome = "clean"
        except httpx.HTTPError as exc:
            self.outcome = repr(exc)
        finally:
            self.ended.set()

    async def until(self, count: int, within: float = 10) -> list[Event]:
        """The events, once there are at least `count` (AssertionError after `within` seconds)."""
        deadline = time.monotonic() + within
        while len(self.events) < count and not self.ended.is_set():
            assert time.monotonic() < deadline, f"{len(self.events)} events, not {count}: {self.kinds()}"
            await asyncio.sleep(0.02)
        return self.events

    async def quiet(self, for_seconds: float = 0.6, within: float = 20) -> list[Event]:
        """The events, once none has come for `for_seconds` (AssertionError after `within` s)."""
        deadline = time.monotonic() + within
        count = -1
        while count != len(self.events):
            count = len(self.events)
            await asyncio.sleep(for_seconds)
            assert time.monotonic() < deadline, f"still busy after {within} s: {len(self.events)} events"
        return self.events

    def kinds(self) -> list[tuple[str, int]]:
        return [(event.type, event.data["lock"]["id"]) for event in self.events]


def npm(*args: str, cwd: Path, timeout: float = 300) -> str:
    """Run npm (without this process's HELIX_LOCKS_ variables); its output, or a failure that shows it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HELIX_LOCKS_")}
    done = subprocess.run(["npm", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    said = f"npm {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, said
    return done.stdout


def build_node_client() -> Path:
    """clients/node, built: `npm ci` when its dev dependencies are missing (CI runs it first), the
    TypeScript compiled when dist/ is older than its sources."""
    if not (NODE_CLIENT / "node_modules" / "typescript").is_dir():
        npm("ci", "--no-audit", "--no-fund", cwd=NODE_CLIENT)
    sources = [*NODE_CLIENT.glob("src/*.ts"), NODE_CLIENT / "tsconfig.json", NODE_CLIENT / "package.json"]
    built = NODE_CLIENT / "dist" / "index.js"
    if not built.exists() or built.stat().st_mtime < max(path.stat().st_mtime for path in sources):
        npm("run", "build", cwd=NODE_CLIENT)
    return NODE_CLIENT


def offline_chromium(console_log: bool = False) -> Any:
    """Debian's chromium, headless, driven by Selenium, that can reach nothing but 127.0.0.1 (every
    other name fails to resolve); with `console_log`, its console messages kept for get_log."""
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
    ):
        options.add_argument(argument)
    if console_log:
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))


def node_example(node_client: Path, into: Path) -> Path:
    """examples/node-worker.mjs as a user runs it: copied into `into`, beside a node_modules that
    holds the built client (build_node_client). The copy's path."""
    (into / "node_modules").mkdir(exist_ok=True)
    (into / "node_modules" / "helix-locks").symlink_to(node_client, target_is_directory=True)
    return Path(shutil.copy(ROOT / "examples" / "node-worker.mjs", into / "node-worker.mjs"))


class Files(SimpleHTTPRequestHandler):
    """python -m http.server's handler, quiet."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextmanager
def plain_http_server(directory: Path) -> Iterator[str]:
    """An HTTP server that is not Helix Locks (python's own, serving an empty directory): 404 to
    a GET, 501 to a POST."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Files, directory=str(directory)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
