"""Streaming step by step, counted in tokens per event (never in wall-clock time).

* SGLang ``--stream-interval N``: the first token goes out at once, then an event whenever N
  tokens are unsent (0.5.23 scheduler_components/output_streamer.py; the emulator used to hold
  the first N).
* A P/D decode read directly: every decode step's token is an event of its own.
* A long prompt arriving at a colocated server: SGLang runs its prefill chunks as prefill-only
  steps (``enable_mixed_chunk`` off), so the running streams get no token until its last chunk;
  vLLM decodes the running streams in every step, beside each chunk. The emulator used to mix
  chunks and decodes on both.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import msgspec

from emulator.api import EmulatorSpec, start_emulator
from tests.emulator.conftest import Factory

LONG_PROMPT = 40_000  # tokens: five 8192-token chunks


def events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for part in raw.split(b"\n\n"):
        if part.startswith(b"data: {"):
            out.append(msgspec.json.decode(part[6:]))
    return out


def generate_deltas(objs: list[dict[str, Any]]) -> list[int]:
    """Tokens each `/generate` event adds (its `output_ids` are the output so far)."""
    deltas, seen = [], 0
    for o in objs:
        n = len(o["output_ids"])
        deltas.append(n - seen)
        seen = n
    return deltas


async def test_stream_interval_sends_the_first_token_at_once(
    emu: Factory, http: aiohttp.ClientSession
) -> None:
    h = await emu("sglang", "both", stream_interval=4)
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 10, "temperature": 0}, "stream": True}
    async with http.post(h.url + "/generate", json=body) as r:
        deltas = generate_deltas(events(await r.read()))
    # 1 at once, then 4 and 4 as they are unsent, the last 1 before the finish (an event of 0)
    assert deltas == [1, 4, 4, 1, 0]


async def test_a_pd_decode_streams_each_step_as_an_event(http: aiohttp.ClientSession) -> None:
    prefill = await start_emulator(EmulatorSpec(engine="sglang", role="prefill", time_scale=0.2))
    decode = await start_emulator(EmulatorSpec(engine="sglang", role="decode", time_scale=0.2))
    try:
        pd = {"bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": 7}
        body = {"text": "hello there", "sampling_params": {"max_new_tokens": 30}, "stream": True} | pd
        p = asyncio.ensure_future(http.post(prefill.url + "/generate", json=body))
        async with http.post(decode.url + "/generate", json=body) as r:
            deltas = generate_deltas(events(await r.read()))
        (await p).release()
        assert deltas == [1] * 30 + [0]
    finally:
        await prefill.stop()
        await decode.stop()


class Log:
    """The order in which the client saw things across its streams."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, int]] = []
        self.short_running = asyncio.Event()  # the short stream has had 5 tokens

    def add(self, name: str, n: int) -> None:
        self.entries.append((name, n))
        if name == "short" and sum(k == "short" for k, _ in self.entries) >= 5:
            self.short_running.set()

    def tokens_of(self, name: str, after: str, before: str) -> int:
        """`name`'s tokens seen after the first `after` entry and before the first `before` one."""
        start = next(i for i, (k, _) in enumerate(self.entries) if k == after)
        end = next(i for i, (k, _) in enumerate(self.entries) if k == before)
        return sum(n for k, n in self.entries[start:end] if k == name)


async def read_deltas(resp: aiohttp.ClientResponse, name: str, log: Log, vllm: bool) -> None:
    pending = b""
    seen = 0
    async for data in resp.content.iter_any():
        pending += data
        *done, pending = pending.split(b"\n\n")
        for part in done:
            if not part.startswith(b"data: {"):
                continue
            obj = msgspec.json.decode(part[6:])
            if vllm:
                n = sum(len(c.get("text") or "") for c in obj.get("choices") or ())
            else:
                n = len(obj["output_ids"]) - seen
                seen += n
            if n:
                log.add(name, n)


def stream_body(engine: str, prompt: str, max_tokens: int) -> tuple[str, dict[str, Any]]:
    if engine == "sglang":
        sp = {"max_new_tokens": max_tokens, "temperature": 0}
        return "/generate", {"text": prompt, "sampling_params": sp, "stream": True}
    return "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}


async def tokens_during_a_long_prefill(emu: Factory, http: aiohttp.ClientSession, engine: str) -> int:
    """A stream runs on a colocated server; a long prompt arrives: how many of the stream's
    tokens come between the long request's going out and its first token."""
    h = await emu(engine, "both", time_scale=0.5, max_model_len=65536)
    log = Log()
    path, short = stream_body(engine, "a short question", 3000)

    async def run_short() -> None:
        async with http.post(h.url + path, json=short) as r:
            await read_deltas(r, "short", log, engine == "vllm")

    async def run_long() -> None:
        _, body = stream_body(engine, "x" * LONG_PROMPT, 2)
        log.add("long-sent", 0)
        async with http.post(h.url + path, json=body) as r:
            log.add("long-headers", 0)
            await read_deltas(r, "long", log, engine == "vllm")

    task = asyncio.ensure_future(run_short())
    await log.short_running.wait()
    await run_long()
    task.cancel()
    return log.tokens_of("short", "long-headers" if engine == "sglang" else "long-sent", "long")


async def test_sglang_pauses_running_streams_for_a_long_prefill(
    emu: Factory, http: aiohttp.ClientSession
) -> None:
    # the long prompt's five chunks run as prefill steps; the stream's token from the step in
    # flight when it arrived may still come (and one the client reads late)
    assert await tokens_during_a_long_prefill(emu, http, "sglang") <= 2


async def test_vllm_keeps_decoding_beside_a_long_prefill(emu: Factory, http: aiohttp.ClientSession) -> None:
    # every step decodes the stream beside a chunk of at most 8192 - 1 prompt tokens: 5 or more
    # steps, a token each
    assert await tokens_during_a_long_prefill(emu, http, "vllm") >= 4


async def test_an_sglang_prefill_reports_its_chunk_size(emu: Factory, http: aiohttp.ClientSession) -> None:
    h = await emu("sglang", "prefill")
    async with http.get(h.url + "/server_info") as r:
        assert (await r.json())["chunked_prefill_size"] == 8192  # the same on every role
