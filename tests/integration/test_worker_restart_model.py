"""In process on loopback: a worker restarted on the same address with another model or context
length between two health probes (so no probe fails: a Kubernetes Service or load balancer
swapping its backend) is known as it is now at the next probe, not at the next periodic info
read, and requests for the model it served before are no longer sent to it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from common.workers import Engine, Role
from emulator.api import EmulatorHandle, EmulatorSpec, start_emulator
from gateway.app import Gateway
from gateway.config import GatewayConfig, HealthConfig, ListenConfig, WorkerConfig

ENGINES = [Engine.VLLM, Engine.SGLANG]


def spec(engine: Engine, model: str, max_model_len: int, port: int = 0) -> EmulatorSpec:
    return EmulatorSpec(
        engine="vllm" if engine is Engine.VLLM else "sglang",
        role="both",
        port=port,
        model=model,
        max_model_len=max_model_len,
    )


def gateway(interval_s: float, *workers: WorkerConfig) -> Gateway:
    gw = Gateway(
        GatewayConfig(
            listen=ListenConfig(host="127.0.0.1", port=0),
            workers=workers,
            health=HealthConfig(interval_s=interval_s, timeout_s=2.0, failure_threshold=3),
        )
    )
    # The periodic full info read (every 12th probe) would find the change by itself sooner or
    # later: keep it out of reach, so only what each probe reads can notice the restart.
    gw.health.info_every = 1_000_000
    return gw


async def restart(emu: EmulatorHandle, engine: Engine, model: str, max_model_len: int) -> EmulatorHandle:
    """Stop `emu` and start another server on its port at once (no probe in between fails)."""
    port = emu.port
    await emu.stop()
    for _ in range(50):  # the port is free again at once (SO_REUSEADDR); retry a moment if not
        try:
            return await start_emulator(spec(engine, model, max_model_len, port))
        except OSError:
            await asyncio.sleep(0.1)
    raise AssertionError(f"port {port} not free again")


async def complete(gw: Gateway, model: str) -> tuple[int, Any]:
    body = {"model": model, "prompt": "hi", "max_tokens": 2}
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw.url + "/v1/completions", json=body) as r,
    ):
        return r.status, json.loads(await r.read())


@pytest.mark.parametrize("engine", ENGINES, ids=lambda e: e.value)
async def test_fast_restart_with_another_model_is_known_within_an_interval(engine: Engine) -> None:
    a = await start_emulator(spec(engine, "model-old", 8192))
    b = await start_emulator(spec(engine, "model-old", 8192))  # keeps serving the old model
    gw = gateway(
        0.2,
        WorkerConfig(url=a.url, role=Role.COLOCATED, engine=engine, id="a"),
        WorkerConfig(url=b.url, role=Role.COLOCATED, engine=engine, id="b"),
    )
    await gw.start()
    try:
        w = gw.registry.get("a")
        assert (w.model, w.healthy) == ("model-old", True)
        await asyncio.sleep(0.5)  # a few probe rounds with nothing changed
        a = await restart(a, engine, "model-new", 4096)
        for _ in range(300):  # up to 15 s, generous: the probes run every 0.2 s
            if w.model == "model-new":
                break
            await asyncio.sleep(0.05)
        assert (w.model, w.info.context_length) == ("model-new", 4096), (
            f"worker a restarted serving 'model-new' (max_model_len 4096) but the gateway still "
            f"knows it as {w.model!r} (context length {w.info.context_length}) after 15 s of probes"
        )
        assert w.healthy
        for _ in range(6):  # the old model goes to b only
            status, out = await complete(gw, "model-old")
            assert status == 200, out
        assert (await a.stats())["received"] == 0, "requests for model-old were sent to the restarted a"
        status, out = await complete(gw, "model-new")
        assert status == 200, out
        assert (await a.stats())["received"] == 1
    finally:
        await gw.stop(grace_s=1.0)
        await a.stop()
        await b.stop()


@pytest.mark.parametrize("engine", ENGINES, ids=lambda e: e.value)
@pytest.mark.parametrize(
    ("model", "max_model_len"), [("model-new", 8192), ("model-old", 1024)], ids=["model", "context-length"]
)
async def test_next_good_probe_after_a_fast_restart_reads_the_worker_afresh(
    engine: Engine, model: str, max_model_len: int
) -> None:
    emu = await start_emulator(spec(engine, "model-old", 8192))
    gw = gateway(3600.0, WorkerConfig(url=emu.url, role=Role.COLOCATED, engine=engine, id="a"))
    await gw.start()  # probes are driven by the test (the loop's first round is an hour away)
    try:
        w = gw.registry.get("a")
        for _ in range(3):
            assert await gw.health.probe(w)
        assert (w.model, w.info.context_length, w.healthy) == ("model-old", 8192, True)
        emu = await restart(emu, engine, model, max_model_len)
        assert await gw.health.probe(w)  # no probe failed: it came back between two probes
        assert (w.model, w.info.context_length, w.healthy) == (model, max_model_len, True), (
            f"after a good probe the restarted worker is still known as {w.model!r} "
            f"(context length {w.info.context_length}), not {model!r} ({max_model_len})"
        )
        assert w.probe_failures == 0
        for _ in range(3):  # nothing changed since: the worker stays as it is, healthy
            assert await gw.health.probe(w)
        assert (w.model, w.info.context_length, w.healthy) == (model, max_model_len, True)
    finally:
        await gw.stop(grace_s=1.0)
        await emu.stop()
