"""UpstreamPool.start() / fetch(): requests resolved from the connection's callbacks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gateway.http import (
    HttpRequest,
    HttpResponder,
    HttpServer,
    UpstreamConnectError,
    UpstreamPool,
    UpstreamProtocolError,
    start_server,
)
from tests.http._util import free_port
from tests.http.test_client import raw_upstream, upstream_handler


@pytest.fixture
async def upstream() -> AsyncIterator[HttpServer]:
    srv = await start_server(upstream_handler, "127.0.0.1", 0)
    yield srv
    await srv.close()


async def test_start_and_fetch_reuse_one_connection(upstream: HttpServer) -> None:
    pool = UpstreamPool("127.0.0.1", upstream.port)
    assert await pool.fetch("POST", "/echo", [], b"first") == (200, b"first")
    assert pool.in_use == 0 and pool.idle == 1
    for i in range(3):
        fut = pool.start("POST", "/echo", [], b"body%d" % i)
        assert not isinstance(fut, asyncio.Task)  # written at once on the pooled connection
        assert pool.in_use == 1 and pool.idle == 0
        r = await fut
        assert r.status == 200 and r.header(b"x-method") == b"POST"
        assert await r.read() == b"body%d" % i
        r.release()
        assert pool.in_use == 0 and pool.idle == 1
        fut2 = pool.fetch("GET", "/stream?3", [], None)
        assert pool.in_use == 1
        assert await fut2 == (200, b"data: 0\n\ndata: 1\n\ndata: 2\n\n")
        assert pool.in_use == 0 and pool.idle == 1
    assert await pool.fetch("GET", "/big-stream?20", [], None) == (200, b"y" * 65536 * 20)
    assert await pool.fetch("GET", "/204", [], None) == (204, b"")
    assert upstream.connections == 1
    await pool.close()
    with pytest.raises(UpstreamConnectError):
        await pool.fetch("GET", "/", [], None)
    with pytest.raises(UpstreamConnectError):
        await pool.start("GET", "/", [], None)
    assert pool.in_use == 0


async def test_fetch_dead_idle_connection_is_retried() -> None:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await r.readuntil(b"\r\n\r\n")
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\nconn%d" % (len(b"conn%d" % n), n))
        await w.drain()
        await r.readuntil(b"\r\n\r\n")
        w.transport.abort()

    srv, port = await raw_upstream(handle)
    pool = UpstreamPool("127.0.0.1", port)
    assert await pool.fetch("GET", "/", [], None) == (200, b"conn1")
    assert pool.idle == 1
    assert await pool.fetch("POST", "/", [], b"x") == (200, b"conn2")  # retried on conn 2
    r = await pool.start("POST", "/", [], b"x")  # conn 2 dies too: retried on conn 3
    assert await r.read() == b"conn3"
    r.release()
    assert pool.in_use == 0
    srv.close()
    await pool.close()


async def test_fetch_errors_leave_nothing_in_use() -> None:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await r.readuntil(b"\r\n\r\n")
        if n == 1:
            w.write(b"NOT HTTP AT ALL\r\n\r\n")
        elif n == 2:
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort")
        else:
            w.transport.abort()  # a fresh connection closed before any response byte
            return
        await w.drain()

    srv, port = await raw_upstream(handle)
    pool = UpstreamPool("127.0.0.1", port)
    for _ in range(3):
        with pytest.raises(UpstreamProtocolError):
            await pool.fetch("GET", "/", [], None)
        assert pool.in_use == 0 and pool.idle == 0
    with pytest.raises(UpstreamProtocolError):
        await pool.start("GET", "/", [], None)
    assert pool.in_use == 0
    srv.close()
    refused = UpstreamPool("127.0.0.1", free_port(), connect_timeout_s=2)
    with pytest.raises(UpstreamConnectError):
        await refused.fetch("GET", "/", [], None)
    with pytest.raises(UpstreamConnectError):
        await refused.start("GET", "/", [], None)
    assert refused.in_use == 0


async def _slow(req: HttpRequest, resp: HttpResponder) -> None:
    if req.path == "/ok":
        resp.send(200, (), b"ok")
        return
    await asyncio.sleep(30)


@pytest.mark.parametrize("kind", ["start", "fetch"])
@pytest.mark.parametrize("pooled", [False, True])
async def test_cancel_before_head_aborts_connection(kind: str, pooled: bool) -> None:
    srv = await start_server(_slow, "127.0.0.1", 0)
    pool = UpstreamPool("127.0.0.1", srv.port)
    call = pool.start if kind == "start" else pool.fetch

    async def prime() -> None:
        if pooled:  # a connection in the pool: the request is written synchronously
            assert await pool.fetch("GET", "/ok", [], None) == (200, b"ok")
            assert pool.idle == 1

    await prime()
    # a direct cancel() ...
    fut = call("GET", "/", [], None)
    await asyncio.sleep(0.05)
    assert pool.in_use == 1 and srv.active_requests == 1
    assert fut.cancel()
    assert pool.in_use == 0
    await asyncio.sleep(0.05)
    assert srv.active_requests == 0 and pool.idle == 0  # the upstream saw the disconnect
    # ... and a timeout around the await (the awaiting task is cancelled)
    await prime()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await call("GET", "/", [], None)
    assert pool.in_use == 0
    await asyncio.sleep(0.05)
    assert srv.active_requests == 0 and pool.idle == 0
    # cancelled at once (still connecting, unless pooled)
    await prime()
    fut = call("GET", "/", [], None)
    fut.cancel()
    await asyncio.sleep(0.05)
    assert pool.in_use == 0 and srv.active_requests == 0 and pool.idle == 0
    await srv.close()


async def test_cancel_fetch_mid_body_aborts_connection(upstream: HttpServer) -> None:
    pool = UpstreamPool("127.0.0.1", upstream.port)
    assert await pool.fetch("GET", "/", [], None) == (200, b"empty")
    fut = pool.fetch("GET", "/hang", [], None)  # head and "first" arrive, then nothing
    await asyncio.sleep(0.05)
    assert not fut.done() and pool.in_use == 1 and upstream.active_requests == 1
    fut.cancel()
    assert pool.in_use == 0
    await asyncio.sleep(0.05)
    assert upstream.active_requests == 0 and pool.idle == 0
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await pool.fetch("GET", "/hang", [], None)
    await asyncio.sleep(0.05)
    assert pool.in_use == 0 and upstream.active_requests == 0
    await pool.close()


async def test_start_cancelled_after_head_is_callers() -> None:
    """Once start()'s future holds the response, cancel() is a no-op: the caller owns it."""
    srv = await start_server(upstream_handler, "127.0.0.1", 0)
    pool = UpstreamPool("127.0.0.1", srv.port)
    fut = pool.start("GET", "/hang", [], None)
    r = await fut
    assert not fut.cancel() and pool.in_use == 1
    assert await r.next_chunk() == b"first"
    r.abort()
    await asyncio.sleep(0.05)
    assert pool.in_use == 0 and srv.active_requests == 0
    await srv.close()
