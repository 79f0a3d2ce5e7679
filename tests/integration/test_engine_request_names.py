"""The rids the gateway gives SGLang requests (adapters/sglang.py), against an emulated SGLang that
treats rids as SGLang 0.5.23 does: a second request in flight under a rid it already holds is
refused ("Duplicate request ID detected"), and an abort of rid X, or the disconnect of X's client,
aborts every request whose rid starts with X (emulator/README.md).

The client's X-Request-Id is no rid: two clients may send the same one, and one's id may extend
another's; neither may cost the other its answer."""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from adapters import ADAPTERS, HandoffCtx
from common.request import parse_request
from common.workers import Engine, Role, RouteKind, WorkerState
from tests.integration.conftest import Cluster, build_cluster, stop_cluster
from tests.integration.test_gateway import body_for, generated, post, sse_events

TS = 1.0  # ~10 ms per decoded token: requests overlap


@pytest.fixture
async def slow_cluster() -> AsyncIterator[Cluster]:
    c = await build_cluster(time_scale=TS)
    try:
        yield c
    finally:
        await stop_cluster(c)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["/generate", "/v1/completions", "/v1/chat/completions"])
async def test_two_requests_sharing_an_x_request_id_both_get_their_answer(
    slow_cluster: Cluster, route: str, stream: bool
) -> None:
    c = slow_cluster
    body = body_for(route, "m-sglang", "shared id", stream, max_tokens=40)
    headers = {"X-Request-Id": "retry-7"}
    (s1, h1, r1), (s2, h2, r2) = await asyncio.gather(
        post(c.url + route, body, headers), post(c.url + route, body, headers)
    )
    assert (s1, s2) == (200, 200), (r1, r2)
    assert h1["X-Request-Id"] == h2["X-Request-Id"] == "retry-7"  # echoed as before
    _, _, ref = await post(c.reference["m-sglang"].url + route, body)
    want = generated(route, ref, stream)
    for raw in (r1, r2):
        assert generated(route, raw, stream) == want
        if stream:
            assert b'"error"' not in raw and sse_events(raw)[-1] == "[DONE]"


async def _open_stream(port: int, path: str, body: dict[str, Any], request_id: str) -> asyncio.StreamWriter:
    """A streamed request on a raw connection, read up to its first event; the caller closes the
    connection: the client goes away mid-stream."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\nx-request-id: {request_id}\r\n"
        f"content-length: {len(data)}\r\n\r\n".encode()
        + data
    )
    await writer.drain()
    got = b""
    while b"data:" not in got:
        chunk = await asyncio.wait_for(reader.read(4096), 10)
        assert chunk, got
        got += chunk
    assert got.startswith(b"HTTP/1.1 200"), got
    return writer


@pytest.mark.parametrize("route", ["/generate", "/v1/completions"])
async def test_a_client_gone_does_not_abort_a_request_whose_id_extends_its_own(
    slow_cluster: Cluster, route: str
) -> None:
    """Client A ("job-1") hangs up mid-stream while client B ("job-12") streams: the gateway
    aborts A's legs (connection close, /abort_request); B's answer must be whole."""
    c = slow_cluster
    long_body = body_for(route, "m-sglang", "the one that leaves", True, max_tokens=400)
    body = body_for(route, "m-sglang", "the one that stays", True, max_tokens=80)
    a = await _open_stream(c.gateway.port, route, long_body, "job-1")
    async with aiohttp.ClientSession() as http:
        async with http.post(c.url + route, json=body, headers={"X-Request-Id": "job-12"}) as r:
            assert r.status == 200
            first = await r.content.readuntil(b"\n\n")  # B is decoding now
            a.close()  # A goes away while B runs
            raw = first + await r.read()
    _, _, ref = await post(c.reference["m-sglang"].url + route, body)
    assert b'"error"' not in raw and b'"abort"' not in raw, raw[-400:]
    assert sse_events(raw)[-1] == "[DONE]"
    assert generated(route, raw, True) == generated(route, ref, True)
    # A's legs were aborted on both engines (nothing of it is left running)
    for _ in range(100):
        if [(await c.emulators[n].stats())["running"] for n in ("sgl-p", "sgl-d")] == [0, 0]:
            break
        await asyncio.sleep(0.05)
    assert (await c.emulators["sgl-d"].stats())["running"] == 0


async def test_a_client_s_own_rid_is_kept_readable_but_made_unique(slow_cluster: Cluster) -> None:
    """A body's `rid` gets the unique part in front too: two clients naming their requests alike
    both get their answers, and each answer shows the client's name at the end of its id."""
    c = slow_cluster
    body = {**body_for("/generate", "m-sglang", "named", False, max_tokens=30), "rid": "mine"}
    (s1, _, r1), (s2, _, r2) = await asyncio.gather(
        post(c.url + "/generate", body), post(c.url + "/generate", body)
    )
    assert (s1, s2) == (200, 200), (r1, r2)
    ids = [json.loads(r)["meta_info"]["id"] for r in (r1, r2)]
    assert ids[0] != ids[1] and all(re.fullmatch(r"[0-9a-f]{16}-mine", i) for i in ids), ids


