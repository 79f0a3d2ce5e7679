"""`turn_keep_x` through the gateway, on two emulated SGLang workers with real timing: a turn whose
prefill would break a short answer decoding on its cache holder goes to the other worker and
computes its whole prompt there when the SLO misses rank first (the default), and stays on its
holder, finding its prefix, when the other worker costs more than `turn_keep_x` times as much
(policies/turn_keep.py). The decision is read from the gateway's `x-pdgw-decision` header."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest
from openai import AsyncOpenAI

from common.workers import Engine, Role
from gateway.app import Gateway
from gateway.config import GatewayConfig, HealthConfig, ListenConfig, WorkerConfig
from policies.config import CacheAwareCfg
from tests.integration.conftest import cached_tokens_of, start_cached_sglang, stop_started

MODEL = "m-sgl"
DOC = 8_000  # the conversation so far, on its holder
SUFFIX = 1_500  # the turn's new tokens


@pytest.fixture
async def serve() -> AsyncIterator[Any]:
    started: list[Any] = []

    async def start(keep_x: float) -> Gateway:
        # 20x slower than the profile: a 3-token answer decodes for ~0.3 s after its first token
        for _ in range(2):
            started.append(await start_cached_sglang(MODEL, time_scale=20.0))
        workers = tuple(
            WorkerConfig(url=e.url, role=Role.COLOCATED, engine=Engine.SGLANG, id=f"w{i}", vocab_size=256)
            for i, e in enumerate(started)
        )
        policy = CacheAwareCfg(
            index="approximate",
            seed=1,
            tpot_slo_x=5.0,
            turn_keep_x=keep_x,
            inflight_factor=0.0,
            queue_externality=0.0,
        )
        cfg = GatewayConfig(
            listen=ListenConfig(host="127.0.0.1", port=0),
            workers=workers,
            policy=policy,
            health=HealthConfig(interval_s=0.5, timeout_s=2.0),
            explain_header=True,
        )
        gw = Gateway(cfg)
        await gw.start()
        started.append(gw)
        return gw

    yield start
    await stop_started(started)


async def explained(client: AsyncOpenAI, prompt: list[int]) -> tuple[dict[str, Any], int]:
    raw = await client.completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=1, extra_headers={"x-pdgw-explain": "1"}
    )
    return json.loads(raw.headers["x-pdgw-decision"]), cached_tokens_of(raw.parse().usage)


@pytest.mark.parametrize("keep_x", [0.0, 2.0])
async def test_a_far_cheaper_holder_keeps_its_turn(serve: Any, keep_x: float) -> None:
    gw = await serve(keep_x)
    rng = random.Random(7)
    doc = [rng.randrange(3, 250) for _ in range(DOC)]
    client = AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    try:
        first, _ = await explained(client, doc)
        holder = first["chosen"]
        # a short answer on the holder (its prompt is the document: routed there), decoding ...
        short = await client.completions.create(
            model=MODEL, prompt=[*doc, 5], max_tokens=3, stream=True, extra_body={"ignore_eos": True}
        )
        stream = short.__aiter__()
        await stream.__anext__()
        # ... when the turn comes: its prefill on the holder would put the answer past 5x its TPOT
        record, found = await explained(client, [*doc, *(rng.randrange(3, 250) for _ in range(SUFFIX))])
        async for _ in stream:
            pass
    finally:
        await client.close()
    cands = {c["worker"]: c for c in record["candidates"]}
    other = next(w for w in cands if w != holder)
    assert cands[holder]["cached_tokens"] >= DOC - 16
    assert (cands[holder]["slo_misses"], cands[other]["slo_misses"]) == (1, 0)
    # the other worker computes the whole prompt: far more than twice the holder's cost
    assert cands[other]["cost"] > 2.0 * cands[holder]["cost"]
    if keep_x:
        assert record["chosen"] == holder
        assert found >= DOC - 16
    else:
        assert record["chosen"] == other
        assert found == 0
