"""The HTTP load's connections: every client has its own keep-alive connection.

The default client speaks just enough HTTP/1.1 for the lock cycles' requests: on this 2-core
machine httpx spent about 1 ms of CPU per request, more than the service itself, which would leave
the service less CPU than a real deployment has. --httpx runs the same load through
httpx.AsyncClient instead."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar

import httpx

REQUEST_TIMEOUT = 30  # seconds; an answer that takes longer counts as a failed cycle


T = TypeVar("T")


class Connection(Protocol):
    async def request(
        self, method: str, path: str, headers: str = "", body: bytes = b""
    ) -> tuple[int, bytes]:
        """(status, body); `headers` are extra "Name: value\\r\\n" lines."""
        ...

    async def close(self) -> None: ...


class RawConnection:
    """One keep-alive HTTP/1.1 connection; answers must carry Content-Length (uvicorn's do)."""

    def __init__(self, host: str, port: int, timeout: float = REQUEST_TIMEOUT) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self.streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def request(
        self, method: str, path: str, headers: str = "", body: bytes = b""
    ) -> tuple[int, bytes]:
        try:
            async with asyncio.timeout(self.timeout):
                return await self._request(method, path, headers, body)
        except BaseException:
            await self.close()  # the connection's state is unknown: start afresh next time
            raise

    async def _request(self, method: str, path: str, headers: str, body: bytes) -> tuple[int, bytes]:
        if self.streams is None:
            self.streams = await asyncio.open_connection(self.host, self.port)
        reader, writer = self.streams
        head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\n{headers}"
        writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        status = int((await reader.readuntil(b"\r\n")).split(b" ", 2)[1])
        length = 0
        while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
            elif name.strip().lower() == b"transfer-encoding":
                raise ValueError("a chunked answer: this client reads Content-Length only")
        return status, await reader.readexactly(length)

    async def close(self) -> None:
        if self.streams is not None:
            self.streams[1].close()
            self.streams = None


class HttpxConnection:
    """The same requests through a shared httpx.AsyncClient (--httpx)."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http

    async def request(
        self, method: str, path: str, headers: str = "", body: bytes = b""
    ) -> tuple[int, bytes]:
        lines = [line.split(": ", 1) for line in headers.splitlines() if line]
        answer = await self.http.request(method, path, headers=dict(lines), content=body)
        return answer.status_code, answer.content

    async def close(self) -> None:
        pass


def run_loop(coroutine: Coroutine[Any, Any, T]) -> T:
    """uvloop where installed (it comes with uvicorn[standard]): less CPU for the same load."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)
