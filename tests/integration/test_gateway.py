"""The gateway end to end on loopback: every endpoint, both engines, stream and not, the openai client."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict
from openai import AsyncOpenAI, BadRequestError, NotFoundError

from tests.emulator.conftest import drawn_instead
from tests.integration.conftest import Cluster, build_cluster, stop_cluster

PROMPTS = ["Hello", "The capital of France is", "Once upon a time, in a land far away, " * 8, "x"]


async def post(
    url: str, body: dict[str, Any] | bytes, headers: dict[str, str] | None = None
) -> tuple[int, CIMultiDict[str], bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    h = {"content-type": "application/json", **(headers or {})}
    async with aiohttp.ClientSession() as s, s.post(url, data=data, headers=h) as r:
        return r.status, CIMultiDict(r.headers), await r.read()


def sse_events(raw: bytes) -> list[Any]:
    out = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def generated(route: str, raw: bytes, stream: bool) -> list[str]:
    """The generated text per choice/prompt, streaming deltas joined."""
    if not stream:
        data = json.loads(raw)
        if route == "/generate":
            return [d["text"] for d in data] if isinstance(data, list) else [data["text"]]
        key = "message" if route.endswith("chat/completions") else None
        return [
            (c["message"]["content"] if key else c["text"])
            for c in sorted(data["choices"], key=lambda c: c["index"])
        ]
    events = [e for e in sse_events(raw) if e != "[DONE]"]
    if route == "/generate":  # cumulative text per event; last one per index wins
        last: dict[int, str] = {}
        for e in events:
            last[e.get("index", 0)] = e["text"]
        return [last[i] for i in sorted(last)]
    parts: dict[int, str] = {}
    for e in events:
        for c in e.get("choices", []):
            piece = c.get("delta", {}).get("content") if "delta" in c else c.get("text")
            parts[c["index"]] = parts.get(c["index"], "") + (piece or "")
    return [parts[i] for i in sorted(parts)]


def body_for(route: str, model: str, prompt: str, stream: bool, max_tokens: int = 12) -> dict[str, Any]:
    if route == "/generate":
        return {
            "model": model,
            "text": prompt,
            "stream": stream,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_tokens},
        }
    if route == "/v1/chat/completions":
        return {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0,
            "max_tokens": max_tokens,
            "stream": stream,
        }
    return {"model": model, "prompt": prompt, "temperature": 0, "max_tokens": max_tokens, "stream": stream}


CASES = [
    ("m-sglang", "/generate"),
    ("m-sglang", "/v1/completions"),
    ("m-sglang", "/v1/chat/completions"),
    ("m-vllm", "/v1/completions"),
    ("m-vllm", "/v1/chat/completions"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("model", "route"), CASES)
async def test_pd_output_equals_colocated_reference(
    cluster: Cluster, model: str, route: str, stream: bool
) -> None:
    for prompt in PROMPTS:
        body = body_for(route, model, prompt, stream)
        status, headers, raw = await post(cluster.url + route, body)
        assert status == 200, raw
        ref_status, _, ref = await post(cluster.reference[model].url + route, body)
        assert ref_status == 200
        got, want = generated(route, raw, stream), generated(route, ref, stream)
        assert got == want and all(want), (prompt, got, want)
        if stream:
            assert headers["Content-Type"].startswith("text/event-stream")
            if route != "/generate" or model == "m-sglang":
                assert sse_events(raw)[-1] == "[DONE]"
    stats_p = await cluster.emulators["sgl-p" if model == "m-sglang" else "vllm-p"].stats()
    stats_d = await cluster.emulators["sgl-d" if model == "m-sglang" else "vllm-d"].stats()
    # every answer came through a real KV handoff, none recomputed on the decode
    assert stats_p["kv_transfers_ok"] + stats_d["kv_transfers_ok"] >= len(PROMPTS), (stats_p, stats_d)
    assert stats_p["kv_transfers_failed"] + stats_d["kv_transfers_failed"] == 0
    assert stats_d["completed"] >= len(PROMPTS)


async def test_kv_really_moved(cluster: Cluster) -> None:
    before_p = await cluster.emulators["vllm-p"].stats()
    before_d = await cluster.emulators["vllm-d"].stats()
    s, _, raw = await post(
        cluster.url + "/v1/completions", body_for("/v1/completions", "m-vllm", "abc def", False)
    )
    assert s == 200, raw
    after_p = await cluster.emulators["vllm-p"].stats()
    after_d = await cluster.emulators["vllm-d"].stats()
    assert after_p["completed"] == before_p["completed"] + 1
    assert (
        after_d["kv_transfers_ok"] + after_p["kv_transfers_ok"]
        > before_d["kv_transfers_ok"] + before_p["kv_transfers_ok"]
    )


async def test_colocated_worker_and_models_listing(cluster: Cluster) -> None:
    s, _, raw = await post(
        cluster.url + "/v1/completions", body_for("/v1/completions", "m-colocated", "hi", False)
    )
    assert s == 200, raw
    async with aiohttp.ClientSession() as sess:
        async with sess.get(cluster.url + "/v1/models") as r:
            models = await r.json()
        ids = {m["id"]: m for m in models["data"]}
        assert set(ids) == {"m-sglang", "m-vllm", "m-colocated"}
        assert all(m["max_model_len"] for m in ids.values())
        assert ids["m-sglang"]["routes"] == ["disaggregated:sglang"]
        async with sess.get(cluster.url + "/health") as r:
            assert r.status == 200
        async with sess.get(cluster.url + "/readiness") as r:
            assert r.status == 200 and (await r.json())["ready"] is True
        async with sess.get(cluster.url + "/metrics") as r:
            text = await r.text()
        assert "pdgw_requests_total" in text and "pdgw_worker_inflight" in text


async def test_openai_client_models_list_and_retrieve(cluster: Cluster) -> None:
    """`models.retrieve` is `GET /v1/models/{id}`: the same card as the listing, or a 404 in
    OpenAI's shape naming the model (ids may hold slashes and escapes)."""
    client = AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    try:
        listed = {m.id: m for m in (await client.models.list()).data}
        assert set(listed) == {"m-sglang", "m-vllm", "m-colocated"}
        for name in listed:
            got = await client.models.retrieve(name)
            assert got.id == name and got.object == "model"
            assert got.model_dump() == listed[name].model_dump()
        with pytest.raises(NotFoundError) as ei:
            await client.models.retrieve("org/no-such-model")
        err = ei.value.body
        assert isinstance(err, dict) and err["code"] == "model_not_found" and err["param"] == "model"
        assert "'org/no-such-model'" in err["message"]
    finally:
        await client.close()
    s, _, raw = await post(cluster.url + "/v1/models/m-vllm", {})
    assert s == 405 and json.loads(raw)["error"]["code"] == "method_not_allowed"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("model", ["m-sglang", "m-vllm", "m-colocated"])
