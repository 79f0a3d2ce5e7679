"""Upstream HTTP/1.1 client: a keep-alive connection pool per origin on a raw
``asyncio.Protocol`` + ``httptools.HttpResponseParser``.

See docs/architecture.md (``gateway/http/client.py``) for the contract. Timeouts are applied by
callers with ``asyncio.timeout``; the only timeout here is the connect timeout.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import ssl
from collections.abc import Sequence

from .errors import LocalResourceError, UpstreamConnectError, UpstreamProtocolError
from .response import Batching, FlowControl, UpstreamResponse
from .upstream import _Call, _UpstreamConnection

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
        # the request's head (and a small body, in one write); Host added unless given, the
        # framing fields (`_DROP`) dropped and Content-Length set here
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
        extra = None
        if body is not None:
            parts.append(b"content-length: %d\r\n\r\n" % len(body))
            if len(body) <= _JOIN_BODY_MAX:
                parts.append(body)
            else:
                extra = body
        elif method in _NO_BODY_METHODS:
            parts.append(b"\r\n")
        else:
            parts.append(b"content-length: 0\r\n\r\n")
        data = b"".join(parts)
        call = _Call(loop, self, data, extra, method == "HEAD", whole, replay)
        if self._closed:
            call.set_exception(UpstreamConnectError(f"pool for {self.host}:{self.port} is closed"))
            return call
        self.in_use += 1
        idle, conn = self._idle, None
        if idle:  # the newest idle connection, if open and fresh (`_take`'s first step, inline)
            conn = idle[-1]
            if not conn._closed and loop.time() - conn._idle_since <= self.idle_timeout_s:
                idle.pop()
            else:
                conn = self._take(loop.time())
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