def _ctx(room: int, request_id: str) -> HandoffCtx:
    p = WorkerState(
        id="p", url="http://127.0.0.1:1", role=Role.PREFILL, engine=Engine.SGLANG, bootstrap_port=2
    )
    d = WorkerState(id="d", url="http://127.0.0.1:3", role=Role.DECODE, engine=Engine.SGLANG)
    return HandoffCtx(request_id=request_id, prefill=p, decode=d, room=room)


def _req(body: dict[str, Any]) -> Any:
    return parse_request(
        RouteKind.GENERATE,
        "/generate",
        json.dumps(body).encode(),
        default_model="m",
        max_n=8,
        max_tokens_cap=None,
    )


async def test_the_rids_sent_are_prefix_free_and_the_abort_names_the_attempt_s() -> None:
    """(Adapter level; async: each test task has its own record of the rids it sent.)"""
    sgl = ADAPTERS[Engine.SGLANG]
    req = _req({"text": "x", "sampling_params": {"max_new_tokens": 2}})
    sent: list[str] = []
    # gateway ids that extend each other (gw-<run>-1, gw-<run>-10), and client ids "a", "ab"
    for rid in ("gw-0a1b2c3d-1", "gw-0a1b2c3d-10", "a", "ab"):
        for _attempt in range(2):  # a retry is another upstream request
            ctx = _ctx(random.getrandbits(63), rid)
            legs = {
                json.loads(sgl.prefill_body(req, ctx))["rid"],
                json.loads(sgl.decode_body(req, ctx, None))["rid"],
            }
            assert len(legs) == 1  # both legs of a handoff: one name (on two servers)
            (name,) = legs
            assert name.endswith("-" + rid) and re.fullmatch(r"[0-9a-f]{16}", name[:16])
            call = sgl.abort_call(req, rid)
            assert call == ("/abort_request", json.dumps({"rid": name}, separators=(",", ":")).encode())
            sent.append(name)
        colocated = json.loads(sgl.colocated_body(req, rid))["rid"]
        assert sgl.abort_call(req, rid) == (
            "/abort_request",
            json.dumps({"rid": colocated}, separators=(",", ":")).encode(),
        )
        sent.append(colocated)
    assert len(set(sent)) == len(sent)
    assert not [(x, y) for x in sent for y in sent if x != y and y.startswith(x)]
    # batches and n > 1: no rid (SGLang names the items), no abort by name
    for body in ({"text": ["x", "y"]}, {"text": "x", "sampling_params": {"n": 2, "temperature": 1}}):
        b = _req(body)
        assert "rid" not in json.loads(sgl.prefill_body(b, _ctx(5, "r")))
        assert sgl.abort_call(b, "r") is None


@pytest.mark.parametrize("stream", [False, True])
async def test_a_null_rid_is_no_name_and_the_gateway_names_the_request(stream: bool) -> None:
    """`"rid": null` is SGLang's "no name" (the engine makes one up, which the gateway could not
    abort by): the gateway names such a request as if the field were absent, on every leg, and
    sends no second `rid` key."""
    sgl = ADAPTERS[Engine.SGLANG]
    body = {"text": "x", "sampling_params": {"max_new_tokens": 2}, "rid": None, "stream": stream}
    for make in (
        lambda r, ctx: sgl.prefill_body(r, ctx),
        lambda r, ctx: sgl.decode_body(r, ctx, None),
        lambda r, ctx: sgl.colocated_body(r, ctx.request_id),
    ):
        req = _req(body)
        ctx = _ctx(random.getrandbits(63), "nul-1")
        sent = make(req, ctx)
        assert sent.count(b'"rid"') == 1, sent
        name = json.loads(sent)["rid"]
        assert isinstance(name, str) and name.endswith("-nul-1"), sent
        assert sgl.abort_call(req, "nul-1") == (
            "/abort_request",
            json.dumps({"rid": name}, separators=(",", ":")).encode(),
        )