async def test_openai_client_chat_and_completions(cluster: Cluster, model: str, stream: bool) -> None:
    client = AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    try:
        if stream:
            chunks = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "Say hi"}],
                max_tokens=8,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            text, usage = "", None
            async for ch in chunks:
                if ch.choices:
                    text += ch.choices[0].delta.content or ""
                if ch.usage:
                    usage = ch.usage
            assert text and usage is not None and usage.completion_tokens == 8
            stream_c = await client.completions.create(
                model=model, prompt="abc", max_tokens=5, temperature=0, stream=True
            )
            ctext = "".join([c.choices[0].text async for c in stream_c if c.choices])
            assert ctext
        else:
            r = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8, temperature=0
            )
            assert r.choices[0].message.content and r.usage and r.usage.completion_tokens == 8
            c = await client.completions.create(model=model, prompt="abc", max_tokens=5, temperature=0)
            assert c.choices[0].text
    finally:
        await client.close()


async def test_openai_client_errors(cluster: Cluster) -> None:
    client = AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    try:
        with pytest.raises(NotFoundError) as nf:
            await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
        assert "nope" in str(nf.value)
        with pytest.raises(BadRequestError):
            await client.completions.create(model="m-vllm", prompt="x", max_tokens=-1)
    finally:
        await client.close()


@pytest.mark.parametrize("model", ["m-sglang", "m-vllm"])
async def test_batches_and_n(cluster: Cluster, model: str) -> None:
    body = {
        "model": model,
        "prompt": ["one", "two two", "three three three"],
        "max_tokens": 6,
        "temperature": 0,
    }
    s, _, raw = await post(cluster.url + "/v1/completions", body)
    assert s == 200, raw
    _, _, ref = await post(cluster.reference[model].url + "/v1/completions", body)
    got = generated("/v1/completions", raw, False)
    assert len(got) == 3 and got == generated("/v1/completions", ref, False)
    body_n = body_for("/v1/chat/completions", model, "pick", False) | {"n": 3}
    if model == "m-vllm":
        # vLLM refuses n > 1 with greedy sampling: the engine's 400 reaches the client as it is
        s, _, raw = await post(cluster.url + "/v1/chat/completions", body_n)
        assert s == 400 and b"n must be 1 when using greedy sampling" in raw, raw
        body_n |= {"temperature": 0.7, "seed": 11}
    s, _, raw = await post(cluster.url + "/v1/chat/completions", body_n)
    assert s == 200, raw
    _, _, ref = await post(cluster.reference[model].url + "/v1/chat/completions", body_n)
    got = generated("/v1/chat/completions", raw, False)
    assert len(got) == 3 and got == generated("/v1/chat/completions", ref, False)


