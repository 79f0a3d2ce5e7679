"""HTTP/1.1 server on a raw ``asyncio.Protocol`` + ``httptools.HttpRequestParser``.

One protocol object per client connection; one handler Task per complete request. Pipelined
requests are queued and handled one after another, responses in order. See
docs/architecture.md (``gateway/http/server.py``) for the contract.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from http import HTTPStatus
from typing import Any, Protocol, cast

from httptools import (
    HttpParserCallbackError,
    HttpParserError,
    HttpParserUpgrade,
    HttpRequestParser,
    parse_url,
)

from .errors import error_body
from .limits import ServerLimits

_OUTQ: int | None  # the ioctl that says how many bytes a socket's send queue holds
try:
    from fcntl import ioctl
    from termios import TIOCOUTQ  # Linux's SIOCOUTQ for a socket
except ImportError:  # pragma: no cover - a platform without them: the transport's buffer alone
    _OUTQ = None
else:
    _OUTQ = TIOCOUTQ

__all__ = [
    "Handler",
    "HttpRequest",
    "HttpResponder",
    "HttpServer",
    "Refusal",
    "RefusalHook",
    "StallHook",
    "start_server",
]

log = logging.getLogger("gateway.http.server")

Handler = Callable[["HttpRequest", "HttpResponder"], Coroutine[Any, Any, None]]

_STATUS_LINES: dict[int, bytes] = {
    s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode("latin-1")) for s in HTTPStatus
}
_METHODS: dict[bytes, str] = {
    m: m.decode() for m in (b"GET", b"POST", b"PUT", b"DELETE", b"HEAD", b"OPTIONS", b"PATCH")
}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# after an error answered before its request was read to the end (413, 431...): how long the rest
# of what the client sends is read and dropped, so that it reads the answer, not a reset
_LINGER_S = 2.0
# the same for a connection refused past limits.max_connections: short, as it holds a descriptor
# beyond the limit
_REFUSED_LINGER_S = 0.5
_LAST_CHUNK = b"0\r\n\r\n"
# the request header fields the server itself reads (on_header)
_FRAMING = frozenset((b"content-length", b"expect", b"transfer-encoding", b"host"))
_SMALL = 16 * 1024  # below this, header+body / chunk framing+data are joined into one write


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = b"HTTP/1.1 %d Unknown\r\n" % status
    return line


class HttpRequest:
    """A complete request, built by the protocol and read by handlers."""

    __slots__ = (
        "_index",
        "body",
        "client",
        "headers",
        "http_version",
        "keep_alive",
        "method",
        "path",
        "query",
    )

    def __init__(
        self,
        method: str,
        path: str,
        query: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        client: tuple[str, int] | None,
        http_version: str = "1.1",
        keep_alive: bool = True,
    ) -> None:
        self.method = method
        self.path = path  # without the query string, not percent-decoded
        self.query = query  # raw query string, "" if none
        self.headers = headers  # names lowercased, values as sent
        self.body = body
        self.client = client
        self.http_version = http_version
        self.keep_alive = keep_alive
        self._index: dict[bytes, bytes] | None = None

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (lowercase), or None. The first call indexes the
        fields (in C: the later of two equal names is written first, so the first one wins); a
        request's handlers look up four to six names among the `openai` client's seventeen
        fields, each a scan of the list before. `headers` is not to be changed after that."""
        index = self._index
        if index is None:
            index = self._index = dict(reversed(self.headers))
        return index.get(name)

    def __repr__(self) -> str:
        return f"<HttpRequest {self.method} {self.path}>"


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

    def __init__(self, conn: _HttpConnection, request: HttpRequest) -> None:
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
        buf = bytearray(_status_line(status))
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
        if not data or self._finished or self._conn._closed or self._head_only:
            return
        cork = self._cork
        if cork is not None:
            if self._chunked:
                cork += (b"%x\r\n" % len(data), data, b"\r\n")
            else:
                cork.append(data)
            return
        transport = self._conn._transport
        if self._chunked:
            n = len(data)
            if n < _SMALL:
                transport.write(b"%x\r\n%b\r\n" % (n, data))
            else:
                transport.writelines((b"%x\r\n" % n, data, b"\r\n"))
        else:
            transport.write(data)

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


