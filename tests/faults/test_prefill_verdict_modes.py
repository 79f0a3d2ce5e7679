"""When an SGLang P/D stream's prefill verdict is checked (`guards.prefill_verdict`, issue #27
item 12): before the first byte (the default: the decode's bytes wait for it), or before the
stream's end (they flow at once). Either way a failing prefill never yields a 200 stream that
ends cleanly with `[DONE]` and wrong tokens, and the hold is measured
(`pdgw_prefill_verdict_hold_seconds`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import aiohttp
import pytest

from gateway.config import BreakerConfig, GuardsConfig, RetriesConfig, TimeoutsConfig
from gateway.metrics import GatewayMetrics
from tests.integration.conftest import Cluster, build_cluster, stop_cluster

MODES = ("before_first_byte", "before_end")
# prefill faults: a failed transfer, SGLang #30233's abort after a 1-token KV (its decode
# streams garbage), an HTTP 500
FAULTS = ("transfer_fail", "silent_truncation", "http_error")
TIMEOUTS = TimeoutsConfig(prefill_s=5.0, handoff_s=5.0, idle_s=5.0, client_stall_s=10.0, total_s=15.0)


def body(route: str, i: int) -> dict[str, object]:
    out: dict[str, object] = {"model": "m-sglang", "max_tokens": 24, "temperature": 0, "stream": True}
    text = f"verdict mode prompt {i}: a few words to continue"
    if route == "chat":
        return out | {"messages": [{"role": "user", "content": text}]}
    return out | {"prompt": text}


def path(route: str) -> str:
    return "/v1/chat/completions" if route == "chat" else "/v1/completions"


async def stream(
    session: aiohttp.ClientSession, url: str, b: dict[str, object]
) -> tuple[int, str, bool, bool]:
    """(status, text streamed, ended with [DONE], carried an error event)."""
    async with session.post(url, json=b) as r:
        raw = (await r.read()).decode()
    if r.status != 200:
        return r.status, "", False, False
    text, error = "", False
    for line in raw.splitlines():
        if not line.startswith("data: {"):
            continue
        event = json.loads(line[6:])
        if "error" in event:
            error = True
            continue
        for choice in event.get("choices") or ():
            delta = choice.get("delta")
            text += (delta.get("content") if isinstance(delta, dict) else choice.get("text")) or ""
    return r.status, text, raw.rstrip().endswith("data: [DONE]"), error


def held(m: GatewayMetrics, what: str) -> int:
    return sum(m.verdict_hold.labels(what).counts)


@pytest.fixture(params=MODES)
async def cluster(request: pytest.FixtureRequest) -> AsyncIterator[Cluster]:
    c = await build_cluster(
        time_scale=0.05,
        guards=GuardsConfig(prefill_verdict=request.param),
        timeouts=TIMEOUTS,
        retries=RetriesConfig(max_attempts=2, backoff_initial_s=0.01),
        breaker=BreakerConfig(failure_threshold=1000, open_s=0.01),  # every request reaches the pair
    )
    yield c
    await stop_cluster(c)


async def reference(c: Cluster, session: aiohttp.ClientSession, route: str, i: int) -> str:
    status, text, done, _ = await stream(session, c.reference["m-sglang"].url + path(route), body(route, i))
    assert status == 200 and done
    return text


async def test_a_failing_prefill_never_ends_a_stream_cleanly(cluster: Cluster) -> None:
    c = cluster
    mode = c.gateway.cfg.guards.prefill_verdict
    cut = 0  # 200 streams that carried tokens and then an error event (no [DONE])
    async with aiohttp.ClientSession() as session:
        for fault in FAULTS:
            await c.emulators["sgl-p"].set_faults([fault])
            for i in range(6):
                route = ("completions", "chat")[i % 2]
                status, text, done, error = await stream(session, c.url + path(route), body(route, i))
                if status != 200:
                    continue  # a clear error before any byte
                assert not done, (mode, fault, route, text)  # never a clean end over a bad prefill
                assert error, (mode, fault, route, text)
                cut += bool(text)
        await c.emulators["sgl-p"].set_faults([])
        # and a sound handoff streams the reference's answer, cleanly ended
        for i in range(4):
            route = ("completions", "chat")[i % 2]
            status, text, done, error = await stream(session, c.url + path(route), body(route, 100 + i))
            assert (status, done, error) == (200, True, False), (mode, route, text)
            assert text == await reference(c, session, route, 100 + i)
    m = c.gateway.metrics
    if mode == "before_end":
        # the decode's tokens were not held: the streams that got a bad verdict had started
        assert cut > 0
        assert held(m, "end") >= 4  # each sound stream's end waited for (or found) its verdict
    else:
        assert cut == 0  # nothing reached a client before its verdict
        assert held(m, "end") == 0
        assert held(m, "first_byte") >= 4
