"""Fuzz the request parser path: the server never crashes and answers 4xx (501/505 for what
HTTP says so) or closes."""

from __future__ import annotations

import asyncio
import logging
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.http import HttpRequest, HttpResponder, ServerLimits, start_server
from tests.http._util import read_response

VALID = [
    b"GET / HTTP/1.1\r\nHost: a\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhello",
    b"POST /x HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    b"GET /a?b=c HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\nhi",
]
STATUS = re.compile(rb"HTTP/1\.1 (\d\d\d) ")


@st.composite
def request_bytes(draw: st.DrawFn) -> bytes:
    kind = draw(st.integers(0, 1))
    if kind == 0:
        return draw(st.binary(min_size=1, max_size=300))
    base = bytearray(b"".join(draw(st.lists(st.sampled_from(VALID), min_size=1, max_size=3))))
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.integers(0, 2))
        pos = draw(st.integers(0, len(base)))
        if op == 0 and base:
            del base[pos : pos + draw(st.integers(1, 8))]
        elif op == 1:
            base[pos:pos] = draw(st.binary(min_size=1, max_size=12))
        elif base:
            base[min(pos, len(base) - 1)] = draw(st.integers(0, 255))
    return bytes(base)


async def handler(req: HttpRequest, resp: HttpResponder) -> None:
    resp.send(200, (), b"%d" % len(req.body))


def test_fuzz_requests(caplog: pytest.LogCaptureFixture) -> None:
    runner = asyncio.Runner()
    limits = ServerLimits(
        read_timeout_s=0.1, keepalive_timeout_s=0.1, max_body_bytes=4096, max_header_bytes=1024
    )
    srv = runner.run(start_server(handler, "127.0.0.1", 0, limits=limits))

    async def one(data: bytes, split: int) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        try:
            writer.write(data[:split])
            await asyncio.sleep(0)
            writer.write(data[split:])
            out = b""
            async with asyncio.timeout(3):  # the server closes within its timeouts
                while chunk := await reader.read(65536):
                    out += chunk
            return out
        except ConnectionError:
            return b""
        finally:
            writer.close()

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
    @given(request_bytes(), st.integers(0, 400))
    def check(data: bytes, split: int) -> None:
        out = runner.run(one(data, min(split, len(data))))
        if out:
            assert out.startswith(b"HTTP/1.1 "), out[:100]
            for m in STATUS.finditer(out):
                code = int(m.group(1))
                # 501: a transfer coding other than chunked; 505: an HTTP version above 1.x
                assert code in (100, 200, 501, 505) or 400 <= code < 500, out[:300]

    try:
        with caplog.at_level(logging.ERROR, logger="gateway.http"):
            check()
        assert not [r for r in caplog.records if r.name.startswith("gateway.http")]

        async def still_serving() -> None:
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
            writer.write(VALID[1])
            r = await read_response(reader)
            assert r.status == 200 and r.body == b"5"
            writer.close()

        runner.run(still_serving())
    finally:
        runner.run(srv.close())
        runner.close()
