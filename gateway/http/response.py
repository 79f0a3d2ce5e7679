"""An upstream response as the pool hands it to callers: `UpstreamResponse` reads the body whole,
chunk by chunk, or pipes it to a sink with flow control (`FlowControl`, `Batching`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .upstream import _Call, _UpstreamConnection

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
        "_time",
        "_waiter",
        "_whole",
        "complete",
        "first_data_at",
        "first_read_at",
        "headers",
        "held_back",
        "last_read_at",
        "reads",
        "second_read_at",
        "status",
        "tail",
    )

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], conn: _UpstreamConnection) -> None:
        self.status = status
        self.headers = headers  # names lowercased
        self.complete = False  # body fully received
        self._conn = conn
        self._time = conn._loop.time  # (bound once: read per piped read)
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
        # pipe(): when (time.monotonic()) the first two reads reached the sink, 0.0 until then:
        # a stream's first token (a chat stream's first read is often its role-only event)
        self.first_read_at = 0.0
        self.second_read_at = 0.0
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
        data = b"".join(pend)  # (one piece: that piece itself, not a copy)
        pend.clear()
        sink = self._sink
        if sink is not None:
            self.reads = n = self.reads + 1
            self.last_read_at = self._time()
            self._prev = self.tail
            self.tail = data
            if n < 3:
                self._early_read(n)
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
        self._early_read(self.reads)
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

    def _early_read(self, n: int) -> None:
        if n == 1:
            self.first_read_at = time.monotonic()
        elif n == 2:
            self.second_read_at = time.monotonic()

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
