"""A client that goes away says nothing about the worker: its request is no verdict for the
circuit breakers (found by a probe: it counted as a success, so a hung worker whose `/health`
stays 200 got its half-open breaker closed by an impatient client and was back in rotation,
and the consecutive-failure count was reset the same way)."""

from __future__ import annotations

import asyncio

import aiohttp

from common.workers import Engine, Role
from emulator.api import EmulatorSpec, start_emulator
from gateway.app import Gateway
from gateway.breaker import BreakerState
from gateway.config import (
    BreakerConfig,
    GatewayConfig,
    HealthConfig,
    ListenConfig,
    RetriesConfig,
    TimeoutsConfig,
    WorkerConfig,
)

BODY = {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": True}


async def test_a_client_leaving_neither_closes_a_breaker_nor_resets_its_failures() -> None:
    hung = await start_emulator(
        EmulatorSpec(engine="vllm", role="both", model="m", faults=["health_ok_but_hung"])
    )
    gw = Gateway(
        GatewayConfig(
            listen=ListenConfig(host="127.0.0.1", port=0),
            workers=(WorkerConfig(url=hung.url, role=Role.COLOCATED, engine=Engine.VLLM, id="w"),),
            health=HealthConfig(interval_s=3600.0, timeout_s=2.0),
            timeouts=TimeoutsConfig(prefill_s=0.4),  # a stream's headers come within this
            retries=RetriesConfig(max_attempts=1),
            # (alone in its pool: may be ejected for any failures, the mechanics under test here)
            breaker=BreakerConfig(
                failure_threshold=2, success_threshold=1, open_s=0.3, max_ejected_share=1.0
            ),
        )
    )
    await gw.start()
    breaker = gw.registry.get("w").breaker

    async def patient(s: aiohttp.ClientSession) -> int:
        async with s.post(gw.url + "/v1/completions", json=BODY) as r:
            await r.read()
            return r.status

    async def impatient(s: aiohttp.ClientSession) -> None:
        try:
            async with s.post(
                gw.url + "/v1/completions", json=BODY, timeout=aiohttp.ClientTimeout(total=0.1)
            ):
                raise AssertionError("the hung worker answered")
        except TimeoutError:
            pass
        await asyncio.sleep(0.2)  # the gateway sees the connection go and unwinds

    try:
        async with aiohttp.ClientSession() as s:
            assert await patient(s) >= 500  # the worker's first failure (no byte within 0.4 s)
            await impatient(s)
            assert await patient(s) >= 500  # the second in a row: the breaker opens
            assert breaker.state is BreakerState.OPEN
            await asyncio.sleep(0.35)  # open_s: the next request is a half-open trial
            await impatient(s)
            gw.registry.snapshot()
            assert breaker.state is BreakerState.HALF_OPEN  # not closed by a client leaving
    finally:
        await gw.stop(grace_s=0.5)
        await hung.stop()