def _n_body(route: str, stream: bool, n: int, seed: int | None) -> dict[str, Any]:
    body = body_for(route, "m-sglang", "pick a card, any card", stream, max_tokens=6)
    sampled = {"temperature": 0.8} if seed is not None else {}
    if route == "/generate":
        body["sampling_params"] |= {"n": n, **sampled}
        if seed is not None:
            body["sampling_params"]["sampling_seed"] = seed
        return body
    body |= {"n": n, **sampled}
    if seed is not None:
        body["seed"] = seed
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _usage(raw: bytes, stream: bool) -> Any:
    if not stream:
        return json.loads(raw).get("usage")
    return [e["usage"] for e in sse_events(raw) if e != "[DONE]" and e.get("usage")]


@pytest.mark.parametrize("seed", [None, 1234], ids=["greedy", "seeded"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/generate"])
async def test_sglang_pd_n_samples_split_and_merged(
    cluster: Cluster, route: str, stream: bool, seed: int | None
) -> None:
    """SGLang 0.5.23 hangs on n > 1 in P/D (its samples share a room; the emulator does the
    same): the gateway sends one handoff per sample and merges them into the answer a colocated
    server gives: same samples in the same order, usage counted as the engine counts it."""
    body = _n_body(route, stream, 3, seed)
    s, _, raw = await post(cluster.url + route, body)
    assert s == 200, raw
    _, _, ref = await post(cluster.reference["m-sglang"].url + route, body)
    got, want = generated(route, raw, stream), generated(route, ref, stream)
    assert len(got) == 3 and got == want
    assert (len(set(got)) == 1) == (seed is None)  # greedy samples agree, seeded ones differ
    if route != "/generate":
        assert _usage(raw, stream) == _usage(ref, stream)
    if stream:
        assert sse_events(raw).count("[DONE]") == 1 and sse_events(raw)[-1] == "[DONE]"
        if route != "/generate":  # one stream, one id (each sample's engine named its own)
            events = [e for e in sse_events(raw) if e != "[DONE]"]
            assert len({(e["id"], e["created"]) for e in events}) == 1
            finishes = {
                c["index"]: c["finish_reason"]
                for e in sse_events(raw)
                if e != "[DONE]"
                for c in e["choices"]
                if c.get("finish_reason")
            }
            assert finishes == {0: "length", 1: "length", 2: "length"}
    else:
        data = json.loads(raw)
        if route == "/generate":
            assert isinstance(data, list) and len(data) == 3
        else:
            assert [c["index"] for c in data["choices"]] == [0, 1, 2]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_sglang_pd_batch_times_n(cluster: Cluster, stream: bool) -> None:
    body = _n_body("/v1/completions", stream, 2, 7) | {"prompt": ["alpha beta", "gamma delta epsilon"]}
    s, _, raw = await post(cluster.url + "/v1/completions", body)
    assert s == 200, raw
    _, _, ref = await post(cluster.reference["m-sglang"].url + "/v1/completions", body)
    got = generated("/v1/completions", raw, stream)
    assert len(got) == 4 and got == generated("/v1/completions", ref, stream)
    assert _usage(raw, stream) == _usage(ref, stream)


async def test_sglang_generate_batch_and_logprobs(cluster: Cluster) -> None:
    ref = cluster.reference["m-sglang"].url
    batch = {
        "model": "m-sglang",
        "input_ids": [[1, 2, 3, 4], [5, 6, 7]],
        "sampling_params": {"temperature": 0, "max_new_tokens": 5},
    }
    s, _, raw = await post(cluster.url + "/generate", batch)
    assert s == 200, raw
    _, _, want = await post(ref + "/generate", batch)
    assert [d["output_ids"] for d in json.loads(raw)] == [d["output_ids"] for d in json.loads(want)]
    lp = {
        "model": "m-sglang",
        "text": "The quick brown fox",
        "return_logprob": True,
        "logprob_start_len": 0,
        "sampling_params": {"temperature": 0, "max_new_tokens": 4},
    }
    s, _, raw = await post(cluster.url + "/generate", lp)
    assert s == 200, raw
    _, _, want = await post(ref + "/generate", lp)
    got_meta, want_meta = json.loads(raw)["meta_info"], json.loads(want)["meta_info"]
    assert got_meta["input_token_logprobs"] == want_meta["input_token_logprobs"]
    assert json.loads(raw)["output_ids"] == json.loads(want)["output_ids"]


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_sglang_generate_sampling_params_per_prompt(cluster: Cluster, stream: bool, n: int) -> None:
    """SGLang's `/generate` takes `sampling_params` as a list, one object per prompt of a batch:
    passed through P/D (and split per sample when n > 1), each prompt gets its own limits."""
    body = {
        "model": "m-sglang",
        "text": ["alpha beta", "gamma delta epsilon", "zeta"],
        "stream": stream,
        "sampling_params": [
            {"temperature": 0, "max_new_tokens": 2, "n": n},
            {"temperature": 0, "max_new_tokens": 7, "n": n},
            {"temperature": 0.9, "sampling_seed": 11, "max_new_tokens": 4, "n": n},
        ],
    }
    s, _, raw = await post(cluster.url + "/generate", body)
    assert s == 200, raw
    _, _, ref = await post(cluster.reference["m-sglang"].url + "/generate", body)
    got = generated("/generate", raw, stream)
    assert len(got) == 3 * n and got == generated("/generate", ref, stream)
    if not stream:
        lengths = [d["meta_info"]["completion_tokens"] for d in json.loads(raw)]
        assert lengths == [x for x in (2, 7, 4) for _ in range(n)]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"text": "one prompt", "sampling_params": [{"max_new_tokens": 2}]}, "needs a batch"),
        ({"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 2}]}, "1 entries for a batch of 2"),
        (
            {"input_ids": [[1, 2], [3]], "sampling_params": [{"n": 2}, {"n": 3}]},
            "'n' must be the same",
        ),
        ({"text": ["a", "b"], "sampling_params": [{"max_new_tokens": "x"}, {}]}, "Expected `int"),
    ],
)
async def test_generate_sampling_params_list_errors(
    cluster: Cluster, body: dict[str, Any], needle: str
) -> None:
    s, _, raw = await post(cluster.url + "/generate", {"model": "m-sglang", **body})
    assert s == 400, raw
    err = json.loads(raw)["error"]
    assert needle in err["message"] and err["param"] == "sampling_params", err


