"""`inflight_hold` through the gateway, on an emulated SGLang worker with real timing: a turn sent
while its predecessor's prompt is still being prefilled there finds only the predecessor's
chunks computed before its own first chunk when sent at once (the engine takes that chunk into
the step of the predecessor's last one, and matches it before that last chunk's blocks are in
its radix cache, as SGLang does), and all of the prefix when the gateway holds it until the
predecessor's predicted end (policies/inflight.py)."""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from common.workers import Engine, Role
from gateway.app import Gateway
from gateway.config import GatewayConfig, HealthConfig, ListenConfig, WorkerConfig
from policies.config import CacheAwareCfg
from tests.integration.conftest import cached_tokens_of, start_cached_sglang, stop_started

MODEL = "m-sgl"
PROMPT = 16_000  # two prefill chunks of 8,192: the turn comes during the first


@pytest.fixture
async def serve() -> AsyncIterator[Any]:
    started: list[Any] = []

    async def start(hold: float) -> Gateway:
        # time 2x slower than the profile: the first prompt's two chunks take ~1.2 s
        emu = await start_cached_sglang(MODEL, time_scale=2.0)
        started.append(emu)
        cfg = GatewayConfig(
            listen=ListenConfig(host="127.0.0.1", port=0),
            workers=(
                # (a vocabulary: token ids proven, so the two requests are not run one by one)
                WorkerConfig(url=emu.url, role=Role.COLOCATED, engine=Engine.SGLANG, id="w0", vocab_size=256),
            ),
            policy=CacheAwareCfg(index="approximate", seed=1, inflight_hold=hold),
            health=HealthConfig(interval_s=0.5, timeout_s=2.0),
        )
        gw = Gateway(cfg)
        await gw.start()
        started.append(gw)
        return gw

    yield start
    await stop_started(started)


@pytest.mark.parametrize("hold", [0.0, 5.0])
async def test_a_turn_behind_its_running_predecessor_finds_its_prefix_only_held(
    serve: Any, hold: float
) -> None:
    gw = await serve(hold)
    rng = random.Random(5)
    first = [rng.randrange(3, 250) for _ in range(PROMPT)]
    turn = first + [rng.randrange(3, 250) for _ in range(200)]
    client = AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    try:
        ahead = asyncio.create_task(client.completions.create(model=MODEL, prompt=first, max_tokens=2))
        await asyncio.sleep(0.05)  # the predecessor is in its first chunk
        began = time.monotonic()
        got = await client.completions.create(model=MODEL, prompt=turn, max_tokens=2)
        took = time.monotonic() - began
        assert cached_tokens_of((await ahead).usage) == 0
    finally:
        await client.close()
    found = cached_tokens_of(got.usage)
    if hold:
        # held until the predicted end (the prior rate, slower than the emulator's: a late
        # release), then read the whole prefix; the hold is counted
        assert found >= PROMPT - 16, found
        assert took < hold
        async with aiohttp.ClientSession() as http, http.get(gw.url + "/metrics") as r:
            text = await r.text()
        assert re.search(r"^pdgw_cache_holds_total 1\.0$", text, re.M), text
        assert re.search(r"^pdgw_cache_hold_seconds_total [1-4]\.", text, re.M)
    else:
        # sent at once: the engine read the first chunk (8,192 tokens, 512 whole blocks) and
        # computed the last one's part of the prefix again
        assert found == 8_192, found