class _Err:
    __slots__ = ("code", "headers", "message", "status", "t0", "url")

    def __init__(self, status: int, message: str, code: str) -> None:
        self.status = status
        self.message = message
        self.code = code
        # what was read of the refused request (set by `_HttpConnection._fail`)
        self.headers: list[tuple[bytes, bytes]] = []
        self.url = b""
        self.t0 = 0.0


class Refusal:
    """A request the server answered itself, with an error, before any handler saw it (413,
    431, 400, 408, 414, 417, 501, 505), as the `on_refusal` hook of :func:`start_server` gets it.

    ``headers``: the header fields read before the refusal (names lowercased; all of them when
    the head was complete, those complete so far otherwise, none when not even the request line
    was). ``path``: the request target's path as far as it was read ("" if none), not decoded.
    ``elapsed_s``: since the request's first byte (0 when none was read)."""

    __slots__ = ("_index", "client", "code", "elapsed_s", "headers", "message", "path", "status")

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        headers: list[tuple[bytes, bytes]],
        path: str,
        client: tuple[str, int] | None,
        elapsed_s: float,
    ) -> None:
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers
        self.path = path
        self.client = client
        self.elapsed_s = elapsed_s
        self._index: dict[bytes, bytes] | None = None

    # the first value of header ``name`` (lowercase) among those read, or None
    header = HttpRequest.header

    def __repr__(self) -> str:
        return f"<Refusal {self.status} {self.code} {self.path!r}>"


# the application's word on a refusal (log it, count it): more response headers to send with it
RefusalHook = Callable[[Refusal], Sequence[tuple[bytes, bytes]]]
# told when the server cuts a client that stopped reading (`ServerLimits.client_stall_s`), just
# before the connection is aborted: the responder of the last request on it (its handler still
# running, or finished with its answer not all taken), if any, and how long the client took no byte
StallHook = Callable[["HttpResponder | None", float], None]


def _target_path(url: bytes) -> str:
    """The path of a request target as far as it was read (origin or absolute form)."""
    if url[:1] != b"/" and b"://" in url:
        rest = url.partition(b"://")[2]
        slash = rest.find(b"/")
        url = rest[slash:] if slash >= 0 else b""
    for sep in (b"?", b"#"):
        i = url.find(sep)
        if i >= 0:
            url = url[:i]
    return url.decode("latin-1")


def _wake_all(waiters: list[asyncio.Future[None]]) -> None:
    """Each of `waiters` that is still waiting, resolved."""
    for w in waiters:
        if not w.done():
            w.set_result(None)


def _split_target(url: bytes) -> tuple[str, str]:
    """(path, query) of a request target: origin form (`/p?q#f`), `*`, or absolute form."""
    if url[:1] == b"/":
        q = url.find(b"?")
        if q < 0:
            h = url.find(b"#")
            return (url if h < 0 else url[:h]).decode("latin-1"), ""
        rest = url[q + 1 :]
        h = rest.find(b"#")
        return url[:q].decode("latin-1"), (rest if h < 0 else rest[:h]).decode("latin-1")
    if url == b"*":
        return "*", ""
    try:
        u = parse_url(url)
    except HttpParserError:
        raise _RequestError(400, "Malformed request target.", "bad_request") from None
    return (u.path or b"/").decode("latin-1"), (u.query or b"").decode("latin-1")