async def test_generate_on_a_model_without_sglang_workers_is_a_clear_400(cluster: Cluster) -> None:
    """/generate is SGLang's own route: a model served only by vLLM workers gets a 400 that says
    so (not the engine's 404 passed on as a failed prefill), and no engine sees the request."""
    before = (await cluster.emulators["vllm-p"].stats())["received"]
    s, _, raw = await post(
        cluster.url + "/generate", {"model": "m-vllm", "text": "hi", "sampling_params": {"max_new_tokens": 2}}
    )
    assert s == 400, raw
    err = json.loads(raw)["error"]
    assert (
        err["param"] == "model" and "vllm workers" in err["message"] and "/v1/completions" in err["message"]
    )
    assert (await cluster.emulators["vllm-p"].stats())["received"] == before


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/completions", {"model": "m-vllm", "prompt": "x", "max_tokens": 10**7}, "max_tokens"),
        (
            "/v1/chat/completions",
            {"model": "m-sglang", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**7},
            "max_tokens",
        ),
        (
            "/generate",
            {"model": "m-sglang", "text": "x", "sampling_params": {"max_new_tokens": 10**7}},
            "max_new_tokens",
        ),
        ("/v1/completions", {"model": "m-vllm", "prompt": list(range(5, 9000)), "max_tokens": 4}, "prompt"),
        (
            "/generate",
            {"model": "m-sglang", "input_ids": [5] * 9000, "sampling_params": {"max_new_tokens": 4}},
            "input_ids",
        ),
    ],
)
async def test_context_length_errors_name_what_is_too_large(
    cluster: Cluster, route: str, body: dict[str, Any], param: str
) -> None:
    s, _, raw = await post(cluster.url + route, body)
    assert s == 400, raw
    err = json.loads(raw)["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == param, err
    assert "at least 0" not in err["message"]


def _logprobs_of(route: str, raw: bytes, stream: bool) -> list[Any]:
    """Per choice 0: the (token, logprob, top alternatives) triples, streamed chunks joined."""
    chat = route.endswith("chat/completions")
    objs = [json.loads(raw)] if not stream else [e for e in sse_events(raw) if e != "[DONE]"]
    out: list[Any] = []
    for o in objs:
        for c in o.get("choices", []):
            lp = c.get("logprobs")
            if c.get("index", 0) != 0 or not lp:
                continue
            if chat:
                out += [
                    (e["token"], e["logprob"], [t["token"] for t in e["top_logprobs"]]) for e in lp["content"]
                ]
            else:
                out += list(
                    zip(
                        lp["tokens"],
                        lp["token_logprobs"],
                        [sorted(t) for t in lp["top_logprobs"]],
                        strict=True,
                    )
                )
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("model", "route"), [c for c in CASES if c[1] != "/generate"])
async def test_openai_logprobs_through_pd_equal_colocated(
    cluster: Cluster, model: str, route: str, stream: bool
) -> None:
    body = body_for(route, model, "The capital of France is", stream, max_tokens=6)
    if route == "/v1/chat/completions":
        body |= {"logprobs": True, "top_logprobs": 3}
    else:
        body |= {"logprobs": 2}
    s, _, raw = await post(cluster.url + route, body)
    assert s == 200, raw
    _, _, ref = await post(cluster.reference[model].url + route, body)
    got, want = _logprobs_of(route, raw, stream), _logprobs_of(route, ref, stream)
    assert len(got) == 6 and got == want
    assert all(lp < 0 and len(top) == (3 if "chat" in route else 2) for _, lp, top in got)
    assert "".join(t for t, _, _ in got) == generated(route, raw, stream)[0]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("model", "route"), CASES)
