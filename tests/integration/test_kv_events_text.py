"""Text prompts and the precise index: with a routing tokenizer (`[tokenizer] kind =
"emulator"`), the gateway keys the text of /v1/completions prompts and the emulator's chats
with the ids the engine sees, and its KV-event index predicts the cached tokens each engine
then reports within a few percent (as test_kv_events.py shows for prompts of token ids).

The figures are the policy's own: each routed request's prediction by the `kv_events` source,
joined with the cached tokens its answer reported (`CacheState.accuracy`)."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.cache_metrics import cache_states
from gateway.routing_tokenizer import TokenizerConfig
from policies.config import CacheAwareCfg
from tests.integration.test_kv_events import Setup, caught_up
from tests.integration.test_kv_events import start as start_kv
from tests.unit.test_routing_tokenizer import write_tokenizer_json

ENGINES = ("vllm", "sglang")


async def start(tokenizer: TokenizerConfig | None) -> Setup:
    """test_kv_events.py's two engines (caches small enough that they evict), the gateway's
    approximate index told the emulator's one byte a token."""
    return await start_kv(policy=CacheAwareCfg(chars_per_token=1.0), tokenizer=tokenizer)


@pytest.fixture
async def setup() -> AsyncIterator[Setup]:
    s = await start(TokenizerConfig(kind="emulator"))
    try:
        yield s
    finally:
        await s.gateway.stop(grace_s=1.0)
        for h in s.emulators.values():
            await h.stop()


def words(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abcdefghij ") for _ in range(n))


async def send(http: aiohttp.ClientSession, s: Setup, engine: str, body: dict[str, Any], chat: bool) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with http.post(s.gateway.url + path, json={"model": f"m-{engine}", "max_tokens": 2, **body}) as r:
        assert r.status == 200, await r.text()


def accuracy(s: Setup, engine: str) -> tuple[int, float, float, float]:
    (state,) = cache_states(s.gateway.policy)
    return state.accuracy.summary().get((engine, "kv_events"), (0, 0.0, 0.0, 0.0))


@pytest.mark.parametrize("engine", ENGINES)
async def test_text_prompts_are_predicted_from_the_engines_events(setup: Setup, engine: str) -> None:
    s = setup
    rng = random.Random(11)
    systems = [words(rng, rng.randrange(150, 400)) for _ in range(3)]
    convs = [rng.choice(systems) + words(rng, 80) for _ in range(8)]
    async with aiohttp.ClientSession() as http:
        for _ in range(40):
            c = rng.randrange(len(convs))
            convs[c] += words(rng, rng.randrange(5, 60))
            await caught_up(s, engine)
            await send(http, s, engine, {"prompt": convs[c]}, chat=False)
    n, _err, predicted, reported = accuracy(s, engine)
    # every request was predicted by the precise index (those whose answer reported its cached
    # tokens are counted: vLLM leaves the count out when it is 0)
    (state,) = cache_states(s.gateway.policy)
    assert {src for w, src in state.accuracy.summary() if w == engine} == {"kv_events"}
    assert n >= 36, s.gateway.kv_events.status()
    assert reported > 5000  # the prompts did share prefixes
    assert abs(predicted - reported) <= 0.03 * reported, (predicted, reported)
    w = s.gateway.kv_events.index.worker(engine)
    assert w is not None and w.state == "live" and w.removed > 0  # live, and the engine evicted
    (status,) = [r for r in s.gateway.kv_events.status() if r.worker == engine]
    assert status.lag_s is not None and 0 <= status.lag_s <= status.max_lag_s < 5.0  # kept up


async def test_the_emulators_chats_are_predicted_too(setup: Setup) -> None:
    s = setup
    rng = random.Random(5)
    history: list[dict[str, Any]] = [{"role": "system", "content": words(rng, 300)}]
    async with aiohttp.ClientSession() as http:
        for _ in range(12):
            history.append({"role": "user", "content": words(rng, 40)})
            await caught_up(s, "sglang")
            await send(http, s, "sglang", {"messages": history}, chat=True)
            history.append({"role": "assistant", "content": words(rng, 10)})
    n, _err, predicted, reported = accuracy(s, "sglang")
    assert n >= 11 and reported > 2000  # (the first one found none: no count)
    assert abs(predicted - reported) <= 0.03 * reported, (predicted, reported)


async def test_without_a_tokenizer_text_prompts_use_the_approximate_index() -> None:
    s = await start(None)
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(3):
                await send(http, s, "sglang", {"prompt": "abc " * 100}, chat=False)
        assert accuracy(s, "sglang")[0] == 0
        (state,) = cache_states(s.gateway.policy)
        assert state.accuracy.summary()[("sglang", "approx")][0] >= 2
    finally:
        await s.gateway.stop(grace_s=1.0)
        for h in s.emulators.values():
            await h.stop()


async def test_a_long_prompt_tokenized_off_the_loop_is_routed_on_its_ids(tmp_path: Path) -> None:
    """An `hf` tokenizer's long text prompt is tokenized in a worker thread as it is served
    (gateway/routing_tokenizer.py `offload_bytes`): before it is routed, so that the precise
    index reads its ids (the engines' are the emulator's: the index finds nothing, but knows)."""
    path = str(write_tokenizer_json(tmp_path / "t.json"))
    s = await start(TokenizerConfig(kind="hf", path=path, offload_bytes=64))
    try:
        # the index routes a worker on its events only once its stream is live (before that, on
        # the approximate index): on a loaded machine the request can come first
        await caught_up(s, "sglang")
        async with aiohttp.ClientSession() as http:
            await send(http, s, "sglang", {"prompt": "hello world the cat " * 20}, chat=False)
        (state,) = cache_states(s.gateway.policy)
        assert state.decisions == {("colocated", "kv_events", False): 1}
    finally:
        await s.gateway.stop(grace_s=1.0)
        for h in s.emulators.values():
            await h.stop()
