from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import aiohttp
import pytest

from tests.emulator.conftest import Factory, drawn_instead, sse_events

PROMPT = "Hello world, the quick brown fox"


async def post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[int, str, dict[str, str]]:
    async with http.post(url, json=body) as r:
        return r.status, await r.text(), dict(r.headers)


async def pd_pair(emu: Factory, **kw: Any) -> tuple[Any, Any]:
    pkw, dkw = kw.pop("pkw", {}), kw.pop("dkw", {})
    p = await emu("sglang", "prefill", **pkw, **kw)
    d = await emu("sglang", "decode", **dkw, **kw)
    return p, d


def boot(p: Any, room: int | None = None) -> dict[str, Any]:
    return {
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": p.bootstrap_port,
        "bootstrap_room": room if room is not None else random.getrandbits(63),
    }


async def pd(http: aiohttp.ClientSession, p: Any, d: Any, path: str, body: dict[str, Any]) -> tuple[Any, Any]:
    b = {**body, **boot(p)}
    return await asyncio.gather(post(http, p.url + path, b), post(http, d.url + path, b))


async def test_generate_single_shape(emu: Factory, http: aiohttp.ClientSession) -> None:
    s = await emu("sglang", "both")
    st, text, headers = await post(
        http,
        s.url + "/generate",
        {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 12}},
    )
    assert st == 200 and headers["Content-Type"] == "application/json"
    obj = json.loads(text)
    assert len(obj["output_ids"]) == 12 and obj["text"].isprintable() and len(obj["text"]) == 12
    m = obj["meta_info"]
    assert m["finish_reason"] == {"type": "length", "length": 12}
    assert m["prompt_tokens"] == len(PROMPT) + 1 and m["completion_tokens"] == 12 and m["cached_tokens"] == 0
    # second time: prefix cache hit
    _, text2, _ = await post(
        http,
        s.url + "/generate",
        {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 12}},
    )
    obj2 = json.loads(text2)
    assert obj2["output_ids"] == obj["output_ids"]
    assert obj2["meta_info"]["cached_tokens"] == 32
    assert obj2["meta_info"]["cached_tokens_details"] == {"device": 32, "host": 0}