async def test_stop_strings_through_pd_equal_colocated(
    cluster: Cluster, model: str, route: str, stream: bool
) -> None:
    """An answer cut short by a stop string (fewer tokens than asked, finish "stop") passes the
    decode guard and equals the colocated server's, on every route of both engines."""
    body = body_for(route, model, "Once upon a time", False, max_tokens=30)
    _, _, raw = await post(cluster.reference[model].url + route, body)
    full = generated(route, raw, False)[0]
    stop = full[8:10]
    if route == "/generate":
        body["sampling_params"]["stop"] = [stop]
    else:
        body["stop"] = [stop]
    body["stream"] = stream
    s, _, raw = await post(cluster.url + route, body)
    assert s == 200, raw
    _, _, ref = await post(cluster.reference[model].url + route, body)
    got = generated(route, raw, stream)
    assert got == generated(route, ref, stream) == [full[: full.index(stop)]]
    if stream and route != "/generate":
        finishes = [
            c["finish_reason"]
            for e in sse_events(raw)
            if e != "[DONE]"
            for c in e["choices"]
            if c.get("finish_reason")
        ]
        assert finishes == ["stop"]
    text = cluster.gateway.metrics.render().decode()
    assert "pdgw_guard_failures_total{" not in text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("model", "route"), CASES)
async def test_min_tokens_reach_the_decode(cluster: Cluster, model: str, route: str, stream: bool) -> None:
    """A minimum length (`min_tokens`, SGLang's `min_new_tokens`) keeps a stop token id from
    ending the answer early: it is masked, another token drawn in its place. The vLLM prefill
    gets it as 1 (its one token is drawn as the decode's first); the decode, which generates,
    must get it whole: the answer equals the colocated server's, which is longer than without it."""
    body = body_for(route, model, "Once upon a time", False, max_tokens=40)
    _, _, raw = await post(cluster.reference[model].url + route, body)
    full = generated(route, raw, False)[0]
    ch = max(sorted(set(full)), key=full.count)  # a character that recurs
    first = full.index(ch)
    nxt = full.index(ch, first + 1)
    params = body["sampling_params"] if route == "/generate" else body
    params["stop_token_ids"] = [ord(ch) + 3]  # the emulator's byte tokenizer: id = byte + 3
    params["min_new_tokens" if route == "/generate" else "min_tokens"] = first + 1
    body["stream"] = stream
    s, _, raw = await post(cluster.url + route, body)
    assert s == 200, raw
    _, _, ref = await post(cluster.reference[model].url + route, body)
    held = full[:first] + drawn_instead(ch) + full[first + 1 : nxt]
    assert generated(route, raw, stream) == generated(route, ref, stream) == [held]


@pytest.fixture
async def stop_first() -> AsyncIterator[Cluster]:
    c = await build_cluster(vllm_stop_checks_first=True)
    try:
        yield c
    finally:
        await stop_cluster(c)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("model", "route"), CASES)
@pytest.mark.parametrize("how", ["stop_string", "stop_id", "stop_id_held_by_min_tokens"])
async def test_a_prefill_that_stops_on_its_token_is_no_failure(
    stop_first: Cluster, model: str, route: str, stream: bool, how: str
) -> None:
    """A vLLM prefill whose one token is a stop token id ends "stop" on newer vLLM (its stop ids
    are judged before the length cap; the emulator's `--stop-checks-first`) and hands over no KV:
    vLLM's connectors do so only for a prefill capped by length, and it answers
    `kv_transfer_params: null`. That is no failure of the prefill: the decode computes the prompt
    itself, and the answer equals the colocated server's. With the client's `min_tokens` (which
    the prefill is sent as 1) the stop id is masked on both legs and another token drawn: the
    prefill does not stop, the answer goes on past it, as the colocated server's does. Neither a retry, a fallback, an upstream error nor a breaker
    verdict comes of it (it was a 502 verdict against the prefill, and six of them opened its
    breaker). A stop string is the front end's finding, after the length cap: the KV is handed
    over. SGLang's prefill hands over its KV and token whatever ended it."""
    cluster = stop_first
    body = body_for(route, model, "Once upon a time", False, max_tokens=20)
    _, _, raw = await post(cluster.reference[model].url + route, body)
    full = generated(route, raw, False)[0]
    params = body["sampling_params"] if route == "/generate" else body
    if how == "stop_string":
        params["stop"] = [full[0]]
        want = ""
    else:
        params["stop_token_ids"] = [ord(full[0]) + 3]  # the emulator's byte tokenizer: id = byte + 3
        want = ""
    if how == "stop_id_held_by_min_tokens":
        params["min_new_tokens" if route == "/generate" else "min_tokens"] = 1
        nxt = full.find(full[0], 1)  # its first token masked: another is drawn instead
        want = drawn_instead(full[0]) + (full[1:] if nxt < 0 else full[1:nxt])
    body["stream"] = stream
    for _ in range(6):
        s, _, raw = await post(cluster.url + route, body)
        assert s == 200, raw
        _, _, ref = await post(cluster.reference[model].url + route, body)
        assert generated(route, raw, stream) == generated(route, ref, stream) == [want]
    text = cluster.gateway.metrics.render().decode()
    for name in ("upstream_errors", "retries", "fallbacks", "guard_failures"):
        assert f"pdgw_{name}_total{{" not in text, name
    lines = text.splitlines()
    healthy = [ln for ln in lines if ln.startswith("pdgw_worker_healthy{")]
    assert healthy and all(ln.endswith(" 1.0") for ln in healthy), healthy
    assert all(ln.endswith(" 0.0") for ln in lines if ln.startswith("pdgw_pair_breaker_open{"))
    served = [ln for ln in lines if ln.startswith("pdgw_requests_total{")]
    assert served and served == [
        ln for ln in served if 'outcome="ok"' in ln and 'plan="disaggregated"' in ln
    ], served