class _RequestError(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.err = _Err(status, message, code)


class _StopParsing(Exception):
    pass


class _HttpConnection(asyncio.Protocol):
    __slots__ = (
        "_body_len",
        "_body_parts",
        "_client",
        "_closed",
        "_content_length",
        "_continue_due",
        "_cur",
        "_drain_waiters",
        "_expect",
        "_handler",
        "_hdr_bytes",
        "_headers",
        "_hosts",
        "_idle_t0",
        "_in_headers",
        "_last",
        "_limits",
        "_listeners",
        "_loop",
        "_parser",
        "_queue",
        "_raw_hdr",
        "_reading_paused",
        "_req_t0",
        "_reserved",
        "_responder",
        "_server",
        "_stall_mark",
        "_stall_s",
        "_stall_t0",
        "_stall_timer",
        "_stalled_s",
        "_stop_parsing",
        "_task",
        "_te",
        "_transport",
        "_url",
        "_write_paused",
    )

    def __init__(self, server: HttpServer) -> None:
        self._server = server
        self._loop = server._loop
        self._handler = server._handler
        self._limits = server.limits
        self._parser = HttpRequestParser(self)
        self._transport: asyncio.Transport = None  # type: ignore[assignment]
        self._client: tuple[str, int] | None = None
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._hdr_bytes = 0
        self._raw_hdr = 0
        self._in_headers = False
        self._content_length: bytes | None = None
        self._expect: bytes | None = None
        self._continue_due = False  # a 100 Continue held back while a response was in flight
        self._te: bytes | None = None
        self._hosts = 0
        self._body_parts: list[bytes] = []
        self._body_len = 0
        self._cur: HttpRequest | None = None
        self._req_t0 = 0.0
        self._idle_t0 = 0.0
        self._queue: deque[HttpRequest | _Err] = deque()
        self._task: asyncio.Task[None] | None = None
        self._responder: HttpResponder | None = None
        self._stop_parsing = False
        self._closed = False
        self._write_paused = False
        self._reading_paused = False
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._listeners: list[tuple[Callable[[], None], Callable[[], None]]] = []
        # the responder of the last request dispatched (running, or finished with its bytes
        # maybe not all taken): what the on_stall hook is told about
        self._last: HttpResponder | None = None
        # client_stall_s (0: off); while the writes are paused, since when the client has taken
        # no byte (`_stall_t0`) and how many were waiting then (`_stall_mark`)
        self._stall_s = self._limits.client_stall_s
        self._stall_t0 = 0.0
        self._stall_mark = 0
        self._stall_timer: asyncio.TimerHandle | None = None
        self._stalled_s = 0.0  # set when the connection is cut for a stalled client
        # accepted into the reserve (ServerLimits.reserved_connections): one request on a reserved
        # path, then closed
        self._reserved = False

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it
        self._transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except (OSError, AttributeError):
                pass
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self._client = (str(peer[0]), int(peer[1]))
        self._idle_t0 = self._loop.time()
        server = self._server
        conns = server._conns
        conns.add(self)
        most = self._limits.max_connections
        if most and len(conns) > most - self._limits.reserved_connections:
            if len(conns) > most:
                self._refuse_connection()
            else:
                self._reserved = True

    def _refuse_connection(self) -> None:
        """Past `max_connections`: a 503 at once (nothing read: there is no room to read it) and
        close; told to `on_refusal` like the other refusals."""
        self._stop_parsing = True
        self._server.connections_refused += 1
        err = _Err(503, "Too many open connections; try again later.", "too_many_connections")
        self._transport.write(self._error_bytes(err))
        # (not a bare close: the request the client sent at once would be unread, and closing
        # with unread bytes sends a reset that can destroy the answer before it is read)
        self._linger_close(_REFUSED_LINGER_S)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._server._conns.discard(self)
        self._queue.clear()
        self._listeners.clear()
        self._last = None
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        task = self._task
        resp = self._responder
        if task is not None and resp is not None and not resp._finished:
            task.cancel()
        waiters = self._drain_waiters
        if waiters:
            self._drain_waiters = []
            _wake_all(waiters)

    def eof_received(self) -> bool | None:
        # A FIN from the client: a half-close looks the same as a disconnect, and for an LLM
        # gateway noticing a disconnect (to cancel generation) matters more. Close; the
        # handler in flight, if any, is cancelled by connection_lost.
        return False

    def pause_writing(self) -> None:
        self._write_paused = True
        if self._stall_s:
            self._watch_stall()
        for pause, _ in self._listeners:
            pause()

    def resume_writing(self) -> None:
        self._write_paused = False
        for _, resume in self._listeners:
            resume()
        waiters = self._drain_waiters
        if waiters:
            self._drain_waiters = []
            _wake_all(waiters)

    # -- a client that stops reading -----------------------------------------------------------
    def _watch_stall(self) -> None:
        """The writes to the client just paused. If it then takes no byte for `client_stall_s`,
        it is cut (`_check_stall`). One timer per connection at most, armed here when none is;
        a resume does not disarm it (nothing is done per resume): when it fires it finds the
        writes resumed (and ends), or paused again since (and waits for that pause's limit).
        Bytes written while paused would hide bytes taken; there are few: the relays stop
        reading their engines at the pause."""
        now = self._loop.time()
        self._stall_t0 = now
        self._stall_mark = self._unsent()
        if self._stall_timer is None:
            self._stall_timer = self._loop.call_at(now + self._stall_s, self._check_stall)

    def _check_stall(self) -> None:
        self._stall_timer = None
        if self._closed or not self._write_paused:
            return
        now = self._loop.time()
        due = self._stall_t0 + self._stall_s
        if now < due:
            self._stall_timer = self._loop.call_at(due, self._check_stall)
            return
        unsent = self._unsent()
        if unsent < self._stall_mark:
            # it took bytes: a slow reader (the writes stay paused until the transport's buffer
            # is drained down to low water, which a slow reader takes long to do), not a stalled one
            self._stall_t0 = now
            self._stall_mark = unsent
            self._stall_timer = self._loop.call_at(now + self._stall_s, self._check_stall)
            return
        self._stalled_s = now - self._stall_t0
        hook = self._server._on_stall
        if hook is not None:
            try:
                hook(self._last, self._stalled_s)
            except Exception:
                log.exception("the stall hook failed")
        # as a client that went away: connection_lost cancels the handler in flight
        self._transport.abort()

    def _unsent(self) -> int:
        """The bytes written to the client that it has not taken: the transport's buffer, and the
        socket's send queue. The kernel's queue grows to megabytes (`net.ipv4.tcp_wmem`): a slow
        reader drains it long before the transport's buffer moves."""
        n = self._transport.get_write_buffer_size()
        if _OUTQ is not None:
            sock = self._transport.get_extra_info("socket")
            if sock is not None:
                try:
                    n += int.from_bytes(ioctl(sock.fileno(), _OUTQ, b"\0\0\0\0"), sys.byteorder, signed=True)
                except (OSError, ValueError):  # not a socket that says (a test's transport)
                    pass
        return n

    def data_received(self, data: bytes) -> None:
        if self._stop_parsing:
            return
        was_in_headers = self._in_headers
        try:
            self._parser.feed_data(data)
        except HttpParserCallbackError as e:
            ctx = e.__context__
            if isinstance(ctx, _RequestError):
                self._fail(ctx.err)
            elif isinstance(ctx, _StopParsing):
                pass
            else:
                log.exception("request parsing callback failed", exc_info=ctx)
                self._fail(_Err(400, "Malformed HTTP request.", "bad_request"))
        except HttpParserUpgrade:
            # Upgrade requests (h2c, websocket) are served as plain HTTP/1.1 requests without a
            # body, then the connection is closed; the rest of the data is not HTTP/1.1.
            self._stop_parsing = True
        except HttpParserError:
            self._fail(_Err(400, "Malformed HTTP request.", "bad_request"))
        else:
            if self._in_headers and was_in_headers:
                self._raw_hdr += len(data)
                if self._raw_hdr > self._limits.max_header_bytes:
                    self._fail(
                        _Err(431, "Request header fields too large.", "request_header_fields_too_large")
                    )

    # -- parser callbacks ------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self._stop_parsing:
            raise _StopParsing
        self._in_headers = True
        self._raw_hdr = 0
        self._hdr_bytes = 0
        self._url = b""
        self._headers = []
        self._content_length = None
        self._expect = None
        self._continue_due = False
        self._te = None
        self._hosts = 0
        self._body_parts = []
        self._body_len = 0
        self._idle_t0 = 0.0
        self._req_t0 = self._loop.time()

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._hdr_bytes += len(url)
        if self._hdr_bytes > self._limits.max_header_bytes:
            raise _RequestError(414, "Request URI too long.", "uri_too_long")

    def on_header(self, name: bytes, value: bytes) -> None:
        n = self._hdr_bytes + len(name) + len(value) + 4
        self._hdr_bytes = n
        if n > self._limits.max_header_bytes:
            raise _RequestError(431, "Request header fields too large.", "request_header_fields_too_large")
        name = name.lower()
        if name in _FRAMING:  # one set lookup for the many fields the server does not read
            if name == b"content-length":
                self._content_length = value
            elif name == b"expect":
                self._expect = value
            elif name == b"transfer-encoding":
                self._te = value if self._te is None else self._te + b"," + value
            else:
                self._hosts += 1
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._in_headers = False
        parser = self._parser
        mb = parser.get_method()
        method = _METHODS.get(mb) or mb.decode("latin-1")
        path, query = _split_target(self._url)
        version = parser.get_http_version()
        self._check_framing(version)
        keep_alive = parser.should_keep_alive()
        if self._reserved:
            if not path.startswith(self._limits.reserved_paths):
                raise _RequestError(
                    503, "Too many open connections; try again later.", "too_many_connections"
                )
            keep_alive = False  # one request: the slot is free again at once
        cl = self._content_length
        if cl is not None:
            self._check_length(cl, parser.should_upgrade())
        if self._expect is not None:
            self._expect_continue(self._expect, version)
        self._cur = HttpRequest(method, path, query, self._headers, b"", self._client, version, keep_alive)

    def _check_length(self, cl: bytes, upgrade: bool) -> None:
        """The Content-Length `cl` checked: a number, within the body limit, 0 on an upgrade."""
        try:
            n = int(cl)
        except ValueError:
            raise _RequestError(400, "Invalid Content-Length.", "bad_request") from None
        if n > self._limits.max_body_bytes:
            raise _RequestError(413, "Request body too large.", "request_too_large")
        if upgrade and cl != b"0":
            raise _RequestError(400, "Upgrade with a request body is not supported.", "bad_request")

    def _expect_continue(self, expect: bytes, version: str) -> None:
        """`Expect: 100-continue` answered (417 for any other expectation). Not inside another
        response: while one is being written (or requests wait before this one) the 100 is held
        back and sent when they are done (`_next`)."""
        if expect.lower() != b"100-continue":
            raise _RequestError(417, "Unsupported Expect header.", "expectation_failed")
        if version == "1.1":
            resp = self._responder
            if not self._queue and (self._task is None or (resp is not None and resp._finished)):
                self._transport.write(_CONTINUE)
            else:
                self._continue_due = True

    def _check_framing(self, version: str) -> None:
        """The request head's version, Host and Transfer-Encoding checked, and the server not
        shutting down: a `_RequestError` otherwise."""
        if version[0] > "1":
            raise _RequestError(
                505, f"HTTP/{version} is not supported; use HTTP/1.1.", "http_version_not_supported"
            )
        if self._hosts != 1 and (self._hosts or version == "1.1"):
            # RFC 9112 3.2: exactly one Host in HTTP/1.1 (at most one in 1.0); uvicorn, nginx
            # and Go's server answer the same 400
            what = "Missing" if not self._hosts else "Duplicate"
            raise _RequestError(400, f"{what} Host header.", "bad_request")
        te = self._te
        if te is not None and version == "1.0":
            # RFC 9112 6.1: Transfer-Encoding in an HTTP/1.0 message means faulty framing (1.0
            # has no chunked coding; a proxy between may frame it otherwise): what follows the
            # body cannot be trusted to be a request, so it is refused and the connection closed
            raise _RequestError(
                400, "Transfer-Encoding is not allowed in an HTTP/1.0 request.", "bad_request"
            )
        if te is not None and te.strip().lower() != b"chunked":
            # the parser frames `gzip, chunked` as chunked and would hand on the coded bytes
            raise _RequestError(
                501,
                f"Unsupported transfer coding {te.decode('latin-1')!r}; only chunked is accepted.",
                "not_implemented",
            )
        if self._server._draining:
            # a request that arrives while the server shuts down (on a keep-alive connection:
            # the listening socket is closed) is answered 503 and its connection closed, not
            # reset: the client learns why, and the refusal is logged through on_refusal
            raise _RequestError(503, "The server is shutting down.", "shutting_down")

    def on_body(self, body: bytes) -> None:
        self._body_len += len(body)
        if self._body_len > self._limits.max_body_bytes:
            raise _RequestError(413, "Request body too large.", "request_too_large")
        self._body_parts.append(body)

    def on_message_complete(self) -> None:
        req = self._cur
        assert req is not None
        self._cur = None
        self._continue_due = False
        parts = self._body_parts
        if parts:
            req.body = parts[0] if len(parts) == 1 else b"".join(parts)
        self._req_t0 = 0.0
        if self._parser.should_upgrade():
            req.keep_alive = False
        if not req.keep_alive:
            self._stop_parsing = True
        if self._task is None and not self._queue:
            self._dispatch(req)
        else:
            self._queue.append(req)
            if len(self._queue) >= self._limits.max_pipelined and not self._reading_paused:
                self._reading_paused = True
                self._transport.pause_reading()

    # -- request lifecycle -----------------------------------------------------------------
    def _dispatch(self, req: HttpRequest) -> None:
        resp = HttpResponder(self, req)
        self._responder = resp
        self._last = resp
        server = self._server
        server.active_requests += 1
        task = self._loop.create_task(self._handler(req, resp))
        resp.task = task
        self._task = task
        task.add_done_callback(self._on_done)

    def _on_done(self, task: asyncio.Task[None]) -> None:
        resp = self._responder
        assert resp is not None
        self._task = None
        self._responder = None
        server = self._server
        server.active_requests -= 1
        if server.active_requests == 0 and server._idle_waiters:
            server._wake_idle()
        exc = None if task.cancelled() else task.exception()
        if not resp._finished:
            if self._closed:
                pass
            elif not resp.started and not task.cancelled():
                if exc is not None:
                    log.error("handler failed", exc_info=exc)
                else:
                    log.error("handler returned without a response")
                resp._keep_alive = False
                resp.send(
                    500,
                    ((b"content-type", b"application/json"),),
                    error_body("Internal server error.", type="server_error", code="internal_error"),
                )
            else:
                if exc is not None:
                    log.error("handler failed after the response started", exc_info=exc)
                resp.abort()
        elif exc is not None:
            log.error("handler failed after its response", exc_info=exc)
        if self._closed:
            return
        self._next()

    def _next(self) -> None:
        queue = self._queue
        if queue:
            item = queue.popleft()
            if self._reading_paused and len(queue) < self._limits.max_pipelined // 2:
                self._reading_paused = False
                self._transport.resume_reading()
            if isinstance(item, _Err):
                self._write_error(item)
            else:
                self._dispatch(item)
        elif self._continue_due:  # the request after is waiting for its 100 to send its body
            self._continue_due = False
            self._transport.write(_CONTINUE)
        elif self._cur is None and not self._in_headers:
            if self._server._draining:
                self._transport.close()
            else:
                self._idle_t0 = self._loop.time()

    def _write_error(self, err: _Err) -> None:
        self._last = None  # (an answer of the server's own: no request of the application's)
        self._transport.write(self._error_bytes(err))
        self._linger_close()

    def _error_bytes(self, err: _Err) -> bytes:
        """The whole answer to a refusal (Connection: close), told to `on_refusal`."""
        # (a 503 is the server's state, not the request's fault; 501 and 505 are the request's)
        kind = "server_error" if err.status == 503 else "invalid_request_error"
        body = error_body(err.message, type=kind, code=err.code)
        extra = b""
        hook = self._server._on_refusal
        if hook is not None:
            url = err.url
            refusal = Refusal(
                err.status,
                err.code,
                err.message,
                err.headers,
                _target_path(url) if url else "",
                self._client,
                self._loop.time() - err.t0 if err.t0 else 0.0,
            )
            try:
                extra = b"".join(b"%s: %s\r\n" % (n, v) for n, v in hook(refusal))
            except Exception:
                log.exception("the refusal hook failed")
        return b"%s%bcontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%b" % (
            _status_line(err.status),
            extra,
            len(body),
            body,
        )

    def _linger_close(self, linger_s: float = _LINGER_S) -> None:
        """Close after an error answer. The request may not have been read to its end (a 413 or
        431 while the client is still sending): closing with unread bytes makes the kernel send a
        reset, which can destroy the answer before the client reads it. So the write side is shut
        once the answer is out, and what the client still sends is read and dropped until it
        closes or `_LINGER_S` has passed (RFC 9112 section 9.6)."""
        t = self._transport
        try:
            if not t.can_write_eof():
                t.close()
                return
            t.write_eof()
        except (OSError, RuntimeError):
            t.close()
            return
        if self._reading_paused:
            self._reading_paused = False
            t.resume_reading()
        self._loop.call_later(linger_s, t.close)

    def _fail(self, err: _Err) -> None:
        """A protocol-level error: answer it after what is in flight, then close."""
        if self._req_t0:  # inside a request (its first byte read, not yet complete): what was read of it
            err.headers = self._headers
            err.url = self._url
            err.t0 = self._req_t0
        self._stop_parsing = True
        self._req_t0 = 0.0
        self._in_headers = False
        if self._closed:
            return
        if self._task is None and not self._queue:
            self._write_error(err)
        else:
            self._queue.append(err)


class HttpServer:
    """A listening server; see :func:`start_server`."""

    def __init__(
        self,
        handler: Handler,
        limits: ServerLimits,
        loop: asyncio.AbstractEventLoop,
        on_refusal: RefusalHook | None = None,
        on_stall: StallHook | None = None,
    ) -> None:
        self._handler = handler
        self._on_refusal = on_refusal
        self._on_stall = on_stall
        self.limits = limits
        self._loop = loop
        self._server: asyncio.Server | None = None
        self._conns: set[_HttpConnection] = set()
        self._draining = False
        self._idle_waiters: list[asyncio.Future[None]] = []
        self._sweep_handle: asyncio.TimerHandle | None = None
        self.active_requests = 0
        self.connections_refused = 0  # connections answered 503 past limits.max_connections
        self.host = ""
        self.port = 0

    @property
    def connections(self) -> int:
        return len(self._conns)

    def _protocol(self) -> _HttpConnection:
        return _HttpConnection(self)

    def _sweep_interval(self) -> float:
        lim = self.limits
        short = lim.reserved_timeout_s if lim.reserved_connections else 60.0
        return max(0.02, min(1.0, lim.read_timeout_s / 4, lim.keepalive_timeout_s / 4, short / 4))

    def _sweep(self) -> None:
        now = self._loop.time()
        lim = self.limits
        read_to = lim.read_timeout_s
        ka_to = lim.keepalive_timeout_s
        short = lim.reserved_timeout_s
        for c in list(self._conns):
            if c._closed:
                continue
            if c._req_t0 and now - c._req_t0 > (min(read_to, short) if c._reserved else read_to):
                c._fail(_Err(408, "Timed out reading the request.", "request_timeout"))
            elif c._idle_t0 and now - c._idle_t0 > (min(ka_to, short) if c._reserved else ka_to):
                c._transport.close()
        self._sweep_handle = self._loop.call_later(self._sweep_interval(), self._sweep)

    def _wake_idle(self) -> None:
        waiters = self._idle_waiters
        self._idle_waiters = []
        _wake_all(waiters)

    def stop_accepting(self) -> None:
        """Stop listening. Responses in flight are sent with ``Connection: close``; a request
        that arrives from now on (on a keep-alive connection, idle or not) is answered 503
        ``shutting_down`` with ``Connection: close`` by the server itself (through
        ``on_refusal``) instead of finding its connection reset. Idle connections stay open
        until `close()` or their keep-alive timeout."""
        self._draining = True
        if self._server is not None:
            self._server.close()

    async def wait_idle(self, timeout: float) -> bool:  # noqa: ASYNC109 (the contract)
        """Wait until no request is in flight; False if ``timeout`` passed first."""
        if self.active_requests == 0:
            return True
        fut: asyncio.Future[None] = self._loop.create_future()
        self._idle_waiters.append(fut)
        try:
            async with asyncio.timeout(timeout):
                await fut
        except TimeoutError:
            return self.active_requests == 0
        return True

    async def close(self) -> None:
        """Stop accepting, close all connections and cancel running handlers."""
        self.stop_accepting()
        if self._sweep_handle is not None:
            self._sweep_handle.cancel()
            self._sweep_handle = None
        tasks = []
        for c in list(self._conns):
            if c._task is not None:
                tasks.append(c._task)
                c._task.cancel()
            c._transport.close()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        if self._server is not None:
            await self._server.wait_closed()


async def start_server(
    handler: Handler,
    host: str,
    port: int,
    *,
    limits: ServerLimits | None = None,
    reuse_port: bool = False,
    sock: socket.socket | None = None,
    on_refusal: RefusalHook | None = None,
    on_stall: StallHook | None = None,
) -> HttpServer:
    """Listen on ``host:port`` (port 0 picks one; or on an already bound ``sock``) and serve
    each complete request with ``await handler(request, responder)`` in its own Task.

    ``on_refusal(refusal)``: called for each request the server refuses itself (a `Refusal`:
    413, 431, 400, 408...) as its answer is written; the header fields it returns are sent
    with the answer (e.g. the request id). An exception in it is logged, the answer still sent.

    ``on_stall(responder, stalled_s)``: called for each client cut for taking no byte of its
    answer for ``limits.client_stall_s`` (see `StallHook`); an exception in it is logged."""
    loop = asyncio.get_running_loop()
    lim = limits if limits is not None else ServerLimits()
    server = HttpServer(handler, lim, loop, on_refusal, on_stall)
    if sock is not None:
        srv = await loop.create_server(server._protocol, sock=sock, backlog=lim.backlog)
    else:
        srv = await loop.create_server(
            server._protocol, host, port, reuse_port=reuse_port or None, backlog=lim.backlog
        )
    server._server = srv
    sockname = srv.sockets[0].getsockname()
    server.host = str(sockname[0])
    server.port = int(sockname[1])
    server._sweep_handle = loop.call_later(server._sweep_interval(), server._sweep)
    return server
