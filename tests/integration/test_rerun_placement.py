"""Verification re-runs on an emulated vLLM cluster of one prefill and two decodes (issue #31),
in front of the in-process gateway with the `cost_model` decider.

A re-run (docs/guards.md, "Verified before delivery") is a whole prefill of the prompt on the
vLLM decode it lands on, which stalls the decodes running there. A sampled one starts with the
verified request's prefill (not at its verdict, after which a long prompt's re-run outlasted a
short answer and held its end); the decider places it where it slows the fewest running decodes,
books it there as a local prefill while it runs and settles the booking at its end; the gateway
counts it in flight on that worker meanwhile. Before, it started at the prefill's verdict on the
verified answer's own decode, unbooked and uncounted.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from common.workers import Engine, Role
from emulator.api import EmulatorHandle, EmulatorSpec, start_emulator
from gateway.app import Gateway
from gateway.config import GatewayConfig, GuardsConfig, HealthConfig, ListenConfig, WorkerConfig
from policies.config import DeciderCfg
from policies.decider import CostModelDecider

MODEL = "m-vllm"
LONG = "the quick brown fox jumps over the lazy dog " * 700  # ~30,000 tokens: a token a byte


async def _cluster() -> tuple[Gateway, dict[str, EmulatorHandle]]:
    roles = {"vp": "prefill", "vd1": "decode", "vd2": "decode"}
    emus = {
        name: await start_emulator(
            EmulatorSpec(
                engine="vllm", role=role, model=MODEL, time_scale=1.0, max_model_len=65536, kv_port=0
            )
            if role == "prefill"
            else EmulatorSpec(engine="vllm", role=role, model=MODEL, time_scale=1.0, max_model_len=65536)
        )
        for name, role in roles.items()
    }
    workers = tuple(
        WorkerConfig(url=emus[name].url, role=Role(role), engine=Engine.VLLM, id=name)
        for name, role in roles.items()
    )
    cfg = GatewayConfig(
        listen=ListenConfig(host="127.0.0.1", port=0),
        workers=workers,
        health=HealthConfig(interval_s=0.5, timeout_s=2.0),
        # every greedy P/D answer verified before delivery; the emulator's tokenizer: a token a byte
        guards=GuardsConfig(shadow_fraction=1.0, chars_per_token_estimate=1.0),
        # a local prefill costs twice its TTFT here: both requests go P/D
        decider=DeciderCfg(type="cost_model", tpot_slo_s=0.05, local_penalty=1.0),
    )
    gw = Gateway(cfg)
    await gw.start()
    return gw, emus


@pytest.mark.timeout(120)
async def test_a_rerun_starts_with_its_prefill_booked_where_it_slows_no_decode() -> None:
    """A long sampled answer (not verifiable) decodes on one decode; then a greedy 30,000-token
    prompt goes P/D to the other (the least loaded). Its re-run starts while its prefill runs, on
    its own decode (idle until its KV arrives; beside the long answer it would slow it), counted
    in flight there and booked with the decider. At the end every count and booking is back at
    zero and the re-run agreed."""
    gw, emus = await _cluster()
    decider = gw.policy.decider  # type: ignore[attr-defined]
    assert isinstance(decider, CostModelDecider)
    model = decider.model
    url = gw.url
    try:
        async with aiohttp.ClientSession() as s:
            long_body = {
                "model": MODEL,
                "prompt": "hi",
                "max_tokens": 2000,
                "temperature": 1.0,
                "ignore_eos": True,
                "stream": True,
            }
            a = await s.post(url + "/v1/completions", json=long_body)
            assert a.status == 200
            await a.content.readany()  # decoding now
            busy = [w for w in ("vd1", "vd2") if (await emus[w].stats())["received"] == 1]
            assert len(busy) == 1, busy
            x = busy[0]
            y = "vd2" if x == "vd1" else "vd1"
            seen: list[tuple[int, int, int]] = []
            vp, wy = gw.registry.find("vp"), gw.registry.find(y)
            assert vp is not None and wy is not None

            async def watch() -> None:  # while the prefill runs: what is in flight, booked on y
                while True:
                    if vp.inflight:
                        seen.append((wy.inflight, model.running_on(y), (await emus[y].stats())["in_flight"]))
                    await asyncio.sleep(0.005)

            watcher = asyncio.ensure_future(watch())
            body = {"model": MODEL, "prompt": LONG, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                await r.read()
            watcher.cancel()
            a.close()
        stats = {w: (await emus[w].stats())["received"] for w in emus}
        # the 30k prompt: prefilled on vp, decoded on y and re-run there, before its KV came
        assert stats == {"vp": 2, x: 1, y: 2}, stats
        # (in flight on y: the re-run; booked there: the request's decode and the re-run; the
        # engine runs the re-run)
        assert (1, 2, 1) in seen, seen[:: max(1, len(seen) // 20)]
        for _ in range(500):  # the long answer's abort reaches the gateway's books
            if all(w.inflight == 0 for w in gw.registry.workers()) and model.tracked() == 0:
                break
            await asyncio.sleep(0.01)
        assert all((w.inflight, w.inflight_tokens) == (0, 0) for w in gw.registry.workers())
        assert model.tracked() == 0 and all(model.booked_s(w) == 0.0 for w in emus)
        assert model.reruns == {y: 1}
        text = gw.metrics.render().decode()
        assert 'pdgw_shadow_runs_total{outcome="agreed",when="before_delivery"} 1.0' in text, text
    finally:
        await gw.stop(grace_s=1.0)
        for e in emus.values():
            await e.stop()
