"""A hostile (or careless) client (issue #27, item 3), against real emulator servers: requests
valid but sized past the gateway's total deadline (`max_tokens` x `n` reckoned at
`timeouts.per_token_s` beyond `total_s`) each end with a clear 504 of their own, and open no
breaker: other clients keep being served, during them and after. A request whose size does not
explain its timeout (a hung engine) still counts against the worker."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from common.workers import Engine, Role
from emulator.api import EmulatorHandle, EmulatorSpec, start_emulator
from gateway.app import Gateway
from gateway.breaker import BreakerState
from gateway.config import (
    BreakerConfig,
    GatewayConfig,
    ListenConfig,
    RetriesConfig,
    TimeoutsConfig,
    WorkerConfig,
)

# 1 s for the whole request; a generated token reckoned at 2 ms: 500 tokens fit
TIMEOUTS = TimeoutsConfig(
    connect_s=0.5,
    prefill_s=1.0,
    handoff_s=1.0,
    idle_s=1.0,
    client_stall_s=1.0,
    total_s=1.0,
    per_token_s=0.002,
)
# sensitive breakers that may eject a pool of one: two failures in a row open them
BREAKER = BreakerConfig(failure_threshold=2, success_threshold=1, open_s=30.0, max_ejected_share=1.0)
SMALL = {"model": "m", "prompt": "hello", "max_tokens": 4}
# 4 x 1500 tokens: 12 s of the request's own at 2 ms each, far past 1 s (and the emulated
# engine, at its time scale, takes longer than 1 s to write them)
BIG = {"model": "m", "prompt": "hello", "max_tokens": 1500, "n": 4, "ignore_eos": True}


async def cluster(shape: str, faults: list[str] | None = None) -> tuple[list[EmulatorHandle], Gateway]:
    spec = dict(model="m", time_scale=1.0, faults=faults or [])
    if shape == "sglang-pd":
        p = await start_emulator(EmulatorSpec(engine="sglang", role="prefill", bootstrap_port=0, **spec))  # type: ignore[arg-type]
        d = await start_emulator(EmulatorSpec(engine="sglang", role="decode", **spec))  # type: ignore[arg-type]
        emus = [p, d]
        workers: tuple[WorkerConfig, ...] = (
            WorkerConfig(
                url=p.url, role=Role.PREFILL, engine=Engine.SGLANG, id="p", bootstrap_port=p.bootstrap_port
            ),
            WorkerConfig(url=d.url, role=Role.DECODE, engine=Engine.SGLANG, id="d"),
        )
    else:
        c = await start_emulator(EmulatorSpec(engine="vllm", role="both", **spec))  # type: ignore[arg-type]
        emus = [c]
        workers = (WorkerConfig(url=c.url, role=Role.COLOCATED, engine=Engine.VLLM, id="c"),)
    gw = Gateway(
        GatewayConfig(
            listen=ListenConfig(host="127.0.0.1", port=0),
            workers=workers,
            timeouts=TIMEOUTS,
            breaker=BREAKER,
            retries=RetriesConfig(max_attempts=1),
        )
    )
    await gw.start()
    return emus, gw


async def post(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with s.post(url + "/v1/completions", json=body) as r:
        return r.status, json.loads(await r.read())


def breakers_closed(gw: Gateway) -> bool:
    return not gw.registry.open_pairs() and all(
        w.breaker.state is BreakerState.CLOSED for w in gw.registry.workers()
    )


@pytest.mark.parametrize("shape", ["sglang-pd", "vllm-colocated"])
async def test_requests_sized_past_the_deadline_open_no_breaker(shape: str) -> None:
    emus, gw = await cluster(shape)
    try:
        async with aiohttp.ClientSession() as s:

            async def others() -> list[int]:
                out = []
                for _ in range(6):
                    out.append((await post(s, gw.url, SMALL))[0])
                    await asyncio.sleep(0.1)
                return out

            bigs = [post(s, gw.url, BIG) for _ in range(4)]
            *answers, served = await asyncio.gather(*bigs, others())
            for status, out in answers:
                assert status == 504, out
                err = out["error"]
                assert err["code"] == "request_exceeds_deadline" and err["type"] == "invalid_request_error"
                assert "max_tokens x n" in err["message"], err
            assert served == [200] * 6, served  # other clients, meanwhile
            assert breakers_closed(gw)
            status, out = await post(s, gw.url, SMALL)  # and right after
            assert status == 200, out
    finally:
        await gw.stop()
        for e in emus:
            await e.stop()


async def test_a_timeout_the_request_size_does_not_explain_is_the_worker_s() -> None:
    emus, gw = await cluster("vllm-colocated", faults=["health_ok_but_hung"])
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(2):
                status, out = await post(s, gw.url, SMALL)
                assert status == 504 and out["error"]["code"] == "upstream_timeout", out
        assert not breakers_closed(gw)
    finally:
        await gw.stop()
        for e in emus:
            await e.stop()
