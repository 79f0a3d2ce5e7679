from __future__ import annotations

import asyncio
import json
import re
import uuid
from typing import Any

import aiohttp
import pytest

from tests.emulator.conftest import Factory, drawn_instead, sse_events

PREFILL_KTP = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


async def post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], rid: str | None = None
) -> tuple[int, str]:
    headers = {"X-Request-Id": rid} if rid else {}
    async with http.post(url, json=body, headers=headers) as r:
        return r.status, await r.text()


async def handoff(
    http: aiohttp.ClientSession, p: Any, d: Any, path: str, body: dict[str, Any]
) -> tuple[dict[str, Any], int, str]:
    rid = str(uuid.uuid4())
    pbody = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_KTP}
    pbody.pop("stream_options", None)
    st, ptext = await post(http, p.url + path, pbody, rid)
    assert st == 200, ptext
    pobj = json.loads(ptext)
    ds, dtext = await post(
        http, d.url + path, {**body, "kv_transfer_params": pobj["kv_transfer_params"]}, rid
    )
    return pobj, ds, dtext


def text_of(obj: dict[str, Any]) -> str:
    c = obj["choices"][0]
    return c["message"]["content"] if "message" in c else c["text"]


async def test_completions_handoff_equals_colocated(emu: Factory, http: aiohttp.ClientSession) -> None:
    single = await emu("vllm", "both")
    p = await emu("vllm", "prefill")
    d = await emu("vllm", "decode")
    body = {
        "model": "tiny",
        "prompt": "The capital of France is",
        "max_tokens": 12,
        "temperature": 0,
        "return_token_ids": True,
    }
    _, ref = await post(http, single.url + "/v1/completions", body)
    pobj, ds, dtext = await handoff(http, p, d, "/v1/completions", body)
    ktp = pobj["kv_transfer_params"]
    assert list(ktp) == [
        "do_remote_prefill",
        "do_remote_decode",
        "remote_block_ids",
        "remote_engine_id",
        "remote_request_id",
        "remote_host",
        "remote_port",
        "tp_size",
        "dcp_size",
        "pp_size",
        "remote_num_tokens",
        "remote_blocks_expiry_time",
        "transfer_mode",
        "remote_prefill_cached_tokens",
    ]
    assert (
        ktp["remote_port"] == p.kv_port and ktp["transfer_mode"] == "pull" and ktp["remote_num_tokens"] == 25
    )
    assert re.fullmatch(r"cmpl-[0-9a-f-]{36}-0-[0-9a-f]{8}", ktp["remote_request_id"])
    assert ktp["remote_block_ids"] == [[ktp["remote_block_ids"][0][0], ktp["remote_block_ids"][0][1]]]
    dobj = json.loads(dtext)
    assert ds == 200 and dobj["kv_transfer_params"] is None
    assert dobj["choices"][0]["token_ids"] == json.loads(ref)["choices"][0]["token_ids"]
    assert dobj["id"] == pobj["id"] and dobj["id"].startswith("cmpl-")
    assert dobj["usage"]["prompt_tokens_details"] is None  # (no --enable-prompt-tokens-details)
    async with http.get(d.url + "/metrics") as r:
        m = await r.text()
    assert (
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="meta-llama/Meta-Llama-3-8B-Instruct",source="external_kv_transfer"} 25.0'
        in m
    )
    assert "vllm:nixl_xfer_time_seconds_count" in m and "vllm:nixl_num_failed_transfers_total" in m


async def test_chat_stream_handoff(emu: Factory, http: aiohttp.ClientSession) -> None:
    single = await emu("vllm", "both")
    p = await emu("vllm", "prefill")
    d = await emu("vllm", "decode")
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello gateway"}],
        "max_tokens": 12,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    _, ref = await post(http, single.url + "/v1/chat/completions", body)
    pobj, ds, dtext = await handoff(http, p, d, "/v1/chat/completions", body)
    assert re.fullmatch(
        r"chatcmpl-[0-9a-f-]{36}-[0-9a-f]{8}", pobj["kv_transfer_params"]["remote_request_id"]
    )

    def content(raw: str) -> str:
        ev = sse_events(raw)
        assert ev[-1] == "[DONE]"
        return "".join((c["delta"].get("content") or "") for e in ev[:-1] for c in json.loads(e)["choices"])

    assert ds == 200 and content(dtext) == content(ref) and len(content(ref)) == 12
    ev = sse_events(dtext)
    usage = json.loads(ev[-2])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    assert json.loads(ev[-3])["choices"][0]["finish_reason"] == "length"
    # completions stream
    cbody = {
        "model": "tiny",
        "prompt": "abc",
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
    }
    _, raw = await post(http, single.url + "/v1/completions", cbody)
    ev = sse_events(raw)
    assert json.loads(ev[0])["choices"][0]["prompt_token_ids"] == [1, 100, 101, 102]
    assert json.loads(ev[-2])["choices"][0]["finish_reason"] == "length"


