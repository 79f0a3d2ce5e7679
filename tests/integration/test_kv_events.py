"""The gateway subscribed to emulated engines' KV events (real ZMQ sockets on 127.0.0.1).

- the precise index predicts the cached tokens each engine then reports in its answer (SGLang
  `meta_info.cached_tokens`, vLLM `usage.prompt_tokens_details.cached_tokens`) within a few
  percent, with caches small enough that the engines evict;
- an engine restarted on the same event port is a new epoch: the worker's entries are dropped
  and rebuilt, equal to the new engine's blocks;
- a wrong hash scheme or block size is caught on the first events: the worker is reported
  misaligned (log line, metrics) and its precise index is not used.
"""

from __future__ import annotations

import asyncio
import random
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
import pytest
from structlog.testing import capture_logs

from adapters.blockhash import HashSpec, make_hasher
from emulator.api import EmulatorHandle, EmulatorSpec, start_emulator
from gateway.app import Gateway
from gateway.config import GatewayConfig, HealthConfig, KvEventsConfig, ListenConfig, WorkerConfig
from gateway.routing_tokenizer import TokenizerConfig
from policies.config import CacheAwareCfg
from policies.prompt_key import PromptKey
from policies.snapshot import Engine, Role

BLOCK = 16


def free_port_pair() -> int:
    """A port p with p and p + 1 free (the emulator's replay socket is on p + 1)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no free port pair")


@dataclass
class Setup:
    gateway: Gateway
    emulators: dict[str, EmulatorHandle]
    kv_ports: dict[str, int]


def spec(engine: str, model: str, port: int, max_total_tokens: int = 2048) -> EmulatorSpec:
    return EmulatorSpec(
        engine=engine,  # type: ignore[arg-type]
        role="both",
        model=model,
        kv_events=f"tcp://127.0.0.1:{port}",
        block_size=BLOCK,
        max_total_tokens=max_total_tokens,
        enable_prompt_tokens_details=engine == "vllm",  # (vLLM reports cached tokens only so)
        enable_cache_report=engine == "sglang",  # (on its OpenAI routes; /generate always does)
    )


async def start(
    kv: dict[str, dict[str, Any]] | None = None,
    max_total_tokens: int = 2048,
    *,
    policy: CacheAwareCfg | None = None,
    tokenizer: TokenizerConfig | None = None,
) -> Setup:
    """Two emulated engines (vLLM, SGLang) publishing KV events, and a gateway subscribed to
    both; `kv`: per engine, `KvEventsConfig` fields that differ from the emulator's scheme."""
    kv = kv or {}
    ports = {name: free_port_pair() for name in ("vllm", "sglang")}
    emus = {
        "vllm": await start_emulator(spec("vllm", "m-vllm", ports["vllm"], max_total_tokens)),
        "sglang": await start_emulator(spec("sglang", "m-sglang", ports["sglang"], max_total_tokens)),
    }
    workers = tuple(
        WorkerConfig(
            url=emus[name].url,
            role=Role.COLOCATED,
            engine=Engine(name),
            id=name,
            kv_events=KvEventsConfig(
                endpoint=f"tcp://127.0.0.1:{ports[name]}",
                replay_endpoint=f"tcp://127.0.0.1:{ports[name] + 1}",
                **({"hash": "emulator"} | kv.get(name, {})),
            ),
        )
        for name in ("vllm", "sglang")
    )
    cfg = GatewayConfig(
        listen=ListenConfig(host="127.0.0.1", port=0),
        workers=workers,
        policy=policy or CacheAwareCfg(),
        health=HealthConfig(interval_s=0.5, timeout_s=2.0),
        tokenizer=tokenizer,
    )
    gateway = Gateway(cfg)
    await gateway.start()
    return Setup(gateway, emus, ports)


async def stop(s: Setup) -> None:
    await s.gateway.stop(grace_s=1.0)
    for h in s.emulators.values():
        await h.stop()


@pytest.fixture
async def setup() -> AsyncIterator[Setup]:
    s = await start()
    try:
        yield s
    finally:
        await stop(s)


