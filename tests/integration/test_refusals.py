"""Requests the gateway refuses without serving them are no blind spot: those its HTTP layer
answers itself (413, 431, 400, 501, 408), the routing-time 404 and 405 and a client that leaves
while queued each echo the request id (the client's, else a generated one), have their one
`request.done` line and are counted in `pdgw_requests_total`, with bounded labels. Real sockets
on 127.0.0.1 against a gateway in front of emulated engines."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
from structlog.testing import capture_logs

from gateway.config import LimitsConfig
from tests.http._util import RawResponse, read_response
from tests.integration.conftest import Cluster, build_cluster, stop_cluster

_SAMPLE = re.compile(r"^pdgw_requests_total\{(.*)\} ([0-9.e+-]+)$")


async def requests_metric(c: Cluster) -> dict[tuple[str, str, str, str], float]:
    """pdgw_requests_total by (route, model, plan, outcome), read from GET /metrics."""
    r = await exchange(c, b"GET /metrics HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    out = {}
    for line in r.body.decode().splitlines():
        m = _SAMPLE.match(line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            key = (labels["route"], labels["model"], labels["plan"], labels["outcome"])
            out[key] = float(m.group(2))
    return out


async def exchange(c: Cluster, raw: bytes) -> RawResponse:
    """Send `raw` on a new connection and read the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", c.gateway.port)
    try:
        writer.write(raw)
        return await asyncio.wait_for(read_response(reader), 10)
    finally:
        writer.close()


def done_lines(logs: list[dict[str, Any]], request_id: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == "request.done" and e.get("request_id") == request_id]


def body(n: int = 10) -> bytes:
    return json.dumps({"model": "m-colocated", "prompt": "x" * n, "max_tokens": 2}).encode()


@pytest.fixture
async def small_limits() -> AsyncIterator[Cluster]:
    c = await build_cluster(
        limits=LimitsConfig(max_body_bytes=1000, max_header_bytes=2000, read_timeout_s=0.3),
        request_id_headers=("x-trace", "x-request-id"),
    )
    try:
        yield c
    finally:
        await stop_cluster(c)


HEADERS = b"".join(b"X-Filler-%d: %s\r\n" % (i, b"v" * 60) for i in range(40))  # ~3 KB: over 2000