async def test_get_endpoints(emu: Factory, http: aiohttp.ClientSession) -> None:
    s = await emu("vllm", "both", max_model_len=512, model="tiny")
    async with http.get(s.url + "/v1/models") as r:
        assert (await r.json())["data"][0]["max_model_len"] == 512
    async with http.get(s.url + "/health") as r:
        assert r.status == 200
    async with http.post(s.url + "/tokenize", json={"model": "tiny", "prompt": "The capital"}) as r:
        assert await r.json() == {
            "count": 12,
            "max_model_len": 512,
            "tokens": [1, *[b + 3 for b in b"The capital"]],
            "token_strs": None,
        }
    async with http.post(s.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}) as r:
        assert (await r.json())["count"] > 3
    async with http.get(s.url + "/metrics") as r:
        m = await r.text()
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
    ):
        assert name in m
    st, text = await post(http, s.url + "/v1/completions", {"prompt": "x" * 600, "max_tokens": 4})
    assert st == 400
    assert json.loads(text) == {
        "error": {
            # a text prompt is tokenized to at most max_model_len + 1 tokens (renderers/params.py)
            "message": "This model's maximum context length is 512 tokens. However, your prompt contains at least 513 input tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. (parameter=input_tokens, value=513)",
            "type": "BadRequestError",
            "param": "input_tokens",
            "code": 400,
        }
    }
    # clamp like vLLM
    st, text = await post(http, s.url + "/v1/completions", {"prompt": "x" * 499, "max_tokens": 24})
    assert st == 200 and json.loads(text)["usage"]["completion_tokens"] == 12


