"""A waiting prefill matches its prefix when it is scheduled, not only when it arrives.

A conversation's next turn that reaches a worker while the prefill of its own earlier turn runs
finds that prefix cached on a real engine: SGLang matches the waiting queue against the radix
cache as it forms each prefill batch (managers/scheduler.py ``get_new_batch_prefill``,
managers/schedule_policy.py ``calc_priority``), vLLM v1 as it schedules a waiting request
(v1/core/sched/scheduler.py ``Scheduler.schedule``: ``get_computed_blocks``). The emulator
matched only at admission, so the second request computed the whole prefix again.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from tests.emulator.conftest import Factory

# with the BOS token, two whole 8192-token chunks: the next request is not in the last one
FIRST = "x" * (16_384 - 1)


async def send(http: aiohttp.ClientSession, url: str, engine: str, text: str) -> dict[str, Any]:
    body: dict[str, Any]
    if engine == "sglang":
        path = "/generate"
        body = {"text": text, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    else:
        path = "/v1/completions"
        body = {"prompt": text, "max_tokens": 2, "temperature": 0}
    async with http.post(url + path, json=body) as r:
        assert r.status == 200
        out: dict[str, Any] = await r.json()
        return out


def cached_of(engine: str, obj: dict[str, Any]) -> int:
    if engine == "sglang":
        return int(obj["meta_info"]["cached_tokens"])
    details = obj["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


async def next_turn_behind_its_prefix(emu: Factory, http: aiohttp.ClientSession, engine: str) -> int:
    h = await emu(engine, "both", time_scale=0.5, max_model_len=65536, enable_prompt_tokens_details=True)
    first = asyncio.ensure_future(send(http, h.url, engine, FIRST))
    await asyncio.sleep(0.02)  # the first prompt's prefill is under way
    assert not first.done()
    second = await send(http, h.url, engine, FIRST + " and the next turn")
    assert (await first)["usage" if engine == "vllm" else "meta_info"] is not None
    return cached_of(engine, second)


async def test_sglang_next_turn_reads_the_prefix_computed_ahead_of_it(
    emu: Factory, http: aiohttp.ClientSession
) -> None:
    cached = await next_turn_behind_its_prefix(emu, http, "sglang")
    assert len(FIRST) - 64 <= cached <= len(FIRST) + 1


async def test_vllm_next_turn_reads_the_prefix_computed_ahead_of_it(
    emu: Factory, http: aiohttp.ClientSession
) -> None:
    cached = await next_turn_behind_its_prefix(emu, http, "vllm")
    assert len(FIRST) - 64 <= cached <= len(FIRST) + 1


# A turn scheduled in the same step as its predecessor's last chunk (two and a half chunks with the
# BOS token: the last chunk leaves half the step's budget to the next prompt). The chunks computed
# before that step are in the prefix cache on both engines: SGLang inserts a chunked request's
# filled tokens into its radix tree as it forms the next batch (``cache_unfinished_req``); vLLM v1
# caches a request's full blocks as it schedules them (``allocate_slots`` → ``cache_blocks``), so
# there the last chunk's blocks are read too. The emulator registered a prompt's blocks only when
# its whole prefill ended, so this turn computed all of it again (0 cached tokens on both).
LONGER = "x" * (20_480 - 1)


async def turn_beside_the_last_chunk(emu: Factory, http: aiohttp.ClientSession, engine: str) -> int:
    h = await emu(engine, "both", time_scale=0.5, max_model_len=65536, enable_prompt_tokens_details=True)
    first = asyncio.ensure_future(send(http, h.url, engine, LONGER))
    await asyncio.sleep(0.02)  # the first prompt's first chunk is under way
    assert not first.done()
    second = await send(http, h.url, engine, LONGER + " and the next turn")
    await first
    return cached_of(engine, second)


async def test_sglang_turn_beside_the_last_chunk_reads_the_chunks_computed_before(
    emu: Factory, http: aiohttp.ClientSession
) -> None:
    cached = await turn_beside_the_last_chunk(emu, http, "sglang")
    assert 16_384 - 64 <= cached <= 16_384


async def test_vllm_turn_beside_the_last_chunk_reads_the_chunks_scheduled_before_it(
    emu: Factory, http: aiohttp.ClientSession
) -> None:
    cached = await turn_beside_the_last_chunk(emu, http, "vllm")
    assert len(LONGER) - 64 <= cached <= len(LONGER) + 1
