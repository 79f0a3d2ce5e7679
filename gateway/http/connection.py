"""One client connection of the server: an ``asyncio.Protocol`` that parses requests
(`RequestParsing`), runs one handler Task per request in order, answers refusals itself, and
cuts a client that stops reading."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from httptools import (
    HttpParserCallbackError,
    HttpParserError,
    HttpParserUpgrade,
    HttpRequestParser,
)

from .errors import error_body
from .parsing import _CONTINUE, RequestParsing
from .request import HttpRequest, Refusal, _Err, _RequestError, _StopParsing, _target_path
from .responder import HttpResponder, _status_line
from .transport import adopt

if TYPE_CHECKING:
    from .server import HttpServer

_OUTQ: int | None  # the ioctl that says how many bytes a socket's send queue holds
try:
    from fcntl import ioctl
    from termios import TIOCOUTQ  # Linux's SIOCOUTQ for a socket
except ImportError:  # pragma: no cover - a platform without them: the transport's buffer alone
    _OUTQ = None
else:
    _OUTQ = TIOCOUTQ

log = logging.getLogger("gateway.http.server")

# after an error answered before its request was read to the end (413, 431...): how long the rest
# of what the client sends is read and dropped, so that it reads the answer, not a reset
_LINGER_S = 2.0
# the same for a connection refused past limits.max_connections: short, as it holds a descriptor
# beyond the limit
_REFUSED_LINGER_S = 0.5
# the name of every request handler's Task: given one, `asyncio.Task.__init__` does not format a
# "Task-<n>" for each (~1,400 instructions a request under callgrind)
_HANDLER_TASK = "pdgw-request"

# told when the server cuts a client that stopped reading (`ServerLimits.client_stall_s`), just
# before the connection is aborted: the responder of the last request on it (its handler still
# running, or finished with its answer not all taken), if any, and how long the client took no byte
StallHook = Callable[["HttpResponder | None", float], None]


def _wake_all(waiters: list[asyncio.Future[None]]) -> None:
    """Each of `waiters` that is still waiting, resolved."""
    for w in waiters:
        if not w.done():
            w.set_result(None)


class HttpConnection(RequestParsing, asyncio.Protocol):
    __slots__ = (
        "_client",
        "_closed",
        "_drain_waiters",
        "_handler",
        "_last",
        "_limits",
        "_listeners",
        "_loop",
        "_parser",
        "_queue",
        "_reading_paused",
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
        "_transport",
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
        self._transport = adopt(transport)
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
        # (the loop's `create_task` less its closed check and task factory, neither of which
        # applies: the loop runs this callback, and the server sets no factory)
        task = asyncio.Task(self._handler(req, resp), loop=self._loop, name=_HANDLER_TASK)
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
