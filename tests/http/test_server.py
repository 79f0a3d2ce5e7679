from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator

import pytest

from gateway.http import HttpRequest, HttpResponder, HttpServer, Refusal, ServerLimits, start_server
from tests.http._util import is_closed, read_response, request

JSON = ((b"content-type", b"application/json"),)


async def echo(req: HttpRequest, resp: HttpResponder) -> None:
    """Echoes method/path/query/body; special paths for the tests."""
    if req.path == "/sleep":
        await asyncio.sleep(float(req.query.split("=")[1]))
    if req.path == "/stream":
        resp.start_stream(200, ((b"content-type", b"text/event-stream"),))
        for i in range(int(req.query or "3")):
            resp.write(b"data: %d\n\n" % i)
            await resp.drain()
        resp.end()
        return
    if req.path == "/boom":
        raise RuntimeError("boom")
    if req.path == "/boom-late":
        resp.start_stream(200, ())
        resp.write(b"partial")
        raise RuntimeError("late boom")
    body = json.dumps(
        {
            "method": req.method,
            "path": req.path,
            "query": req.query,
            "len": len(req.body),
            "client": req.client,
        }
    ).encode()
    if req.path == "/raw":
        body = req.body
    resp.send(200, JSON, body)


@pytest.fixture
async def server() -> AsyncIterator[HttpServer]:
    srv = await start_server(echo, "127.0.0.1", 0)
    yield srv
    await srv.close()


