"""A watcher of the event stream over raw HTTP, as the tests and benchmarks count what it receives."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from helix_locks.client import EventDecoder


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
