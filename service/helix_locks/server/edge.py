"""The HTTP server's own bounds on what a client may send, and how slowly: uvicorn's httptools
protocol, with a limit on a request's head and deadlines for its head and its body.

uvicorn's httptools protocol has no limit on header size and no read timeout: one client could
stream an endless header into memory, or hold sockets open without finishing a request. Here:
- a request's head (request line and headers) over `max_head_bytes` gets 431 and the connection
  is closed; the parser is never fed more than that, so nothing larger is buffered;
- a connection that sends no complete head within `head_timeout` is closed (408 if it had begun
  one), from the moment it opens or its previous answer went out;
- a body that does not arrive in full within `body_timeout` of its head gets 408 and the
  connection is closed;
- a connection beyond `max_connections` open in this worker is closed at once, so that the
  process's file descriptors (its nofile limit must be higher) never run out;
- an answer the client does not read is cut off: once the unsent part of the answers is over
  asyncio's high-water mark (64 KiB), the client must take WRITE_RATE bytes a second of it (or
  all of it) over every `write_timeout`, or the connection is aborted and what it held is freed.
  Otherwise a client that asks for large pages and reads them slowly, or not at all, pins each
  one in memory for as long as it likes.
Between requests, uvicorn's own keep-alive timeout closes an idle connection.
"""

from __future__ import annotations

import asyncio
import functools
import socket
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from helix_locks.server.settings import EdgeSettings


@functools.cache
def limits() -> EdgeSettings:
    """Read once per worker process (uvicorn builds a protocol per connection)."""
    return EdgeSettings()


def _answer(status: bytes, reason: str) -> bytes:
    body = reason.encode()
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body
    )


TOO_LARGE = _answer(b"431 Request Header Fields Too Large", "Request header fields too large.")
TOO_SLOW = _answer(b"408 Request Timeout", "The request did not arrive in time.")
# What a client must read of a paused answer, a second on average over each write timeout: a
# page of 500 locks with 8 KiB of metadata each (4 MB) may then take a minute to read, not more.
WRITE_RATE = 64 * 1024
# The kernel's send buffer of a connection (Linux doubles it for its own bookkeeping).
SEND_BUFFER_BYTES = 128 * 1024


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """HttpToolsProtocol with the bounds above."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits()
        self._head_bytes = 0  # of the head being read
        self._reading_head = True
        self._begun = False  # the head being read has its first byte
        self._in_message = False  # between a request's first byte and its body's end
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0  # loop.time() when the timer fires
        self._deadline: float | None = None  # when the current phase times out, if it can
        self._write_timer: asyncio.TimerHandle | None = None
        self._unsent = 0  # bytes buffered at the last look, while writing is paused

    # The deadline moves on every phase of every request; the timer does not follow it. It fires
    # when it was set to, and if the deadline has moved on meanwhile, it is set again for that:
    # one timer per connection every ten seconds or so, not four per request (docs/performance.md).
    def _arm(self, seconds: float) -> None:
        self._deadline = self.loop.time() + seconds
        if self._timer is None or self._timer_at > self._deadline:
            self._set_timer()

    def _set_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        assert self._deadline is not None
        self._timer_at = self._deadline
        self._timer = self.loop.call_at(self._deadline, self._timed_out)

    def _disarm(self) -> None:
        self._deadline = None  # a timer still set finds nothing to do

    def _timed_out(self) -> None:
        self._timer = None
        if self._deadline is None or self.transport.is_closing():
            return
        if self.loop.time() < self._deadline:
            self._set_timer()
            return
        self._deadline = None
        # The last request's cycle stays until the next one begins: it is answering only while
        # its answer has begun and not ended.
        cycle = self.cycle
        responding = cycle is not None and cycle.response_started and not cycle.response_complete
        if (self._begun or not self._reading_head) and not responding:
            self.transport.write(TOO_SLOW)
        self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            transport.close()
            return
        # The kernel's send buffer grows by itself up to net.ipv4.tcp_wmem's maximum (4 MB by
        # default): a whole page of answers would wait there, out of the write timeout's sight.
        # Capped, what a slow reader has not taken waits in the transport, where it is watched.
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        self._arm(self.limits.head_timeout_seconds)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._stop_watching_writes()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        self._unsent = self.transport.get_write_buffer_size()
        self._write_timer = self.loop.call_later(self.limits.write_timeout_seconds, self._check_writes)

    def resume_writing(self) -> None:
        self._stop_watching_writes()
        super().resume_writing()

    def _stop_watching_writes(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _check_writes(self) -> None:
        unsent = self.transport.get_write_buffer_size()
        if self._unsent - unsent < min(WRITE_RATE * self.limits.write_timeout_seconds, self._unsent):
            self._write_timer = None
            self.transport.abort()  # close() would wait to send what is buffered
            return
        self._unsent = unsent
        self._write_timer = self.loop.call_later(self.limits.write_timeout_seconds, self._check_writes)

    def data_received(self, data: bytes) -> None:
        # While a head is read, the parser gets no more than its budget: a head still unfinished
        # when the budget is spent is too large, and nothing past it was buffered.
        while data and self._reading_head:
            budget = self.limits.max_head_bytes - self._head_bytes
            if budget <= 0:
                self._disarm()
                self.transport.write(TOO_LARGE)
                self.transport.close()
                return
            chunk, data = data[:budget], data[budget:]
            self._head_bytes += len(chunk)
            self._begun = True
            super().data_received(chunk)
            if self.transport.is_closing():
                return
        if data:
            super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_message = True
        if not self._reading_head:  # a pipelined request right after the last one's body
            self._reading_head, self._head_bytes, self._begun = True, 0, True
            self._arm(self.limits.head_timeout_seconds)

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._arm(self.limits.body_timeout_seconds)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_message = False
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        # The next request's head, unless one is already on its way (pipelined): from here
        # uvicorn's keep-alive timeout also runs (it closes a connection that stays idle), and
        # ours bounds a head that begins but never ends.
        if not self._in_message:
            self._reading_head, self._head_bytes, self._begun = True, 0, False
            self._arm(self.limits.head_timeout_seconds)
        super().on_response_complete()