async def generate(http: aiohttp.ClientSession, s: Setup, engine: str, ids: list[int]) -> int:
    """One request through the gateway; the cached tokens the engine reports."""
    if engine == "sglang":
        body = {"model": "m-sglang", "input_ids": ids, "sampling_params": {"max_new_tokens": 2}}
        async with http.post(s.gateway.url + "/generate", json=body) as r:
            assert r.status == 200, await r.text()
            return int((await r.json())["meta_info"]["cached_tokens"])
    body = {"model": "m-vllm", "prompt": ids, "max_tokens": 2}
    async with http.post(s.gateway.url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        usage = (await r.json())["usage"]
        return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def caught_up(s: Setup, engine: str, within_s: float = 5.0) -> None:
    """Until the index is live and has applied every batch the engine published."""
    publisher = s.emulators[engine].server.publisher
    index = s.gateway.kv_events.index
    async with asyncio.timeout(within_s):
        while True:
            w = index.worker(engine)
            if w is not None and w.state in ("live", "misaligned"):
                if publisher._seq == 0 or w.last_seq == publisher._seq - 1:
                    return
            await asyncio.sleep(0.01)


def engine_keys(s: Setup, engine: str) -> set[int]:
    hasher = make_hasher(HashSpec(scheme="emulator", block_size=BLOCK))
    return {hasher.event_key(h) for h in s.emulators[engine].server.engine.pool._by_hash}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_the_precise_index_predicts_what_the_engine_reports(setup: Setup, engine: str) -> None:
    s = setup
    index = s.gateway.kv_events.index
    model = f"m-{engine}"
    rng = random.Random(7)
    # conversations over shared system prompts; 2048 tokens of KV: the engine evicts
    systems = [[rng.randrange(3, 250) for _ in range(rng.randrange(100, 300))] for _ in range(3)]
    convs = [rng.choice(systems) + [rng.randrange(3, 250) for _ in range(60)] for _ in range(10)]
    predicted = reported = exact = 0
    async with aiohttp.ClientSession() as http:
        for i in range(60):
            c = rng.randrange(len(convs))
            convs[c] = convs[c] + [rng.randrange(3, 250) for _ in range(rng.randrange(5, 40))]
            ids = convs[c]
            await caught_up(s, engine)
            key = PromptKey.from_token_ids(ids)
            assert key is not None
            look = index.lookup(model, key, 4)
            assert look is not None
            p = look.cached_tokens(engine)
            assert p is not None, f"request {i}: the index is not usable: {index.status()}"
            r = await generate(http, s, engine, ids)
            predicted += p
            reported += r
            exact += p == r
    assert reported > 5000  # the prompts did share prefixes
    assert abs(predicted - reported) <= 0.03 * reported, (predicted, reported)
    assert exact >= 55, exact
    await caught_up(s, engine)
    assert index.worker_keys(engine) == engine_keys(s, engine)
    w = index.worker(engine)
    assert w is not None and w.verified > 0 and w.state == "live"
    assert w.removed > 20 and w.evicted == 0  # the engine evicted; the index kept up
    async with aiohttp.ClientSession() as http, http.get(s.gateway.url + "/metrics") as r:
        text = await r.text()
    assert f'pdgw_kv_index_usable{{state="live",worker="{engine}"}} 1.0' in text
    assert f'pdgw_kv_index_misaligned{{worker="{engine}"}} 0.0' in text
    assert "pdgw_kv_index_bytes" in text


async def test_an_engine_restart_is_a_new_epoch(setup: Setup) -> None:
    s = setup
    index = s.gateway.kv_events.index
    ids = list(range(3, 200))
    async with aiohttp.ClientSession() as http:
        await generate(http, s, "vllm", ids)
        await caught_up(s, "vllm")
        assert index.blocks("vllm") == len(ids) // BLOCK
        old = s.emulators["vllm"]
        url_port = old.port
        await old.stop()
        s.emulators["vllm"] = await start_emulator(
            msgspec.structs.replace(spec("vllm", "m-vllm", s.kv_ports["vllm"]), port=url_port)
        )
        await asyncio.sleep(0.5)  # the health probes see it back
        other = list(range(100, 250))
        async with asyncio.timeout(10):
            while True:
                try:
                    await generate(http, s, "vllm", other)
                    break
                except AssertionError:
                    await asyncio.sleep(0.2)
        await caught_up(s, "vllm")
    w = index.worker("vllm")
    assert w is not None and w.restarts == 1 and w.epoch == 1 and w.state == "live"
    assert index.worker_keys("vllm") == engine_keys(s, "vllm")
    key = PromptKey.from_token_ids(ids)
    assert key is not None
    assert index.lookup("m-vllm", key, 4).cached_tokens("vllm") == 0  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("kv", "reason"),
    [
        ({"hash": None}, "block hash"),  # the emulator does not hash like vLLM / SGLang
        ({"block_size": 32}, "block size"),
        ({"hash_seed": "12345", "hash": "vllm"}, "block hash"),
    ],
)
async def test_a_wrong_scheme_or_block_size_is_reported(kv: dict[str, Any], reason: str) -> None:
    s = await start({"vllm": kv, "sglang": kv})
    try:
        index = s.gateway.kv_events.index
        with capture_logs() as logs:
            async with aiohttp.ClientSession() as http:
                for engine in ("vllm", "sglang"):
                    await generate(http, s, engine, list(range(3, 120)))
                    await caught_up(s, engine)
        for engine in ("vllm", "sglang"):
            w = index.worker(engine)
            assert w is not None and w.state == "misaligned" and not w.usable
            assert w.reason is not None and w.reason.startswith(reason), w.reason
            key = PromptKey.from_token_ids(list(range(3, 120)))
            assert key is not None
            look = index.lookup(f"m-{engine}", key, 4)
            assert look is None or look.cached_tokens(engine) is None  # the policy uses the approximate index
        lines = [e for e in logs if e["event"] == "kv_events.misaligned"]
        assert {e["worker"] for e in lines} == {"vllm", "sglang"} and all(
            e["log_level"] == "error" for e in lines
        )
        async with aiohttp.ClientSession() as http, http.get(s.gateway.url + "/metrics") as r:
            text = await r.text()
        assert 'pdgw_kv_index_misaligned{worker="vllm"} 1.0' in text
    finally:
        await stop(s)