async def test_get_and_keepalive_reuse(server: HttpServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    for i in range(3):
        writer.write(b"GET /x?a=%d HTTP/1.1\r\nHost: t\r\n\r\n" % i)
        r = await read_response(reader)
        assert r.status == 200
        d = json.loads(r.body)
        assert d["method"] == "GET" and d["path"] == "/x" and d["query"] == f"a={i}"
        assert r.header(b"connection") is None
    assert server.connections == 1
    writer.close()


async def test_post_body_and_headers(server: HttpServer) -> None:
    seen: list[HttpRequest] = []

    async def h(req: HttpRequest, resp: HttpResponder) -> None:
        seen.append(req)
        resp.send(201, ((b"x-a", b"1"),), req.body)

    srv = await start_server(h, "127.0.0.1", 0)
    try:
        r, _, w = await request(
            srv.port, b"POST /v1/chat HTTP/1.1\r\nHost: t\r\nX-Foo: Bar\r\nContent-Length: 5\r\n\r\nhello"
        )
        assert r.status == 201 and r.body == b"hello" and r.header(b"x-a") == b"1"
        assert seen[0].header(b"x-foo") == b"Bar" and seen[0].header(b"host") == b"t"
        assert seen[0].client is not None and seen[0].client[0] == "127.0.0.1"
        w.close()
    finally:
        await srv.close()


async def test_a_repeated_field_reads_as_its_first_value_and_all_are_kept() -> None:
    """`header()` indexes the fields once (a dict); the first of repeated names must still win,
    as with the scan it replaced, and `headers` keeps every field in order."""
    seen: list[HttpRequest] = []

    async def h(req: HttpRequest, resp: HttpResponder) -> None:
        seen.append(req)
        resp.send(200, (), b"")

    srv = await start_server(h, "127.0.0.1", 0)
    try:
        head = b"GET / HTTP/1.1\r\nHost: t\r\nX-Dup: first\r\nx-other: 1\r\nX-DUP: second\r\n\r\n"
        r, _, w = await request(srv.port, head)
        assert r.status == 200
        req = seen[0]
        assert req.header(b"x-dup") == b"first" and req.header(b"x-other") == b"1"
        assert req.header(b"x-missing") is None and req.header(b"x-dup") == b"first"
        assert req.headers == [
            (b"host", b"t"),
            (b"x-dup", b"first"),
            (b"x-other", b"1"),
            (b"x-dup", b"second"),
        ]
        w.close()
    finally:
        await srv.close()


async def test_pipelined_in_order(server: HttpServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(
        b"GET /sleep?t=0.1 HTTP/1.1\r\nHost: t\r\n\r\n"
        b"POST /raw HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nabc"
        b"GET /stream?2 HTTP/1.1\r\nHost: t\r\n\r\n"
        b"GET /last HTTP/1.1\r\nHost: t\r\n\r\n"
    )
    r1 = await read_response(reader)
    r2 = await read_response(reader)
    r3 = await read_response(reader)
    r4 = await read_response(reader)
    assert json.loads(r1.body)["path"] == "/sleep"
    assert r2.body == b"abc"
    assert r3.chunks == [b"data: 0\n\n", b"data: 1\n\n"]
    assert json.loads(r4.body)["path"] == "/last"
    writer.close()


async def test_chunked_request_body(server: HttpServer) -> None:
    raw = b"POST /raw HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    r, _, w = await request(server.port, raw)
    assert r.status == 200 and r.body == b"hello world"
    w.close()


async def test_stream_response_chunked(server: HttpServer) -> None:
    r, _, w = await request(server.port, b"GET /stream?64 HTTP/1.1\r\nHost: t\r\n\r\n")
    assert r.header(b"transfer-encoding") == b"chunked"
    assert len(r.chunks) == 64 and r.chunks[63] == b"data: 63\n\n"
    w.close()


async def test_big_bodies(server: HttpServer) -> None:
    body = bytes(range(256)) * (5 * 4096)  # 5 MiB
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"POST /raw HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % len(body))
    writer.write(body)
    r = await read_response(reader)
    assert r.body == body
    # chunked, big
    writer.write(b"POST /raw HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
    for i in range(0, len(body), 100_000):
        part = body[i : i + 100_000]
        writer.write(b"%x\r\n%b\r\n" % (len(part), part))
    writer.write(b"0\r\n\r\n")
    r = await read_response(reader)
    assert r.body == body
    writer.close()


async def test_head_request(server: HttpServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"HEAD /raw HTTP/1.1\r\nHost: t\r\n\r\nGET /after HTTP/1.1\r\nHost: t\r\n\r\n")
    r = await read_response(reader, head=True)
    assert r.status == 200 and r.header(b"content-length") == b"0"
    r = await read_response(reader)
    assert json.loads(r.body)["path"] == "/after"
    writer.close()


def _error(r: object) -> dict:
    body = r.body  # type: ignore[attr-defined]
    d = json.loads(body)
    assert set(d["error"]) == {"message", "type", "param", "code"}
    assert d["error"]["type"] == "invalid_request_error" and d["error"]["param"] is None
    return d["error"]


async def test_limits_413_431() -> None:
    srv = await start_server(
        echo, "127.0.0.1", 0, limits=ServerLimits(max_body_bytes=1000, max_header_bytes=2000)
    )
    try:
        r, reader, w = await request(
            srv.port, b"POST /raw HTTP/1.1\r\nHost: t\r\nContent-Length: 1001\r\n\r\n"
        )
        assert r.status == 413 and r.header(b"connection") == b"close"
        assert _error(r)["code"] == "request_too_large"
        assert await is_closed(reader)
        # chunked body growing past the limit
        raw = (
            b"POST /raw HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"200\r\n"
            + b"x" * 512
            + b"\r\n"
        )
        r, reader, w = await request(srv.port, raw * 1 + (b"200\r\n" + b"x" * 512 + b"\r\n") * 2)
        assert r.status == 413
        # many headers
        raw = (
            b"GET / HTTP/1.1\r\nHost: t\r\n"
            + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 50) for i in range(60))
            + b"\r\n"
        )
        r, reader, w = await request(srv.port, raw)
        assert r.status == 431 and _error(r)["code"] == "request_header_fields_too_large"
        assert await is_closed(reader)
        # one huge header, sent in pieces (never completes)
        reader, w = await asyncio.open_connection("127.0.0.1", srv.port)
        w.write(b"GET / HTTP/1.1\r\nHost: t\r\nX-Big: ")
        await asyncio.sleep(0.02)
        for _ in range(5):  # 2500 bytes of one unfinished header
            w.write(b"v" * 500)
            await asyncio.sleep(0.01)
        r = await read_response(reader)
        assert r.status == 431
        # fine at the limit
        r, reader, w = await request(
            srv.port, b"POST /raw HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n" + b"y" * 1000
        )
        assert r.status == 200 and len(r.body) == 1000
        w.close()
    finally:
        await srv.close()


async def test_read_timeout_408_and_keepalive_timeout() -> None:
    srv = await start_server(
        echo, "127.0.0.1", 0, limits=ServerLimits(read_timeout_s=0.2, keepalive_timeout_s=0.3)
    )
    try:
        reader, w = await asyncio.open_connection("127.0.0.1", srv.port)
        w.write(b"POST /raw HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nabc")
        t0 = asyncio.get_running_loop().time()
        r = await asyncio.wait_for(read_response(reader), 3)
        assert r.status == 408 and _error(r)["code"] == "request_timeout"
        assert asyncio.get_running_loop().time() - t0 < 1.5
        assert await is_closed(reader)
        # idle keep-alive connection is closed
        r, reader, w = await request(srv.port, b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        assert r.status == 200
        assert await is_closed(reader, 3)
    finally:
        await srv.close()


@pytest.mark.parametrize(
    "raw",
    [
        b"GARBAGE\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: t\r\nContent-Length: abc\r\n\r\n",
        b"GET / HTTP/9.9\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"GET / HTTP/1.1\r\nHost: t\r\nBad Header\r\n\r\n",
    ],
)
async def test_malformed_400_and_close(server: HttpServer, raw: bytes) -> None:
    r, reader, _w = await request(server.port, raw)
    assert r.status == 400 and r.header(b"connection") == b"close"
    assert _error(r)["code"] == "bad_request"
    assert await is_closed(reader)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"GET / HTTP/1.1\r\n\r\n", "Missing Host header."),
        (b"GET / HTTP/1.1\r\nHost: a\r\nhost: b\r\n\r\n", "Duplicate Host header."),
        (b"GET / HTTP/1.0\r\nHost: a\r\nHost: a\r\n\r\n", "Duplicate Host header."),
    ],
)
async def test_an_http_1_1_request_needs_exactly_one_host(
    server: HttpServer, raw: bytes, message: str
) -> None:
    r, reader, _w = await request(server.port, raw)
    assert r.status == 400 and _error(r) == {
        "message": message,
        "type": "invalid_request_error",
        "param": None,
        "code": "bad_request",
    }
    assert await is_closed(reader)


