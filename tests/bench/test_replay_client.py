"""bench/replay client against real emulated servers (in-process, real sockets): the timing of a
stream, the engine's prompt_tokens, the direct P/D handoffs, open- and closed-loop bounds."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import pytest

from bench.loadgen import vllm_prefill_dict
from bench.replay import client as rc
from bench.replay import prompts
from bench.replay.trace import Row
from emulator.api import EmulatorHandle, EmulatorSpec, start_emulator

MODEL = "m"
BUILDER = prompts.PromptBuilder(prompts.ByteTokenizer())


def items(
    n: int, *, t_step: float = 0.0, length: int = 700, out: int = 5, vllm_pd: bool = False
) -> list[rc.Item]:
    res = []
    for i in range(n):
        n = -(-(length + i) // 512)
        row = Row(i * t_step, length + i, out, tuple(1000 + 20 * i + k for k in range(n)))
        body = rc.request_dict(MODEL, BUILDER.text(row), row)
        pbody = rc.encode(vllm_prefill_dict(body)) if vllm_pd else None
        res.append(rc.Item(i, row, rc.encode(body), pbody))
    return res


async def _start(engine: str, role: str, **kw: object) -> EmulatorHandle:
    return await start_emulator(EmulatorSpec(engine=engine, role=role, model=MODEL, max_model_len=4096, **kw))  # type: ignore[arg-type]


@pytest.fixture
async def colocated() -> AsyncIterator[list[EmulatorHandle]]:
    hs = [await _start("sglang", "both", time_scale=0.05) for _ in range(2)]
    yield hs
    for h in hs:
        await h.stop()


def ctl(**kw: object) -> rc.RunControl:
    return rc.RunControl(stop=asyncio.Event(), **kw)  # type: ignore[arg-type]


async def test_closed_loop_times_each_stream_and_reads_the_engines_prompt_tokens(
    colocated: list[EmulatorHandle],
) -> None:
    d = rc.Direct("sglang", [h.url for h in colocated])
    try:
        recs = await rc.closed_loop(items(6, out=8), d, ctl(), concurrency=2)
    finally:
        d.close()
    assert [r.index for r in recs] == list(range(6))
    for r in recs:
        assert r.ok, r.error
        assert r.prompt_tokens == r.input_length
        assert r.completion_tokens == 8
        assert 0 < r.ttft < r.e2e
        assert r.tpot > 0  # timed mode: one engine step per token
    stats = [await h.stats() for h in colocated]
    assert [s["completed"] for s in stats] == [3, 3]  # round robin


async def test_open_loop_sends_on_schedule_and_stops_at_the_duration(colocated: list[EmulatorHandle]) -> None:
    d = rc.FrontEnd(colocated[0].url)
    try:
        recs = await rc.open_loop(items(5, t_step=0.3), d, ctl(duration_s=0.7), rate=1.0)
    finally:
        d.close()
    assert len(recs) == 3  # due at 0, 0.3, 0.6 s; 0.9 and 1.2 are past the duration
    gaps = [b.sent - a.sent for a, b in itertools.pairwise(recs)]
    assert all(0.25 < g < 0.45 for g in gaps), gaps
    assert all(r.ok and r.send_lag < 0.1 for r in recs)


async def test_a_rate_multiplier_compresses_arrivals(colocated: list[EmulatorHandle]) -> None:
    d = rc.FrontEnd(colocated[0].url)
    try:
        recs = await rc.open_loop(items(3, t_step=1.0), d, ctl(), rate=4.0)
    finally:
        d.close()
    assert recs[2].scheduled - recs[0].scheduled == pytest.approx(0.5)


async def test_stopping_leaves_requests_in_flight_unfinished() -> None:
    slow = await _start("sglang", "both", time_scale=1.0)
    d = rc.FrontEnd(slow.url)
    c = ctl()
    try:
        run = asyncio.ensure_future(rc.open_loop(items(3, out=400), d, c))
        await asyncio.sleep(0.5)
        c.stop.set()
        recs = await asyncio.wait_for(run, 10)
    finally:
        d.close()
        await slow.stop()
    assert len(recs) == 3
    assert all(not r.ok and not r.error and r.done == 0 for r in recs)


async def test_an_engine_refusal_is_an_error_with_its_text() -> None:
    small = await _start("sglang", "both", time_scale=0.0)
    d = rc.FrontEnd(small.url)
    try:
        recs = await rc.closed_loop(items(1, length=5000), d, ctl(), concurrency=1)
    finally:
        d.close()
        await small.stop()
    assert recs[0].status == 400 and "HTTP 400" in recs[0].error


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_the_direct_baseline_does_each_engines_pd_handoff(engine: str) -> None:
    pre = await _start(engine, "prefill", time_scale=0.05)
    dec = await _start(engine, "decode", time_scale=0.05)
    d = rc.Direct(engine, prefill=[rc.PrefillAddr(pre.url, pre.bootstrap_port)], decode=[dec.url])
    try:
        recs = await rc.closed_loop(items(3, vllm_pd=engine == "vllm"), d, ctl(), concurrency=3)
    finally:
        d.close()
    try:
        for r in recs:
            assert r.ok, r.error
            assert r.prompt_tokens == r.input_length and r.completion_tokens == 5
        assert (await pre.stats())["kv_transfers_ok"] + (await dec.stats())["kv_transfers_ok"] >= 3
    finally:
        await pre.stop()
        await dec.stop()


async def test_a_front_end_is_sent_each_rows_index_as_its_request_id() -> None:
    """`replay-<row>` in `x-request-id`, what the gateway's access log names a request by: where
    each row went can be read from the log (warm-up requests, index -1, send none)."""
    from aiohttp import web

    seen: list[str | None] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("x-request-id"))
        await request.read()
        return web.Response(status=503, text="no")

    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    d = rc.FrontEnd(f"http://127.0.0.1:{port}")
    try:
        batch = items(2)
        warm = rc.Item(-1, batch[0].row, batch[0].body)
        for it in (*batch, warm):
            await d.send(it, rc.Record(index=it.index, input_length=1, output_length=1))
    finally:
        d.close()
        await runner.cleanup()
    assert seen == ["replay-0", "replay-1", None]
