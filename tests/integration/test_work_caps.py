"""What one request may ask for (`limits.max_batch`, `max_request_tokens`, `max_json_values`),
refused before any engine or handoff sees it, in OpenAI's error shape; and a body built to cost
the most to decode (issue #27: 350,000 tiny prompts) refused without holding the event loop."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest

from bench.loop_watch import LoopWatch
from gateway.config import LimitsConfig
from tests.integration.conftest import build_cluster, stop_cluster


async def post_raw(url: str, data: bytes) -> tuple[int, dict[str, Any]]:
    timeout = aiohttp.ClientTimeout(total=60)
    async with (
        aiohttp.ClientSession(timeout=timeout) as s,
        s.post(url, data=data, headers={"content-type": "application/json"}) as r,
    ):
        return r.status, await r.json()


async def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    return await post_raw(url, json.dumps(body).encode())


@pytest.mark.parametrize(
    ("model", "path", "body", "status", "param", "needle"),
    [
        # prompts x n past limits.max_batch (1024): each would be a handoff of its own on SGLang P/D
        ("m-sglang", "/v1/completions", {"prompt": ["a"] * 1025, "max_tokens": 1}, 400, "prompt", "1025"),
        (
            "m-sglang",
            "/v1/completions",
            {"prompt": ["a"] * 600, "n": 2, "max_tokens": 1},
            400,
            "prompt",
            "1200",
        ),
        (
            "m-sglang",
            "/generate",
            {"input_ids": [[5]] * 1025, "sampling_params": {}},
            400,
            "input_ids",
            "1025",
        ),
        # tokens past limits.max_request_tokens (2 M): n x max_tokens
        (
            "m-vllm",
            "/v1/completions",
            {"prompt": "hi", "n": 128, "max_tokens": 20000},
            400,
            "max_tokens",
            "2560",
        ),
        (
            "m-sglang",
            "/generate",
            {"text": ["a"] * 64, "sampling_params": {"max_new_tokens": 40000}},
            400,
            "max_new_tokens",
            "2560",
        ),
        # JSON values past limits.max_json_values (131,072): refused before it is decoded
        ("m-vllm", "/v1/completions", {"prompt": [5] * 200_000, "max_tokens": 1}, 413, None, "131072"),
        (
            "m-colocated",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a"}] * 70_000, "max_tokens": 1},
            413,
            None,
            "131072",
        ),
    ],
)
async def test_requests_past_the_work_caps_are_refused(
    model: str, path: str, body: dict[str, Any], status: int, param: str | None, needle: str
) -> None:
    c = await build_cluster()
    try:
        before = sum([(await e.stats())["received"] for e in c.emulators.values()])
        got, out = await post(c.url + path, {"model": model, **body})
        assert got == status, out
        err = out["error"]
        assert err["param"] == param and needle in err["message"], err
        assert err["code"] == ("request_too_large" if status == 413 else "invalid_request")
        assert err["type"] == "invalid_request_error"
        # no engine saw it (the health probes' GETs are not counted)
        assert sum([(await e.stats())["received"] for e in c.emulators.values()]) == before
    finally:
        await stop_cluster(c)


async def test_the_caps_are_configurable() -> None:
    c = await build_cluster(limits=LimitsConfig(max_batch=4, max_request_tokens=100, max_json_values=1000))
    try:
        url = c.url + "/v1/completions"
        got, out = await post(url, {"model": "m-vllm", "prompt": ["a", "b"], "n": 3, "max_tokens": 1})
        assert got == 400 and out["error"]["param"] == "prompt", out
        got, out = await post(url, {"model": "m-vllm", "prompt": "a", "n": 5, "max_tokens": 1})
        assert got == 400 and out["error"]["param"] == "n", out
        got, out = await post(url, {"model": "m-vllm", "prompt": "a", "n": 2, "max_tokens": 60})
        assert got == 400 and out["error"]["param"] == "max_tokens", out
        got, out = await post(url, {"model": "m-vllm", "prompt": [5] * 70_000, "max_tokens": 1})
        assert got == 413, out
        got, out = await post(url, {"model": "m-vllm", "prompt": ["a", "b"], "n": 2, "max_tokens": 20})
        assert got == 200, out  # within every cap
    finally:
        await stop_cluster(c)


async def test_the_issues_350000_tiny_prompts_are_refused_without_holding_the_event_loop() -> None:
    """A 9 MB body of 350,000 tiny prompts (issue #27: accepted, 120k handoffs, the event loop
    held 4.1 s) is refused with a 413 before it is decoded; meanwhile health checks are answered
    and the longest event-loop stall stays far below the issue's (the figure on a quiet machine:
    `python -m bench.body_stall`, docs/benchmarks.md; this asserts a generous bound only)."""
    c = await build_cluster()
    try:
        body = json.dumps({"model": "m-sglang", "prompt": ["x" * 22] * 350_000, "max_tokens": 1}).encode()
        assert len(body) > 9_000_000
        health: list[float] = []
        done = asyncio.Event()

        async def probe() -> None:
            async with aiohttp.ClientSession() as s:
                while not done.is_set():
                    t0 = time.perf_counter()
                    async with s.get(c.url + "/health") as r:
                        assert r.status == 200
                    health.append(time.perf_counter() - t0)
                    await asyncio.sleep(0.01)

        async with LoopWatch(0.001) as watch:
            prober = asyncio.create_task(probe())
            await asyncio.sleep(0.05)
            t0 = time.perf_counter()
            try:
                got, out = await post_raw(c.url + "/v1/completions", body)
            finally:
                took = time.perf_counter() - t0
                done.set()
                await prober
        assert got == 413 and out["error"]["code"] == "request_too_large", out
        assert took < 5.0, took
        # (the client's own JSON work shares this loop; the gateway's alone is the bench's figure)
        assert watch.worst_s < 0.5, watch.worst_s
        assert health and max(health) < 1.0, max(health)
        assert not [n for n, e in c.emulators.items() if e.dead]
        stats = await c.emulators["sgl-p"].stats()
        assert stats["in_flight"] == 0
    finally:
        await stop_cluster(c)
