"""Rids on the emulated SGLang, as SGLang 0.5.23 treats them (emulator/README.md):

- a request naming a rid another request in flight holds is refused ("Duplicate request ID
  detected: <rid>", tokenizer_manager.py:3832-3836), as each route answers a ValueError raised
  inside `generate_request`; so are rids repeated within one request (io_struct.py:390-397);
- `/abort_request` is ignored unless a request holds exactly the rid named, and then aborts every
  request whose rid starts with it (scheduler.py:5677, 5688); a client that goes away aborts its
  rids the same way (`_release_req_states_on_failure`);
- a streamed `/generate` answer aborts its rids 2 s after it ends, should a request still hold one
  (`create_abort_task`);
- a scalar rid on a batch names its items `rid_0`, `rid_1`, ... (`_normalize_rid`)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest

from tests.emulator.conftest import Factory, sse_events


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, str]:
    async with http.post(url, json=body) as r:
        return r.status, await r.text()


def long_generate(rid: str, tokens: int = 3000) -> dict[str, Any]:
    return {"text": "x", "rid": rid, "sampling_params": {"max_new_tokens": tokens}}


async def running(s: Any, n: int) -> None:
    for _ in range(200):
        if (await s.stats())["running"] == n:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not {n} running: {await s.stats()}")


def finish(text: str) -> str:
    return str(json.loads(text)["meta_info"]["finish_reason"]["type"])


async def test_a_rid_in_flight_is_refused_on_every_route(emu: Factory, http: aiohttp.ClientSession) -> None:
    s = await emu("sglang", "both", time_scale=1.0)
    holder = asyncio.ensure_future(post(http, s.url + "/generate", long_generate("dup", 150)))
    await running(s, 1)
    msg = "Duplicate request ID detected: dup"
    st, text = await post(http, s.url + "/generate", {"text": "y", "rid": "dup"})
    assert (st, json.loads(text)) == (400, {"error": {"message": msg}})
    for path, body in (
        ("/v1/completions", {"prompt": "y", "rid": "dup", "max_tokens": 3}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y"}], "rid": "dup"}),
    ):
        for stream in (False, True):  # the stream's first chunk is awaited first: a 400 either way
            st, text = await post(http, s.url + path, {**body, "stream": stream})
            assert st == 400 and json.loads(text) == {
                "object": "error",
                "message": msg,
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            }
    st, text = await holder
    assert st == 200 and finish(text) == "length"  # the refusals cost the holder nothing
    # the rid is free again once its request has ended
    st, text = await post(
        http, s.url + "/generate", {"text": "y", "rid": "dup", "sampling_params": {"max_new_tokens": 2}}
    )
    assert st == 200 and json.loads(text)["meta_info"]["id"] == "dup"


async def test_a_refused_streamed_generate_aborts_the_holder_two_seconds_later(
    emu: Factory, http: aiohttp.ClientSession
) -> None:
    s = await emu("sglang", "both", time_scale=1.0)
    holder = asyncio.ensure_future(post(http, s.url + "/generate", long_generate("dup")))
    await running(s, 1)
    st, text = await post(http, s.url + "/generate", {"text": "y", "rid": "dup", "stream": True})
    t0 = time.monotonic()
    assert st == 200
    events = sse_events(text)
    assert json.loads(events[0]) == {
        "error": {
            "message": "Duplicate request ID detected: dup",
            "type": "invalid_request_error",
            "code": 400,
            "retryable": False,
        }
    }
    assert events[1:] == ["[DONE]"]
    st, text = await asyncio.wait_for(holder, 10)
    assert st == 200 and finish(text) == "abort" and 1.5 < time.monotonic() - t0 < 5


async def test_rids_repeated_within_a_request_and_a_batch_s_scalar_rid(
    emu: Factory, http: aiohttp.ClientSession
) -> None:
    s = await emu("sglang", "both")
    st, text = await post(http, s.url + "/generate", {"text": ["a", "b"], "rid": ["r", "r"]})
    assert (st, json.loads(text)) == (
        400,
        {"error": {"message": "Duplicate request IDs detected within the request: ['r']"}},
    )
    st, text = await post(
        http, s.url + "/generate", {"text": ["a", "b"], "rid": "b", "sampling_params": {"max_new_tokens": 2}}
    )
    assert st == 200 and [o["meta_info"]["id"] for o in json.loads(text)] == ["b_0", "b_1"]


async def test_an_abort_reaches_every_rid_that_extends_the_one_named(
    emu: Factory, http: aiohttp.ClientSession
) -> None:
    s = await emu("sglang", "both", time_scale=1.0)
    tasks = {
        rid: asyncio.ensure_future(post(http, s.url + "/generate", long_generate(rid)))
        for rid in ("r1", "r12", "r2")
    }
    await running(s, 3)
    async with http.post(s.url + "/abort_request", json={"rid": "r"}) as r:  # held by nobody: ignored
        assert r.status == 200
    await asyncio.sleep(0.1)
    assert (await s.stats())["running"] == 3
    async with http.post(s.url + "/abort_request", json={"rid": "r1"}) as r:
        assert r.status == 200
    for rid in ("r1", "r12"):
        st, text = await asyncio.wait_for(tasks[rid], 5)
        assert st == 200 and finish(text) == "abort", rid
    await asyncio.sleep(0.1)
    assert not tasks["r2"].done()
    async with http.post(s.url + "/abort_request", json={"rid": "r2"}) as r:
        assert r.status == 200
    st, text = await asyncio.wait_for(tasks["r2"], 5)
    assert finish(text) == "abort"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_gone_aborts_the_rids_that_extend_its_own(
    emu: Factory, http: aiohttp.ClientSession, stream: bool
) -> None:
    s = await emu("sglang", "both", time_scale=1.0)
    other = asyncio.ensure_future(post(http, s.url + "/generate", long_generate("c12", 300)))
    bystander = asyncio.ensure_future(post(http, s.url + "/generate", long_generate("d1", 150)))
    gone = asyncio.ensure_future(post(http, s.url + "/generate", {**long_generate("c1"), "stream": stream}))
    await running(s, 3)
    gone.cancel()  # the client of "c1" hangs up
    st, text = await asyncio.wait_for(other, 5)
    assert st == 200 and finish(text) == "abort"
    st, text = await asyncio.wait_for(bystander, 10)
    assert st == 200 and finish(text) == "length"


async def test_continuous_usage_stats_gives_each_chunk_its_usage(
    emu: Factory, http: aiohttp.ClientSession
) -> None:
    """SGLang's should_include_usage (entrypoints/openai/utils.py:250-264): continuous_usage_stats
    alone puts the counts so far on every completions chunk and every chat content chunk; only
    the final usage-only chunk needs include_usage."""
    s = await emu("sglang", "both")
    for path, body in (
        ("/v1/completions", {"prompt": "y", "max_tokens": 3}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y"}], "max_tokens": 3}),
    ):
        for include in (False, True):
            opts = {"continuous_usage_stats": True, "include_usage": include}
            st, text = await post(http, s.url + path, {**body, "stream": True, "stream_options": opts})
            assert st == 200
            events = [json.loads(e) for e in sse_events(text)[:-1]]
            final = [e for e in events if e["choices"] == []]
            assert len(final) == int(include)
            chunks = [e for e in events if e["choices"]]
            if path == "/v1/chat/completions":  # the role and finish chunks carry none
                assert "usage" not in chunks[0] and "usage" not in chunks[-1]
                chunks = chunks[1:-1]
            counts = [e["usage"]["completion_tokens"] for e in chunks]
            assert counts == sorted(counts) and counts[-1] == 3 and all(counts)
            assert all(
                e["usage"]["total_tokens"] == e["usage"]["prompt_tokens"] + e["usage"]["completion_tokens"]
                for e in chunks
            )
