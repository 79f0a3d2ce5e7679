"""Breakers as outlier ejection (gateway/breaker.py), against emulated engines with injected
HTTP 500s: a worker failing a share of its requests is never ejected where that would shed its
whole pool (the share of requests lost stays near the failing worker's own), one failing all
of them is, and in a pool a partly failing worker gets less traffic, the others none ejected."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import aiohttp

from emulator.api import EmulatorHandle, EmulatorSpec, start_emulator
from gateway.app import Gateway
from gateway.config import (
    BreakerConfig,
    GatewayConfig,
    HealthConfig,
    ListenConfig,
    RetriesConfig,
    WorkerConfig,
)
from policies.snapshot import Engine, Role

# a low threshold and short ejections: the consecutive-failure rule fires often at a 20 % failure
# rate, as a default threshold does over a long run
BREAKER = BreakerConfig(failure_threshold=2, success_threshold=1, open_s=0.5)


async def gateway(workers: list[WorkerConfig], retries: int = 1) -> Gateway:
    gw = Gateway(
        GatewayConfig(
            listen=ListenConfig(host="127.0.0.1", port=0),
            workers=tuple(workers),
            health=HealthConfig(interval_s=0.5),
            breaker=BREAKER,
            retries=RetriesConfig(max_attempts=retries, backoff_initial_s=0.01),
        )
    )
    await gw.start()
    return gw


async def fire(gw: Gateway, n: int, conc: int = 8) -> Counter[str]:
    out: Counter[str] = Counter()
    sem = asyncio.Semaphore(conc)
    async with aiohttp.ClientSession() as s:

        async def one(i: int) -> None:
            async with sem:
                body = {"model": "m", "prompt": f"p{i}", "max_tokens": 4}
                async with s.post(gw.url + "/v1/completions", json=body) as r:
                    raw = await r.read()
                out["ok" if r.status == 200 else str(json.loads(raw)["error"]["code"])] += 1
                await asyncio.sleep(0.002)

        await asyncio.gather(*(one(i) for i in range(n)))
    return out


async def sglang_pair() -> tuple[EmulatorHandle, EmulatorHandle, list[WorkerConfig]]:
    p = await start_emulator(EmulatorSpec(engine="sglang", role="prefill", model="m", bootstrap_port=0))
    d = await start_emulator(EmulatorSpec(engine="sglang", role="decode", model="m"))
    workers = [
        WorkerConfig(
            url=p.url, role=Role.PREFILL, engine=Engine.SGLANG, id="p", bootstrap_port=p.bootstrap_port
        ),
        WorkerConfig(url=d.url, role=Role.DECODE, engine=Engine.SGLANG, id="d"),
    ]
    return p, d, workers


async def test_a_partly_failing_worker_alone_in_its_pool_is_kept_serving() -> None:
    """One SGLang pair; its decode answers 20 % of requests with HTTP 500. Ejecting the decode
    or the pair would shed every request for the ejection time (a probe of the old breaker
    shed 45 % of all requests so): only its own failures reach the clients."""
    p, d, workers = await sglang_pair()
    gw = await gateway(workers)
    try:
        await d.set_faults(["http_error:0.2"])
        out = await fire(gw, 400)
        assert out["no_worker_available"] == 0, out  # nothing shed by a breaker
        assert out["ok"] >= 0.7 * 400, out  # ~80 % served, ~20 % the decode's own 500s
        assert gw.registry.get("d").breaker.state.value == "closed"
    finally:
        await gw.stop(1.0)
        await p.stop()
        await d.stop()


async def test_a_fully_failing_worker_is_ejected_even_alone() -> None:
    p, d, workers = await sglang_pair()
    gw = await gateway(workers)
    try:
        await d.set_faults(["http_error:1.0"])
        out = await fire(gw, 200)
        assert out["ok"] == 0 and out["no_worker_available"] >= 150, out  # answered at once
        assert (await d.stats())["received"] <= 20  # ejected after a few failures, re-tried seldom
        opened = [s.value for *_, s in gw.registry.pair_states()] + [gw.registry.get("d").breaker.state.value]
        assert "open" in opened or "half_open" in opened, opened
    finally:
        await gw.stop(1.0)
        await p.stop()
        await d.stop()


async def test_in_a_pool_a_partly_failing_worker_gets_less_traffic_and_nothing_is_shed() -> None:
    emus = [await start_emulator(EmulatorSpec(engine="vllm", role="both", model="m")) for _ in range(4)]
    workers = [
        WorkerConfig(url=e.url, role=Role.COLOCATED, engine=Engine.VLLM, id=f"c{i}")
        for i, e in enumerate(emus)
    ]
    gw = await gateway(workers, retries=3)
    try:
        await emus[0].set_faults(["http_error:0.3"])
        out = await fire(gw, 800)
        assert out == Counter(ok=800), out  # its failures retried elsewhere; no pool shed
        got = [(await e.stats())["received"] for e in emus]
        assert got[0] < 0.8 * min(got[1:]), got  # ejected again and again, for longer each time
        assert all(gw.registry.get(f"c{i}").breaker.state.value == "closed" for i in (1, 2, 3))
    finally:
        await gw.stop(1.0)
        for e in emus:
            await e.stop()
