"""A streamed token reaches the client before the engine makes the next one.

The relay writes each upstream read to the client as soon as it is parsed (one write per read,
gateway/http/upstream.py and response.py); nothing may wait for more data or for a timer. Stand-in
SGLang engines (aiohttp, real sockets) stream one event at a time in lockstep with the client:
event i+1 is sent only once the client has read event i through the gateway. A gateway that held
an event back (to join it with the next, say) would never see the next: the engine's wait runs out
and the test fails. The watched P/D stream (first token checked, end held until checked: the
events in between pass as they come) and the unwatched colocated one are both covered.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from common.workers import Engine, Role
from gateway.app import Gateway
from gateway.config import GatewayConfig, GuardsConfig, HealthConfig, ListenConfig, WorkerConfig
from tests.integration.conftest import serve_app

EVENTS = 12  # tokens per stream: "a", then "b"s; the last carries the finish reason
PROMPT_TOKENS = 5
WAIT_S = 2.0  # how long the engine waits for the client to have read its previous event


def _event(i: int) -> bytes:
    finish = "length" if i == EVENTS - 1 else None
    ev = {
        "id": "cmpl-pace",
        "object": "text_completion",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "text": "a" if i == 0 else "b", "logprobs": None, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(ev, separators=(",", ":")).encode() + b"\n\n"


@dataclass
class Pace:
    """The engine's side of the lockstep: which events the client has read, and the events
    the engine waited for in vain (each a token the gateway held back)."""

    seen: list[asyncio.Event] = field(default_factory=lambda: [asyncio.Event() for _ in range(EVENTS)])
    late: list[int] = field(default_factory=list)


def _engine(model: str, mode: str, pace: Pace) -> web.Application:
    """A stand-in SGLang server: a prefill answers at once; a decode (or colocated) server
    streams its events one at a time, each after the client has read the one before."""

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    async def models(_: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": model, "object": "model", "max_model_len": 8192}]}
        )

    async def info(_: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": model,
                "context_length": 8192,
                "max_req_input_len": 8186,
                "disaggregation_mode": mode,
            }
        )

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        if mode == "prefill":
            usage = {
                "prompt_tokens": PROMPT_TOKENS,
                "completion_tokens": 1,
                "total_tokens": PROMPT_TOKENS + 1,
            }
            choice = {"index": 0, "text": "a", "logprobs": None, "finish_reason": "length"}
            return web.json_response(
                {
                    "id": "cmpl-pace",
                    "object": "text_completion",
                    "created": 0,
                    "model": model,
                    "choices": [choice],
                    "usage": usage,
                }
            )
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(EVENTS):
            if i and i < EVENTS - 1:  # (the finish event's end is held by a watched relay: not paced)
                try:
                    await asyncio.wait_for(pace.seen[i - 1].wait(), WAIT_S)
                except TimeoutError:
                    pace.late.append(i - 1)
            await resp.write(_event(i))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
        app.router.add_get(path, info)
    app.router.add_post("/v1/completions", completions)
    return app


@dataclass
class Rig:
    gateway: Gateway
    pace: Pace


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    pace = Pace()
    runners, workers = [], []
    for wid, model, role, mode in (
        ("p", "m", Role.PREFILL, "prefill"),
        ("d", "m", Role.DECODE, "decode"),
        ("c", "m-col", Role.COLOCATED, "null"),
    ):
        runner, url = await serve_app(_engine(model, mode, pace))
        runners.append(runner)
        workers.append(
            WorkerConfig(
                url=url,
                role=role,
                engine=Engine.SGLANG,
                id=wid,
                bootstrap_port=8998 if role is Role.PREFILL else None,
            )
        )
    cfg = GatewayConfig(
        listen=ListenConfig(host="127.0.0.1", port=0),
        workers=tuple(workers),
        health=HealthConfig(interval_s=5.0, timeout_s=2.0),
        guards=GuardsConfig(shadow_fraction=0.0),  # no re-run elsewhere: one stream per request
    )
    gw = Gateway(cfg)
    await gw.start()
    try:
        yield Rig(gw, pace)
    finally:
        await gw.stop(grace_s=1.0)
        for r in runners:
            await r.cleanup()


async def _stream(port: int, model: str, pace: Pace) -> bytes:
    """One greedy stream through the gateway, read chunk by chunk: each event read is told to
    the engine at once (`pace.seen`). Returns the body."""
    body = json.dumps(
        {"model": model, "prompt": "hello", "max_tokens": EVENTS, "stream": True, "temperature": 0}
    ).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        assert b"transfer-encoding: chunked" in head.lower(), head
        got = b""
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                return got
            got += data[:-2]
            events = got.count(b"\n\n")
            for i in range(min(events, EVENTS)):
                pace.seen[i].set()
    finally:
        writer.close()


@pytest.mark.parametrize("model", ["m", "m-col"], ids=["pd-watched", "colocated"])
async def test_each_streamed_token_reaches_the_client_before_the_next_is_made(rig: Rig, model: str) -> None:
    body = await asyncio.wait_for(_stream(rig.gateway.port, model, rig.pace), 30)
    assert rig.pace.late == [], f"events held back by the gateway: {rig.pace.late}"
    events = [e for e in body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    texts = [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]]
    assert "".join(texts) == "a" + "b" * (EVENTS - 1)