async def test_x_request_id_and_cached_tokens(emu: Factory, http: aiohttp.ClientSession) -> None:
    s = await emu("vllm", "both", enable_prompt_tokens_details=True)
    body = {"prompt": "a" * 40, "max_tokens": 2}
    _, t1 = await post(http, s.url + "/v1/completions", body, "abc")
    _, t2 = await post(
        http,
        s.url + "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "q"}], "max_tokens": 2},
        "abc",
    )
    _, t3 = await post(http, s.url + "/v1/completions", body)
    assert json.loads(t1)["id"] == "cmpl-abc" and json.loads(t2)["id"] == "chatcmpl-abc"
    assert json.loads(t3)["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    # vLLM fills the details only when asked to, and only above 0: left out of a stream's usage
    # chunk, null in a whole answer
    plain = await emu("vllm", "both")
    _, t4 = await post(http, plain.url + "/v1/completions", body)
    _, t5 = await post(http, plain.url + "/v1/completions", body)
    assert json.loads(t4)["usage"]["prompt_tokens_details"] is None
    assert json.loads(t5)["usage"]["prompt_tokens_details"] is None
    _, t6 = await post(http, s.url + "/v1/completions", {"prompt": "zz" * 30, "max_tokens": 2})
    assert json.loads(t6)["usage"]["prompt_tokens_details"] is None  # nothing cached
    streamed = body | {"stream": True, "stream_options": {"include_usage": True}}
    _, t7 = await post(http, s.url + "/v1/completions", streamed)
    last = [json.loads(line[5:]) for line in t7.splitlines() if line.startswith("data: {")][-1]
    assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    _, t8 = await post(http, plain.url + "/v1/completions", streamed)
    last = [json.loads(line[5:]) for line in t8.splitlines() if line.startswith("data: {")][-1]
    assert "prompt_tokens_details" not in last["usage"]


async def test_stale_params_give_wrong_tokens(emu: Factory, http: aiohttp.ClientSession) -> None:
    single = await emu("vllm", "both")
    p = await emu("vllm", "prefill")
    d = await emu("vllm", "decode")
    a = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    b = {"prompt": "My favourite colour was!", "max_tokens": 8, "temperature": 0}
    pa, _, _ = await handoff(http, p, d, "/v1/completions", a)  # consumes A's params
    _, ref_b = await post(http, single.url + "/v1/completions", b)
    ds, dtext = await post(
        http, d.url + "/v1/completions", {**b, "kv_transfer_params": pa["kv_transfer_params"]}
    )
    assert ds == 200 and text_of(json.loads(dtext)) != text_of(json.loads(ref_b))
    # same prompt, stale params: the blocks still hold A's KV -> still right
    _, ref_a = await post(http, single.url + "/v1/completions", a)
    ds, dtext = await post(
        http, d.url + "/v1/completions", {**a, "kv_transfer_params": pa["kv_transfer_params"]}
    )
    assert text_of(json.loads(dtext)) == text_of(json.loads(ref_a))


async def test_short_block_list_kills_decode(emu: Factory, http: aiohttp.ClientSession) -> None:
    p = await emu("vllm", "prefill")
    d = await emu("vllm", "decode")
    pa, _, _ = await handoff(http, p, d, "/v1/completions", {"prompt": "short", "max_tokens": 2})
    ds, dtext = await post(
        http,
        d.url + "/v1/completions",
        {"prompt": "x" * 300, "max_tokens": 2, "kv_transfer_params": pa["kv_transfer_params"]},
    )
    assert ds == 500 and "EngineCore encountered an issue" in dtext
    await asyncio.sleep(0.3)
    assert d.dead
    try:
        async with http.get(d.url + "/health") as r:
            raise AssertionError(f"decode still answers {r.status}")
    except aiohttp.ClientConnectionError:
        pass


async def test_prefill_dead_before_pull(emu: Factory, http: aiohttp.ClientSession) -> None:
    p = await emu("vllm", "prefill")
    d = await emu("vllm", "decode", handshake_timeout_s=0.3)
    rid = "r-dead"
    _st, ptext = await post(
        http,
        p.url + "/v1/completions",
        {"prompt": "abc", "max_tokens": 1, "kv_transfer_params": PREFILL_KTP},
        rid,
    )
    ktp = json.loads(ptext)["kv_transfer_params"]
    await p.stop()
    ds, dtext = await post(
        http, d.url + "/v1/completions", {"prompt": "abc", "max_tokens": 4, "kv_transfer_params": ktp}, rid
    )
    assert ds == 500 and json.loads(dtext)["error"]["message"] == "Internal server error"
    ds, raw = await post(
        http,
        d.url + "/v1/completions",
        {"prompt": "abc", "max_tokens": 4, "stream": True, "kv_transfer_params": ktp},
        rid,
    )
    ev = sse_events(raw)
    assert ds == 200 and json.loads(ev[0])["error"]["code"] == 500 and ev[-1] == "[DONE]"
    assert (await d.stats())["kv_transfers_failed"] == 2


async def test_disconnect_aborts(emu: Factory, http: aiohttp.ClientSession) -> None:
    s = await emu("vllm", "both", time_scale=1.0)
    task = asyncio.ensure_future(post(http, s.url + "/v1/completions", {"prompt": "x", "max_tokens": 5000}))
    await asyncio.sleep(0.3)
    assert (await s.stats())["running"] == 1
    task.cancel()
    for _ in range(50):
        await asyncio.sleep(0.05)
        st = await s.stats()
        if st["running"] == 0 and st["in_flight"] == 0:
            break
    assert st["running"] == 0 and st["aborted"] == 1
    async with http.get(s.url + "/metrics") as r:
        assert (
            'vllm:num_requests_running{engine="0",model_name="meta-llama/Meta-Llama-3-8B-Instruct"} 0.0'
            in await r.text()
        )


async def test_out_of_vocabulary_token_ids_are_a_400(emu: Factory, http: aiohttp.ClientSession) -> None:
    """vLLM's renderer refuses prompt ids outside the vocabulary (a 400, not a crash)."""
    s = await emu("vllm", "both")
    for ids, bad in (([-1, 5], -1), ([5, 10**6], 10**6)):
        async with http.post(
            s.url + "/v1/completions", json={"model": "m", "prompt": ids, "max_tokens": 2}
        ) as r:
            assert r.status == 400
            assert (await r.json())["error"]["message"] == f"Token id {bad} is out of vocabulary"


async def test_openai_logprobs_shapes(emu: Factory, http: aiohttp.ClientSession) -> None:
    """`logprobs` (completions) and `logprobs` + `top_logprobs` (chat), whole and streamed: one
    entry per generated token, the chosen token the most likely, the same values either way."""
    s = await emu("vllm", "both")
    comp = {"prompt": "Hello there", "max_tokens": 5, "temperature": 0, "logprobs": 3}
    st, text = await post(http, s.url + "/v1/completions", comp)
    assert st == 200, text
    c = json.loads(text)["choices"][0]
    lp = c["logprobs"]
    assert "".join(lp["tokens"]) == c["text"] and len(lp["token_logprobs"]) == 5
    assert lp["text_offset"] == [0, 1, 2, 3, 4]
    for tok, val, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert len(top) == 3 and max(top.values()) == top[tok] == val < 0
    st, raw = await post(http, s.url + "/v1/completions", comp | {"stream": True})
    events = [json.loads(e) for e in sse_events(raw) if e != "[DONE]"]
    streamed = [e["choices"][0]["logprobs"] for e in events if e["choices"]]
    assert [v for x in streamed for v in x["token_logprobs"]] == lp["token_logprobs"]
    assert [v for x in streamed for v in x["text_offset"]] == lp["text_offset"]
    chat = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    st, text = await post(http, s.url + "/v1/chat/completions", chat)
    assert st == 200, text
    content = json.loads(text)["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(len(e["top_logprobs"]) == 2 for e in content)
    assert all(e["top_logprobs"][0]["token"] == e["token"] for e in content)
    st, text = await post(http, s.url + "/v1/chat/completions", chat | {"logprobs": False})
    assert st == 400 and "`logprobs` must be set to true" in text
    st, text = await post(http, s.url + "/v1/completions", comp | {"logprobs": 21})
    assert st == 400 and "greater than max allowed: 20" in text
    st, text = await post(http, s.url + "/v1/completions", comp | {"logprobs": None})
    assert st == 200 and json.loads(text)["choices"][0]["logprobs"] is None


async def test_stop_strings_and_stop_token_ids(emu: Factory, http: aiohttp.ClientSession) -> None:
    """vLLM's stop handling: the text ends before the first stop string (kept with
    include_stop_str_in_output), every generated token counts in the usage, stop_reason names
    the match; a stop token id ends the sequence and never shows in the text."""
    s = await emu("vllm", "both")
    base = {"prompt": "Hello there", "max_tokens": 40, "temperature": 0}
    _, text = await post(http, s.url + "/v1/completions", base)
    full = json.loads(text)["choices"][0]["text"]
    stop = full[5:7]  # a two-character string that first occurs at or before position 5
    at = full.index(stop)
    _, text = await post(http, s.url + "/v1/completions", base | {"stop": ["zzzz", stop]})
    obj = json.loads(text)
    c = obj["choices"][0]
    assert (c["text"], c["finish_reason"], c["stop_reason"]) == (full[:at], "stop", stop)
    assert obj["usage"]["completion_tokens"] == at + 2
    _, text = await post(
        http, s.url + "/v1/completions", base | {"stop": stop, "include_stop_str_in_output": True}
    )
    assert json.loads(text)["choices"][0]["text"] == full[: at + 2]
    _, raw = await post(http, s.url + "/v1/completions", base | {"stop": [stop], "stream": True})
    events = [json.loads(e) for e in sse_events(raw) if e != "[DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events) == full[:at]
    assert (
        events[-1]["choices"][0]["finish_reason"] == "stop"
        and events[-1]["choices"][0]["stop_reason"] == stop
    )
    tok = ord(full[3]) + 3  # the emulator's byte tokenizer: id = byte + 3
    _, text = await post(http, s.url + "/v1/completions", base | {"stop_token_ids": [tok]})
    c = json.loads(text)["choices"][0]
    first = full.index(full[3])
    assert (c["text"], c["finish_reason"], c["stop_reason"]) == (full[:first], "stop", tok)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, "temperature": 0}
    _, text = await post(http, s.url + "/v1/chat/completions", chat)
    said = json.loads(text)["choices"][0]["message"]["content"]
    _, raw = await post(http, s.url + "/v1/chat/completions", chat | {"stop": said[4:6], "stream": True})
    events = [json.loads(e) for e in sse_events(raw) if e != "[DONE]"]
    got = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert got == said[: said.index(said[4:6])] and events[-1]["choices"][0]["finish_reason"] == "stop"
    st, text = await post(http, s.url + "/v1/completions", base | {"stop": [""]})
    assert st == 400 and "must not be empty" in text


async def test_min_tokens_holds_off_stop_strings_and_stop_token_ids(
    emu: Factory, http: aiohttp.ClientSession
) -> None:
    """vLLM checks stop strings only once the output is longer than `min_tokens` (detokenizer)
    and masks stop token ids until it is that long: a stop string inside the first `min_tokens`
    tokens does not end the sequence, a later one does; a stop id is not drawn there at all
    (another token is, tests/emulator/test_min_tokens.py), a later one ends it."""
    s = await emu("vllm", "both")
    base = {"prompt": "Hello there", "max_tokens": 60, "temperature": 0}
    _, text = await post(http, s.url + "/v1/completions", base)
    full = json.loads(text)["choices"][0]["text"]
    ch = max(sorted(set(full)), key=full.count)  # a character that recurs
    first = full.index(ch)
    nxt = full.index(ch, first + 1)
    held = full[:first] + drawn_instead(ch) + full[first + 1 : nxt]
    for mt, want in ((first, first), (first + 1, nxt)):  # the first match is token first + 1
        body = base | {"stop": ch, "min_tokens": mt}
        _, text = await post(http, s.url + "/v1/completions", body)
        c = json.loads(text)["choices"][0]
        assert (c["text"], c["finish_reason"], c["stop_reason"]) == (full[:want], "stop", ch)
        body = base | {"stop_token_ids": [ord(ch) + 3], "min_tokens": mt}
        _, text = await post(http, s.url + "/v1/completions", body)
        c = json.loads(text)["choices"][0]
        shown = full[:first] if mt == first else held
        assert (c["text"], c["finish_reason"], c["stop_reason"]) == (shown, "stop", ord(ch) + 3)
    _, raw = await post(http, s.url + "/v1/completions", body | {"stream": True})
    events = [json.loads(e) for e in sse_events(raw) if e != "[DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events) == held


async def test_a_seed_outside_int64_is_refused(emu: Factory, http: aiohttp.ClientSession) -> None:
    """vLLM bounds `seed` to a signed 64-bit int on its request models."""
    s = await emu("vllm", "both")
    base = {"prompt": "Hello", "max_tokens": 3, "temperature": 0.5}
    for seed, ok in ((2**63 - 1, True), (-(2**63), True), (2**63, False), (-(2**63) - 1, False)):
        st, text = await post(http, s.url + "/v1/completions", base | {"seed": seed})
        assert (st == 200) == ok, text
        if not ok:
            err = json.loads(text)["error"]
            assert err["param"] == "seed" and "Input should be" in err["message"]


async def test_a_colocated_server_ignores_kv_transfer_params(
    emu: Factory, http: aiohttp.ClientSession
) -> None:
    """A colocated vLLM (`both`) runs no KV connector, and vLLM without one reads no
    kv_transfer_params (the scheduler consults no connector: Scheduler._connector_finished is
    (False, None), GenerateBaseServing.has_kv_connector is False): a client's params, for a
    handoff or a pull, are served as a plain request, with null params in the answer. They
    neither kill the server (a pull of blocks it never held) nor hold its blocks for a decode."""
    s = await emu("vllm", "both")
    body = {"model": "m", "prompt": "The capital of France is", "max_tokens": 5, "temperature": 0}
    _, plain = await post(http, s.url + "/v1/completions", body)
    junk_pull = {"do_remote_prefill": True, "remote_block_ids": [[999]], "remote_engine_id": "x"}
    for ktp in (junk_pull, {"do_remote_prefill": True}, PREFILL_KTP, {"anything": 1}):
        for stream in (False, True):
            st, raw = await post(
                http, s.url + "/v1/completions", body | {"kv_transfer_params": ktp, "stream": stream}
            )
            assert st == 200, (ktp, raw)
            if stream:
                assert sse_events(raw)[-1] == "[DONE]", raw
                continue
            obj = json.loads(raw)
            assert obj["kv_transfer_params"] is None and text_of(obj) == text_of(json.loads(plain)), raw
            assert obj["usage"]["completion_tokens"] == 5, raw
    stats = await s.stats()
    assert not s.dead and not stats["dead"] and stats["held_transfers"] == 0, stats
    assert stats["kv_transfers_ok"] == stats["kv_transfers_failed"] == 0 and stats["kv_blocks_used"] == 0, (
        stats
    )


@pytest.mark.parametrize("role", ["both", "prefill", "decode"])
async def test_kv_transfer_params_that_are_not_an_object_are_a_400(
    emu: Factory, http: aiohttp.ClientSession, role: str
) -> None:
    """The request models' `kv_transfer_params: dict[str, Any] | None`: pydantic refuses anything
    else while parsing (a 400, not a 500 from reading it)."""
    s = await emu("vllm", role)
    for ktp in ("x", [1], 5):
        st, raw = await post(
            http, s.url + "/v1/completions", {"prompt": "hi", "max_tokens": 1, "kv_transfer_params": ktp}
        )
        assert st == 400, raw
        assert json.loads(raw)["error"]["message"] == (
            "1 validation error: kv_transfer_params: Input should be a valid dictionary"
        )
    st, raw = await post(
        http, s.url + "/v1/completions", {"prompt": "hi", "max_tokens": 1, "kv_transfer_params": None}
    )
    assert st == 200, raw
