"""The precise index's pending overlay against real emulated engines publishing KV events.

Two SGLang workers of one model, timed (a long prompt's prefill takes about a second). A
conversation's first turn is routed to one of them; its next turn arrives while the first is still
prefilling, before that engine has published a `BlockStored` for it. With the events alone
(`precise_record = "stored"`) the precise index knows no holder, and the turn is sent to the idle
worker, which computes the whole prompt again. With the pending overlay (`"routed"`)
the turn is predicted to find the first turn's prefix on its worker and is sent there; the engine
matches the prefix again as it schedules the queued turn, after the first one's prefill, and
reports it cached. The overlay's entries are gone once the requests ended; the index's outcome
check stays quiet (the engine-only prediction is the one checked)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Literal

import aiohttp
import pytest

from emulator.api import EmulatorHandle, EmulatorSpec, start_emulator
from gateway.app import Gateway
from gateway.config import GatewayConfig, HealthConfig, KvEventsConfig, ListenConfig, WorkerConfig
from policies.config import CacheAwareCfg
from policies.snapshot import Engine, Role
from tests.integration.test_kv_events import BLOCK, free_port_pair

WORKERS = ("a", "b")
PROMPT = 6000  # tokens: a prefill of about a second at time_scale 4


async def start(record: Literal["routed", "stored"]) -> tuple[Gateway, dict[str, EmulatorHandle]]:
    ports = {w: free_port_pair() for w in WORKERS}
    emus = {
        w: await start_emulator(
            EmulatorSpec(
                engine="sglang",
                role="both",
                model="m",
                kv_events=f"tcp://127.0.0.1:{ports[w]}",
                block_size=BLOCK,
                max_total_tokens=65536,
                time_scale=4.0,
            )
        )
        for w in WORKERS
    }
    workers = tuple(
        WorkerConfig(
            url=emus[w].url,
            role=Role.COLOCATED,
            engine=Engine.SGLANG,
            id=w,
            vocab_size=259,  # (the emulator's: else a prompt of ids waits for the first one's answer)
            kv_events=KvEventsConfig(
                endpoint=f"tcp://127.0.0.1:{ports[w]}",
                replay_endpoint=f"tcp://127.0.0.1:{ports[w] + 1}",
                hash="emulator",
                block_size=BLOCK,  # (else known from the engine's first event)
            ),
        )
        for w in WORKERS
    )
    cfg = GatewayConfig(
        listen=ListenConfig(host="127.0.0.1", port=0),
        workers=workers,
        policy=CacheAwareCfg(precise_record=record, seed=1),
        health=HealthConfig(interval_s=0.5, timeout_s=2.0),
    )
    gateway = Gateway(cfg)
    await gateway.start()
    async with asyncio.timeout(5):  # both streams live (their start-up replay done)
        while True:
            if all((w := gateway.kv_events.index.worker(n)) and w.usable for n in WORKERS):
                break
            await asyncio.sleep(0.01)
    return gateway, emus


@pytest.fixture(params=["routed", "stored"])
async def setup(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[str, Gateway, dict[str, EmulatorHandle]]]:
    gateway, emus = await start(request.param)
    try:
        yield request.param, gateway, emus
    finally:
        await gateway.stop(grace_s=1.0)
        for h in emus.values():
            await h.stop()


async def generate(http: aiohttp.ClientSession, gateway: Gateway, ids: list[int]) -> int:
    body = {"model": "m", "input_ids": ids, "sampling_params": {"max_new_tokens": 2}}
    async with http.post(gateway.url + "/generate", json=body) as r:
        assert r.status == 200, await r.text()
        return int((await r.json())["meta_info"]["cached_tokens"])


def served(emus: dict[str, EmulatorHandle]) -> dict[str, int]:
    return {w: h.server.engine.counters.received for w, h in emus.items()}


async def test_a_turn_routed_during_its_predecessors_prefill_goes_to_its_holder(
    setup: tuple[str, Gateway, dict[str, EmulatorHandle]],
) -> None:
    record, gateway, emus = setup
    index = gateway.kv_events.index
    rng = random.Random(3)
    first = [rng.randrange(3, 250) for _ in range(PROMPT)]
    second = first + [rng.randrange(3, 250) for _ in range(200)]
    async with aiohttp.ClientSession() as http:
        turn1 = asyncio.create_task(generate(http, gateway, first))
        async with asyncio.timeout(5):  # routed and running: its engine has stored nothing yet
            while True:
                if sum(served(emus).values()) >= 1:
                    break
                await asyncio.sleep(0.005)
        await asyncio.sleep(0.2)
        (holder,) = [w for w, n in served(emus).items() if n == 1]
        assert index.blocks(holder) == 0, "the first turn's prefill ended too soon for this test"
        cached = await generate(http, gateway, second)
        assert await turn1 == 0
    counts = served(emus)
    if record == "stored":  # the events alone: no holder yet, the turn is spread
        assert counts[holder] == 1 and cached == 0
        return
    assert counts[holder] == 2, counts
    assert cached >= PROMPT - BLOCK, cached  # the engine found the first turn's prompt
    st = {s.worker: s for s in index.status()}
    assert st[holder].usable and st[holder].outcome_mismatches == 0
    pending = index.pending
    assert pending.added == 2 and not pending.entries and pending.blocks == 0
    assert pending.dropped_ended == 2
    async with aiohttp.ClientSession() as http, http.get(gateway.url + "/metrics") as r:
        text = await r.text()
    assert "pdgw_kv_index_pending_requests 0.0" in text
    assert 'pdgw_kv_index_pending_dropped_total{why="expired"} 0.0' in text