async def test_pd_generate_equals_colocated(emu: Factory, http: aiohttp.ClientSession) -> None:
    single = await emu("sglang", "both")
    p, d = await pd_pair(emu)
    body = {"text": PROMPT * 3, "sampling_params": {"temperature": 0, "max_new_tokens": 20}}
    _, ref, _ = await post(http, single.url + "/generate", body)
    (ps, ptext, _), (ds, dtext, _) = await pd(http, p, d, "/generate", body)
    assert ps == 200 and ds == 200
    pobj, dobj = json.loads(ptext), json.loads(dtext)
    assert pobj["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert pobj["meta_info"]["completion_tokens"] == 1
    assert dobj["output_ids"] == json.loads(ref)["output_ids"]
    assert pobj["output_ids"] == dobj["output_ids"][:1]
    assert (await d.stats())["kv_transfers_ok"] == 1
    assert (await p.stats())["kv_transfers_ok"] == 1


async def test_pd_stream_generate_and_openai(emu: Factory, http: aiohttp.ClientSession) -> None:
    single = await emu("sglang", "both")
    p, d = await pd_pair(emu)
    body = {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 6}, "stream": True}
    _, ref, h = await post(http, single.url + "/generate", body)
    assert h["Content-Type"] == "text/event-stream; charset=utf-8"
    ev = sse_events(ref)
    assert ev[-1] == "[DONE]"
    last = json.loads(ev[-2])
    assert len(last["output_ids"]) == 6 and json.loads(ev[0])["output_ids"] == last["output_ids"][:1]
    (_, ptext, _), (_, dtext, _) = await pd(http, p, d, "/generate", body)
    pev, dev = sse_events(ptext), sse_events(dtext)
    assert len(pev) == 2 and pev[-1] == "[DONE]"
    assert json.loads(dev[-2])["output_ids"] == last["output_ids"]
    # chat stream with usage
    cbody = {
        "model": "x",
        "messages": [{"role": "user", "content": "hello gateway"}],
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    _, cref, _ = await post(http, single.url + "/v1/chat/completions", cbody)
    (_, _cp, _), (_, cd, _) = await pd(http, p, d, "/v1/chat/completions", cbody)

    def content(raw: str) -> str:
        out = ""
        for e in sse_events(raw)[:-1]:
            o = json.loads(e)
            for c in o["choices"]:
                out += c["delta"].get("content") or ""
        return out

    assert content(cd) == content(cref) and len(content(cref)) == 5
    evs = sse_events(cd)
    usage = json.loads(evs[-2])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert json.loads(evs[0])["choices"][0]["delta"]["role"] == "assistant"
    # completions non-stream
    kbody = {"model": "x", "prompt": PROMPT, "max_tokens": 7, "temperature": 0}
    _, kref, _ = await post(http, single.url + "/v1/completions", kbody)
    (_, kp, _), (_, kd, _) = await pd(http, p, d, "/v1/completions", kbody)
    assert json.loads(kd)["choices"][0]["text"] == json.loads(kref)["choices"][0]["text"]
    assert json.loads(kp)["usage"]["completion_tokens"] == 1
    assert json.loads(kd)["usage"]["prompt_tokens"] == len(PROMPT) + 1


async def test_batch_rooms(emu: Factory, http: aiohttp.ClientSession) -> None:
    single = await emu("sglang", "both")
    p, d = await pd_pair(emu)
    prompts = [[1, 50, 60, 70, 80], [1, 90, 91, 92]]
    body = {"input_ids": prompts, "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
    _, ref, _ = await post(http, single.url + "/generate", body)
    b = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": p.bootstrap_port, "bootstrap_room": 1000}
    (ps, _, _), (ds, dtext, _) = await asyncio.gather(
        post(http, p.url + "/generate", b), post(http, d.url + "/generate", b)
    )
    assert ps == ds == 200
    assert [o["output_ids"] for o in json.loads(dtext)] == [o["output_ids"] for o in json.loads(ref)]
    # list form of the bootstrap fields
    b2 = {
        **body,
        "bootstrap_host": ["127.0.0.1"] * 2,
        "bootstrap_port": [p.bootstrap_port] * 2,
        "bootstrap_room": [7, 99],
    }
    (_, _, _), (_, dtext2, _) = await asyncio.gather(
        post(http, p.url + "/generate", b2), post(http, d.url + "/generate", b2)
    )
    assert [o["output_ids"] for o in json.loads(dtext2)] == [o["output_ids"] for o in json.loads(ref)]


async def test_generate_sampling_params_list(emu: Factory, http: aiohttp.ClientSession) -> None:
    """One `sampling_params` object per prompt of a batch, as SGLang takes them."""
    s = await emu("sglang", "both")
    prompts = [[1, 50, 60], [1, 90, 91, 92], [1, 7]]
    sps = [{"temperature": 0, "max_new_tokens": k} for k in (2, 6, 3)]
    st, text, _ = await post(http, s.url + "/generate", {"input_ids": prompts, "sampling_params": sps})
    assert st == 200, text
    outs = json.loads(text)
    assert [len(o["output_ids"]) for o in outs] == [2, 6, 3]
    for prompt, sp, out in zip(prompts, sps, outs, strict=True):  # each as if sent alone
        _, one, _ = await post(http, s.url + "/generate", {"input_ids": prompt, "sampling_params": sp})
        assert json.loads(one)["output_ids"] == out["output_ids"]
    st, text, _ = await post(
        http, s.url + "/generate", {"input_ids": prompts, "sampling_params": [{"n": 2}, {}, {"n": 2}]}
    )
    assert st == 400 and "parallel_sample_num should be the same" in text
    st, text, _ = await post(http, s.url + "/generate", {"input_ids": prompts, "sampling_params": sps[:1]})
    assert st == 400 and "1 entries for 3 prompt(s)" in text


async def test_logprobs(emu: Factory, http: aiohttp.ClientSession) -> None:
    s = await emu("sglang", "both")
    _, text, _ = await post(
        http,
        s.url + "/generate",
        {
            "input_ids": [1, 5, 6],
            "sampling_params": {"max_new_tokens": 3},
            "return_logprob": True,
            "top_logprobs_num": 2,
        },
    )
    m = json.loads(text)["meta_info"]
    assert m["input_token_logprobs"][0] == [None, 1, None] and len(m["input_token_logprobs"]) == 3
    assert len(m["output_token_logprobs"]) == 3 and len(m["output_top_logprobs"][0]) == 2


async def test_get_endpoints(emu: Factory, http: aiohttp.ClientSession) -> None:
    p, d = await pd_pair(emu, max_model_len=1536, max_total_tokens=1024)
    async with http.get(p.url + "/metrics") as r:
        text = await r.text()
        # like the real scheduler: no load gauges before a forward batch has logged stats
        assert "sglang:num_running_reqs" not in text and "sglang:token_usage" not in text
        assert "sglang:max_total_num_tokens" in text
    for srv, mode in ((p, "prefill"), (d, "decode")):
        for path in ("/model_info", "/get_model_info"):
            async with http.get(srv.url + path) as r:
                assert (await r.json())["disaggregation_mode"] == mode
        for path in ("/server_info", "/get_server_info"):
            async with http.get(srv.url + path) as r:
                info = await r.json()
                assert info["context_length"] == 1536 and info["max_req_input_len"] == 1018
                assert info["max_total_num_tokens"] == 1024
        async with http.get(srv.url + "/v1/models") as r:
            data = (await r.json())["data"][0]
            assert data["owned_by"] == "sglang" and data["max_model_len"] == 1536
        for path in ("/health", "/health_generate"):
            async with http.get(srv.url + path) as r:
                assert r.status == 200 and await r.read() == b""
        async with http.get(srv.url + "/metrics") as r:
            text = await r.text()
            for name in (  # /health_generate ran a forward batch, so the gauges are there now
                "sglang:num_running_reqs",
                "sglang:num_queue_reqs",
                "sglang:token_usage",
                "sglang:cache_hit_rate",
                "sglang:num_transfer_failed_reqs_total",
                "sglang:kv_transfer_latency_ms_count",
            ):
                assert name in text
        async with http.get(srv.url + "/get_load") as r:
            assert r.status == 404  # gone in SGLang 0.5.23; /v1/loads replaced it
        async with http.get(srv.url + "/v1/loads") as r:
            loads = await r.json()
            assert loads["version"] == "0.5.23" and len(loads["loads"]) == 1
            rank = loads["loads"][0]
            assert rank["dp_rank"] == 0 and rank["num_running_reqs"] == 0 and rank["num_waiting_reqs"] == 0
            assert rank["max_total_num_tokens"] == 1024 and rank["disaggregation"]["mode"] == mode
        async with http.get(srv.url + "/v1/loads?include=core") as r:
            assert "disaggregation" not in (await r.json())["loads"][0]
        async with http.get(srv.url + "/v1/loads?include=bogus") as r:
            assert r.status == 400
        async with http.post(srv.url + "/flush_cache") as r:
            assert r.status == 200
    async with http.get(f"http://127.0.0.1:{p.bootstrap_port}/health") as r:
        assert await r.text() == "OK"
    q = "prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
    async with http.get(f"http://127.0.0.1:{p.bootstrap_port}/route?{q}") as r:
        assert (await r.json())["page_size"] == 16
    async with http.get(f"http://127.0.0.1:{p.bootstrap_port}/route?{q.replace('-1', '0')}") as r:
        assert (await r.json())["rank_port"] == p.kv_port
    async with http.get(f"http://127.0.0.1:{p.bootstrap_port}/route") as r:
        assert r.status == 400


async def test_prefill_rejects_and_decode_times_out(emu: Factory, http: aiohttp.ClientSession) -> None:
    p, d = await pd_pair(
        emu,
        max_model_len=1536,
        pkw={"max_total_tokens": 1024},
        dkw={"waiting_timeout_s": 0.5, "max_total_tokens": 4096},
    )
    body = {"input_ids": [1] + [10] * 1099, "sampling_params": {"max_new_tokens": 4}}
    (ps, ptext, _), (ds, dtext, _) = await pd(http, p, d, "/generate", body)
    assert (
        ps == 400 and "Input length (1100 tokens) exceeds the maximum allowed length (1018 tokens)" in ptext
    )
    assert ds == 500 and "timed out after 0.5s in KVPoll.WaitingForInput" in dtext
    assert json.loads(dtext)["object"] == "error"
    # stream: 200 + abort event with prompt_tokens 1
    st, raw, _ = await post(http, p.url + "/generate", {**body, "stream": True, **boot(p)})
    ev = json.loads(sse_events(raw)[0])
    assert (
        st == 200
        and ev["meta_info"]["finish_reason"]["type"] == "abort"
        and ev["meta_info"]["prompt_tokens"] == 1
    )
    st, raw, _ = await post(
        http, p.url + "/generate", {"input_ids": [1] * 1600, "sampling_params": {"max_new_tokens": 4}}
    )
    assert st == 400 and "longer than the model's context length (1536 tokens)" in raw


async def test_abort_request_and_disconnect(emu: Factory, http: aiohttp.ClientSession) -> None:
    s = await emu("sglang", "both", time_scale=1.0)
    task = asyncio.ensure_future(
        post(
            http, s.url + "/generate", {"text": "x", "rid": "r1", "sampling_params": {"max_new_tokens": 5000}}
        )
    )
    await asyncio.sleep(0.3)
    assert (await s.stats())["running"] == 1
    async with http.post(s.url + "/abort_request", json={"rid": "r1"}) as r:
        assert r.status == 200
    _st, text, _ = await asyncio.wait_for(task, 5)
    assert json.loads(text)["meta_info"]["finish_reason"]["type"] == "abort"
    # disconnect
    task = asyncio.ensure_future(
        post(
            http,
            s.url + "/generate",
            {"text": "y", "sampling_params": {"max_new_tokens": 5000}, "stream": True},
        )
    )
    await asyncio.sleep(0.3)
    assert (await s.stats())["running"] == 1
    task.cancel()
    for _ in range(50):
        await asyncio.sleep(0.05)
        st2 = await s.stats()
        if st2["running"] == 0 and st2["in_flight"] == 0:
            break
    assert st2["running"] == 0 and st2["aborted"] >= 2


async def test_load_gauges_appear_once_stats_are_logged(emu: Factory, http: aiohttp.ClientSession) -> None:
    s = await emu("sglang", "both")
    await post(http, s.url + "/generate", {"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 2}})
    async with http.get(s.url + "/metrics") as r:
        text = await r.text()
    for name in (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:cache_hit_rate",
    ):
        assert name in text


async def test_return_token_ids_shapes(emu: Factory, http: aiohttp.ClientSession) -> None:
    """SGLang 0.5.23: completions answer choices[].token_ids + prompt_token_ids; chat answers
    prompt_token_ids + response_token_ids; a streamed chat asking for them is a 400."""
    s = await emu("sglang", "both")
    base = {"model": "m", "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    _, text, _ = await post(http, s.url + "/v1/completions", {**base, "prompt": [1, 5, 6]})
    c = json.loads(text)["choices"][0]
    assert c["prompt_token_ids"] == [1, 5, 6] and len(c["token_ids"]) == 4
    _, plain, _ = await post(
        http, s.url + "/v1/completions", {**base, "prompt": [1, 5, 6], "return_token_ids": False}
    )
    assert "token_ids" not in json.loads(plain)["choices"][0]
    # streamed completions: ids chunk by chunk, the prompt's with the first
    async with http.post(s.url + "/v1/completions", json={**base, "prompt": [1, 5, 6], "stream": True}) as r:
        events = [
            json.loads(line[6:]) for line in (await r.text()).splitlines() if line.startswith("data: {")
        ]
    streamed = [t for e in events for ch in e["choices"] for t in ch.get("token_ids", [])]
    assert streamed == c["token_ids"] and events[0]["choices"][0]["prompt_token_ids"] == [1, 5, 6]
    chat = {**base, "messages": [{"role": "user", "content": "hi"}]}
    _, text, _ = await post(http, s.url + "/v1/chat/completions", chat)
    c = json.loads(text)["choices"][0]
    assert c["prompt_token_ids"] and len(c["response_token_ids"]) == 4 and "token_ids" not in c
    async with http.post(s.url + "/v1/chat/completions", json={**chat, "stream": True}) as r:
        assert r.status == 400
        assert "return_token_ids is not supported with streaming" in (await r.json())["message"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"input_ids": [5, 300], "sampling_params": {}}),
        ("/v1/completions", {"model": "m", "prompt": [5, 10**6], "max_tokens": 2}),
        # 0.5.23's chat takes `input_ids` as its prompt, a pydantic list[int] (lax: "999" is 999)
        ("/v1/chat/completions", {"model": "m", "messages": [], "input_ids": [5, "999"], "max_tokens": 2}),
        # with a minimum length, stop ids go into the min-new-tokens penalizer's vocabulary-wide
        # scatter, which raises in the scheduler
        ("/generate", {"text": "hi", "sampling_params": {"min_new_tokens": 1, "stop_token_ids": [10**6]}}),
        ("/v1/completions", {"model": "m", "prompt": "hi", "min_tokens": 1, "stop_token_ids": [-1]}),
    ],
)
async def test_out_of_vocabulary_token_ids_kill_the_server(
    emu: Factory, http: aiohttp.ClientSession, path: str, body: dict[str, object]
) -> None:
    """SGLang 0.5.23 does not check prompt ids: its scheduler dies on the embedding lookup and
    the server with it (seen on the real engine); the request gets no answer."""
    s = await emu("sglang", "both")
    with pytest.raises(aiohttp.ClientError):
        async with http.post(s.url + path, json=body) as r:
            await r.read()
    assert s.dead


async def test_chat_input_ids_are_the_prompt(emu: Factory, http: aiohttp.ClientSession) -> None:
    """SGLang 0.5.23's chat `input_ids` replace the templated messages (serving_chat.py:1947)."""
    s = await emu("sglang", "both")
    body = {"model": "m", "messages": [{"role": "user", "content": "a long question"}], "max_tokens": 2}
    async with http.post(s.url + "/v1/chat/completions", json={**body, "input_ids": [5, 6.0, "7"]}) as r:
        assert r.status == 200 and (await r.json())["usage"]["prompt_tokens"] == 3
    async with http.post(s.url + "/v1/chat/completions", json={**body, "input_ids": ["x"]}) as r:
        assert r.status == 400
    async with http.post(s.url + "/v1/chat/completions", json={**body, "input_ids": None}) as r:
        assert r.status == 200 and (await r.json())["usage"]["prompt_tokens"] > 3
    assert not s.dead


async def test_stop_strings(emu: Factory, http: aiohttp.ClientSession) -> None:
    """SGLang's stop handling on /generate (sampling_params.stop, matched in finish_reason) and
    on the OpenAI routes (matched_stop); no_stop_trim keeps the stop string."""
    s = await emu("sglang", "both")
    sp = {"temperature": 0, "max_new_tokens": 40}
    _, text, _ = await post(http, s.url + "/generate", {"text": PROMPT, "sampling_params": sp})
    full = json.loads(text)["text"]
    stop = full[6:8]
    at = full.index(stop)
    body = {"text": PROMPT, "sampling_params": sp | {"stop": [stop]}}
    _, text, _ = await post(http, s.url + "/generate", body)
    obj = json.loads(text)
    assert obj["text"] == full[:at] and obj["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert obj["meta_info"]["completion_tokens"] == len(obj["output_ids"]) == at + 2
    _, text, _ = await post(http, s.url + "/generate", {**body, "stream": True})
    assert json.loads(sse_events(text)[-2])["text"] == full[:at]
    kept = {"text": PROMPT, "sampling_params": sp | {"stop": stop, "no_stop_trim": True}}
    _, text, _ = await post(http, s.url + "/generate", kept)
    assert json.loads(text)["text"] == full[: at + 2]
    comp = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stop": stop}
    _, text, _ = await post(http, s.url + "/v1/completions", comp)
    c = json.loads(text)["choices"][0]
    assert (c["text"], c["finish_reason"], c["matched_stop"]) == (full[:at], "stop", stop)
    _, text, _ = await post(http, s.url + "/v1/completions", comp | {"logprobs": 1})
    lp = json.loads(text)["choices"][0]["logprobs"]
    assert "".join(lp["tokens"]) == full[:at]  # logprobs of the shown tokens only, as the text


async def test_min_new_tokens_holds_off_stop_token_ids_only(
    emu: Factory, http: aiohttp.ClientSession
) -> None:
    """SGLang masks stop token ids until the output is `min_new_tokens` long (its min-new-tokens
    penalizer: another token is drawn in their place) but checks stop strings from the first
    token (`Req.check_finished`)."""
    s = await emu("sglang", "both")
    sp = {"temperature": 0, "max_new_tokens": 60}
    _, text, _ = await post(http, s.url + "/generate", {"text": PROMPT, "sampling_params": sp})
    full = json.loads(text)["text"]
    ch = max(sorted(set(full)), key=full.count)  # a character that recurs
    tok = ord(ch) + 3
    first = full.index(ch)
    nxt = full.index(ch, first + 1)
    want = full[:first] + drawn_instead(ch) + full[first + 1 : nxt]
    held = sp | {"stop_token_ids": [tok], "min_new_tokens": first + 1}
    _, text, _ = await post(http, s.url + "/generate", {"text": PROMPT, "sampling_params": held})
    obj = json.loads(text)
    assert obj["text"] == want and obj["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok}
    comp = {"prompt": PROMPT, "max_tokens": 60, "temperature": 0, "stop_token_ids": [tok]}
    _, text, _ = await post(http, s.url + "/v1/completions", comp | {"min_tokens": first + 1})
    assert json.loads(text)["choices"][0]["text"] == want
    _, text, _ = await post(http, s.url + "/v1/completions", comp | {"min_tokens": first})
    assert json.loads(text)["choices"][0]["text"] == full[:first]
    at = first
    stop = ch
    strings = sp | {"stop": [stop], "min_new_tokens": at + 1}
    _, text, _ = await post(http, s.url + "/generate", {"text": PROMPT, "sampling_params": strings})
    assert json.loads(text)["text"] == full[:at]


@pytest.mark.parametrize(
    ("limits", "want"),
    [
        ({"max_completion_tokens": 0, "max_tokens": 3}, 3),  # 0 is falsy: max_tokens counts
        ({"max_completion_tokens": None, "max_tokens": 4}, 4),
        ({"max_completion_tokens": 5, "max_tokens": 3}, 5),
    ],
)
async def test_chat_budget_is_max_completion_tokens_or_max_tokens(
    emu: Factory, http: aiohttp.ClientSession, limits: dict[str, Any], want: int
) -> None:
    """SGLang's chat reads ``max_completion_tokens or max_tokens`` (``to_sampling_params``,
    entrypoints/openai/protocol.py:1214; ``_validate_request``, serving_chat.py:1180)."""
    s = await emu("sglang", "both")
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, **limits}
    st, text, _ = await post(http, s.url + "/v1/chat/completions", body)
    assert st == 200, text
    assert json.loads(text)["usage"]["completion_tokens"] == want


async def test_generate_prompt_fields_as_the_engine_normalizes_them(
    emu: Factory, http: aiohttp.ClientSession
) -> None:
    """``GenerateReqInput.normalize_batch_and_arguments`` (managers/io_struct.py): an empty text
    list is a batch of none, which ``_handle_batch_request`` sends nowhere and answers with no
    results (a 200 `[]`; streamed, `[DONE]` alone); an empty input_ids, or no prompt field at all,
    is its ValueError (a 400; streamed, a 200 with one error event). Not a 500."""
    g = await emu("sglang", "both")
    url = g.url + "/generate"
    for extra in ({}, {"sampling_params": {"max_new_tokens": 4, "n": 2}}, {"rid": "r"}):
        st, raw, _ = await post(http, url, {"text": [], **extra})
        assert st == 200 and json.loads(raw) == [], raw
        st, raw, _ = await post(http, url, {"text": [], "stream": True, **extra})
        assert st == 200 and sse_events(raw) == ["[DONE]"], raw
    refused = [
        ({"input_ids": []}, "input_ids cannot be empty."),
        ({}, "Either text, input_ids or input_embeds should be provided."),
        ({"text": None, "input_ids": None}, "Either text, input_ids or input_embeds should be provided."),
    ]
    for body, message in refused:
        st, raw, _ = await post(http, url, body)
        assert st == 400 and json.loads(raw) == {"error": {"message": message}}, (body, raw)
        st, raw, _ = await post(http, url, {**body, "stream": True})
        err = {"message": message, "type": "invalid_request_error", "code": 400, "retryable": False}
        assert st == 200 and sse_events(raw) == [json.dumps({"error": err}, separators=(",", ":")), "[DONE]"]
    stats = await g.stats()
    assert not g.dead and stats["prompt_tokens_total"] == 0 and stats["running"] == 0, stats
    st, raw, _ = await post(http, url, {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 2}})
    assert st == 200 and len(json.loads(raw)) == 2, raw