async def test_malformed_after_pipelined_request(server: HttpServer) -> None:
    reader, w = await asyncio.open_connection("127.0.0.1", server.port)
    w.write(b"GET /sleep?t=0.05 HTTP/1.1\r\nHost: t\r\n\r\nNOT HTTP\r\n\r\n")
    r1 = await read_response(reader)
    r2 = await read_response(reader)
    assert r1.status == 200 and r2.status == 400
    assert await is_closed(reader)


async def test_expect_100_continue(server: HttpServer) -> None:
    reader, w = await asyncio.open_connection("127.0.0.1", server.port)
    w.write(b"POST /raw HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
    line = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
    assert line.startswith(b"HTTP/1.1 100 Continue")
    w.write(b"data")
    r = await read_response(reader)
    assert r.body == b"data"
    # too large: 413 instead of 100
    srv = await start_server(echo, "127.0.0.1", 0, limits=ServerLimits(max_body_bytes=10))
    try:
        r, _, _ = await request(
            srv.port, b"POST /raw HTTP/1.1\r\nHost: t\r\nContent-Length: 11\r\nExpect: 100-continue\r\n\r\n"
        )
        assert r.status == 413
    finally:
        await srv.close()


async def test_http10_close_and_keepalive(server: HttpServer) -> None:
    r, reader, w = await request(server.port, b"GET /a HTTP/1.0\r\n\r\n")
    assert r.status == 200 and r.header(b"connection") == b"close"
    assert await is_closed(reader)
    reader, w = await asyncio.open_connection("127.0.0.1", server.port)
    for _ in range(2):
        w.write(b"GET /a HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        r = await read_response(reader)
        assert r.status == 200 and r.header(b"connection") == b"keep-alive"
    # a stream to an HTTP/1.0 client is delimited by close
    w.write(b"GET /stream?3 HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    r = await read_response(reader)
    assert r.body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    # Connection: close on 1.1
    r, reader, w = await request(server.port, b"GET /a HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    assert r.header(b"connection") == b"close" and await is_closed(reader)


async def test_client_disconnect_cancels_handler() -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def h(req: HttpRequest, resp: HttpResponder) -> None:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    srv = await start_server(h, "127.0.0.1", 0)
    try:
        _reader, w = await asyncio.open_connection("127.0.0.1", srv.port)
        w.write(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        await asyncio.wait_for(started.wait(), 2)
        assert srv.active_requests == 1
        w.close()
        await asyncio.wait_for(cancelled.wait(), 2)
        await asyncio.sleep(0)
        assert srv.active_requests == 0
    finally:
        await srv.close()


async def test_handler_errors(server: HttpServer) -> None:
    r, reader, w = await request(server.port, b"GET /boom HTTP/1.1\r\nHost: t\r\n\r\n")
    assert r.status == 500
    assert json.loads(r.body)["error"]["type"] == "server_error"
    reader, w = await asyncio.open_connection("127.0.0.1", server.port)
    w.write(b"GET /boom-late HTTP/1.1\r\nHost: t\r\n\r\n")
    raw = b""
    with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
        raw = await reader.readuntil(b"0\r\n\r\n")
    assert b"partial" not in raw or not raw.endswith(b"0\r\n\r\n")
    # the server still works
    r, _, w = await request(server.port, b"GET /ok HTTP/1.1\r\nHost: t\r\n\r\n")
    assert r.status == 200


async def test_no_response_is_500() -> None:
    async def h(req: HttpRequest, resp: HttpResponder) -> None:
        return None

    srv = await start_server(h, "127.0.0.1", 0)
    try:
        r, _, _ = await request(srv.port, b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        assert r.status == 500
    finally:
        await srv.close()


async def test_backpressure_drain_and_flow_listeners() -> None:
    events: list[str] = []
    done = asyncio.Event()

    async def h(req: HttpRequest, resp: HttpResponder) -> None:
        resp.add_flow_listener(lambda: events.append("pause"), lambda: events.append("resume"))
        resp.start_stream(200, ())
        chunk = b"x" * 65536
        for _ in range(200):  # 12.5 MiB
            resp.write(chunk)
            await resp.drain()
        resp.end()
        done.set()

    srv = await start_server(h, "127.0.0.1", 0)
    try:
        reader, w = await asyncio.open_connection("127.0.0.1", srv.port, limit=2**16)
        w.write(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        await asyncio.sleep(0.3)  # the client does not read: the server must pause
        assert events and events[0] == "pause"
        assert not done.is_set()
        r = await read_response(reader)
        assert len(r.body) == 200 * 65536
        assert "resume" in events
        await asyncio.wait_for(done.wait(), 2)
    finally:
        await srv.close()


async def test_graceful_shutdown() -> None:
    release = asyncio.Event()

    async def h(req: HttpRequest, resp: HttpResponder) -> None:
        if req.path == "/slow":
            await release.wait()
        resp.send(200, (), b"ok")

    srv = await start_server(h, "127.0.0.1", 0)
    # one idle keep-alive connection and one in flight
    r, idle_reader, idle_w = await request(srv.port, b"GET /fast HTTP/1.1\r\nHost: t\r\n\r\n")
    reader, w = await asyncio.open_connection("127.0.0.1", srv.port)
    w.write(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n")
    await asyncio.sleep(0.05)
    srv.stop_accepting()
    assert not await is_closed(idle_reader, timeout=0.1)  # kept: a request on it gets a 503
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", srv.port)
    idle_w.write(b"GET /fast HTTP/1.1\r\nHost: t\r\n\r\n")
    late = await read_response(idle_reader)
    assert late.status == 503 and late.header(b"connection") == b"close"
    assert json.loads(late.body)["error"] == {
        "message": "The server is shutting down.",
        "type": "server_error",
        "param": None,
        "code": "shutting_down",
    }
    assert await is_closed(idle_reader)
    assert not await srv.wait_idle(0.05)
    release.set()
    assert await srv.wait_idle(2)
    r = await read_response(reader)
    assert r.body == b"ok" and r.header(b"connection") == b"close"
    await srv.close()


async def test_close_cancels_handlers() -> None:
    cancelled = asyncio.Event()

    async def h(req: HttpRequest, resp: HttpResponder) -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    srv = await start_server(h, "127.0.0.1", 0)
    reader, w = await asyncio.open_connection("127.0.0.1", srv.port)
    w.write(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
    await asyncio.sleep(0.05)
    await asyncio.wait_for(srv.close(), 3)
    assert cancelled.is_set()
    assert await is_closed(reader)


async def test_reuse_port() -> None:
    a = await start_server(echo, "127.0.0.1", 0, reuse_port=True)
    b = await start_server(echo, "127.0.0.1", a.port, reuse_port=True)
    try:
        assert a.port == b.port
        r, _, _ = await request(a.port, b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        assert r.status == 200
    finally:
        await a.close()
        await b.close()


def test_stdlib_asyncio_loop() -> None:
    """The suite runs on uvloop (tests/conftest.py); the data plane also works on asyncio's loop."""

    async def main() -> None:
        srv = await start_server(echo, "127.0.0.1", 0)
        try:
            r, reader, w = await request(srv.port, b"GET /stream?5 HTTP/1.1\r\nHost: t\r\n\r\n")
            assert len(r.chunks) == 5
            w.write(b"POST /raw HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nabc")
            r = await read_response(reader)
            assert r.body == b"abc"
            w.close()
        finally:
            await srv.close()

    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        runner.run(main())


async def test_expect_100_continue_waits_only_for_the_response_before_it() -> None:
    """A 100 is held back only while another response is being written: sent at once when the
    response before has ended although its handler still runs, and, for a pipelined request,
    as soon as the requests before it are done (it used to be never, stalling the client until
    its own timeout)."""

    async def h(req: HttpRequest, resp: HttpResponder) -> None:
        resp.send(200, JSON, req.body or b"{}")
        if req.path == "/linger":
            await asyncio.sleep(1.0)  # work after the answer (a handler's bookkeeping)

    srv = await start_server(h, "127.0.0.1", 0)
    try:
        reader, w = await asyncio.open_connection("127.0.0.1", srv.port)
        w.write(b"GET /linger HTTP/1.1\r\nHost: t\r\n\r\n")
        assert (await read_response(reader)).status == 200
        w.write(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 0.5)
        assert head.startswith(b"HTTP/1.1 100 Continue")
        w.write(b"{}")
        assert (await read_response(reader)).status == 200
        # pipelined behind a request still being answered: the 100 follows that answer
        w.write(
            b"GET /linger HTTP/1.1\r\nHost: t\r\n\r\n"
            b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n"
        )
        assert (await read_response(reader)).status == 200
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2.0)
        assert head.startswith(b"HTTP/1.1 100 Continue")
        w.write(b"{}")
        assert (await read_response(reader)).status == 200
        w.close()
    finally:
        await srv.close()


@pytest.mark.parametrize("te", [b"gzip, chunked", b"br,chunked", b"gzip\r\nTransfer-Encoding: chunked"])
async def test_transfer_codings_other_than_chunked_are_501(server: HttpServer, te: bytes) -> None:
    """The parser frames `gzip, chunked` as chunked and would pass the coded bytes on as the
    body: RFC 9112 section 6.1, a coding the server does not understand is a 501."""
    r, _, _ = await request(
        server.port,
        b"POST /raw HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: %s\r\n\r\n2\r\n{}\r\n0\r\n\r\n" % te,
    )
    assert r.status == 501 and _error(r)["code"] == "not_implemented"


async def test_http_versions_above_1_are_505(server: HttpServer) -> None:
    r, _, _ = await request(server.port, b"GET /x HTTP/2.0\r\nHost: t\r\n\r\n")
    assert r.status == 505 and _error(r)["code"] == "http_version_not_supported"


def _upload_past_the_limit(port: int) -> bytes:
    """A blocking client that sends its whole (too large) body before reading, as
    http.client does; returns what it reads."""
    import socket

    with socket.create_connection(("127.0.0.1", port)) as s:
        body = b"x" * (4 * 1024 * 1024)
        s.sendall(b"POST /raw HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % len(body))
        s.sendall(body)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


async def test_a_client_still_uploading_reads_its_413_not_a_reset() -> None:
    """After an error answered before the body was read, the server shuts its write side and
    drops what still comes: closing with unread bytes made the kernel reset the connection,
    and a client that sends its whole body before reading got ECONNRESET, not the 413."""
    srv = await start_server(echo, "127.0.0.1", 0, limits=ServerLimits(max_body_bytes=1000))
    try:
        for _ in range(3):
            out = await asyncio.to_thread(_upload_past_the_limit, srv.port)
            assert out.startswith(b"HTTP/1.1 413 "), out[:200]
            assert b'"request_too_large"' in out
    finally:
        await srv.close()


async def test_refusal_hook_sees_what_was_read_and_adds_headers() -> None:
    """`on_refusal` gets each request the server answers itself, with the header fields read
    before the refusal (none of an earlier request on the connection), and what it returns is
    sent with the answer; a hook that fails does not cost the client its answer."""
    seen: list[Refusal] = []

    def hook(r: Refusal) -> list[tuple[bytes, bytes]]:
        seen.append(r)
        if r.header(b"x-boom") is not None:
            raise RuntimeError("hook failed")
        return [(b"x-request-id", r.header(b"x-request-id") or b"made-up")]

    srv = await start_server(
        echo, "127.0.0.1", 0, limits=ServerLimits(max_body_bytes=100, read_timeout_s=0.2), on_refusal=hook
    )
    try:
        r, _, _ = await request(
            srv.port,
            b"POST /raw?q=1 HTTP/1.1\r\nHost: t\r\nX-Request-Id: a1\r\nContent-Length: 101\r\n\r\n",
        )
        assert r.status == 413 and r.header(b"x-request-id") == b"a1"
        assert (seen[-1].status, seen[-1].code, seen[-1].path) == (413, "request_too_large", "/raw")
        assert seen[-1].client is not None and seen[-1].client[0] == "127.0.0.1"
        # an earlier, complete request's headers are not the refused one's
        reader, w = await asyncio.open_connection("127.0.0.1", srv.port)
        w.write(b"GET /x HTTP/1.1\r\nHost: t\r\nX-Request-Id: ok-1\r\n\r\n")
        assert (await read_response(reader)).status == 200
        w.write(b"GARBAGE\r\n\r\n")
        r = await read_response(reader)
        assert r.status == 400 and r.header(b"x-request-id") == b"made-up"
        assert seen[-1].headers == [] and seen[-1].path == ""
        w.close()
        # pipelined behind a slow request: answered after it, with what was read of it
        reader, w = await asyncio.open_connection("127.0.0.1", srv.port)
        w.write(
            b"GET /sleep?s=0.1 HTTP/1.1\r\nHost: t\r\n\r\n"
            b"POST /raw HTTP/1.1\r\nHost: t\r\nX-Request-Id: p2\r\nContent-Length: zz\r\n\r\n"
        )
        assert (await read_response(reader)).status == 200
        r = await read_response(reader)
        assert r.status == 400 and r.header(b"x-request-id") == b"p2"
        w.close()
        # a timeout: elapsed since the request's first byte
        reader, w = await asyncio.open_connection("127.0.0.1", srv.port)
        w.write(b"POST /raw HTTP/1.1\r\nHost: t\r\nX-Request-Id: t3\r\nContent-Length: 10\r\n\r\nab")
        r = await asyncio.wait_for(read_response(reader), 3)
        assert r.status == 408 and r.header(b"x-request-id") == b"t3" and seen[-1].elapsed_s >= 0.15
        w.close()
        # the hook fails: the answer still goes out
        r, _, _ = await request(
            srv.port, b"GET / HTTP/1.1\r\nHost: t\r\nX-Boom: 1\r\nContent-Length: x\r\n\r\n"
        )
        assert r.status == 400 and r.header(b"x-request-id") is None and _error(r)["code"] == "bad_request"
    finally:
        await srv.close()


async def _reads_nothing(port: int, target: bytes) -> socket.socket:
    """A client that sends one request and never reads (its receive buffer 4 KB)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    await loop.sock_sendall(sock, b"GET %s HTTP/1.1\r\nHost: t\r\n\r\n" % target)
    return sock


async def test_a_client_that_reads_nothing_is_cut_after_client_stall_s() -> None:
    """`client_stall_s`: a client that takes none of a stream for that long, the writes to it
    paused, is cut as a disconnect is (its handler cancelled) and the `on_stall` hook is told
    (the responder, how long); one whose whole answer was sent (its handler done) is cut too."""
    cancelled = asyncio.Event()
    stalls: list[tuple[str | None, bool, float]] = []
    responders: list[HttpResponder] = []

    async def h(req: HttpRequest, resp: HttpResponder) -> None:
        responders.append(resp)
        name = [(b"x-name", req.path.encode())]  # the hook reads it back off the responder
        if req.path == "/whole":
            resp.send(200, name, b"x" * (16 << 20))  # more than the socket buffers take
            return
        resp.start_stream(200, name)
        try:
            while True:
                resp.write(b"y" * 65536)
                await resp.drain()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    def on_stall(resp: HttpResponder | None, stalled_s: float) -> None:
        name = resp.sent_header(b"x-name") if resp else None
        stalls.append((name.decode() if name else None, resp.finished if resp else False, stalled_s))

    srv = await start_server(h, "127.0.0.1", 0, limits=ServerLimits(client_stall_s=0.3), on_stall=on_stall)
    socks: list[socket.socket] = []
    try:
        t0 = time.monotonic()
        socks.append(await _reads_nothing(srv.port, b"/stream"))
        await asyncio.wait_for(cancelled.wait(), 10)
        assert 0.3 <= time.monotonic() - t0 < 5
        # asyncio runs a timer up to its clock resolution early: 0.3 s may read 0.2999999999
        assert [(p, f) for p, f, _ in stalls] == [("/stream", False)] and 0.299 <= stalls[0][2] < 2, stalls
        assert responders[0].stalled_s == stalls[0][2] and responders[0].closed
        socks.append(await _reads_nothing(srv.port, b"/whole"))
        for _ in range(200):
            if len(stalls) == 2:
                break
            await asyncio.sleep(0.05)
        assert [(p, f) for p, f, _ in stalls[1:]] == [("/whole", True)], stalls
        for _ in range(100):
            if not srv.connections:
                break
            await asyncio.sleep(0.02)
        assert srv.connections == 0 and srv.active_requests == 0
    finally:
        for s in socks:
            s.close()
        await srv.close()


async def test_without_client_stall_s_a_client_that_reads_nothing_is_kept() -> None:
    """Off by default (0): the server waits for the client as long as the handler does."""
    stalls: list[float] = []

    async def h(req: HttpRequest, resp: HttpResponder) -> None:
        resp.send(200, (), b"x" * (16 << 20))

    srv = await start_server(h, "127.0.0.1", 0, on_stall=lambda r, s: stalls.append(s))
    try:
        sock = await _reads_nothing(srv.port, b"/")
        await asyncio.sleep(1.0)
        assert srv.connections == 1 and not stalls
        sock.close()
    finally:
        await srv.close()


async def test_http10_with_transfer_encoding_is_refused_and_closed(server: HttpServer) -> None:
    """RFC 9112 6.1: an HTTP/1.0 message with Transfer-Encoding has faulty framing. What follows
    its chunked body must not be served as another request (request smuggling): the server
    answers 400 and closes, whatever the Connection header says."""
    smuggled = b"GET /smuggled HTTP/1.1\r\nHost: t\r\n\r\n"
    r, reader, _ = await request(
        server.port,
        b"POST /raw HTTP/1.0\r\nHost: t\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"4\r\nabcd\r\n0\r\n\r\n" + smuggled,
    )
    assert r.status == 400 and r.header(b"connection") == b"close", r.body
    assert b"Transfer-Encoding" in r.body
    rest = b""
    with contextlib.suppress(ConnectionError, OSError):
        rest = await asyncio.wait_for(reader.read(), 5)
    assert b"HTTP/1.1" not in rest and b"smuggled" not in rest, rest


async def test_a_reserved_connection_is_closed_soon_when_idle() -> None:
    """A connection accepted into the reserve (`reserved_connections`) that sends nothing is
    closed after `reserved_timeout_s`, not after the keep-alive timeout: a client cannot hold
    the slots kept for health checks by connecting and waiting."""
    srv = await start_server(
        echo,
        "127.0.0.1",
        0,
        limits=ServerLimits(
            max_connections=3, reserved_connections=2, reserved_paths=("/health",), reserved_timeout_s=0.3
        ),
    )
    try:
        ordinary, w1 = await asyncio.open_connection("127.0.0.1", srv.port)
        reserved, w2 = await asyncio.open_connection("127.0.0.1", srv.port)
        t0 = time.monotonic()
        assert await is_closed(reserved, timeout=3.0)
        assert time.monotonic() - t0 < 1.5
        assert not await is_closed(ordinary, timeout=0.2)  # (keep-alive timeout: 75 s)
        w1.close()
        w2.close()
    finally:
        await srv.close()
