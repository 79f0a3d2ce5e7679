"""Upstream HTTP/1.1 client: a keep-alive connection pool per origin on a raw
``asyncio.Protocol`` + ``httptools.HttpResponseParser``.

See docs/architecture.md (``gateway/http/client.py``) for the contract. Timeouts are applied by
callers with ``asyncio.timeout``; the only timeout here is the connect timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import ssl
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

from httptools import HttpParserCallbackError, HttpParserError, HttpResponseParser

from .errors import LocalResourceError, UpstreamConnectError, UpstreamProtocolError

# connect() errors that say this process is short of something, not that the upstream is
# (EADDRNOTAVAIL is not one of them: it is also an address this host cannot reach, e.g. ::1
# with IPv6 off, which must count against that worker)
_LOCAL_SHORTAGE = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def _shortage_behind(e: OSError) -> OSError | None:
    """The shortage of this process behind a connect failure, if any. Some show only as another
    error: a worker named by host name fails to resolve (`gaierror`) when the resolver cannot
    open its socket, so for any other error one socket is opened to find out (error path only)."""
    if e.errno in _LOCAL_SHORTAGE:
        return e
    try:
        socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()
    except OSError as short:
        if short.errno in _LOCAL_SHORTAGE:
            return short
    return None


__all__ = ["Batching", "FlowControl", "UpstreamPool", "UpstreamResponse"]

_METHODS: dict[str, bytes] = {
    m: m.encode() for m in ("GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH")
}
_NO_BODY_METHODS = frozenset(("GET", "HEAD", "DELETE", "OPTIONS"))
# Framing/hop-by-hop headers the pool sets itself; dropped from the caller's headers.
_DROP = frozenset((b"content-length", b"transfer-encoding", b"connection", b"keep-alive", b"host"))
_JOIN_BODY_MAX = 64 * 1024  # bodies up to this size go out in the same write as the head
_BUFFER_HIGH = 1024 * 1024  # next_chunk(): pause the upstream above this many buffered bytes
_BUFFER_LOW = 256 * 1024


class FlowControl(Protocol):
    """What ``UpstreamResponse.pipe(flow=...)`` subscribes to; ``HttpResponder`` is one."""

    def add_flow_listener(self, pause: Callable[[], None], resume: Callable[[], None]) -> None: ...
    def remove_flow_listener(self, pause: Callable[[], None], resume: Callable[[], None]) -> None: ...


class Batching(Protocol):
    """What ``UpstreamResponse.pipe(batch=...)`` uses; ``HttpResponder`` is one."""

    def cork(self) -> None: ...
    def uncork(self) -> None: ...


class _Call(asyncio.Future[Any]):
    """One request in flight on a pool: the future of its response head (``start()``) or of its
    whole body (``fetch()``), resolved from the connection's callbacks, with no Task unless a new
    connection must be made. Cancelling it before it is done aborts the connection."""

    __slots__ = (
        "_conn",
        "_data",
        "_extra",
        "_fresh",
        "_head_req",
        "_pool",
        "_replay",
        "_resent",
        "_resp",
        "_task",
        "_whole",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        pool: UpstreamPool,
        data: bytes,
        extra: bytes | None,
        head_req: bool,
        whole: bool,
        replay: bool,
    ) -> None:
        super().__init__(loop=loop)
        self._pool = pool
        self._data = data
        self._extra = extra
        self._head_req = head_req
        self._whole = whole
        self._fresh = False  # sent on a connection made for it (no retry when it dies)
        self._replay = replay  # may be sent again when a reused connection dies before answering
        self._resent = False  # this is that second send: the first copy may have reached the server
        self._conn: _UpstreamConnection | None = None
        self._resp: UpstreamResponse | None = None  # fetch(): the response whose body is read
        self._task: asyncio.Task[None] | None = None  # connecting

    def cancel(self, msg: Any | None = None) -> bool:
        if not super().cancel(msg):
            return False
        self._pool._cancelled(self)
        return True


class UpstreamResponse:
    """A response whose status line and headers are in; the body follows."""

    __slots__ = (
        "_buf",
        "_buffered",
        "_conn",
        "_error",
        "_fetch",
        "_flow",
        "_pend",
        "_pipe_fut",
        "_prev",
        "_released",
        "_sink",
        "_waiter",
        "_whole",
        "complete",
        "first_data_at",
        "headers",
        "held_back",
        "last_read_at",
        "reads",
        "status",
        "tail",
    )

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], conn: _UpstreamConnection) -> None:
        self.status = status
        self.headers = headers  # names lowercased
        self.complete = False  # body fully received
        self._conn = conn
        self._buf: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._sink: Callable[[bytes], None] | None = None
        self._pipe_fut: asyncio.Future[None] | None = None
        self._flow: FlowControl | None = None
        self._error: BaseException | None = None
        self._released = False
        self._whole = False
        self._fetch: _Call | None = None  # fetch(): resolved with (status, body) at the end
        # pipe(): how many reads reached the sink, and the loop time of the last one (or of the
        # pipe's start): what a relay needs for its idle deadline and inter-token figures
        self.reads = 0
        self.last_read_at = 0.0
        # the loop time the first body bytes were buffered before a pipe() or read() took them
        # (0: none were): how long an answer's start waited (a P/D stream for its prefill's verdict)
        self.first_data_at = 0.0
        # pipe(): reading paused because the client is not taking the bytes (its backpressure):
        # while held back, the upstream's silence is the client's doing, not the worker's
        self.held_back = False
        # pipe(): the pieces of body of the upstream read being parsed, handed to the sink as one
        # at the end of that read (a 64-event burst is one sink call, not 64)
        self._pend: list[bytes] = []
        # the body's last read (a piped body's: the last piece the sink got, the one before in
        # `_prev`; read(): the whole body), for whoever reads an answer's end (`last_bytes`)
        self.tail = b""
        self._prev = b""

    def last_bytes(self) -> bytes:
        """The body's end as read: a piped body's last two reads (a stream's final events), or the
        whole body that read() returned."""
        return self._prev + self.tail if self._prev else self.tail

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (lowercase), or None."""
        for n, v in self.headers:
            if n == name:
                return v
        return None

    def __repr__(self) -> str:
        return f"<UpstreamResponse {self.status} complete={self.complete}>"

    # -- called by the protocol ---------------------------------------------------------------
    def _flush(self) -> bool:
        """The pieces of body of the read just parsed (``_pend``), as one: to the sink when
        piped, else into the buffer (waking a reader). Per chunk the protocol only appends;
        this runs once per upstream read. False if the sink failed (the response then failed
        with its exception and the connection is aborted, as a failing sink does)."""
        pend = self._pend
        data = pend[0] if len(pend) == 1 else b"".join(pend)
        pend.clear()
        sink = self._sink
        if sink is not None:
            self.reads += 1
            self.last_read_at = self._conn._loop.time()
            self._prev = self.tail
            self.tail = data
            try:
                sink(data)
            except Exception as e:
                self._on_error(e)
                self._conn.abort()
                return False
            return True
        if not self.first_data_at:
            self.first_data_at = self._conn._loop.time()
        self._buf.append(data)
        self._buffered += len(data)
        if self._waiter is not None:
            self._wake_reader()
        if self._buffered > _BUFFER_HIGH and not self._whole:
            self._conn.pause_reading()
        return True

    def _on_complete(self) -> None:
        if self._pend and not self._flush():
            return
        self.complete = True
        call = self._fetch
        if call is not None:
            self._fetch = None
            buf = self._buf
            data = buf.popleft() if len(buf) == 1 else b"".join(buf)
            buf.clear()
            self._buffered = 0
            self.release()
            if not call.done():
                call.set_result((self.status, data))
            return
        self._settle(None)

    def _on_error(self, exc: BaseException) -> None:
        if self.complete or self._error is not None:
            return
        if self._pend:  # what arrived before the failure still reaches the sink (or buffer)
            if self._sink is not None:
                pend, self._pend = self._pend, []
                with contextlib.suppress(Exception):
                    self._sink(b"".join(pend))
            else:
                self._flush()
        self._error = exc
        call = self._fetch
        if call is not None:
            self._fetch = None
            self.abort()
            if not call.done():
                call.set_exception(exc)
            return
        self._settle(exc)

    def _settle(self, exc: BaseException | None) -> None:
        """The body ended (failed with `exc`, or whole where None): a pipe's future resolved,
        a reader woken."""
        fut = self._pipe_fut
        if fut is not None:
            self._pipe_fut = None
            self._end_pipe()
            if not fut.done():
                if exc is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(exc)
        if self._waiter is not None:
            self._wake_reader()

    def _wake_reader(self) -> None:
        """The reader waiting for more of the body (`_wait`; its callers check there is one),
        woken."""
        w = self._waiter
        self._waiter = None
        if w is not None and not w.done():
            w.set_result(None)

    def _end_pipe(self) -> None:
        self._sink = None
        flow = self._flow
        if flow is not None:
            self._flow = None
            flow.remove_flow_listener(self.pause_reading, self.resume_reading)

    # -- public ---------------------------------------------------------------------------------
    async def _wait(self) -> None:
        w = self._conn._loop.create_future()
        self._waiter = w
        await w

    async def read(self) -> bytes:
        """The whole body (chunked decoding done)."""
        self._whole = True
        if self._conn._reading_paused:
            self._conn.resume_reading()
        while not self.complete:
            if self._error is not None:
                raise self._error
            await self._wait()
        buf = self._buf
        if len(buf) == 1:
            data = buf.popleft()
        else:
            data = b"".join(buf)
            buf.clear()
        self._buffered = 0
        self.tail = data
        return data

    async def next_chunk(self) -> bytes:
        """Body bytes as they arrive (whatever is buffered, joined); ``b""`` at the end."""
        buf = self._buf
        while not buf:
            if self.complete:
                return b""
            if self._error is not None:
                raise self._error
            await self._wait()
        data = buf.popleft() if len(buf) == 1 else b"".join(buf)
        buf.clear()
        self._buffered = 0
        if self._conn._reading_paused and self._sink is None:
            self._conn.resume_reading()
        return data

    def pipe(
        self,
        sink: Callable[[bytes], None],
        *,
        flow: FlowControl | None = None,
        batch: Batching | None = None,
    ) -> asyncio.Future[None]:
        """Call ``sink(data)`` for each piece of body, directly from the protocol's data callback
        (already-buffered body first, synchronously). The returned future resolves at the end of
        the body, or fails with UpstreamProtocolError if the connection drops first, or with the
        sink's exception (the connection is then aborted).

        ``flow``: a :class:`FlowControl` (e.g. the client's ``HttpResponder``); while it signals
        pause, reading from the upstream socket is paused (backpressure). Cancelling the future
        aborts the upstream connection.

        ``batch``: a :class:`Batching` (e.g. the ``HttpResponder`` whose ``write`` is the sink):
        corked around the body buffered before this call, so a response head written just
        before goes out with it. The pieces of one upstream read always reach the sink as one
        call. Typical relay::

            await up.pipe(responder.write, flow=responder, batch=responder)"""
        loop = self._conn._loop
        fut: asyncio.Future[None] = loop.create_future()
        self.last_read_at = loop.time()
        if self._buf:
            self._sink_backlog(sink, batch)
        self._buffered = 0
        if self._error is not None:
            fut.set_exception(self._error)
            return fut
        if self.complete:
            fut.set_result(None)
            return fut
        if self._pipe_fut is not None:
            raise RuntimeError("pipe() already in progress")
        self._sink = sink
        self._pipe_fut = fut
        if self._conn._reading_paused:
            self._conn.resume_reading()
        if flow is not None:
            self._flow = flow
            flow.add_flow_listener(self.pause_reading, self.resume_reading)
        fut.add_done_callback(self._pipe_done)
        return fut

    def _sink_backlog(self, sink: Callable[[bytes], None], batch: Batching | None) -> None:
        """What arrived before pipe() (e.g. a whole stream while the prefill's verdict was
        awaited), as one sink call; corked, the response head (if the sink starts the response)
        leaves with it in one client write. A sink that fails sets the error (pipe's future
        fails with it) and closes the connection, as from the data callback."""
        buf = self._buf
        backlog = buf[0] if len(buf) == 1 else b"".join(buf)
        buf.clear()
        self.reads += 1
        self.tail = backlog
        if batch is not None:
            batch.cork()
        try:
            sink(backlog)
        except Exception as e:  # a complete body fails too
            self._error = e
            self._conn.abort()
        finally:
            if batch is not None:
                batch.uncork()

    def _pipe_done(self, fut: asyncio.Future[None]) -> None:
        if fut.cancelled():
            self._pipe_fut = None
            self._end_pipe()
            self.abort()

    def pause_reading(self) -> None:
        """Stop reading from the upstream socket (the client's backpressure)."""
        self.held_back = True
        self._conn.pause_reading()

    def resume_reading(self) -> None:
        if self.held_back:
            self.held_back = False
            self.last_read_at = self._conn._loop.time()  # the idle clock restarts from here
        self._conn.resume_reading()

    def release(self) -> None:
        """Return the connection to the pool if the body was fully read, else close it.
        Idempotent."""
        if self._released:
            return
        self._released = True
        conn = self._conn
        pool = conn._pool
        pool.in_use -= 1
        if self.complete and conn._keep_alive and not conn._closed and not pool._closed:
            if conn._reading_paused:
                conn.resume_reading()
            pool._put(conn)
        else:
            conn.abort()

    def abort(self) -> None:
        """Close the upstream connection now (how a request is cancelled upstream). After
        release() it does nothing: the connection is back in the pool, or already closed."""
        if self._released:
            return
        self._released = True
        self._conn._pool.in_use -= 1
        self._conn.abort()

    async def __aenter__(self) -> UpstreamResponse:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class _UpstreamConnection(asyncio.Protocol):
    __slots__ = (
        "_call",
        "_closed",
        "_has_cl",
        "_has_te",
        "_head_req",
        "_headers",
        "_idle_since",
        "_informational",
        "_keep_alive",
        "_loop",
        "_parser",
        "_pool",
        "_read_to_close",
        "_reading_paused",
        "_resp",
        "_seen",
        "_transport",
    )

    def __init__(self, pool: UpstreamPool, loop: asyncio.AbstractEventLoop) -> None:
        self._pool = pool
        self._loop = loop
        self._parser = HttpResponseParser(self)
        self._transport: asyncio.Transport = None  # type: ignore[assignment]
        self._closed = False
        self._resp: UpstreamResponse | None = None
        self._call: _Call | None = None  # the request whose response head is awaited
        self._headers: list[tuple[bytes, bytes]] = []
        self._seen = False
        self._keep_alive = False
        self._head_req = False
        self._has_cl = False
        self._has_te = False
        self._read_to_close = False
        self._informational = False
        self._reading_paused = False
        self._idle_since = 0.0

    # -- asyncio.Protocol -----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it
        self._transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except (OSError, AttributeError):
                pass

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        call = self._call
        if call is not None:
            self._call = None
            if not self._seen:
                self._pool._stale(call, str(exc) if exc else "EOF")
            else:
                self._pool._failed(call, UpstreamProtocolError("upstream closed the connection mid-headers"))
        resp = self._resp
        if resp is not None and not resp.complete:
            if self._read_to_close:
                resp._on_complete()  # the body of a response without length ends at EOF
            else:
                resp._on_error(UpstreamProtocolError("upstream closed the connection mid-body"))
        pool = self._pool
        if self._idle_since:
            try:
                pool._idle.remove(self)
            except ValueError:
                pass

    def data_received(self, data: bytes) -> None:
        self._seen = True
        try:
            self._parser.feed_data(data)
        except HttpParserCallbackError as e:
            ctx = e.__context__
            self._fail(ctx if ctx is not None else UpstreamProtocolError(str(e)))
        except HttpParserError as e:
            self._fail(UpstreamProtocolError(f"invalid HTTP response from upstream: {e}"))
        finally:
            cur = self._resp  # the one whose head came in this read, too
            if cur is not None and cur._pend:
                cur._flush()  # one sink call per read: one client write, no cork needed

    def eof_received(self) -> bool | None:
        return False

    # -- parser callbacks -----------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self._call is None and not self._informational:
            raise UpstreamProtocolError("unexpected data from upstream")
        self._headers = []
        self._has_cl = False
        self._has_te = False

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length":
            self._has_cl = True
        elif name == b"transfer-encoding":
            self._has_te = True
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self._parser
        status = parser.get_status_code()
        if status < 200:
            self._informational = True  # 100 Continue / 103: the real response follows
            return
        keep_alive = parser.should_keep_alive()
        resp = UpstreamResponse(status, self._headers, self)
        no_body = self._head_req or status == 204 or status == 304
        self._read_to_close = not no_body and not self._has_cl and not self._has_te
        if self._read_to_close or self._head_req:
            keep_alive = False
        self._keep_alive = keep_alive
        self._resp = resp
        call = self._call
        self._call = None
        if call is None or call.done():
            return
        call._data = b""
        call._extra = None
        if call._whole:
            call._resp = resp
            resp._whole = True
            resp._fetch = call
            if self._head_req:
                resp._on_complete()
            return
        if self._head_req:
            resp.complete = True
        call.set_result(resp)

    def on_body(self, body: bytes) -> None:
        resp = self._resp
        if resp is None or resp.complete:
            return  # e.g. after a HEAD response; the connection is not reused
        resp._pend.append(body)  # handed over as one at the end of this read (data_received)

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        resp = self._resp
        if resp is not None and not resp.complete:
            resp._on_complete()

    # -- internals ----------------------------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        call = self._call
        if call is not None:
            self._call = None
            self._pool._failed(call, exc)
        resp = self._resp
        if resp is not None:
            resp._on_error(exc)
        self.abort()

    def abort(self) -> None:
        if not self._closed:
            self._closed = True
            self._transport.abort()

    def pause_reading(self) -> None:
        if not self._reading_paused and not self._closed:
            self._reading_paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self._reading_paused:
            self._reading_paused = False
            if not self._closed:
                self._transport.resume_reading()

    def _send(self, call: _Call) -> None:
        self._idle_since = 0.0
        self._seen = False
        self._resp = None
        self._head_req = call._head_req
        self._call = call
        call._conn = self
        extra = call._extra
        if extra is None:
            self._transport.write(call._data)
        else:
            self._transport.writelines((call._data, extra))


class UpstreamPool:
    """Keep-alive connection pool for one upstream origin ``host:port`` (over TLS when given an
    SSL context: the certificate is checked against ``host``)."""

    __slots__ = (
        "_closed",
        "_host_line",
        "_idle",
        "_keep_after",
        "_loop",
        "connect_timeout_s",
        "host",
        "idle_timeout_s",
        "in_use",
        "max_idle",
        "port",
        "tls",
    )

    def __init__(
        self,
        host: str,
        port: int,
        *,
        max_idle: int = 256,
        connect_timeout_s: float = 5.0,
        idle_timeout_s: float = 4.0,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.tls = tls
        self.max_idle = max_idle
        self.connect_timeout_s = connect_timeout_s
        # Pooled connections idle longer than this are not reused (uvicorn, behind SGLang and
        # vLLM, closes idle keep-alive connections after 5 s).
        self.idle_timeout_s = idle_timeout_s
        self.in_use = 0
        self._idle: list[_UpstreamConnection] = []  # LIFO: the newest at the end
        self._keep_after = 0.0  # loop time before which no connection is kept idle (shed_idle)
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        default = 443 if tls is not None else 80
        hostport = host if port == default else f"{host}:{port}"
        if ":" in host and not host.startswith("["):
            hostport = f"[{host}]" if port == default else f"[{host}]:{port}"
        self._host_line = b"host: %s\r\n" % hostport.encode("idna")

    @property
    def idle(self) -> int:
        return len(self._idle)

    def __repr__(self) -> str:
        return f"<UpstreamPool {self.host}:{self.port} in_use={self.in_use} idle={len(self._idle)}>"

    def _take(self, now: float) -> _UpstreamConnection | None:
        idle = self._idle
        while idle:
            conn = idle.pop()
            if conn._closed:
                continue
            if now - conn._idle_since > self.idle_timeout_s:
                # The newest is too old, so are all below it.
                conn.abort()
                for c in idle:
                    c.abort()
                idle.clear()
                return None
            return conn
        return None

    def prune(self) -> int:
        """Close the idle connections that would not be reused (idle past `idle_timeout_s`, or
        closed by the engine): after a burst they would hold sockets, here and on the engine,
        until the engine's own keep-alive timeout. Returns how many were dropped."""
        idle = self._idle
        if not idle or self._loop is None:
            return 0
        cutoff = self._loop.time() - self.idle_timeout_s
        keep = [c for c in idle if not c._closed and c._idle_since >= cutoff]
        dropped = len(idle) - len(keep)
        if dropped:
            for c in idle:
                if not c._closed and c._idle_since < cutoff:
                    c.abort()
            idle[:] = keep  # oldest first, as before
        return dropped

    def shed_idle(self, for_s: float) -> None:
        """The process is short of descriptors: close the idle connections, and for `for_s`
        close each connection as its response ends instead of keeping it (they were what held
        the descriptors after a burst: without this the gateway stayed at its limit, unable to
        accept a client's connection)."""
        for c in self._idle:
            c.abort()
        self._idle.clear()
        if self._loop is not None:
            self._keep_after = self._loop.time() + for_s

    def _put(self, conn: _UpstreamConnection) -> None:
        assert self._loop is not None
        now = self._loop.time()
        if self._keep_after and now < self._keep_after:
            conn.abort()
            return
        idle = self._idle
        if len(idle) >= self.max_idle:
            idle.pop(0).abort()
        conn._idle_since = now
        idle.append(conn)

    async def _connect(self) -> _UpstreamConnection:
        loop = self._loop
        assert loop is not None
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, proto = await loop.create_connection(
                    lambda: _UpstreamConnection(self, loop),
                    self.host,
                    self.port,
                    ssl=self.tls,
                    server_hostname=self.host if self.tls is not None else None,
                )
        except TimeoutError:
            raise UpstreamConnectError(
                f"connect to {self.host}:{self.port} timed out after {self.connect_timeout_s} s"
            ) from None
        except OSError as e:
            short = _shortage_behind(e)
            if short is not None:
                # the idle connections kept for reuse hold descriptors this process lacks now
                self.shed_idle(self.idle_timeout_s)
                raise LocalResourceError(f"connect to {self.host}:{self.port} failed: {short}") from e
            raise UpstreamConnectError(f"connect to {self.host}:{self.port} failed: {e}") from e
        return proto

    def _head(
        self, method: str, path: str | bytes, headers: Sequence[tuple[bytes, bytes]], body: bytes | None
    ) -> bytes:
        m = _METHODS.get(method) or method.encode("ascii")
        p = path if isinstance(path, bytes) else path.encode("latin-1")
        parts = [m, b" ", p, b" HTTP/1.1\r\n"]
        host = self._host_line
        for n, v in headers:
            if n in _DROP:
                if n == b"host":
                    host = b"host: %s\r\n" % v
                continue
            parts += (n, b": ", v, b"\r\n")
        parts.append(host)
        if body is not None:
            parts.append(b"content-length: %d\r\n\r\n" % len(body))
            if len(body) <= _JOIN_BODY_MAX:
                parts.append(body)
        elif method in _NO_BODY_METHODS:
            parts.append(b"\r\n")
        else:
            parts.append(b"content-length: 0\r\n\r\n")
        return b"".join(parts)

    async def request(
        self,
        method: str,
        path: str | bytes,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes | None = None,
    ) -> UpstreamResponse:
        """Send a request; returns when the status line and headers are in.

        Adds Host (unless given) and Content-Length; Content-Length/Transfer-Encoding/Connection/
        Keep-Alive in ``headers`` are dropped. Raises UpstreamConnectError (nothing was sent) or
        UpstreamProtocolError (a bad or cut answer; also a reused connection that died before any
        response byte when sending the request again on a fresh one failed: the first copy may
        have reached the server. A second send that connects is the one retry made here)."""
        call = self.start(method, path, headers, body)
        try:
            return await call
        except asyncio.CancelledError:
            # cancelled after the head was in, before this coroutine resumed: nobody owns it
            if call.done() and not call.cancelled() and call.exception() is None:
                call.result().abort()
            raise

    def start(
        self,
        method: str,
        path: str | bytes,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes | None = None,
        *,
        replay: bool = True,
    ) -> asyncio.Future[UpstreamResponse]:
        """``request()`` without a coroutine: the request is written now when an idle pooled
        connection is at hand (a Task connects otherwise); the future resolves when the status
        line and headers are in, with the same errors as ``request()``. Cancelling it before then
        aborts the connection; once it holds a response, the caller owns it (release/abort).

        ``replay=False``: a reused connection that closes before any response byte fails the
        call (UpstreamProtocolError) instead of sending it again on a fresh one. Such a close is
        either a keep-alive connection the server had just dropped (it never saw the request) or
        a server that took the request and then dropped the connection; only the caller knows
        whether a second copy is harmless (an SGLang P/D leg is not: its bootstrap room is
        used once, and a copy of a leg the engine already saw waits for KV that never comes)."""
        return self._start(method, path, headers, body, False, replay)

    def fetch(
        self,
        method: str,
        path: str | bytes,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes | None = None,
        *,
        replay: bool = True,
    ) -> asyncio.Future[tuple[int, bytes]]:
        """Like ``start()``, but the future resolves with ``(status, whole body)`` once the body
        is in (the connection is then back in the pool); UpstreamProtocolError if the connection
        drops mid-body. Cancelling it before then aborts the connection."""
        return self._start(method, path, headers, body, True, replay)

    def _start(
        self,
        method: str,
        path: str | bytes,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes | None,
        whole: bool,
        replay: bool,
    ) -> _Call:
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        data = self._head(method, path, headers, body)
        extra = body if body is not None and len(body) > _JOIN_BODY_MAX else None
        call = _Call(loop, self, data, extra, method == "HEAD", whole, replay)
        if self._closed:
            call.set_exception(UpstreamConnectError(f"pool for {self.host}:{self.port} is closed"))
            return call
        self.in_use += 1
        conn = self._take(loop.time()) if self._idle else None
        if conn is not None:
            conn._send(call)
        else:
            call._fresh = True
            call._task = loop.create_task(self._connect_send(call))
        return call

    async def _connect_send(self, call: _Call) -> None:
        try:
            conn = await self._connect()
        except Exception as e:
            call._task = None
            if call._resent and isinstance(e, UpstreamConnectError) and not isinstance(e, LocalResourceError):
                # not "never reached": the first copy went out on the connection that died, and
                # the server may have taken it (a caller may act on the difference: a vLLM
                # decode that may have pulled its KV is not handed to another decode)
                e = UpstreamProtocolError(
                    f"upstream {self.host}:{self.port} closed a reused connection before responding, "
                    f"and sending the request again failed: {e}"
                )
            self._failed(call, e)
            return
        call._task = None
        if call.done():  # cancelled while connecting
            conn.abort()
            return
        conn._send(call)

    def _failed(self, call: _Call, exc: BaseException) -> None:
        """``call`` failed before its response head: it never owned a response."""
        if not call.done():
            self.in_use -= 1
            call.set_exception(exc)

    def _stale(self, call: _Call, why: str) -> None:
        """``call``'s connection closed before any byte of the response."""
        if call.done():
            return
        if call._fresh or not call._replay:
            which = "a fresh" if call._fresh else "a reused"
            self._failed(
                call,
                UpstreamProtocolError(
                    f"upstream {self.host}:{self.port} closed {which} connection before responding ({why})"
                ),
            )
            return
        # a pooled idle connection was dead: retry once on a fresh one
        call._fresh = call._resent = True
        call._conn = None
        assert self._loop is not None
        call._task = self._loop.create_task(self._connect_send(call))

    def _cancelled(self, call: _Call) -> None:
        resp = call._resp
        if resp is not None:  # fetch(): mid-body
            resp._fetch = None
            resp.abort()
            return
        self.in_use -= 1
        task = call._task
        if task is not None:
            call._task = None
            task.cancel()
        conn = call._conn
        if conn is not None:
            call._conn = None
            if conn._call is call:
                conn._call = None
            conn.abort()

    async def close(self) -> None:
        """Close idle connections; connections in use are closed when released."""
        self._closed = True
        idle = self._idle
        self._idle = []
        for c in idle:
            c.abort()