async def test_request_ids_are_honoured_echoed_and_generated(cluster: Cluster) -> None:
    s, h, raw = await post(
        cluster.url + "/v1/completions",
        body_for("/v1/completions", "m-vllm", "id test", False),
        headers={"X-Request-Id": "client-id-123"},
    )
    assert s == 200 and h["X-Request-Id"] == "client-id-123"
    assert json.loads(raw)["id"] == "cmpl-client-id-123"  # the engine saw the client's id: not overwritten
    s, h, _ = await post(cluster.url + "/v1/completions", body_for("/v1/completions", "m-sglang", "x", False))
    assert s == 200 and h["X-Request-Id"].startswith("gw-")
    s, h, _ = await post(
        cluster.url + "/v1/completions",
        body_for("/v1/completions", "m-sglang", "x", False),
        headers={"X-Correlation-Id": "corr-7"},
    )
    assert h["X-Request-Id"] == "corr-7"
    # an id outside 1-128 of [A-Za-z0-9._:-] (it goes into engine request names, logs and
    # headers) is replaced by one of the gateway's (docs/operations.md)
    for bad in ("trace id 1", "a,b", "YWJj+/de==", "x" * 129):
        s, h, _ = await post(
            cluster.url + "/v1/completions",
            body_for("/v1/completions", "m-vllm", "x", False),
            headers={"X-Request-Id": bad},
        )
        assert s == 200 and h["X-Request-Id"].startswith("gw-"), bad


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"model": "no-such-model", "prompt": "x"}, 404, "model_not_found"),  # the policy's verdict
        ({"model": "m-sglang", "prompt": [1] * 9000, "max_tokens": 4}, 400, "context_length_exceeded"),
        ({"model": "m-vllm", "prompt": "x", "max_tokens": 4, "temperature": -1}, 400, None),  # the engine's
    ],
)
async def test_errors_after_parsing_echo_the_request_id_too(
    cluster: Cluster, body: dict[str, Any], status: int, code: str | None
) -> None:
    """The id names failed requests as well as served ones (a client's support ticket quotes it)."""
    s, h, raw = await post(cluster.url + "/v1/completions", body, headers={"X-Request-Id": "err-id-9"})
    assert s == status, raw
    assert h.get("X-Request-Id") == "err-id-9", (dict(h), raw)
    if code is not None:
        assert json.loads(raw)["error"]["code"] == code


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/chat/completions", b"{not json", 400, None),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, 400, "model"),
        ("/v1/chat/completions", {"model": "m-vllm"}, 400, "messages"),
        ("/v1/chat/completions", {"model": "m-vllm", "messages": []}, 400, "messages"),
        # (pydantic takes "yes" but strips no bool string: test_lax_fields)
        ("/v1/completions", {"model": "m-vllm", "prompt": "x", "stream": " yes "}, 400, "stream"),
        ("/v1/completions", {"model": "m-vllm", "prompt": "x", "n": 0}, 400, "n"),
        ("/v1/completions", {"model": "no-such-model", "prompt": "x"}, 404, "model"),
        ("/v1/nothing", {"model": "m-vllm"}, 404, None),
        # shapes the engines' schemas refuse, every item checked (not only the first)
        ("/v1/chat/completions", {"model": "m-vllm", "messages": [1]}, 400, "messages"),
        ("/v1/chat/completions", {"model": "m-sglang", "messages": [{"content": "x"}]}, 400, "messages"),
        ("/v1/chat/completions", {"model": "m-vllm", "messages": "hi"}, 400, "messages"),
        ("/v1/completions", {"model": "m-vllm", "prompt": [1, "a"]}, 400, "prompt"),
        ("/v1/completions", {"model": "m-vllm", "prompt": ["a", 1]}, 400, "prompt"),
        ("/v1/completions", {"model": "m-sglang", "prompt": [[1], "a"]}, 400, "prompt"),
        ("/v1/completions", {"model": "m-sglang", "prompt": [1.5, 2]}, 400, "prompt"),
        ("/v1/completions", {"model": "m-vllm", "prompt": [["a"]]}, 400, "prompt"),
        ("/v1/completions", {"model": "m-vllm", "prompt": []}, 400, "prompt"),
        # an empty token-id prompt in a batch (the API probe: a 200 with random text on vLLM)
        ("/v1/completions", {"model": "m-vllm", "prompt": [[1], []]}, 400, "prompt"),
        ("/v1/completions", {"model": "m-colocated", "prompt": [[]]}, 400, "prompt"),
        ("/v1/completions", {"model": "m-sglang", "prompt": [["1"], []]}, 400, "prompt"),
        ("/generate", {"model": "m-sglang", "input_ids": [[3], []]}, 400, "input_ids"),
        ("/v1/completions", {"model": "m-vllm", "prompt": {"a": 1}}, 400, "prompt"),
        ("/generate", {"model": "m-sglang", "text": []}, 400, "text"),
        ("/generate", {"model": "m-sglang", "text": [1, 2]}, 400, "text"),
        ("/generate", {"model": "m-sglang", "input_ids": 5}, 400, "input_ids"),
        ("/generate", {"model": "m-sglang", "input_ids": "abc"}, 400, "input_ids"),
        ("/generate", {"model": "m-sglang", "input_ids": [1, -2]}, 400, "input_ids"),
        (
            "/v1/chat/completions",
            {"model": "m-vllm", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
            400,
            "max_tokens",  # vLLM's own words (SGLang reads the 0 as absent: test_lax_fields)
        ),
        (
            "/v1/chat/completions",
            {"model": "m-vllm", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1},
            400,
            "max_completion_tokens",
        ),
    ],
)
async def test_bad_requests_get_openai_shaped_errors(
    cluster: Cluster, path: str, body: Any, status: int, param: str | None
) -> None:
    s, h, raw = await post(cluster.url + path, body)
    assert s == status, raw
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    assert h["Content-Type"] == "application/json"


