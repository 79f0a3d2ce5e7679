"""vLLM's `echo`, `echo` + `logprobs`, echo without generation and `prompt_logprobs` on
/v1/completions, colocated and on a P/D decode that computes the prompt itself."""

from __future__ import annotations

import functools
import json
from typing import Any

import aiohttp
import pytest

from tests.emulator.conftest import Factory, sse_events
from tests.emulator.echo_helpers import (
    check_offsets,
    choices,
    completion_body,
    encode,
    prompt_scores,
    shifted,
)
from tests.emulator.test_vllm import PREFILL_KTP, post

PROMPT = "The capital of France is"
PATH = "/v1/completions"


body = functools.partial(completion_body, prompt=PROMPT)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_echo_text(emu: Factory, http: aiohttp.ClientSession, stream: bool) -> None:
    v = await emu("vllm", "both")
    _, plain = await post(http, v.url + PATH, body(stream))
    usage_opt = {"stream_options": {"include_usage": True}} if stream else {}  # vLLM: stream only
    s, raw = await post(http, v.url + PATH, body(stream, echo=True, **usage_opt))
    assert s == 200, raw
    got, want = choices(raw, stream)[0], choices(plain, stream)[0]
    assert got["text"] == PROMPT + want["text"] and len(want["text"]) == 6
    assert got["first"].startswith(PROMPT) and got["finish_reason"] == "length"
    assert got["logprobs"] is None
    usage = json.loads(raw)["usage"] if not stream else json.loads(raw.split("data: ")[-2])["usage"]
    assert usage["prompt_tokens"] == len(PROMPT) + 1 and usage["completion_tokens"] == 6
    # a token-id prompt echoes its detokenized text
    _, raw = await post(http, v.url + PATH, body(stream, prompt=encode(PROMPT), echo=True))
    assert choices(raw, stream)[0]["text"] == got["text"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_echo_batch_times_n(emu: Factory, http: aiohttp.ClientSession, stream: bool) -> None:
    v = await emu("vllm", "both")
    prompts = ["first prompt", "second one"]
    b = body(stream, prompt=prompts, n=2, temperature=0.7, seed=7, stop=" ")
    _, plain = await post(http, v.url + PATH, b)
    s, raw = await post(http, v.url + PATH, b | {"echo": True})
    assert s == 200, raw
    got, want = choices(raw, stream), choices(plain, stream)
    assert sorted(got) == [0, 1, 2, 3]
    for k in range(4):
        assert got[k]["text"] == prompts[k // 2] + want[k]["text"]
        assert got[k]["first"].startswith(prompts[k // 2])
        assert got[k]["finish_reason"] == want[k]["finish_reason"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_echo_with_logprobs_scores_the_prompt(
    emu: Factory, http: aiohttp.ClientSession, stream: bool
) -> None:
    v = await emu("vllm", "both")
    prompt = encode(PROMPT)
    _, plain = await post(http, v.url + PATH, body(stream, logprobs=2))
    await post(http, v.url + PATH, body())  # the prompt is now cached
    s, raw = await post(http, v.url + PATH, body(stream, echo=True, logprobs=2, stop="zzz"))
    assert s == 200, raw
    got, want = choices(raw, stream)[0], choices(plain, stream)[0]
    lp, gen = got["logprobs"], want["logprobs"]
    assert got["text"] == PROMPT + want["text"]
    n = len(prompt)
    assert lp["tokens"][:n] == ["", *PROMPT] and lp["token_logprobs"][:n] == prompt_scores(prompt)
    assert lp["top_logprobs"][0] is None and all(len(t) == 2 for t in lp["top_logprobs"][1:])
    assert lp["top_logprobs"][1]["T"] == lp["token_logprobs"][1]
    check_offsets(lp)
    assert {k: x[n:] for k, x in lp.items()} == shifted(gen, len(PROMPT))
    if not stream:
        whole = json.loads(raw)
        assert len(whole["choices"][0]["prompt_logprobs"]) == n  # computed, so answered too
        assert whole["usage"]["prompt_tokens_details"] is None  # no cache read (vLLM: null when 0)
    # echo + logprobs 0: the prompt part too, the chosen token alone in each top_logprobs
    _, raw = await post(http, v.url + PATH, body(stream, echo=True, logprobs=0))
    lp0 = choices(raw, stream)[0]["logprobs"]
    assert lp0["token_logprobs"][:n] == prompt_scores(prompt) and len(lp0["top_logprobs"][1]) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_echo_without_generation(emu: Factory, http: aiohttp.ClientSession, stream: bool) -> None:
    v = await emu("vllm", "both")
    prompt = encode(PROMPT)
    usage_opt = {"stream_options": {"include_usage": True}} if stream else {}  # vLLM: stream only
    b = body(stream, echo=True, max_tokens=0, logprobs=1, **usage_opt)
    s, raw = await post(http, v.url + PATH, b)
    assert s == 200, raw
    got = choices(raw, stream)[0]
    assert got["text"] == PROMPT and got["finish_reason"] == "length"
    lp = got["logprobs"]
    assert lp["tokens"] == ["", *PROMPT] and lp["token_logprobs"] == prompt_scores(prompt)
    usage = json.loads(raw)["usage"] if not stream else json.loads(raw.split("data: ")[-2])["usage"]
    # vLLM generates one token and drops it; the usage still counts it
    assert usage["prompt_tokens"] == len(prompt) and usage["completion_tokens"] == 1
    # without echo max_tokens 0 stays a 400: SamplingParams' (vllm/sampling_params.py:688)
    s, raw = await post(http, v.url + PATH, body(stream, max_tokens=0))
    err = json.loads(raw)["error"]
    assert (
        s == 400 and err["message"] == "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"
    )
    assert err["param"] == "max_tokens"


async def test_prompt_logprobs_shape(emu: Factory, http: aiohttp.ClientSession) -> None:
    v = await emu("vllm", "both")
    prompt = encode(PROMPT)
    _, plain = await post(http, v.url + PATH, body())
    s, raw = await post(http, v.url + PATH, body(prompt_logprobs=3))
    assert s == 200, raw
    choice = json.loads(raw)["choices"][0]
    assert choice["text"] == json.loads(plain)["choices"][0]["text"] and choice["logprobs"] is None
    plp = choice["prompt_logprobs"]
    assert len(plp) == len(prompt) and plp[0] is None
    for i, entry in enumerate(plp[1:], start=1):
        assert len(entry) == 3
        mine = entry[str(prompt[i])]
        assert mine == {"logprob": prompt_scores(prompt)[i], "rank": 1, "decoded_token": PROMPT[i - 1]}
        assert sorted(e["rank"] for e in entry.values()) == [1, 2, 3]
    # chat: the response's prompt_logprobs
    chat = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "prompt_logprobs": 0,
    }
    s, raw = await post(http, v.url + "/v1/chat/completions", chat)
    obj = json.loads(raw)
    assert s == 200 and obj["prompt_logprobs"][0] is None and len(obj["prompt_logprobs"][1]) == 1
    assert obj["usage"]["prompt_tokens"] == len(obj["prompt_logprobs"])
    # refused as vLLM refuses them
    for extra, msg in (
        ({"prompt_logprobs": 2, "stream": True}, "not available when `stream=True`"),
        ({"prompt_logprobs": 21}, "Requested prompt logprobs of 21"),
        ({"prompt_logprobs": -2}, "must be a positive value or -1"),
    ):
        s, raw = await post(http, v.url + PATH, body() | extra)
        err = json.loads(raw)["error"]
        assert s == 400 and msg in err["message"] and err["param"] == "prompt_logprobs", raw


@pytest.mark.parametrize(
    "extra", [{"echo": True, "logprobs": 1}, {"prompt_logprobs": 1}], ids=["echo+logprobs", "prompt_logprobs"]
)
async def test_decode_computes_the_prompt_itself(
    emu: Factory, http: aiohttp.ClientSession, extra: dict[str, Any]
) -> None:
    single = await emu("vllm", "both")
    p = await emu("vllm", "prefill")
    d = await emu("vllm", "decode")
    b = body(**extra)
    _, ref = await post(http, single.url + PATH, b)
    pbody = b | {"max_tokens": 1, "kv_transfer_params": PREFILL_KTP}
    s, praw = await post(http, p.url + PATH, pbody)
    assert s == 200 and (await p.stats())["held_transfers"] == 1, praw
    ktp = json.loads(praw)["kv_transfer_params"]
    ds, raw = await post(http, d.url + PATH, b | {"kv_transfer_params": ktp})
    assert ds == 200, raw
    got, want = json.loads(raw)["choices"][0], json.loads(ref)["choices"][0]
    for key in ("text", "logprobs", "prompt_logprobs", "finish_reason"):
        assert got[key] == want[key], key
    assert got["prompt_logprobs"] is not None and got["prompt_logprobs"][0] is None
    dstats, pstats = await d.stats(), await p.stats()
    n = len(encode(PROMPT))
    assert dstats["kv_transfers_ok"] == 0 and dstats["external_kv_tokens"] == 0
    assert dstats["local_compute_tokens"] == n  # the whole prompt, charged as a local prefill
    # nothing was pulled: the prefill was only told to free the blocks it held
    assert pstats["kv_transfers_ok"] == 0 and pstats["held_transfers"] == 0
    assert pstats["kv_blocks_used"] == 0


CHAT = "/v1/chat/completions"
PREFIX = "Sure, the answer is"  # a partial assistant turn that the answer continues


def chat_body(stream: bool, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": messages, "max_tokens": 6, "temperature": 0, "stream": stream} | extra


def chat_contents(raw: str, stream: bool) -> tuple[dict[int, str], list[dict[str, Any]]]:
    """Each choice's content (a stream's deltas joined) and, streamed, the chunks' choices."""
    if not stream:
        return {c["index"]: c["message"]["content"] for c in json.loads(raw)["choices"]}, []
    out: dict[int, str] = {}
    seen: list[dict[str, Any]] = []
    for e in sse_events(raw):
        if e != "[DONE]":
            for c in json.loads(e)["choices"]:
                seen.append(c)
                out[c["index"]] = out.get(c["index"], "") + (c["delta"].get("content") or "")
    return out, seen


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_chat_echo_prepends_the_last_assistant_message(
    emu: Factory, http: aiohttp.ClientSession, stream: bool
) -> None:
    """vLLM's chat `echo` (chat_completion/serving.py:1132-1145, stream :591-624): the last
    message's content leads each choice's when its role is the answer's ("assistant"), and a
    stream sends it in a chunk of its own after the role chunk."""
    v = await emu("vllm", "both")
    msgs = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": PREFIX}]
    _, plain = await post(http, v.url + CHAT, chat_body(stream, msgs))
    s, raw = await post(http, v.url + CHAT, chat_body(stream, msgs, echo=True))
    assert s == 200, raw
    got, seen = chat_contents(raw, stream)
    want = chat_contents(plain, stream)[0][0]
    assert len(want) == 6 and got[0] == PREFIX + want
    if stream:
        assert seen[0]["delta"] == {"role": "assistant", "content": ""}
        assert seen[1] == {"index": 0, "delta": {"content": PREFIX}, "logprobs": None, "finish_reason": None}
    else:
        # echo asks for the prompt's logprobs (top_logprobs, 0 by default): no cached prefix
        obj = json.loads(raw)
        assert (
            obj["prompt_logprobs"][0] is None and len(obj["prompt_logprobs"]) == obj["usage"]["prompt_tokens"]
        )
        assert obj["usage"]["prompt_tokens_details"] is None
    # n > 1: every choice echoes (a stream: one echo chunk per choice, after the role chunks)
    s, raw = await post(http, v.url + CHAT, chat_body(stream, msgs, echo=True, n=2, temperature=0.5, seed=3))
    got, seen = chat_contents(raw, stream)
    assert s == 200 and sorted(got) == [0, 1] and all(t.startswith(PREFIX) for t in got.values()), raw
    if stream:
        assert [c["delta"] for c in seen[2:4]] == [{"content": PREFIX}] * 2


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_chat_echo_needs_the_answers_role(
    emu: Factory, http: aiohttp.ClientSession, stream: bool
) -> None:
    v = await emu("vllm", "both")
    user = [{"role": "user", "content": "Hello there"}]
    _, plain = await post(http, v.url + CHAT, chat_body(stream, user))
    s, raw = await post(http, v.url + CHAT, chat_body(stream, user, echo=True))
    assert (
        s == 200 and chat_contents(raw, stream)[0] == chat_contents(plain, stream)[0]
    )  # a user turn: nothing
    # without the generation prompt the answer's role is the last message's: it echoes
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    b = chat_body(stream, parts, echo=True, add_generation_prompt=False)
    s, raw = await post(http, v.url + CHAT, b)
    assert s == 200 and chat_contents(raw, stream)[0][0].startswith("a\nb"), raw
