"""Workers joining and leaving at runtime, through the admin API, with `cache_aware`: a worker
added with `kv_events` gets its KV-event subscription (its index goes live and follows its
engine), and a removed worker leaves every index (the KV-event index, the policy's approximate
index, its prediction figures) — emulated SGLang engines, real ZMQ and HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp

from emulator.api import start_emulator
from gateway.app import Gateway
from gateway.config import (
    AdminConfig,
    GatewayConfig,
    HealthConfig,
    KvEventsConfig,
    ListenConfig,
    WorkerConfig,
)
from policies.cache_aware import CacheState
from policies.config import CacheAwareCfg
from policies.prompt_key import PromptKey
from policies.snapshot import Engine, Role
from tests.integration.test_kv_events import free_port_pair, spec

TOKEN = "membership-token"
MODEL = "m-sglang"


def kv(port: int) -> KvEventsConfig:
    return KvEventsConfig(
        endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{port + 1}", hash="emulator"
    )


async def admin(http: aiohttp.ClientSession, gw: Gateway, method: str, path: str, body: Any = None) -> Any:
    async with http.request(
        method, gw.url + "/admin/" + path, json=body, headers={"authorization": f"Bearer {TOKEN}"}
    ) as r:
        assert r.status in (200, 201), await r.text()
        return await r.json()


async def until(check: Any, within_s: float = 5.0) -> None:
    async with asyncio.timeout(within_s):
        while True:
            if check():
                return
            await asyncio.sleep(0.02)


async def test_workers_added_and_removed_at_runtime() -> None:
    ports = [free_port_pair(), free_port_pair()]
    emus = [await start_emulator(spec("sglang", MODEL, p, max_total_tokens=8192)) for p in ports]
    first = WorkerConfig(
        url=emus[0].url, role=Role.COLOCATED, engine=Engine.SGLANG, id="a", kv_events=kv(ports[0])
    )
    cfg = GatewayConfig(
        listen=ListenConfig(host="127.0.0.1", port=0),
        workers=(first,),
        policy=CacheAwareCfg(seed=1),
        health=HealthConfig(interval_s=0.5, timeout_s=2.0),
        admin=AdminConfig(token=TOKEN),
    )
    gw = Gateway(cfg)
    await gw.start()
    try:
        index = gw.kv_events.index
        state: CacheState = gw.policy.prefill.state  # type: ignore[attr-defined]
        async with aiohttp.ClientSession() as http:
            added = {
                "url": emus[1].url,
                "role": "colocated",
                "engine": "sglang",
                "id": "b",
                "kv_events": {
                    "endpoint": f"tcp://127.0.0.1:{ports[1]}",
                    "replay_endpoint": f"tcp://127.0.0.1:{ports[1] + 1}",
                    "hash": "emulator",
                },
            }
            await admin(http, gw, "POST", "workers", added)
            assert index.worker("b") is not None
            rng = random.Random(2)
            prompts = [[rng.randrange(3, 250) for _ in range(300)] for _ in range(6)]
            for ids in prompts * 2:
                body = {"model": MODEL, "input_ids": ids, "sampling_params": {"max_new_tokens": 2}}
                async with http.post(gw.url + "/generate", json=body) as r:
                    assert r.status == 200, await r.text()
            # both engines' events are indexed: the added worker's subscription is live
            for wid in ("a", "b"):
                await until(lambda wid=wid: (w := index.worker(wid)) is not None and w.state == "live")
            await until(lambda: index.blocks("b") > 0)
            keys = [k for ids in prompts if (k := PromptKey.from_token_ids(ids)) is not None]
            served_b = [k for k in keys if (look := index.lookup(MODEL, k, 4)) and look.cached_tokens("b")]
            assert served_b, "the added worker served none of the prompts"
            key = served_b[0]
            approx = state.approx.lookup(MODEL, key, 4)
            assert approx is not None and (approx.cached_tokens("b") or 0) > 0
            assert any(w == "b" for w, _ in state.accuracy.summary())

            await admin(http, gw, "DELETE", "workers/b")
            # gone from every index and figure, at once
            assert index.worker("b") is None
            approx = state.approx.lookup(MODEL, key, 4)
            assert approx is None or not approx.cached_tokens("b")
            assert not any(w == "b" for w, _ in state.accuracy.summary())
            assert "b" not in {r.worker for r in gw.kv_events.status()}
            # the remaining worker still serves, its index live
            body = {
                "model": MODEL,
                "input_ids": list(key.token_ids or ()),
                "sampling_params": {"max_new_tokens": 2},
            }
            async with http.post(gw.url + "/generate", json=body) as r:
                assert r.status == 200
            w = index.worker("a")
            assert w is not None and w.state == "live"
    finally:
        await gw.stop(grace_s=1.0)
        for e in emus:
            await e.stop()


async def test_an_added_workers_impossible_hash_scheme_is_a_400() -> None:
    emu = await start_emulator(spec("sglang", MODEL, free_port_pair()))
    cfg = GatewayConfig(
        listen=ListenConfig(host="127.0.0.1", port=0),
        workers=(WorkerConfig(url=emu.url, role=Role.COLOCATED, engine=Engine.SGLANG, id="a"),),
        policy=CacheAwareCfg(),
        admin=AdminConfig(token=TOKEN),
    )
    gw = Gateway(cfg)
    await gw.start()
    try:
        other = await start_emulator(spec("vllm", "m-vllm", free_port_pair()))
        body = {
            "url": other.url,
            "role": "colocated",
            "engine": "vllm",
            "id": "v",
            # vLLM's builtin hash with no seed is seeded at random per process: not computable
            "kv_events": {"endpoint": "tcp://127.0.0.1:1", "hash_algo": "builtin"},
        }
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                gw.url + "/admin/workers", json=body, headers={"authorization": f"Bearer {TOKEN}"}
            ) as r,
        ):
            text = await r.text()
            assert r.status == 400, text
            assert "kv_events" in text or "hash" in text
        assert gw.registry.find("v") is None
        await other.stop()
    finally:
        await gw.stop(grace_s=1.0)
        await emu.stop()