@pytest.mark.parametrize("model", ["m-sglang", "m-vllm"])
async def test_token_ids_in_pydantic_s_lax_spellings_are_token_ids(cluster: Cluster, model: str) -> None:
    """Both engines read a completions prompt with pydantic's lax mode: `true`, `2.0` and `"7"`
    are token ids 1, 2 and 7. The gateway takes them as the engines do (the bytes go as sent)."""
    for lax, plain in (([True, 2.0, "7", 5], [1, 2, 7, 5]), ([[3.0, "4"], [True]], [[3, 4], [1]])):
        body = {"model": model, "max_tokens": 5, "temperature": 0}
        s1, _, got = await post(cluster.url + "/v1/completions", {**body, "prompt": lax})
        s2, _, want = await post(cluster.reference[model].url + "/v1/completions", {**body, "prompt": plain})
        assert (s1, s2) == (200, 200), got
        texts = [[c["text"] for c in json.loads(r)["choices"]] for r in (got, want)]
        assert texts[0] == texts[1] and all(texts[0]), texts


async def test_a_null_prompt_field_is_an_absent_one(cluster: Cluster) -> None:
    """A client that serialises SGLang's GenerateReqInput sends the prompt form it does not use
    as null (`"text": null` beside `input_ids`); SGLang takes that, and so does the gateway."""
    body = {
        "model": "m-sglang",
        "input_ids": [5, 6, 7],
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
    }
    s, _, got = await post(cluster.url + "/generate", {**body, "text": None})
    _, _, want = await post(cluster.reference["m-sglang"].url + "/generate", body)
    assert s == 200, got
    assert json.loads(got)["output_ids"] == json.loads(want)["output_ids"]


async def test_wrong_method(cluster: Cluster) -> None:
    async with aiohttp.ClientSession() as s, s.get(cluster.url + "/v1/completions") as r:
        assert r.status == 405 and "error" in await r.json()


async def test_over_long_prompt_is_a_clear_4xx(cluster: Cluster) -> None:
    for model in ("m-sglang", "m-vllm"):
        body = body_for("/v1/completions", model, "z" * 200_000, False)
        s, _, raw = await post(cluster.url + "/v1/completions", body)
        assert 400 <= s < 500, raw
        assert json.loads(raw)["error"]["message"]
    for name in ("sgl-p", "sgl-d", "vllm-p", "vllm-d"):
        assert (await cluster.emulators[name].stats())["in_flight"] == 0


