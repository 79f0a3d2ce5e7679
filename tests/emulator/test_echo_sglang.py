"""SGLang's `echo` and `echo` + `logprobs` on /v1/completions: colocated, and in P/D, where the
decode never computed the prompt and so answers without the prompt's logprobs."""

from __future__ import annotations

import functools
import json
from typing import Any

import aiohttp
import pytest

from tests.emulator.conftest import Factory
from tests.emulator.echo_helpers import (
    choices,
    completion_body,
    encode,
    prompt_scores,
)
from tests.emulator.test_sglang import pd, pd_pair, post

PROMPT = "Hello world, the quick brown fox"
PATH = "/v1/completions"


body = functools.partial(completion_body, prompt=PROMPT)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_echo_text(emu: Factory, http: aiohttp.ClientSession, stream: bool) -> None:
    s = await emu("sglang", "both")
    _, plain, _ = await post(http, s.url + PATH, body(stream))
    st, raw, _ = await post(http, s.url + PATH, body(stream, echo=True))
    assert st == 200, raw
    got, want = choices(raw, stream)[0], choices(plain, stream)[0]
    assert got["text"] == PROMPT + want["text"] and len(want["text"]) == 6
    assert got["first"].startswith(PROMPT) and got["logprobs"] is None
    _, raw, _ = await post(http, s.url + PATH, body(stream, prompt=encode(PROMPT), echo=True))
    assert choices(raw, stream)[0]["text"] == got["text"]
    # every generated token held back by a stop string: the finish chunk carries the echo
    _, raw, _ = await post(http, s.url + PATH, body(stream, echo=True, stop=want["text"][:1]))
    assert choices(raw, stream)[0]["text"] == PROMPT


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_echo_batch_times_n(emu: Factory, http: aiohttp.ClientSession, stream: bool) -> None:
    s = await emu("sglang", "both")
    prompts = ["first prompt", "second one"]
    b = body(stream, prompt=prompts, n=2, temperature=0.7, seed=7)
    _, plain, _ = await post(http, s.url + PATH, b)
    st, raw, _ = await post(http, s.url + PATH, b | {"echo": True})
    assert st == 200, raw
    got, want = choices(raw, stream), choices(plain, stream)
    assert sorted(got) == [0, 1, 2, 3]
    for k in range(4):
        assert got[k]["text"] == prompts[k // 2] + want[k]["text"]
        assert got[k]["first"].startswith(prompts[k // 2])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_echo_with_logprobs_colocated(emu: Factory, http: aiohttp.ClientSession, stream: bool) -> None:
    s = await emu("sglang", "both")
    prompt = encode(PROMPT)
    n = len(prompt)
    _, plain, _ = await post(http, s.url + PATH, body(stream, logprobs=1))
    cached = (await s.stats())["cached_tokens_total"]
    st, raw, _ = await post(http, s.url + PATH, body(stream, echo=True, logprobs=1))
    assert st == 200, raw
    # logprob_start_len 0: the prompt is computed in full, without its cached prefix
    assert (await s.stats())["cached_tokens_total"] == cached
    got, want = choices(raw, stream)[0], choices(plain, stream)[0]
    lp = got["logprobs"]
    assert got["text"] == PROMPT + want["text"]
    assert lp["token_logprobs"][:n] == prompt_scores(prompt) and lp["top_logprobs"][0] is None
    assert lp["text_offset"] == [-1] * (n + 6)  # SGLang computes no offsets
    assert {k: x[n:] for k, x in lp.items()} == want["logprobs"]
    # `logprobs` 0 is falsy for SGLang: no prompt part
    _, raw, _ = await post(http, s.url + PATH, body(stream, echo=True, logprobs=0))
    assert len(choices(raw, stream)[0]["logprobs"]["tokens"]) == 6


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_pd_decode_answers_without_the_prompt_logprobs(
    emu: Factory, http: aiohttp.ClientSession, stream: bool
) -> None:
    single = await emu("sglang", "both")
    p, d = await pd_pair(emu)
    b = body(stream, echo=True, logprobs=1)
    _, ref, _ = await post(http, single.url + PATH, body(stream, logprobs=1))
    (ps, praw, _), (ds, raw, _) = await pd(http, p, d, PATH, b)
    assert ps == 200 and ds == 200, (praw, raw)
    got, want = choices(raw, stream)[0], choices(ref, stream)[0]
    # the text echoes the prompt, but the logprobs cover the generated tokens only
    assert got["text"] == PROMPT + want["text"] and got["first"].startswith(PROMPT)
    assert got["logprobs"]["token_logprobs"] == want["logprobs"]["token_logprobs"]
    assert len(got["logprobs"]["tokens"]) == 6 and None not in got["logprobs"]["token_logprobs"]
    # the prefill computed the prompt: its own answer has the prompt part
    prefill_lp = choices(praw, stream)[0]["logprobs"]
    n = len(encode(PROMPT))
    assert prefill_lp["token_logprobs"][:n] == prompt_scores(encode(PROMPT))


async def test_max_tokens_must_be_positive(emu: Factory, http: aiohttp.ClientSession) -> None:
    s = await emu("sglang", "both")
    extras: list[dict[str, Any]] = [{"echo": True, "max_tokens": 0}, {"max_tokens": 0}, {"max_tokens": -1}]
    for extra in extras:
        st, raw, _ = await post(http, s.url + PATH, body() | extra)
        obj = json.loads(raw)
        assert st == 400 and obj["type"] == "Bad Request", raw
        assert "max_tokens must be positive" in obj["message"] and obj["message"].startswith(
            "1 validation error"
        )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_text_offset_is_minus_one(emu: Factory, http: aiohttp.ClientSession, stream: bool) -> None:
    """SGLang does not compute `text_offset`: `to_openai_style_logprobs` appends -1 for every
    token, the prompt's (echo) and the output's (entrypoints/openai/utils.py:150-151)."""
    s = await emu("sglang", "both")
    for extra in ({"logprobs": 2}, {"logprobs": 1, "echo": True}):
        st, raw, _ = await post(http, s.url + PATH, body(stream, **extra))
        assert st == 200, raw
        lp = choices(raw, stream)[0]["logprobs"]
        n = len(encode(PROMPT)) + 6 if extra.get("echo") else 6
        assert len(lp["tokens"]) == n and lp["text_offset"] == [-1] * n, lp
