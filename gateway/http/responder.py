"""The handler's side of a response: `HttpResponder` writes the status, headers and body (whole
or streamed) onto its connection; `Responder` is the Protocol the application codes against."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from http import HTTPStatus
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .connection import HttpConnection
    from .request import HttpRequest

_STATUS_LINES: dict[int, bytes] = {
    s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode("latin-1")) for s in HTTPStatus
}
_LAST_CHUNK = b"0\r\n\r\n"
_SMALL = 16 * 1024  # below this, header+body / chunk framing+data are joined into one write
# the size lines of chunks below 2 KiB (a streamed event's), made once: `b"%x\r\n" % n` per
# chunk formatted an int each time (the table: ~95 KB)
_SIZE_LINES = tuple(b"%x\r\n" % n for n in range(2048))


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = b"HTTP/1.1 %d Unknown\r\n" % status
    return line


class Responder(Protocol):
    """What response-writing code uses of an `HttpResponder`; the gateway's per-sample sinks
    (gateway/samples.py) stand in for one."""

    @property
    def started(self) -> bool: ...
    @property
    def closed(self) -> bool: ...
    @property
    def task(self) -> asyncio.Task[None] | None: ...
    def send(self, status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> None: ...
    def start_stream(
        self, status: int, headers: Sequence[tuple[bytes, bytes]], first: bytes = b""
    ) -> None: ...
    def write(self, data: bytes) -> None: ...
    def end(self) -> None: ...
    def cork(self) -> None: ...
    def uncork(self) -> None: ...
    def add_flow_listener(self, pause: Callable[[], None], resume: Callable[[], None]) -> None: ...
    def remove_flow_listener(self, pause: Callable[[], None], resume: Callable[[], None]) -> None: ...


class HttpResponder:
    """Writes the response of one request. Exactly one of ``send()`` or ``start_stream()`` …
    ``end()`` (or ``abort()``)."""

    __slots__ = (
        "_chunked",
        "_conn",
        "_cork",
        "_drain_close",
        "_finished",
        "_head_only",
        "_http10",
        "_keep_alive",
        "_sent",
        "started",
        "task",
    )

    def __init__(self, conn: HttpConnection, request: HttpRequest) -> None:
        self._conn = conn
        self.started = False  # status line already sent
        self._finished = False
        self._keep_alive = request.keep_alive
        self._head_only = request.method == "HEAD"
        self._http10 = request.http_version == "1.0"
        self._chunked = False
        self._drain_close = False  # Connection: close only because the server is shutting down
        self._cork: list[bytes | bytearray] | None = None
        # the Task running the handler (set at dispatch): known here, a handler need not ask
        # asyncio.current_task(), which costs a getpid() system call on Python 3.11
        self.task: asyncio.Task[None] | None = None
        self._sent: Sequence[tuple[bytes, bytes]] = ()  # the response's headers, once sent

    @property
    def closed(self) -> bool:
        """The client connection is lost (or was aborted)."""
        return self._conn._closed

    def sent_header(self, name: bytes) -> bytes | None:
        """The value of header ``name`` (lowercase) in the response's head as the handler gave
        it, or None (not given, or no head sent yet)."""
        for n, v in self._sent:
            if n == name:
                return v
        return None

    @property
    def finished(self) -> bool:
        """The response is complete (send()/end()/abort() done)."""
        return self._finished

    @property
    def stalled_s(self) -> float:
        """How long the client had taken none of the bytes written to it when the server cut its
        connection for that (`ServerLimits.client_stall_s`); 0.0 if it did not."""
        return self._conn._stalled_s

    def _head(self, status: int, headers: Sequence[tuple[bytes, bytes]]) -> bytearray:
        conn = self._conn
        if conn._server._draining and self._keep_alive:
            self._keep_alive = False
            self._drain_close = True
        buf = bytearray(_STATUS_LINES.get(status) or _status_line(status))
        for n, v in headers:
            buf += n
            buf += b": "
            buf += v
            buf += b"\r\n"
        if not self._keep_alive:
            buf += b"connection: close\r\n"
        elif self._http10:
            buf += b"connection: keep-alive\r\n"
        return buf

    def send(self, status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> None:
        """The whole response; Content-Length is set here. Headers must not include
        Content-Length, Transfer-Encoding or Connection."""
        if self.started:
            raise RuntimeError("response already started")
        self.started = True
        self._sent = headers
        conn = self._conn
        if conn._closed:
            self._finished = True
            return
        buf = self._head(status, headers)
        buf += b"content-length: %d\r\n\r\n" % len(body)
        transport = conn._transport
        if self._head_only or not body:
            transport.write(buf)
        elif len(body) < _SMALL:
            buf += body
            transport.write(buf)
        else:
            transport.write(buf)
            transport.write(body)
        self._finish()

    def start_stream(self, status: int, headers: Sequence[tuple[bytes, bytes]], first: bytes = b"") -> None:
        """Start a streamed response (Transfer-Encoding: chunked; for an HTTP/1.0 client the body
        is delimited by closing the connection). ``first``: the first piece of body, sent with
        the head in one write (as ``write(first)`` would, one system call earlier)."""
        if self.started:
            raise RuntimeError("response already started")
        self.started = True
        self._sent = headers
        conn = self._conn
        if conn._closed:
            return
        if self._http10 and not self._head_only:
            self._keep_alive = False  # the body ends when the connection closes
        buf = self._head(status, headers)
        if not self._head_only and not self._http10:
            buf += b"transfer-encoding: chunked\r\n"
            self._chunked = True
        buf += b"\r\n"
        if first and not self._head_only:
            if self._chunked:
                buf += b"%x\r\n" % len(first)
                buf += first
                buf += b"\r\n"
            else:
                buf += first
        cork = self._cork
        if cork is not None:  # the head goes out with the first body bytes, in one send
            cork.append(buf)
        else:
            conn._transport.write(buf)

    def write(self, data: bytes) -> None:
        """One chunk of a streamed response; empty data is a no-op. Safe to use as a pipe sink:
        data after the client is gone or the response is finished is dropped."""
        conn = self._conn
        if self._finished or conn._closed or self._head_only or not data:
            return
        if self._cork is not None:
            self._corked(data)
        elif self._chunked:
            n = len(data)
            if n < 2048:
                conn._transport.write(b"".join((_SIZE_LINES[n], data, b"\r\n")))
            elif n < _SMALL:
                conn._transport.write(b"%x\r\n%b\r\n" % (n, data))
            else:
                conn._transport.writelines((b"%x\r\n" % n, data, b"\r\n"))
        else:
            conn._transport.write(data)

    def _corked(self, data: bytes) -> None:
        cork = self._cork
        assert cork is not None
        if self._chunked:
            cork += (b"%x\r\n" % len(data), data, b"\r\n")
        else:
            cork.append(data)

    def cork(self) -> None:
        """Collect write()s until uncork(), which sends them in one transport write (e.g. a
        stream's held end and its last chunk; pipe() corks around the body that was buffered
        before it, so the head goes out with it)."""
        if self._cork is None:
            self._cork = []

    def uncork(self) -> None:
        cork = self._cork
        if cork is None:
            return
        self._cork = None
        if cork and not self._finished and not self._conn._closed:
            self._conn._transport.write(b"".join(cork))

    async def drain(self) -> None:
        """Wait while the client transport is paused (its write buffer is above high water)."""
        conn = self._conn
        if conn._write_paused and not conn._closed:
            fut: asyncio.Future[None] = conn._loop.create_future()
            conn._drain_waiters.append(fut)
            await fut

    def end(self) -> None:
        """The last chunk; the connection stays reusable."""
        if self._finished:
            return
        if not self.started:
            raise RuntimeError("end() before start_stream()")
        cork = self._cork
        if cork is not None:  # what is corked and the last chunk, in one send
            if self._chunked:
                cork.append(_LAST_CHUNK)
            self.uncork()
        elif self._chunked and not self._conn._closed:
            self._conn._transport.write(_LAST_CHUNK)
        self._finish()

    def abort(self) -> None:
        """Close the client connection now (buffered data is discarded)."""
        self.started = True
        self._finished = True
        conn = self._conn
        conn._listeners.clear()
        if not conn._closed:
            conn._transport.abort()

    def add_flow_listener(self, pause: Callable[[], None], resume: Callable[[], None]) -> None:
        """``pause()`` is called when the client transport pauses writing, ``resume()`` when it
        resumes; if it is paused now, ``pause()`` is called at once. Removed automatically when
        the response finishes."""
        conn = self._conn
        conn._listeners.append((pause, resume))
        if conn._write_paused:
            pause()

    def remove_flow_listener(self, pause: Callable[[], None], resume: Callable[[], None]) -> None:
        try:
            self._conn._listeners.remove((pause, resume))
        except ValueError:
            pass

    def _finish(self) -> None:
        self._finished = True
        conn = self._conn
        if conn._listeners:
            conn._listeners.clear()
        if not self._keep_alive and not conn._closed:
            if self._drain_close and conn._queue:
                return  # what the client sent after it is answered first (503s), then closed
            conn._transport.close()
