"""One keep-alive connection to an upstream: an ``asyncio.Protocol`` that writes a request
(`_Call`) and parses its response into an `UpstreamResponse`."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from httptools import HttpParserCallbackError, HttpParserError, HttpResponseParser

from .errors import UpstreamProtocolError
from .response import UpstreamResponse
from .transport import adopt

if TYPE_CHECKING:
    from .client import UpstreamPool


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


class _UpstreamConnection(asyncio.Protocol):
    __slots__ = (
        "_body_to",
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
        # where the body's pieces of the read being parsed go (the response's `_pend`), None
        # where no body is taken (before a head, after a HEAD request's)
        self._body_to: list[bytes] | None = None
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
        self._transport = adopt(transport)

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
        self._body_to = None

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
        # (after a HEAD request's head no body is taken; the connection is not reused)
        self._body_to = None if self._head_req else resp._pend
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
        to = self._body_to
        if to is not None:
            to.append(body)  # handed over as one at the end of this read (data_received)

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
