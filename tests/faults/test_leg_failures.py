"""How a failed SGLang leg ends (both found by a probe of a running gateway).

The HTTP pool does not send an SGLang P/D leg a second time when its reused keep-alive
connection closes before any response byte (found by a probe: an engine that took the decode
leg and dropped the connection got the same leg again, with the same bootstrap room, and that
copy waited for KV that never comes: the client got an error only after the whole handoff
budget). The leg fails at once; the request is retried with a new room or fails clearly.
A colocated request keeps the pool's one re-send (a server dropping an idle connection as the
request went out is the common case there, and a second run does no harm).

A prefill refusing what its decode took is the prefill's fault: the request goes down the
fallback ladder instead of getting a 400 that blames the client."""

from __future__ import annotations

import json
import time

import aiohttp

from gateway.config import TimeoutsConfig
from tests.integration.conftest import build_cluster, stop_cluster
from tests.integration.test_gateway import post

BODY = {"model": "m-sglang", "prompt": "hi", "max_tokens": 20, "temperature": 0}


async def stats(url: str) -> dict[str, int]:
    async with aiohttp.ClientSession() as s, s.get(url + "/emulator/stats") as r:
        out: dict[str, int] = await r.json()
        return out


async def test_a_dropped_sglang_leg_is_not_sent_again() -> None:
    c = await build_cluster(timeouts=TimeoutsConfig(handoff_s=20.0, per_token_s=0.5))
    try:
        status, _, raw = await post(c.url + "/v1/completions", BODY)  # pools now hold connections
        assert status == 200, raw
        dec = c.emulators["sgl-d"]
        async with aiohttp.ClientSession() as s:
            async with s.post(dec.url + "/emulator/faults", json=["crash_mid_stream,after=3"]) as r:
                assert r.status == 200
        before = (await stats(dec.url))["received"]
        t0 = time.monotonic()
        status, _, raw = await post(c.url + "/v1/completions", BODY)
        took = time.monotonic() - t0
        assert status >= 500, raw  # the only SGLang pair failed: a clear error
        assert took < 10.0, took  # not the handoff budget (20 s + 0.5 s per token)
        # the first attempt's leg once, and one more per orchestrator retry (each a new room):
        # never two copies of one room's leg
        legs = (await stats(dec.url))["received"] - before
        assert 1 <= legs <= c.gateway.cfg.retries.max_attempts, legs
    finally:
        await stop_cluster(c)


async def test_a_prefill_refusing_what_its_decode_took_goes_down_the_ladder() -> None:
    """sglang #30233 (`silent_truncation` on the prefill: it refuses a prompt its decode took):
    the guard's catch is the prefill's fault, so the colocated rung serves the request (it was a
    400 blaming the client's 35-token prompt, on every request)."""
    c = await build_cluster(faults={"sgl-p": ["silent_truncation"]}, colocated_fallback=True)
    try:
        body = {**BODY, "prompt": "a prompt of a few words that the prefill refuses"}
        status, _, raw = await post(c.url + "/v1/completions", body)
        assert status == 200, raw
        _, _, want = await post(c.reference["m-sglang"].url + "/v1/completions", body)
        assert json.loads(raw)["choices"][0]["text"] == json.loads(want)["choices"][0]["text"]
    finally:
        await stop_cluster(c)
