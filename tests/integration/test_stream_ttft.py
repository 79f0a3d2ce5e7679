"""`Completed.ttft_s` of a stream is its first token, not its response head.

Emulated engines at real speed (time scale 1: a prompt of a few thousand tokens prefills for a
visible fraction of a second) behind a real gateway; the policy's events are read as the
orchestrator sends them. A stream's response head goes out before the engine has computed
anything, so the old `ttft_s` (the head's time) came a whole prefill before the first token.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from common.workers import Engine, Role
from emulator.api import EmulatorSpec, start_emulator
from gateway.app import Gateway
from gateway.config import GatewayConfig, HealthConfig, ListenConfig, WorkerConfig
from policies.base import Completed
from tests.integration.conftest import Cluster, RecordingPolicy, build_cluster, stop_cluster

PROMPT = [(i * 31) % 250 + 3 for i in range(6000)]  # token ids: a prefill of ~0.1-0.3 s


@pytest.fixture
async def timed() -> AsyncIterator[tuple[Cluster, RecordingPolicy]]:
    """The integration cluster (SGLang and vLLM P/D, a vLLM colocated worker) and an SGLang
    colocated worker (model `m-sglang-col`), whose stream's head goes out before its prefill
    (as SGLang's server starts its streaming response), at real speed."""
    c = await build_cluster(time_scale=1.0)
    spec = EmulatorSpec(engine="sglang", role="both", model="m-sglang-col", time_scale=1.0)
    c.emulators["sgl-col"] = h = await start_emulator(spec)
    await c.gateway.stop(grace_s=0.1)
    workers = (
        *c.gateway.cfg.workers,
        WorkerConfig(url=h.url, role=Role.COLOCATED, engine=Engine.SGLANG, id="sgl-col", vocab_size=256),
    )
    cfg = GatewayConfig(
        listen=ListenConfig(host="127.0.0.1", port=0),
        workers=workers,
        health=HealthConfig(interval_s=0.5, timeout_s=2.0),
    )
    c.gateway = Gateway(cfg)
    await c.gateway.start()
    rec = RecordingPolicy(c.gateway.orchestrator.policy)
    c.gateway.orchestrator.policy = rec
    try:
        yield c, rec
    finally:
        await stop_cluster(c)


async def completed(c: Cluster, rec: RecordingPolicy, model: str, stream: bool) -> Completed:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "stream": stream, "temperature": 0}
    async with aiohttp.ClientSession() as s, s.post(f"{c.url}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        await r.read()
    done = [e for e in rec.events if isinstance(e, Completed)]
    assert done, rec.events
    return done[-1]


@pytest.mark.parametrize("model", ["m-sglang-col", "m-colocated", "m-sglang", "m-vllm"])
async def test_a_streams_ttft_is_its_first_token(timed: tuple[Cluster, RecordingPolicy], model: str) -> None:
    c, rec = timed
    ev = await completed(c, rec, model, stream=True)
    t = ev.timings
    assert t is not None and t.first_token_s is not None and ev.ttft_s is not None
    # counted from the request's arrival (a little before its attempt started), to the first
    # token the relay saw: not the head, which came a whole prefill earlier
    assert t.first_token_s <= ev.ttft_s <= t.first_token_s + 0.05, (ev.ttft_s, t)
    assert ev.ttft_s >= 0.05  # the emulated prefill of 6,000 tokens, at least


async def test_a_whole_answers_ttft_is_unchanged(timed: tuple[Cluster, RecordingPolicy]) -> None:
    """A whole answer's first byte is its last: its `ttft_s` is the whole request."""
    c, rec = timed
    ev = await completed(c, rec, "m-sglang", stream=False)
    t = ev.timings
    assert t is not None and t.first_token_s is None and ev.ttft_s is not None
    assert ev.ttft_s >= t.end_s - 0.05
