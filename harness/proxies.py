"""What stands between a client and a server in the tests and benchmarks: a TCP proxy to cut,
PgBouncer in transaction mode, a local HTTP server that lies (delays, drops, scripted answers), a
plain file server."""

from __future__ import annotations

import asyncio
import functools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self

import httpx
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from harness.processes import free_port


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
        self._cut = False

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
        if self._cut:
            # Accepted before the cut, its target opened after: it would outlive the cut (a pool
            # filling itself up at that moment kept one, and a statement reached the database).
            client_writer.transport.abort()
            server_writer.transport.abort()
            return
        self._writers.update((client_writer, server_writer))
        await asyncio.gather(
            self._pipe(client_reader, server_writer), self._pipe(server_reader, client_writer)
        )

    async def start(self) -> None:
        self._cut = False
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
        self._cut = True
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
