"""HTTP/1.1 server on a raw ``asyncio.Protocol`` + ``httptools.HttpRequestParser``.

One protocol object per client connection; one handler Task per complete request. Pipelined
requests are queued and handled one after another, responses in order. See
docs/architecture.md (``gateway/http/server.py``) for the contract.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Coroutine
from typing import Any

from .connection import HttpConnection, StallHook, _wake_all
from .limits import ServerLimits
from .request import HttpRequest, Refusal, RefusalHook, _Err
from .responder import HttpResponder, Responder

__all__ = [
    "Handler",
    "HttpRequest",
    "HttpResponder",
    "HttpServer",
    "Refusal",
    "RefusalHook",
    "Responder",
    "StallHook",
    "start_server",
]

Handler = Callable[["HttpRequest", "HttpResponder"], Coroutine[Any, Any, None]]


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
        self._conns: set[HttpConnection] = set()
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

    def _protocol(self) -> HttpConnection:
        return HttpConnection(self)

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
