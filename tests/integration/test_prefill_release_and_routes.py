"""On loopback, found by a probe of a running gateway: an SGLang prefill stops counting as in
flight once its answer is in (it counted until the decode's last token, so
`max_inflight_per_worker` capped a prefill's concurrent *generations* and idle prefills looked
busy to load-aware policies); a vLLM decode that prefills for itself is a usable route for
`/readiness` and `/v1/models` (a gateway serving fine was reported not ready); and SGLang `n > 1`
handoffs are labelled as disaggregated in the inter-token latency histogram (not "none")."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from common.workers import Engine, Role
from emulator.api import EmulatorSpec, start_emulator
from gateway.app import Gateway
from gateway.config import GatewayConfig, HealthConfig, LimitsConfig, ListenConfig, WorkerConfig


def config(*workers: WorkerConfig, **kw: Any) -> GatewayConfig:
    return GatewayConfig(
        listen=ListenConfig(host="127.0.0.1", port=0),
        workers=workers,
        health=HealthConfig(interval_s=3600.0, timeout_s=2.0),
        **kw,
    )


async def test_sglang_prefill_is_released_when_its_answer_is_in() -> None:
    pre = await start_emulator(
        EmulatorSpec(engine="sglang", role="prefill", model="m", bootstrap_port=0, time_scale=1.0)
    )
    decs = [
        await start_emulator(EmulatorSpec(engine="sglang", role="decode", model="m", time_scale=1.0))
        for _ in range(2)
    ]
    gw = Gateway(
        config(
            WorkerConfig(
                url=pre.url,
                role=Role.PREFILL,
                engine=Engine.SGLANG,
                id="p",
                bootstrap_port=pre.bootstrap_port,
            ),
            *(
                WorkerConfig(url=d.url, role=Role.DECODE, engine=Engine.SGLANG, id=f"d{i}")
                for i, d in enumerate(decs)
            ),
            limits=LimitsConfig(max_inflight_per_worker=2),
        )
    )
    await gw.start()
    long = {"model": "m", "prompt": "a long story", "max_tokens": 2000, "stream": True, "ignore_eos": True}
    try:
        async with aiohttp.ClientSession() as s:
            streams = [await s.post(gw.url + "/v1/completions", json=long) for _ in range(2)]
            for r in streams:  # each has its first token: its prefill is done, its decode runs on
                assert r.status == 200, await r.text()
                await r.content.readline()
            p = gw.registry.get("p")
            assert (p.inflight, p.inflight_tokens) == (0, 0)
            assert sorted(gw.registry.get(f"d{i}").inflight for i in range(2)) == [1, 1]
            # the prefill is not at its cap of 2: a third request is served, not a 503
            async with s.post(
                gw.url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 4}
            ) as r:
                assert r.status == 200, await r.text()
            for r in streams:
                r.close()
    finally:
        await gw.stop(grace_s=1.0)
        for e in (pre, *decs):
            await e.stop()


async def test_vllm_decode_prefilling_for_itself_is_a_route() -> None:
    dec = await start_emulator(EmulatorSpec(engine="vllm", role="decode", model="m"))
    dead = "http://127.0.0.1:9"  # the prefill is down (nothing listens on the discard port)
    gw = Gateway(
        config(
            WorkerConfig(url=dead, role=Role.PREFILL, engine=Engine.VLLM, model="m"),
            WorkerConfig(url=dec.url, role=Role.DECODE, engine=Engine.VLLM),
        )
    )
    await gw.start()
    try:
        async with aiohttp.ClientSession() as s:
            body = {"model": "m", "prompt": "hi", "max_tokens": 4}
            async with s.post(gw.url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()  # served: the decode prefills for itself
            async with s.get(gw.url + "/readiness") as r:
                assert (r.status, await r.json()) == (
                    200,
                    {"ready": True, "models": {"m": ["decode_self_prefill:vllm"]}},
                )
            async with s.get(gw.url + "/v1/models/m") as r:
                assert (await r.json())["routes"] == ["decode_self_prefill:vllm"]
    finally:
        await gw.stop(grace_s=1.0)
        await dec.stop()


async def test_split_samples_are_labelled_disaggregated_in_the_itl_histogram() -> None:
    pre = await start_emulator(EmulatorSpec(engine="sglang", role="prefill", model="m", bootstrap_port=0))
    dec = await start_emulator(EmulatorSpec(engine="sglang", role="decode", model="m"))
    gw = Gateway(
        config(
            WorkerConfig(
                url=pre.url, role=Role.PREFILL, engine=Engine.SGLANG, bootstrap_port=pre.bootstrap_port
            ),
            WorkerConfig(url=dec.url, role=Role.DECODE, engine=Engine.SGLANG),
        )
    )
    await gw.start()
    try:
        async with aiohttp.ClientSession() as s:
            body = {"model": "m", "prompt": "hi", "max_tokens": 8, "n": 2, "stream": True, "ignore_eos": True}
            async with s.post(gw.url + "/v1/completions", json=body) as r:
                assert r.status == 200 and b"[DONE]" in await r.read()
            await asyncio.sleep(0)
            async with s.get(gw.url + "/metrics") as r:
                text = await r.text()
        itl = {
            smp.labels["plan"]: smp.value
            for fam in text_string_to_metric_families(text)
            if fam.name == "pdgw_inter_token_latency_seconds"
            for smp in fam.samples
            if smp.name.endswith("_count")
        }
        assert itl.get("none", 0) == 0 and itl.get("disaggregated", 0) == 2, itl
    finally:
        await gw.stop(grace_s=1.0)
        await pre.stop()
        await dec.stop()
