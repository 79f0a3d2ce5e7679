"""``n > 1`` (several samples per prompt) on both engines: choice indexes, streams, usage,
greedy/seeded determinism, and SGLang 0.5.23's P/D with ``n > 1`` (its samples share a room and
hang; batches pair)."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import aiohttp
import pytest

from tests.emulator.conftest import Factory, sse_events

PROMPT = "Tell me a story about a fox"


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, str]:
    async with http.post(url, json=body) as r:
        return r.status, await r.text()


def texts(raw: str, stream: bool) -> list[str]:
    """Generated text per choice, in index order (stream deltas joined)."""
    if not stream:
        choices = json.loads(raw)["choices"]
        assert [c["index"] for c in choices] == list(range(len(choices)))
        return [c["message"]["content"] if "message" in c else c["text"] for c in choices]
    parts: dict[int, str] = {}
    for ev in sse_events(raw):
        if ev == "[DONE]":
            continue
        for c in json.loads(ev)["choices"]:
            piece = c["delta"].get("content") if "delta" in c else c["text"]
            parts[c["index"]] = parts.get(c["index"], "") + (piece or "")
    assert sorted(parts) == list(range(len(parts)))
    return [parts[i] for i in sorted(parts)]


def finishes(raw: str) -> dict[int, str]:
    out: dict[int, str] = {}
    for ev in sse_events(raw):
        if ev != "[DONE]":
            for c in json.loads(ev)["choices"]:
                if c.get("finish_reason"):
                    out[c["index"]] = c["finish_reason"]
    return out


def usage_of(raw: str, stream: bool) -> dict[str, Any]:
    if not stream:
        return dict(json.loads(raw)["usage"])
    evs = [json.loads(e) for e in sse_events(raw) if e != "[DONE]"]
    return dict(next(e["usage"] for e in reversed(evs) if e.get("usage")))


def chat_body(n: int, stream: bool, **kw: Any) -> dict[str, Any]:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 8,
        "n": n,
        "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
    }
    return body | kw


async def sglang_pd(
    http: aiohttp.ClientSession, p: Any, d: Any, path: str, body: dict[str, Any]
) -> tuple[int, str]:
    b = body | {
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": p.bootstrap_port,
        "bootstrap_room": random.getrandbits(62),
    }
    (ps, ptext), (ds, dtext) = await asyncio.gather(post(http, p.url + path, b), post(http, d.url + path, b))
    assert ps == 200, ptext
    return ds, dtext


@pytest.mark.parametrize("stream", [False, True])
async def test_sglang_chat_n_colocated(emu: Factory, http: aiohttp.ClientSession, stream: bool) -> None:
    col = await emu("sglang", "both")
    path = "/v1/chat/completions"
    # greedy: every sample is the greedy answer
    greedy = chat_body(3, stream, temperature=0)
    s, ref = await post(http, col.url + path, greedy)
    assert s == 200, ref
    want = texts(ref, stream)
    assert len(want) == 3 and want[0] and len(set(want)) == 1
    _, single = await post(http, col.url + path, chat_body(1, False, temperature=0))
    assert texts(single, False) == want[:1]
    u = usage_of(ref, stream)
    assert u["completion_tokens"] == 24 and u["prompt_tokens"] == usage_of(single, False)["prompt_tokens"]
    if stream:
        assert finishes(ref) == {0: "length", 1: "length", 2: "length"}
    # seeded sampling: samples differ, reproducible; sample j is the n=1 request seeded seed + j
    seeded = chat_body(3, stream, temperature=0.8, seed=1234)
    _, ref2 = await post(http, col.url + path, seeded)
    _, again = await post(http, col.url + path, seeded)
    want2 = texts(ref2, stream)
    assert len(set(want2)) == 3 and want2 != want
    assert texts(again, stream) == want2
    for j in range(3):
        _, one = await post(http, col.url + path, chat_body(1, False, temperature=0.8, seed=1234 + j))
        assert texts(one, False) == [want2[j]]


async def test_sglang_pd_n_samples_share_a_room_and_hang(emu: Factory, http: aiohttp.ClientSession) -> None:
    """SGLang 0.5.23: every sample of an n > 1 request keeps its prompt's room, a room transfers
    once, and the other samples' decodes wait out their timeout (sglang PRs #26486, #30723). One
    request per sample, each with its own room, pairs."""
    p = await emu("sglang", "prefill", waiting_timeout_s=1.0)
    d = await emu("sglang", "decode", waiting_timeout_s=1.0)
    path = "/v1/chat/completions"
    b = chat_body(3, False, temperature=0) | {
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": p.bootstrap_port,
        "bootstrap_room": random.getrandbits(62),
    }
    _, (ds, dtext) = await asyncio.gather(post(http, p.url + path, b), post(http, d.url + path, b))
    assert ds == 500 and "KVPoll.WaitingForInput" in dtext, dtext
    assert (await d.stats())["kv_transfers_ok"] == 1  # one sample got the room's KV
    for _ in range(3):
        s, got = await sglang_pd(http, p, d, path, chat_body(1, False, temperature=0))
        assert s == 200, got
    assert (await d.stats())["kv_transfers_ok"] == 4


@pytest.mark.parametrize("stream", [False, True])
async def test_sglang_completions_batch_times_n(
    emu: Factory, http: aiohttp.ClientSession, stream: bool
) -> None:
    col = await emu("sglang", "both")
    p = await emu("sglang", "prefill")
    d = await emu("sglang", "decode")
    prompts = ["alpha beta", "gamma delta epsilon"]
    body = {
        "model": "m",
        "prompt": prompts,
        "max_tokens": 5,
        "n": 2,
        "temperature": 0.7,
        "seed": 7,
        "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
    }
    s, got = await post(http, col.url + "/v1/completions", body)
    assert s == 200, got
    want = texts(got, stream)
    assert len(want) == 4
    # choice k = prompt_index * n + sample_index: sample 0 of each prompt is its n=1 answer
    for i, prompt in enumerate(prompts):
        _, one = await post(
            http, col.url + "/v1/completions", body | {"prompt": prompt, "n": 1, "stream": False}
        )
        assert texts(one, False) == [want[2 * i]]
    assert want[0] != want[1] and want[2] != want[3]
    u = usage_of(got, stream)
    assert u["completion_tokens"] == 20
    assert u["prompt_tokens"] == sum(len(x) + 1 for x in prompts)  # counted once per prompt
    # a batch (n = 1) pairs in P/D: element i gets room + i on both sides
    s, pd = await sglang_pd(http, p, d, "/v1/completions", body | {"n": 1})
    assert s == 200, pd
    assert texts(pd, stream) == [want[0], want[2]]
    assert (await d.stats())["kv_transfers_ok"] == 2


@pytest.mark.parametrize("stream", [False, True])
async def test_sglang_generate_sampling_n(emu: Factory, http: aiohttp.ClientSession, stream: bool) -> None:
    col = await emu("sglang", "both")
    body = {
        "text": PROMPT,
        "stream": stream,
        "sampling_params": {"temperature": 0, "max_new_tokens": 6, "n": 3},
    }

    def outputs(raw: str) -> list[list[int]]:
        if not stream:
            data = json.loads(raw)
            assert isinstance(data, list)  # a single prompt with n > 1 becomes a batch
            return [o["output_ids"] for o in data]
        last: dict[int, list[int]] = {}
        for ev in sse_events(raw):
            if ev != "[DONE]":
                o = json.loads(ev)
                last[o["index"]] = o["output_ids"]
        return [last[i] for i in sorted(last)]

    s, ref = await post(http, col.url + "/generate", body)
    assert s == 200, ref
    want = outputs(ref)
    assert len(want) == 3 and len(want[0]) == 6 and want[0] == want[1] == want[2]


async def test_sglang_bad_n(emu: Factory, http: aiohttp.ClientSession) -> None:
    col = await emu("sglang", "both")
    s, _ = await post(http, col.url + "/v1/chat/completions", chat_body(0, False))
    assert s == 400


@pytest.mark.parametrize("role", ["both", "decode"])
@pytest.mark.parametrize("stream", [False, True])
async def test_vllm_chat_n(emu: Factory, http: aiohttp.ClientSession, stream: bool, role: str) -> None:
    v = await emu("vllm", role)
    path = "/v1/chat/completions"
    # vLLM refuses n > 1 with greedy sampling (SamplingParams._verify_greedy_sampling)
    s, raw = await post(http, v.url + path, chat_body(3, stream, temperature=0))
    assert s == 400 and "n must be 1 when using greedy sampling, got 3." in raw, raw
    seeded = chat_body(3, stream, temperature=1.0, seed=42)
    s, a = await post(http, v.url + path, seeded)
    assert s == 200, a
    _, b = await post(http, v.url + path, seeded)
    sa = texts(a, stream)
    assert len(set(sa)) == 3 and sa == texts(b, stream)
    # sample j of a seeded n-request is the n=1 request seeded seed + j
    for j in range(3):
        _, one = await post(http, v.url + path, chat_body(1, False, temperature=1.0, seed=42 + j))
        assert texts(one, False) == [sa[j]]
        if j == 0:
            single = one
    u = usage_of(a, stream)
    assert u["completion_tokens"] == 24 and u["prompt_tokens"] == usage_of(single, False)["prompt_tokens"]
    if stream:
        assert finishes(a) == {0: "length", 1: "length", 2: "length"}
        roles = [
            c["index"]
            for e in sse_events(a)
            if e != "[DONE]"
            for c in json.loads(e)["choices"]
            if c["delta"].get("role") == "assistant"
        ]
        assert roles == [0, 1, 2]


@pytest.mark.parametrize("stream", [False, True])
async def test_vllm_completions_batch_times_n(
    emu: Factory, http: aiohttp.ClientSession, stream: bool
) -> None:
    v = await emu("vllm", "both")
    prompts = ["alpha beta", "gamma delta epsilon", "zeta"]
    body = {
        "model": "m",
        "prompt": prompts,
        "max_tokens": 4,
        "n": 2,
        "temperature": 0.9,
        "seed": 3,
        "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
    }
    s, raw = await post(http, v.url + "/v1/completions", body)
    assert s == 200, raw
    got = texts(raw, stream)
    assert len(got) == 6
    for i, prompt in enumerate(prompts):
        for j in range(2):
            _, one = await post(
                http,
                v.url + "/v1/completions",
                body | {"prompt": prompt, "n": 1, "seed": 3 + j, "stream": False, "stream_options": None},
            )
            assert got[2 * i + j] == texts(one, False)[0]
    u = usage_of(raw, stream)
    assert u["completion_tokens"] == 24 and u["prompt_tokens"] == sum(len(x) + 1 for x in prompts)
    if stream:
        assert finishes(raw) == dict.fromkeys(range(6), "length")
    s, _ = await post(http, v.url + "/v1/completions", body | {"n": 0})
    assert s == 400
    s, raw = await post(http, v.url + "/v1/completions", body | {"temperature": 0})
    assert s == 400 and "greedy sampling" in raw
