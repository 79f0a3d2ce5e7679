"""The cached tokens each engine reports reach the cache-aware policy, read the way the engines
write them (emulated engines, real sockets, the real `openai` client):

- colocated SGLang with --enable-cache-report: `usage.prompt_tokens_details.cached_tokens` of
  chat and completions answers, whole and streamed (read from the stream's final usage chunk),
  and `/generate`'s `meta_info.cached_tokens`;
- P/D: the prefill's own count (SGLang `meta_info`, vLLM's `kv_transfer_params`
  `remote_prefill_cached_tokens`), not the decode's;

and the policy's prediction accuracy (predicted vs reported, per worker) adds up to exactly what
the clients were told.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from common.workers import Engine, Role
from emulator.api import EmulatorHandle, EmulatorSpec, start_emulator
from gateway.app import Gateway
from gateway.config import GatewayConfig, HealthConfig, ListenConfig, WorkerConfig
from policies.cache_aware import CacheState
from policies.config import CacheAwareCfg
from tests.integration.conftest import build_cluster, stop_cluster

MODEL = "m-sgl"


class Colocated:
    def __init__(self, gateway: Gateway, emus: list[EmulatorHandle]) -> None:
        self.gateway = gateway
        self.emus = emus


@pytest.fixture
async def colocated() -> AsyncIterator[Colocated]:
    emus = [
        await start_emulator(
            EmulatorSpec(engine="sglang", role="both", model=MODEL, block_size=16, enable_cache_report=True)
        )
        for _ in range(2)
    ]
    workers = tuple(
        WorkerConfig(url=e.url, role=Role.COLOCATED, engine=Engine.SGLANG, id=f"w{i}")
        for i, e in enumerate(emus)
    )
    cfg = GatewayConfig(
        listen=ListenConfig(host="127.0.0.1", port=0),
        workers=workers,
        policy=CacheAwareCfg(index="approximate", seed=1),
        health=HealthConfig(interval_s=0.5, timeout_s=2.0),
        explain_header=True,
    )
    gw = Gateway(cfg)
    await gw.start()
    try:
        yield Colocated(gw, emus)
    finally:
        await gw.stop(grace_s=1.0)
        for e in emus:
            await e.stop()


def state_of(gw: Gateway) -> CacheState:
    sel = gw.policy.prefill  # type: ignore[attr-defined]
    st: CacheState = sel.state
    return st


def totals(st: CacheState) -> tuple[int, float, float]:
    rows = st.accuracy.summary().values()
    return sum(r[0] for r in rows), sum(r[2] for r in rows), sum(r[3] for r in rows)


async def settled(st: CacheState, n: int) -> tuple[int, float, float]:
    """The accuracy totals once `n` outcomes are in (a request's outcome is told to the policy
    just after its last byte went out)."""
    async with asyncio.timeout(5):
        while True:
            got = totals(st)
            if got[0] >= n:
                return got
            await asyncio.sleep(0.01)


def details(usage: Any) -> int:
    d = getattr(usage, "prompt_tokens_details", None)
    return int(getattr(d, "cached_tokens", None) or 0)


def prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Conversations over two shared system prompts (token ids)."""
    systems = [[rng.randrange(3, 250) for _ in range(160)] for _ in range(2)]
    out: list[list[int]] = []
    convs = [list(rng.choice(systems)) for _ in range(3)]
    for _ in range(n):
        c = rng.randrange(len(convs))
        convs[c] += [rng.randrange(3, 250) for _ in range(rng.randrange(20, 50))]
        out.append(list(convs[c]))
    return out


async def test_completions_report_exactly_what_the_clients_see(colocated: Colocated) -> None:
    gw = colocated.gateway
    st = state_of(gw)
    client = AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    seen: list[int] = []
    for i, ids in enumerate(prompts(random.Random(3), 16)):
        stream = i % 2 == 1
        if stream:
            got = await client.completions.create(
                model=MODEL, prompt=ids, max_tokens=2, stream=True, stream_options={"include_usage": True}
            )
            usage = None
            async for chunk in got:
                usage = chunk.usage or usage
        else:
            usage = (await client.completions.create(model=MODEL, prompt=ids, max_tokens=2)).usage
        seen.append(details(usage))
    await client.close()
    # answers before the first non-zero count say nothing (the flag may be off): not counted
    first = next(i for i, c in enumerate(seen) if c > 0)
    n, predicted, reported = await settled(st, len(seen) - first)
    assert n == len(seen) - first
    assert reported == sum(seen) > 1000
    # token ids, blocks of the engine's size: the gateway's index of what it sent predicts it
    assert abs(predicted - reported) <= 0.05 * reported, (predicted, reported)


async def test_chat_streams_and_generate_report_too(colocated: Colocated) -> None:
    gw = colocated.gateway
    st = state_of(gw)
    client = AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    system = {"role": "system", "content": "You answer briefly. " * 40}
    seen: list[int] = []
    prompts_seen: list[int] = []
    for i in range(4):
        msgs = [system, {"role": "user", "content": f"question {i} " * 5}]
        got = await client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=2, stream=True, stream_options={"include_usage": True}
        )  # type: ignore[call-overload]
        usage = None
        async for chunk in got:
            usage = chunk.usage or usage
        seen.append(details(usage))
        prompts_seen.append(usage.prompt_tokens if usage is not None else 0)
    await client.close()
    first = next(i for i, c in enumerate(seen) if c > 0)
    n, _, reported = await settled(st, len(seen) - first)
    # a text prompt's size is the gateway's estimate: the engine's counts are rescaled to it,
    # so the hit rate is the engine's
    (row,) = st.accuracy.rows().values()
    engine_rate = sum(seen[first:]) / sum(prompts_seen[first:])
    assert row[3] / row[4] == pytest.approx(engine_rate, rel=0.05) and engine_rate > 0.3
    # /generate: meta_info.cached_tokens is in every answer, 0 included: every one counts
    before = n
    gen: list[int] = []
    async with aiohttp.ClientSession() as http:
        for _ in range(3):
            body = {
                "model": MODEL,
                "input_ids": list(range(10, 200)),
                "sampling_params": {"max_new_tokens": 2},
            }
            async with http.post(gw.url + "/generate", json=body) as r:
                assert r.status == 200, await r.text()
                gen.append(int((await r.json())["meta_info"]["cached_tokens"]))
    n, _, reported2 = await settled(st, before + 3)
    # (3 requests, 2 workers: two of them meet on one worker, the later finds the prefix)
    assert gen[0] == 0 and max(gen) > 100
    assert reported2 - reported == sum(gen)