async def test_client_disconnect_mid_stream_stops_the_engines() -> None:
    from tests.integration.conftest import build_cluster, stop_cluster

    c = await build_cluster(time_scale=1.0)  # real delays: the stream is still running when we leave
    try:
        for model, names in (("m-sglang", ("sgl-p", "sgl-d")), ("m-vllm", ("vllm-p", "vllm-d"))):
            body = body_for("/v1/completions", model, "long story", True, max_tokens=2000)
            async with aiohttp.ClientSession() as s:
                async with s.post(c.url + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    await r.content.readany()
            for _ in range(100):
                stats = [await c.emulators[n].stats() for n in names]
                if all(st["in_flight"] == 0 for st in stats):
                    break
                await asyncio.sleep(0.02)
            assert all(st["in_flight"] == 0 for st in stats), stats
    finally:
        await stop_cluster(c)


async def test_sglang_streamed_logprobs_are_merged_like_colocated(cluster: Cluster) -> None:
    body = {
        "model": "m-sglang",
        "text": "The quick brown fox",
        "return_logprob": True,
        "logprob_start_len": 0,
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 3},
    }
    s, _, raw = await post(cluster.url + "/generate", body)
    assert s == 200
    _, _, want = await post(cluster.reference["m-sglang"].url + "/generate", body)
    got_ev = [e for e in sse_events(raw) if e != "[DONE]"]
    want_ev = [e for e in sse_events(want) if e != "[DONE]"]
    assert len(got_ev) == len(want_ev) >= 3
    for g, w in zip(got_ev, want_ev, strict=True):
        assert g["meta_info"]["input_token_logprobs"] == w["meta_info"]["input_token_logprobs"]
        assert g["output_ids"] == w["output_ids"]


async def test_load_is_read_from_each_engines_live_report() -> None:
    """SGLang's load comes from /v1/loads (its /metrics gauges lag and start absent), vLLM's from
    /metrics; a request held open on the decode shows up as running there."""
    c = await build_cluster(time_scale=1.0)
    try:
        body = {"model": "m-sglang", "prompt": "tell me a long story", "max_tokens": 400, "stream": True}
        async with aiohttp.ClientSession() as s, s.post(c.url + "/v1/completions", json=body) as r:
            await r.content.readline()  # the first event: the decode is running it now
            reg = c.gateway.registry
            for wid in ("sgl-d", "vllm-d"):
                await c.gateway.health.scrape(reg.get(wid))
            sgl_d, vllm_d = reg.get("sgl-d"), reg.get("vllm-d")
            assert sgl_d.load_path == "/v1/loads" and vllm_d.load_path == "/metrics"
            assert sgl_d.load.running == 1 and sgl_d.load.scraped_at > 0
            assert vllm_d.load.running == 0
    finally:
        await stop_cluster(c)


@pytest.mark.parametrize(
    ("model", "path", "body"),
    [
        ("m-sglang", "/generate", {"input_ids": [5, 300], "sampling_params": {"max_new_tokens": 2}}),
        ("m-sglang", "/v1/completions", {"prompt": [[5, 6], [7, 259]], "max_tokens": 2}),
        ("m-vllm", "/v1/completions", {"prompt": [5, 1000], "max_tokens": 2}),
    ],
)
async def test_token_ids_outside_the_vocabulary_are_a_400_and_the_engines_live(
    model: str, path: str, body: dict[str, Any]
) -> None:
    """SGLang 0.5.23 dies on a prompt id outside its vocabulary (the emulator too): with the
    workers' vocab_size configured, the gateway refuses such a prompt before any engine sees it."""
    from tests.integration.conftest import build_cluster, stop_cluster

    c = await build_cluster(vocab_size=259)
    try:
        s, _, raw = await post(c.url + path, {"model": model, **body})
        assert s == 400, raw
        err = json.loads(raw)["error"]
        assert "out of vocabulary" in err["message"] and err["type"] == "invalid_request_error"
        assert err["param"] == ("input_ids" if path == "/generate" else "prompt")
        key = "input_ids" if path == "/generate" else "prompt"
        s, _, raw = await post(c.url + path, {"model": model, **body, key: [5, -1]})
        assert s == 400 and b"Token id -1" in raw, raw  # negative ids: refused whatever the vocabulary
        ok = {"model": model, "prompt": [5, 258], "max_tokens": 2}
        s, _, raw = await post(c.url + "/v1/completions", ok)
        assert s == 200, raw
        assert not any(e.dead for e in c.emulators.values())
    finally:
        await stop_cluster(c)


async def test_idle_upstream_connections_are_closed_after_a_burst(cluster: Cluster) -> None:
    """A burst opens many upstream connections; once idle past their reuse window (4 s) the
    probe loop closes them instead of holding them until the engine's keep-alive timeout."""

    async def one(i: int) -> None:
        s, _, raw = await post(
            cluster.url + "/v1/completions", body_for("/v1/completions", "m-vllm", f"p{i}", False)
        )
        assert s == 200, raw

    await asyncio.gather(*(one(i) for i in range(32)))
    pool = cluster.gateway.registry.get("vllm-d").pool
    assert pool.idle > 2, pool
    for _ in range(100):  # idle timeout 4 s + the probe interval (0.5 s here)
        if pool.idle <= 1:  # (the probes themselves keep one connection warm)
            break
        await asyncio.sleep(0.1)
    assert pool.idle <= 1, pool
