"""A vLLM decode the request never reached gets no second prefill.

A vLLM prefill that answered keeps its KV for a decode to pull (until read, or until the
engine's lease ends: minutes). When the decode the plan named cannot be reached (its port
refuses, or an admin removal closed its pool while the prefill ran), the KV is untouched, and
`kv_transfer_params` name the prefill, not a decode: the decode leg goes to another decode of
the pool. Retrying the whole handoff elsewhere (as before) prefilled the prompt a second time and
left the first prefill's KV held until its lease ended."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from structlog.testing import capture_logs

from common.workers import Engine, Role
from emulator.api import EmulatorHandle, EmulatorSpec, start_emulator
from gateway.app import Gateway
from gateway.config import AdminConfig, GatewayConfig, GuardsConfig, HealthConfig, ListenConfig, WorkerConfig
from tests.integration.test_gateway import post

BODY = {"model": "m", "prompt": "tell me a story", "max_tokens": 12, "temperature": 0}


@asynccontextmanager
async def vllm_pd(
    decodes: int = 2, *, prefill_scale: float = 0.0, **config: Any
) -> AsyncIterator[tuple[Gateway, EmulatorHandle, list[EmulatorHandle]]]:
    """One emulated vLLM prefill ("p") and `decodes` decodes ("d1".."dN") behind a gateway."""
    p = await start_emulator(
        EmulatorSpec(engine="vllm", role="prefill", model="m", kv_port=0, time_scale=prefill_scale)
    )
    ds = [await start_emulator(EmulatorSpec(engine="vllm", role="decode", model="m")) for _ in range(decodes)]
    config.setdefault("health", HealthConfig(interval_s=3600.0, timeout_s=2.0))
    # these tests count each engine's requests: no sampled verification re-run on a decode
    config.setdefault("guards", GuardsConfig(shadow_fraction=0.0))
    gw = Gateway(
        GatewayConfig(
            listen=ListenConfig(host="127.0.0.1", port=0),
            workers=(
                WorkerConfig(url=p.url, role=Role.PREFILL, engine=Engine.VLLM, id="p"),
                *(
                    WorkerConfig(url=d.url, role=Role.DECODE, engine=Engine.VLLM, id=f"d{k + 1}")
                    for k, d in enumerate(ds)
                ),
            ),
            **config,
        )
    )
    await gw.start()
    try:
        yield gw, p, ds
    finally:
        await gw.stop(grace_s=0.5)
        for e in (p, *ds):
            await e.stop()


async def stats(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(url + "/emulator/stats") as r:
        out: dict[str, Any] = await r.json()
        return out


async def metric(gw: Gateway, name: str, label: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
        text = await r.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and label in line
    )


async def test_a_decode_that_refuses_connections_gets_the_decode_leg_moved_not_a_second_prefill() -> None:
    async with vllm_pd(2) as (gw, p, (d1, d2)):
        status, _, raw = await post(gw.url + "/v1/completions", BODY)
        assert status == 200, raw
        want = json.loads(raw)["choices"][0]["text"]
        await d1.stop()  # its port now refuses; the gateway has not noticed (no health probe)
        before = (await stats(p.url))["received"]
        served_before = (await stats(d2.url))["completed"]
        n = 6
        for _ in range(n):  # round robin: half of these plan the dead decode
            status, _, raw = await post(gw.url + "/v1/completions", BODY)
            assert status == 200, raw
            assert json.loads(raw)["choices"][0]["text"] == want
        ps = await stats(p.url)
        assert ps["received"] - before == n  # one prefill per request, none again
        assert ps["held_transfers"] == 0  # every prefill's KV was pulled, none waits for a lease
        assert (await stats(d2.url))["completed"] - served_before == n
        assert await metric(gw, "pdgw_fallbacks_total", 'rung="other_decode"') >= 1


async def test_a_decode_removed_while_the_prefill_runs_gets_the_decode_leg_moved() -> None:
    """The removal's wait ends before the prefill does (`timeout_s` 0.1 against a prefill of
    ~2 s): the request finds the planned decode's pool closed."""
    async with vllm_pd(2, prefill_scale=4.0, admin=AdminConfig(token="t")) as (gw, p, ds):
        long = {**BODY, "prompt": "word " * 1200}
        tasks = [asyncio.create_task(post(gw.url + "/v1/completions", long)) for _ in range(2)]
        # both prefills running, one planned for each decode (round robin)
        for _ in range(200):
            if (await stats(p.url))["in_flight"] == 2:
                break
            await asyncio.sleep(0.01)
        assert (await stats(p.url))["in_flight"] == 2
        async with (
            aiohttp.ClientSession() as s,
            s.delete(
                gw.url + "/admin/workers/d1",
                params={"timeout_s": "0.1"},
                headers={"Authorization": "Bearer t"},
            ) as r,
        ):
            removal = await r.json()
        assert removal["removed"] and not removal["drained"], removal
        for status, _, raw in await asyncio.gather(*tasks):
            assert status == 200, raw
        ps = await stats(p.url)
        assert ps["received"] == 2, ps  # no second prefill
        assert ps["held_transfers"] == 0, ps
        assert (await stats(ds[0].url))["received"] == 0
        assert (await stats(ds[1].url))["completed"] == 2


async def test_with_one_decode_the_request_still_fails_clearly() -> None:
    async with vllm_pd(1) as (gw, _p, (d1,)):
        await d1.stop()
        status, _, raw = await post(gw.url + "/v1/completions", BODY)
        assert status in (502, 503), raw
        assert json.loads(raw)["error"]["message"]


async def test_after_a_move_the_retry_excludes_the_unreachable_decode_and_names_the_last_failure() -> None:
    """The moved-to decode fails too (a 500): the request's next attempt excludes the decode it
    could not reach and the pair that ran (it planned the dead decode again before), and the
    client is told the last failure, not a connect error of the first decode."""
    async with vllm_pd(2) as (gw, _p, (d1, d2)):
        status, _, raw = await post(gw.url + "/v1/completions", BODY)  # d1 (round robin)
        assert status == 200, raw
        status, _, raw = await post(gw.url + "/v1/completions", BODY)  # d2
        assert status == 200, raw
        await d1.stop()
        await d2.set_faults(["http_error,status=500"])
        before = (await stats(d2.url))["received"]
        with capture_logs() as logs:
            status, _, raw = await post(gw.url + "/v1/completions", BODY)  # d1: moved to d2
        assert status in (502, 503), raw
        err = json.loads(raw)["error"]
        # the client is told the last failure's code and phase; the log line names d2's answer
        assert err["code"] == "upstream_error" and "(phase: colocated)" in err["message"], err
        done = next(x for x in logs if x["event"] == "request.done")
        assert "worker d2 answered HTTP 500" in done["error"] and "connect" not in done["error"], done
        # d2 as the moved decode, then as its own prefill (the ladder's decode_self_prefill)
        assert (await stats(d2.url))["received"] - before == 2