@pytest.fixture
async def pd() -> AsyncIterator[Any]:
    c = await build_cluster(policy=CacheAwareCfg(index="approximate", seed=1))
    try:
        yield c
    finally:
        await stop_cluster(c)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_a_pd_prefills_own_count_reaches_the_policy(pd: Any, engine: str) -> None:
    gw: Gateway = pd.gateway
    st = state_of(gw)
    model = f"m-{engine}"
    ids = [random.Random(5).randrange(3, 250) for _ in range(200)]
    async with aiohttp.ClientSession() as http:
        for i in range(3):
            prompt = ids + [7] * i  # the same 200-token prefix
            if engine == "sglang":
                path = "/generate"
                body: dict[str, Any] = {
                    "model": model,
                    "input_ids": prompt,
                    "sampling_params": {"max_new_tokens": 2},
                }
            else:
                path = "/v1/completions"
                body = {"model": model, "prompt": prompt, "max_tokens": 2}
            async with http.post(gw.url + path, json=body) as r:
                assert r.status == 200, await r.text()
    _, _, reported = await settled(st, 3)
    rows = st.accuracy.summary()
    prefill = "sgl-p" if engine == "sglang" else "vllm-p"
    assert {w for w, _ in rows} == {prefill}
    # the 2nd and 3rd prompts found the first's whole blocks in the prefill's cache
    assert reported >= 2 * 192, rows


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples with these labels (among others)."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}(?:{{(.*)}})? (\S+)$", line)
        if m is None:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


async def test_decision_records_in_a_header_and_figures_in_metrics(colocated: Colocated) -> None:
    gw = colocated.gateway
    st = state_of(gw)
    ids = [random.Random(9).randrange(3, 250) for _ in range(320)]
    seen: list[int] = []
    decisions: list[dict[str, Any]] = []
    async with aiohttp.ClientSession() as http:
        for i in range(4):
            body = {"model": MODEL, "prompt": ids + [i + 3] * 8, "max_tokens": 2}
            headers = {"x-pdgw-explain": "1"} if i else {}
            async with http.post(gw.url + "/v1/completions", json=body, headers=headers) as r:
                assert r.status == 200, await r.text()
                usage = (await r.json())["usage"]
                seen.append(int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0))
                raw = r.headers.get("x-pdgw-decision")
                assert (raw is None) == (i == 0)  # only when asked
                if raw is not None:
                    decisions.append(json.loads(raw))
        n, _, _ = await settled(st, 3)
        async with http.get(gw.url + "/metrics") as r:
            text = await r.text()
    for d in decisions:
        assert d["role"] == "cache_aware/colocated" and d["keyed"] == "tokens"
        assert d["prompt_tokens"] == 328 and d["reason"] == "min_ttft"
        rows = {row["worker"]: row for row in d["candidates"]}
        assert set(rows) == {"w0", "w1"}
        mine = rows[d["chosen"]]
        # the worker that served the first request holds its 320-token prefix (20 blocks of 16)
        assert mine["cached_tokens"] == 320 and mine["source"] == "approx"
        assert d["scores"]["predicted_ttft"][d["chosen"]] == 1.0
        assert rows[d["chosen"]]["ttft_s"] < min(r["ttft_s"] for w, r in rows.items() if w != d["chosen"])
    assert len({d["chosen"] for d in decisions}) == 1
    # the figures: what the engines reported, the hit ratios, the decisions
    assert metric(text, "pdgw_cache_reported_tokens_total") == sum(seen) == 3 * 320
    assert metric(text, "pdgw_cache_outcomes_total") == n == 3
    assert metric(text, "pdgw_cache_prompt_tokens_total") == 3 * 328
    assert metric(text, "pdgw_cache_predicted_tokens_total", source="approx") == 3 * 320
    assert metric(text, "pdgw_cache_prediction_error_tokens_total") == 0
    assert metric(text, "pdgw_cache_hit_ratio_count") == 3
    assert metric(text, "pdgw_cache_hit_ratio_bucket", le="0.9") == 0
    assert metric(text, "pdgw_cache_hit_ratio_bucket", le="1.0") == 3
    assert metric(text, "pdgw_cache_decisions_total", matched="true") == 3
    assert metric(text, "pdgw_cache_decisions_total", matched="false") == 1


async def test_no_decision_header_unless_the_gateway_allows_it(pd: Any) -> None:
    gw: Gateway = pd.gateway
    body = {"model": "m-colocated", "prompt": "hi there", "max_tokens": 2}
    async with (
        aiohttp.ClientSession() as http,
        http.post(gw.url + "/v1/completions", json=body, headers={"x-pdgw-explain": "1"}) as r,
    ):
        assert r.status == 200
        assert "x-pdgw-decision" not in r.headers
