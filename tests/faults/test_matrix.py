"""The fault matrix: each engine fault under 64 concurrent requests (32 of them streams).

For every case: no request hangs (each ends within its deadline), every answer is either the
colocated reference's answer or a clear error (never wrong tokens), no engine request is left
running once the clients have their answers, and the expected fallback shows in the metrics.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

import aiohttp
import pytest

from gateway.config import RetriesConfig, TimeoutsConfig
from tests.faults.test_kv_integrity import PROMPTS, answer_text, body, references
from tests.integration.conftest import Cluster, build_cluster, stop_cluster

TIMEOUTS = TimeoutsConfig(
    connect_s=0.5, prefill_s=1.5, handoff_s=1.5, idle_s=1.5, client_stall_s=8.0, total_s=8.0
)
N = 64


async def fire(c: Cluster, model: str, refs: dict[str, str], n: int = N) -> tuple[Counter[str], float]:
    outcomes: Counter[str] = Counter()
    t0 = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=TIMEOUTS.total_s + 4)
    async with aiohttp.ClientSession(timeout=timeout) as s:

        async def one(i: int) -> None:
            prompt = PROMPTS[i % len(PROMPTS)]
            stream = i % 2 == 1
            try:
                async with s.post(c.url + "/v1/completions", json=body(model, prompt, stream)) as r:
                    raw = await r.read()
            except TimeoutError:
                outcomes["HUNG"] += 1
                return
            if r.status != 200:
                assert json.loads(raw)["error"]["message"]
                outcomes[f"error_{r.status}"] += 1
                return
            text, clean = answer_text(raw, stream)
            if not clean:
                outcomes["stream_error_event"] += 1
            elif text == refs[prompt]:
                outcomes["correct"] += 1
            else:
                outcomes["CORRUPTED"] += 1

        await asyncio.gather(*(one(i) for i in range(n)))
    return outcomes, time.monotonic() - t0


async def settled(c: Cluster, within_s: float = 5.0) -> dict[str, int]:
    deadline = time.monotonic() + within_s
    while True:
        counts = {n: (await h.stats())["in_flight"] for n, h in c.emulators.items() if not h.dead}
        if not any(counts.values()) or time.monotonic() > deadline:
            return {n: v for n, v in counts.items() if v}
        await asyncio.sleep(0.005)


def fallbacks(c: Cluster) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in c.gateway.metrics.render().decode().splitlines():
        if line.startswith("pdgw_fallbacks_total{"):
            rung = line.split('rung="')[1].split('"')[0]
            out[rung] = float(line.rsplit(" ", 1)[1])
    return out


# (case, model, emulator, fault or action, expected fallback rung or None, all answers correct?)
CASES: list[tuple[str, str, str, str, str | None, bool]] = [
    ("prefill_dead_before", "m-sglang", "sgl-p", "stop", "colocated", True),
    ("prefill_dead_before", "m-vllm", "vllm-p", "stop", "colocated", True),
    ("transfer_fails", "m-sglang", "sgl-d", "transfer_fail:0.5", "colocated", True),
    ("transfer_fails", "m-vllm", "vllm-d", "transfer_fail:0.5", "colocated", True),
    ("transfer_fails_over_4_concurrent", "m-sglang", "sgl-d", "transfer_fail_concurrent,over=4", None, True),
    ("transfer_stalls", "m-sglang", "sgl-p", "transfer_stall:0.3", "colocated", True),
    ("transfer_stalls", "m-vllm", "vllm-p", "transfer_stall:0.3", None, True),
    ("decode_hung_health_ok", "m-sglang", "sgl-d", "health_ok_but_hung", "colocated", True),
    ("decode_hung_health_ok", "m-vllm", "vllm-d", "health_ok_but_hung", "colocated", True),
    ("prefill_http_5xx", "m-vllm", "vllm-p", "http_error:0.5,status=503", "colocated", True),
    ("decode_dies_mid_stream", "m-sglang", "sgl-d", "crash_mid_stream:0.3", None, False),
    ("decode_dies_mid_stream", "m-vllm", "vllm-d", "crash_mid_stream:0.3", None, False),
    ("slow_worker", "m-vllm", "vllm-d", "slow:1,factor=5", None, True),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("case", "model", "emulator", "fault", "rung", "all_correct"),
    CASES,
    ids=[f"{c[0]}-{c[1]}" for c in CASES],
)
async def test_fault(
    case: str, model: str, emulator: str, fault: str, rung: str | None, all_correct: bool
) -> None:
    c = await build_cluster(
        time_scale=0.01 if case == "slow_worker" else 0.0,
        colocated_fallback=True,
        timeouts=TIMEOUTS,
        retries=RetriesConfig(max_attempts=3, backoff_initial_s=0.01),
    )
    try:
        refs = await references(c, model)
        if fault == "stop":
            await c.emulators[emulator].stop()
        else:
            await c.emulators[emulator].set_faults([fault])
        outcomes, took = await fire(c, model, refs)
        assert outcomes["HUNG"] == 0 and outcomes["CORRUPTED"] == 0 and outcomes["error_500"] == 0, outcomes
        assert took < TIMEOUTS.total_s + 2, took
        if all_correct:
            assert outcomes["correct"] == N, outcomes
        else:  # a stream cut after its first byte can only end with an error event
            assert outcomes["correct"] + outcomes["stream_error_event"] == N, outcomes
        if rung is not None:
            assert fallbacks(c).get(rung, 0) > 0, fallbacks(c)
        if case == "decode_hung_health_ok":
            # passive detection: /health stays green, the requests time out, and the decode (vLLM)
            # or its pair (SGLang: the prefill waits for the decode, so a timeout cannot tell
            # which of the two hung) is taken out by its breaker
            decode = c.gateway.registry.get(emulator)
            pair_open = any(p.endswith("|" + emulator) for p in c.gateway.registry.open_pairs())
            assert decode.healthy and (decode.breaker.state.value == "open" or pair_open)
        await c.emulators[emulator].set_faults([]) if fault != "stop" else None
        assert await settled(c) == {}
    finally:
        await stop_cluster(c)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("model", "prefill"), [("m-sglang", "sgl-p"), ("m-vllm", "vllm-p")])
async def test_prefill_dies_while_transferring(model: str, prefill: str) -> None:
    """The prefill server goes away with requests in flight (time scale > 0, so they are in the
    middle of their prefill or handoff): every request still ends, correct or with a clear error,
    and the retries and fallbacks show in the logs and metrics."""
    from structlog.testing import capture_logs

    c = await build_cluster(
        time_scale=1.0,
        colocated_fallback=True,
        timeouts=TIMEOUTS,
        retries=RetriesConfig(max_attempts=3, backoff_initial_s=0.01),
    )
    try:
        refs = await references(c, model)
        with capture_logs() as logs:
            load = asyncio.ensure_future(fire(c, model, refs))
            await asyncio.sleep(0.02)
            await c.emulators[prefill].stop()
            outcomes, took = await load
        assert outcomes["HUNG"] == 0 and outcomes["CORRUPTED"] == 0 and outcomes["error_500"] == 0, outcomes
        assert outcomes["correct"] + outcomes["stream_error_event"] == N, outcomes
        assert took < TIMEOUTS.total_s + 2
        assert fallbacks(c).get("colocated", 0) > 0, fallbacks(c)
        events = [e["event"] for e in logs]
        assert "request.retry" in events
        assert any(e["event"] == "request.done" and e.get("failed_attempts") for e in logs)
        assert await settled(c) == {}
    finally:
        await stop_cluster(c)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("model", "names"), [("m-sglang", ("sgl-p", "sgl-d")), ("m-vllm", ("vllm-p", "vllm-d"))]
)
async def test_client_disconnect_before_the_first_byte_stops_both_engines(
    model: str, names: tuple[str, str]
) -> None:
    c = await build_cluster(time_scale=1.0, timeouts=TIMEOUTS)
    try:
        # a long prompt (slow prefill at time scale 1) and clients that leave before any byte
        prompt = "p " * 3000
        async with aiohttp.ClientSession() as s:
            tasks = [
                asyncio.ensure_future(s.post(c.url + "/v1/completions", json=body(model, prompt, i % 2 == 0)))
                for i in range(N)
            ]
            await asyncio.sleep(0.05)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        t0 = time.monotonic()
        left = await settled(c, within_s=3.0)
        took = time.monotonic() - t0
        assert left == {}, left
        print(f"engines idle {took:.3f}s after the last client left")
        assert took < 1.0  # measured ~0.05 s on the 2-core CI machine; the goal is 0.1 s
    finally:
        await stop_cluster(c)


@pytest.mark.timeout(300)
async def test_soak_with_random_faults() -> None:
    """10,000 requests over both engines while faults come and go: no hang, no wrong tokens, no
    engine request left behind."""
    import random

    c = await build_cluster(
        colocated_fallback=True,
        timeouts=TIMEOUTS,
        retries=RetriesConfig(max_attempts=3, backoff_initial_s=0.01),
    )
    rng = random.Random(7)
    faults = [
        "transfer_fail:0.1",
        "http_error:0.1,status=503",
        "crash_mid_stream:0.05",
        "wrong_request_kv:0.05",
        "abort_during_transfer:0.05",
        "silent_truncation:0.05",
        "stale_kv_params:0.05",
        "",
    ]
    try:
        refs = {m: await references(c, m) for m in ("m-sglang", "m-vllm")}
        total: Counter[str] = Counter()
        t0 = time.monotonic()
        for _ in range(50):
            for name in ("sgl-p", "sgl-d", "vllm-p", "vllm-d"):
                f = rng.choice(faults)
                await c.emulators[name].set_faults([f] if f else [])
            for model in ("m-sglang", "m-vllm"):
                outcomes, _ = await fire(c, model, refs[model], n=100)
                total.update(outcomes)
        for name in ("sgl-p", "sgl-d", "vllm-p", "vllm-d"):
            await c.emulators[name].set_faults([])
        leaked = await settled(c)
        print(
            f"soak: {sum(total.values())} requests in {time.monotonic() - t0:.1f}s: {dict(total)}; "
            f"leaked engine requests: {leaked}"
        )
        assert sum(total.values()) == 10_000
        assert total["HUNG"] == 0 and leaked == {} and total["error_500"] == 0, total
        # Corruption the cheap checks cannot see (docs/guards.md): wrong-request KV whose first
        # token happens to agree, and the emulator's vLLM silent truncation (a prefill whose KV,
        # sampled token and params all describe the same truncated prompt). Everything else is
        # correct, recovered, or a clear error. Bound: 5 % of the ~1/8 of requests those two
        # faults hit, at most.
        assert total["CORRUPTED"] <= 0.01 * 10_000, total
    finally:
        await stop_cluster(c)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", ["m-sglang", "m-vllm"])
async def test_over_long_prompts_under_load_are_clear_4xx(model: str) -> None:
    c = await build_cluster(colocated_fallback=True, timeouts=TIMEOUTS)
    try:
        async with aiohttp.ClientSession() as s:

            async def one(i: int) -> int:
                b = body(model, "z" * 20_000, i % 2 == 1)
                b["max_tokens"] = 8192  # prompt + max_tokens over every worker's 8192-token context
                async with s.post(c.url + "/v1/completions", json=b) as r:
                    assert (await r.json())["error"]["message"]
                    return r.status

            statuses = await asyncio.gather(*(one(i) for i in range(N)))
        assert set(statuses) == {400}, statuses
        assert await settled(c) == {}
        received = [(await h.stats())["received"] for h in c.emulators.values()]
        assert received == [0] * len(received)  # refused before any engine saw them
    finally:
        await stop_cluster(c)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("model", "names"), [("m-sglang", ("sgl-p", "sgl-d")), ("m-vllm", ("vllm-p", "vllm-d"))]
)
async def test_client_disconnect_mid_stream_under_load(model: str, names: tuple[str, str]) -> None:
    c = await build_cluster(time_scale=1.0, timeouts=TIMEOUTS)
    try:
        b = body(model, "a short prompt", True)
        b["max_tokens"] = 2000
        async with aiohttp.ClientSession() as s:

            async def one() -> None:
                async with s.post(c.url + "/v1/completions", json=b) as r:
                    assert r.status == 200
                    await r.content.readany()  # the first token(s), then the client leaves

            await asyncio.gather(*(one() for _ in range(32)))
        t0 = time.monotonic()
        assert await settled(c, within_s=3.0) == {}
        assert time.monotonic() - t0 < 1.0
    finally:
        await stop_cluster(c)