# (the client's id or None, raw request, status, code, route label)
HTTP_CASES = [
    (  # Content-Length over max_body_bytes: refused before the body
        "big-cl",
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nX-Request-Id: big-cl\r\nContent-Length: 5000\r\n\r\n",
        413,
        "request_too_large",
        "completions",
    ),
    (  # a chunked body growing past it; the id in the first configured header
        "big-chunked",
        b"POST /generate HTTP/1.1\r\nHost: t\r\nX-Trace: big-chunked\r\nTransfer-Encoding: chunked\r\n\r\n"
        + (b"200\r\n" + b"x" * 512 + b"\r\n") * 3,
        413,
        "request_too_large",
        "generate",
    ),
    (  # the id read before the header fields outgrew max_header_bytes
        "big-head",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nX-Request-Id: big-head\r\n" + HEADERS + b"\r\n",
        431,
        "request_header_fields_too_large",
        "chat",
    ),
    (  # no id read: one is generated
        None,
        b"GET /health HTTP/1.1\r\nHost: t\r\n" + HEADERS + b"\r\n",
        431,
        "request_header_fields_too_large",
        "other",
    ),
    (
        "bad-cl",
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nX-Request-Id: bad-cl\r\nContent-Length: 1x\r\n\r\n",
        400,
        "bad_request",
        "completions",
    ),
    (None, b"GARBAGE\r\n\r\n", 400, "bad_request", "other"),
    (
        "gzip-te",
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nX-Request-Id: gzip-te\r\n"
        b"Transfer-Encoding: gzip, chunked\r\n\r\n",
        501,
        "not_implemented",
        "completions",
    ),
    (  # the body never completes within read_timeout_s
        "slow-body",
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nX-Request-Id: slow-body\r\nContent-Length: 100\r\n\r\n{",
        408,
        "request_timeout",
        "completions",
    ),
]


async def test_refusals_of_the_http_layer_echo_the_id_are_logged_and_counted(small_limits: Cluster) -> None:
    c = small_limits
    before = await requests_metric(c)
    with capture_logs() as logs:
        answers = [(await exchange(c, case[1]), case) for case in HTTP_CASES]
    after = await requests_metric(c)
    for r, (client_id, _, status, code, route) in answers:
        assert r.status == status and json.loads(r.body)["error"]["code"] == code, (
            client_id,
            r.status,
            r.body,
        )
        echoed = r.header(b"x-request-id")
        assert echoed is not None, client_id
        rid = echoed.decode()
        if client_id is not None:
            assert rid == client_id
        else:
            assert rid.startswith("gw-"), rid
        lines = done_lines(logs, rid)
        assert len(lines) == 1, (rid, lines)
        e = lines[0]
        assert e["log_level"] == "info" and e["stage"] == "http" and e["plan"] == "none", e
        assert e["status"] == status and e["outcome"] == code, e
        assert e["route"] == (None if route == "other" else route), e
        assert isinstance(e["duration_ms"], float)
    slow = done_lines(logs, "slow-body")[0]
    assert slow["duration_ms"] >= 250  # since its first byte
    assert done_lines(logs, answers[3][0].header(b"x-request-id").decode())[0]["path"] == "/health"  # type: ignore[union-attr]
    want: dict[tuple[str, str, str, str], float] = {}
    for _, _, _, code, route in HTTP_CASES:
        key = (route, "", "none", code)
        want[key] = want.get(key, 0.0) + 1
    for key, n in want.items():
        assert after.get(key, 0.0) - before.get(key, 0.0) == n, (key, after)


async def test_routing_refusals_echo_the_id_are_logged_and_counted(small_limits: Cluster) -> None:
    c = small_limits
    with capture_logs() as logs:
        not_found = await exchange(c, b"GET /v2/nothing HTTP/1.1\r\nHost: t\r\nX-Request-Id: nf-1\r\n\r\n")
        no_id = await exchange(c, b"POST /v2/nothing HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n")
        wrong_gen = await exchange(c, b"GET /v1/completions HTTP/1.1\r\nHost: t\r\nX-Trace: m-1\r\n\r\n")
        wrong_get = await exchange(
            c, b"POST /health HTTP/1.1\r\nHost: t\r\nX-Request-Id: m-2\r\nContent-Length: 0\r\n\r\n"
        )
        no_card = await exchange(c, b"GET /v1/models/nope HTTP/1.1\r\nHost: t\r\nX-Request-Id: nc-1\r\n\r\n")
    metric = await requests_metric(c)
    assert not_found.status == 404 and not_found.header(b"x-request-id") == b"nf-1"
    assert no_id.status == 404
    generated = no_id.header(b"x-request-id")
    assert generated is not None and generated.startswith(b"gw-")
    assert wrong_gen.status == 405 and wrong_gen.header(b"x-request-id") == b"m-1"
    assert wrong_gen.header(b"allow") == b"POST"
    assert wrong_get.status == 405 and wrong_get.header(b"x-request-id") == b"m-2"
    assert no_card.status == 404 and no_card.header(b"x-request-id") == b"nc-1"
    for rid, status in (("nf-1", 404), (generated.decode(), 404), ("m-1", 405), ("m-2", 405), ("nc-1", 404)):
        lines = done_lines(logs, rid)
        assert len(lines) == 1 and lines[0]["status"] == status and lines[0]["stage"] == "route", (rid, lines)
    assert done_lines(logs, "m-1")[0]["route"] == "completions"
    assert done_lines(logs, "nf-1")[0]["path"] == "/v2/nothing"
    assert metric[("completions", "", "none", "method_not_allowed")] == 1
    assert metric[("other", "", "none", "method_not_allowed")] == 1
    assert metric[("other", "", "none", "not_found")] == 2
    assert metric[("other", "", "none", "model_not_found")] == 1


async def test_a_client_that_leaves_while_queued_and_a_405_on_a_generation_route_are_counted() -> None:
    c = await build_cluster(
        time_scale=1.0, limits=LimitsConfig(max_concurrent=1, max_queue=4, queue_timeout_s=10.0)
    )
    try:
        stream = json.dumps(
            {"model": "m-colocated", "prompt": "hold", "max_tokens": 100, "temperature": 0, "stream": True}
        ).encode()
        head = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        with capture_logs() as logs:
            hold_r, hold_w = await asyncio.open_connection("127.0.0.1", c.gateway.port)
            hold_w.write(head + b"X-Request-Id: hold\r\nContent-Length: %d\r\n\r\n%b" % (len(stream), stream))
            await asyncio.wait_for(hold_r.readuntil(b"\r\n\r\n"), 10)  # it holds the one slot
            _, gone_w = await asyncio.open_connection("127.0.0.1", c.gateway.port)
            gone_w.write(head + b"X-Request-Id: gone\r\nContent-Length: %d\r\n\r\n%b" % (len(body()), body()))
            for _ in range(200):
                if c.gateway.admission.stats().queued == 1:
                    break
                await asyncio.sleep(0.01)
            assert c.gateway.admission.stats().queued == 1
            gone_w.close()  # the client leaves while queued
            for _ in range(200):
                if done_lines(logs, "gone"):
                    break
                await asyncio.sleep(0.01)
            hold_w.close()
            wrong = await exchange(
                c, b"PUT /generate HTTP/1.1\r\nHost: t\r\nX-Request-Id: put\r\nContent-Length: 0\r\n\r\n"
            )
        assert wrong.status == 405 and wrong.header(b"x-request-id") == b"put"
        line = done_lines(logs, "gone")
        assert len(line) == 1 and line[0]["outcome"] == "client_gone" and line[0]["stage"] == "admission", (
            line
        )
        metric = await requests_metric(c)
        assert metric[("completions", "m-colocated", "none", "client_gone")] == 1, metric
        assert metric[("generate", "", "none", "method_not_allowed")] == 1, metric
    finally:
        await stop_cluster(c)
