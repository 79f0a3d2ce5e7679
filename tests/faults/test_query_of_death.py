"""Queries of death (issue #27, item 2), against real emulator servers: an SGLang engine dies of a
prompt id outside its vocabulary (as SGLang 0.5.23 does: the emulator's scheduler exits and the
server stops listening). With the default configuration (no `vocab_size`, `max_attempts` 3) one
such request took down three engines of three; now it gets one more try at most, and a copy of
it is refused without reaching any engine. A connection an engine breaks while it stays up is
no query of death: the request is served by its retry and nothing is quarantined."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from emulator.api import EmulatorHandle, EmulatorSpec, start_emulator
from gateway.app import Gateway
from gateway.config import GatewayConfig, ListenConfig, WorkerConfig
from policies.snapshot import Engine, Role
from tests.integration.conftest import build_cluster, stop_cluster

POISON = {"model": "m", "text": "hi", "input_ids": [5, 1_000_000], "sampling_params": {"max_new_tokens": 2}}
VALID = {"model": "m", "text": "hello", "sampling_params": {"max_new_tokens": 2}}


async def colocated(
    n: int, faults: list[str] | None = None, time_scale: float = 0.0
) -> tuple[dict[str, EmulatorHandle], Gateway]:
    emus = {
        f"c{i}": await start_emulator(
            EmulatorSpec(
                engine="sglang",
                role="both",
                model="m",
                faults=(faults or []) if i == 0 else [],
                time_scale=time_scale,
            )
        )
        for i in range(n)
    }
    workers = tuple(
        WorkerConfig(url=e.url, role=Role.COLOCATED, engine=Engine.SGLANG, id=name)
        for name, e in emus.items()
    )
    gw = Gateway(GatewayConfig(listen=ListenConfig(host="127.0.0.1", port=0), workers=workers))
    await gw.start()
    return emus, gw


async def stop(emus: dict[str, EmulatorHandle], gw: Gateway) -> None:
    await gw.stop()
    for e in emus.values():
        await e.stop()


async def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], Any]:
    async with aiohttp.ClientSession() as s, s.post(url + "/generate", json=body) as r:
        return r.status, json.loads(await r.read()), r.headers


def metric(gw: Gateway, event: str) -> float:
    line = f'pdgw_query_of_death_total{{event="{event}"}} '
    for x in gw.metrics.render().decode().splitlines():
        if x.startswith(line):
            return float(x.split()[-1])
    return 0.0


async def received(emus: dict[str, EmulatorHandle]) -> int:
    return sum([(await e.stats())["received"] for e in emus.values() if not e.dead])


async def test_one_poison_request_takes_down_two_engines_at_most_and_its_copy_none() -> None:
    emus, gw = await colocated(3)
    try:
        status, out, _ = await post(gw.url, POISON)
        dead = [n for n, e in emus.items() if e.dead]
        assert len(dead) <= 2, dead  # it was 3 of 3 (a try and two retries)
        assert status == 502 and out["error"]["code"] == "engine_dropped_request", out
        assert set(out["error"]) == {"message", "type", "param", "code"}
        assert metric(gw, "engine_died") == len(dead) and metric(gw, "not_retried") == 1
        assert metric(gw, "quarantined") == 1

        before = await received(emus)
        status, out, headers = await post(gw.url, POISON)  # the same request again
        assert status == 503 and out["error"]["code"] == "request_quarantined", out
        assert "engines died" in out["error"]["message"] and int(headers["Retry-After"]) > 0
        assert [n for n, e in emus.items() if e.dead] == dead  # no engine more lost
        assert await received(emus) == before  # it reached none
        assert metric(gw, "refused") == 1

        status, out, _ = await post(gw.url, VALID)  # other requests are served
        assert status == 200, out
    finally:
        await stop(emus, gw)


async def test_on_a_pd_pair_the_poison_takes_down_the_pair_and_nothing_more() -> None:
    """An SGLang P/D attempt sends the request to both legs, and both die of it: that is its two
    engines; the colocated worker behind them (the fallback ladder's next rung) is spared, and
    a copy reaches no engine."""
    c = await build_cluster(colocated_fallback=True)
    try:
        body = {**POISON, "model": "m-sglang"}
        status, out, _ = await post(c.url, body)
        assert status == 502 and out["error"]["code"] == "engine_dropped_request", out
        assert sorted(n for n, e in c.emulators.items() if e.dead) == ["sgl-d", "sgl-p"]
        status, out, _ = await post(c.url, body)
        assert status == 503 and out["error"]["code"] == "request_quarantined", out
        assert (await c.emulators["sgl-c"].stats())["received"] == 0
        status, out, _ = await post(c.url, {**VALID, "model": "m-sglang"})  # served colocated
        assert status == 200, out
    finally:
        await stop_cluster(c)


async def test_one_engine_dying_under_its_requests_quarantines_none_of_them() -> None:
    """An engine that crashes or is stopped fails every request it holds: each is served by its
    one more try, and a copy of it later is served too (one death is no query of death)."""
    emus, gw = await colocated(2, time_scale=1.0)
    try:
        slow = {**VALID, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
        first = asyncio.ensure_future(post(gw.url, slow))
        victim = ""
        for _ in range(500):  # until an engine holds it
            busy = [n for n, e in emus.items() if (await e.stats())["in_flight"]]
            if busy:
                victim = busy[0]
                break
            await asyncio.sleep(0.01)
        await emus[victim].stop()  # the engine goes away holding the request
        status, out, _ = await first
        assert status == 200, out  # its one more try, on the other engine
        assert metric(gw, "engine_died") == 1 and metric(gw, "quarantined") == 0
        status, out, _ = await post(gw.url, slow)  # a copy: served, not refused
        assert status == 200, out
        assert metric(gw, "refused") == 0
    finally:
        await stop(emus, gw)


async def test_a_connection_broken_by_an_engine_that_stays_up_quarantines_nothing() -> None:
    # c0 breaks every connection it is sent (and stays up); the same request is tried elsewhere
    emus, gw = await colocated(2, faults=["crash_mid_stream,after=0"])
    try:
        for _ in range(4):
            status, out, _ = await post(gw.url, VALID)
            assert status == 200, out
        assert not [n for n, e in emus.items() if e.dead]
        assert metric(gw, "engine_died") == 0 and metric(gw, "refused") == 0
    finally:
        await stop(emus, gw)
