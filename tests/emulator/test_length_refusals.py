"""Over-long requests are refused as the engines refuse them.

vLLM 0.32: the renderer refuses an output limit over ``max_model_len`` (renderers/params.py:
256-268) and a prompt over it (:515-535; a text prompt is tokenized to at most
``max_model_len + 1`` tokens, so it counts "at least" that many); a prompt that fits has its
``max_tokens`` clamped to the room it leaves (entrypoints/serve/utils/api_utils.py:169-205), and
one that fills the context gets 0, which ``SamplingParams`` refuses (sampling_params.py:688).

SGLang 0.5.23: ``_validate_one_request`` (managers/tokenizer_manager.py:1307-1379) raises inside
``generate_request``'s generator, so a streamed ``/generate`` answers 200 with one error event,
then ``[DONE]`` (entrypoints/http_server.py:949-975); not streamed, a 400.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from emulator import tokenizer
from tests.emulator.conftest import Factory, sse_events
from tests.emulator.test_sampling_checks import ROLES, no_work_done, post
from tests.emulator.test_vllm import PREFILL_KTP

CTX = 64
C = "/v1/completions"
CHAT = "/v1/chat/completions"


def verr(message: str, param: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}


def too_long(count: int, at_least: bool) -> str:
    q = "at least " if at_least else ""
    return (
        f"This model's maximum context length is {CTX} tokens. However, your prompt contains {q}{count} "
        "input tokens, which exceeds this limit even without any output tokens. Please reduce the length "
        f"of the input prompt. (parameter=input_tokens, value={count})"
    )


def chat_of(n_tokens: int) -> list[dict[str, str]]:
    """Chat messages whose rendered prompt is exactly `n_tokens` tokens."""
    base = len(tokenizer.encode_chat([{"role": "user", "content": ""}]))
    assert n_tokens >= base
    return [{"role": "user", "content": "y" * (n_tokens - base)}]


# ------------------------------------------------------------------------------------------ vLLM
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_vllm_over_long_prompt(emu: Factory, http: aiohttp.ClientSession, stream: bool) -> None:
    v = await emu("vllm", "both", max_model_len=CTX)
    cases: list[tuple[str, dict[str, Any], str]] = [
        # token ids are counted as sent; "at least" goes with the count max_model_len + 1 alone
        (C, {"prompt": [5] * 70}, too_long(70, False)),
        (C, {"prompt": [5] * 65}, too_long(65, True)),
        # text is tokenized with max_length = max_model_len + 1
        (C, {"prompt": "x" * 100}, too_long(65, True)),
        (C, {"prompt": ["hi", "x" * 100]}, too_long(65, True)),
        (CHAT, {"messages": chat_of(100)}, too_long(65, True)),
    ]
    for path, extra, message in cases:
        s, raw = await post(http, v.url + path, {"max_tokens": 4, "stream": stream} | extra)
        assert s == 400 and json.loads(raw) == verr(message, "input_tokens"), (path, extra, raw)
    await no_work_done(v)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_vllm_output_limit_over_the_context(
    emu: Factory, http: aiohttp.ClientSession, stream: bool
) -> None:
    v = await emu("vllm", "both", max_model_len=CTX)

    def msg(param: str, value: int) -> str:
        return (
            f"{param}={value} cannot be greater than max_model_len={CTX}. Please request fewer output "
            f"tokens. (parameter={param}, value={value})"
        )

    chat = {"messages": chat_of(30)}
    cases: list[tuple[str, dict[str, Any], str, str]] = [
        (C, {"prompt": "hi", "max_tokens": 65}, msg("max_tokens", 65), "max_tokens"),
        (CHAT, chat | {"max_tokens": 100}, msg("max_tokens", 100), "max_tokens"),
        (
            CHAT,
            chat | {"max_completion_tokens": 65, "max_tokens": 4},
            msg("max_completion_tokens", 65),
            "max_completion_tokens",
        ),
        # checked when the renderer's params are built, before any prompt
        (C, {"prompt": [5] * 70, "max_tokens": 65}, msg("max_tokens", 65), "max_tokens"),
    ]
    for path, extra, message, param in cases:
        s, raw = await post(http, v.url + path, {"stream": stream} | extra)
        assert s == 400 and json.loads(raw) == verr(message, param), (path, extra, raw)
    # max_model_len itself is allowed (then clamped to the room the prompt leaves)
    s, raw = await post(http, v.url + C, {"prompt": [5] * 10, "max_tokens": CTX})
    assert s == 200 and json.loads(raw)["usage"]["completion_tokens"] == CTX - 10, raw


async def test_vllm_clamps_max_tokens_to_the_room_left(emu: Factory, http: aiohttp.ClientSession) -> None:
    v = await emu("vllm", "both", max_model_len=CTX)
    s, raw = await post(http, v.url + C, {"prompt": [5] * 60, "max_tokens": 50})
    got = json.loads(raw)
    assert (
        s == 200 and got["usage"]["completion_tokens"] == 4 and got["choices"][0]["finish_reason"] == "length"
    )
    s, raw = await post(http, v.url + CHAT, {"messages": chat_of(60), "max_completion_tokens": 50})
    assert s == 200 and json.loads(raw)["usage"]["completion_tokens"] == 4, raw
    # no limit: completions default to 16 (completion/protocol.py:63), chat to the whole room
    s, raw = await post(http, v.url + C, {"prompt": [5] * 10})
    assert s == 200 and json.loads(raw)["usage"]["completion_tokens"] == 16, raw
    s, raw = await post(http, v.url + C, {"prompt": [5] * 60})
    assert s == 200 and json.loads(raw)["usage"]["completion_tokens"] == 4, raw
    s, raw = await post(http, v.url + CHAT, {"messages": chat_of(30)})
    assert s == 200 and json.loads(raw)["usage"]["completion_tokens"] == CTX - 30, raw


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_vllm_prompt_filling_the_context(
    emu: Factory, http: aiohttp.ClientSession, stream: bool
) -> None:
    v = await emu("vllm", "both", max_model_len=CTX)
    zero = verr("max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)", "max_tokens")
    for path, extra in (
        (C, {"prompt": [5] * CTX, "max_tokens": 4}),
        (C, {"prompt": [5] * CTX}),
        (C, {"prompt": [[5, 6], [5] * CTX], "max_tokens": 4}),
        (CHAT, {"messages": chat_of(CTX), "max_tokens": 4}),
        (CHAT, {"messages": chat_of(CTX)}),
        # an explicit 0 or less is the same SamplingParams refusal
        (C, {"prompt": "hi", "max_tokens": 0}),
    ):
        s, raw = await post(http, v.url + path, {"stream": stream} | extra)
        assert s == 400 and json.loads(raw) == zero, (path, extra, raw)
    s, raw = await post(http, v.url + C, {"prompt": "hi", "max_tokens": -3, "stream": stream})
    assert json.loads(raw) == verr(
        "max_tokens must be at least 1, got -3. (parameter=max_tokens, value=-3)", "max_tokens"
    ), raw
    # in SamplingParams' order: after the penalties, before min_tokens
    s, raw = await post(http, v.url + C, {"prompt": [5] * CTX, "presence_penalty": 3, "stream": stream})
    assert json.loads(raw) == verr("presence_penalty must be in [-2, 2], got 3.0.", None), raw
    s, raw = await post(http, v.url + C, {"prompt": [5] * CTX, "min_tokens": -1, "stream": stream})
    assert json.loads(raw) == zero, raw
    await no_work_done(v)


async def test_vllm_echo_only_prompt_filling_the_context(emu: Factory, http: aiohttp.ClientSession) -> None:
    """An echo without generation asks 1 token whatever the room: the engine's own prompt check
    refuses it (v1/engine/input_processor.py:593-601), from inside the response's generator."""
    v = await emu("vllm", "both", max_model_len=CTX)
    message = (
        f"The decoder prompt (length {CTX}) plus the number of requested output tokens (at least 1) is "
        f"longer than the maximum model length of {CTX}. Make sure that `max_model_len` is no smaller "
        "than the number of text tokens (prompt + requested output tokens)."
    )
    body = {"prompt": [5] * CTX, "echo": True, "max_tokens": 0}
    s, raw = await post(http, v.url + C, body)
    assert s == 400 and json.loads(raw) == verr(message, None), raw
    s, raw = await post(http, v.url + C, body | {"stream": True})
    events = sse_events(raw)
    assert s == 200 and len(events) == 2 and events[1] == "[DONE]", raw
    assert json.loads(events[0]) == verr(message, None), raw
    await no_work_done(v)
    # one token shorter, it is served
    s, raw = await post(http, v.url + C, body | {"prompt": [5] * (CTX - 1)})
    assert s == 200, raw


async def test_vllm_decode_length_refusal_frees_the_prefills_blocks(
    emu: Factory, http: aiohttp.ClientSession
) -> None:
    """A refusal raised inside create_completion tells the KV connector
    (``_with_kv_transfer_rejection_cleanup``, entrypoints/generate/base/serving.py:271-303)."""
    p = await emu("vllm", "prefill", max_model_len=CTX)
    d = await emu("vllm", "decode", max_model_len=CTX)
    s, praw = await post(
        http, p.url + C, {"prompt": [5] * 20, "max_tokens": 1, "kv_transfer_params": PREFILL_KTP}
    )
    assert s == 200 and (await p.stats())["held_transfers"] == 1, praw
    ktp = json.loads(praw)["kv_transfer_params"]
    s, raw = await post(http, d.url + C, {"prompt": [5] * 20, "max_tokens": 65, "kv_transfer_params": ktp})
    assert s == 400 and json.loads(raw)["error"]["param"] == "max_tokens", raw
    for _ in range(100):
        if (await p.stats())["held_transfers"] == 0:
            break
        await asyncio.sleep(0.02)
    assert (await p.stats())["held_transfers"] == 0


# ---------------------------------------------------------------------------------------- SGLang
def sglang_too_long(n: int) -> str:
    return f"The input ({n} tokens) is longer than the model's context length ({CTX} tokens)."


def sglang_total(n: int, new: int) -> str:
    return (
        f"Requested token count exceeds the model's maximum context length of {CTX} tokens. You requested a "
        f"total of {n + new} tokens: {n} tokens from the input messages and {new} tokens for the completion. "
        "Please reduce the number of tokens in the input messages or the completion to fit within the limit."
    )


SGLANG_CASES: list[tuple[dict[str, Any], str]] = [
    ({"input_ids": [5] * 70, "sampling_params": {"max_new_tokens": 4}}, sglang_too_long(70)),
    ({"input_ids": [5] * CTX, "sampling_params": {"max_new_tokens": 4}}, sglang_too_long(CTX)),
    ({"input_ids": [5] * 40, "sampling_params": {"max_new_tokens": 30}}, sglang_total(40, 30)),
    ({"text": "x" * 100, "sampling_params": {"max_new_tokens": 4}}, sglang_too_long(101)),
    # a batch: each request's check in turn, still one error event
    ({"input_ids": [[5, 6], [5] * 70], "sampling_params": {"max_new_tokens": 4}}, sglang_too_long(70)),
]


@pytest.mark.parametrize("role", ROLES)
async def test_sglang_generate_length_refusal(emu: Factory, http: aiohttp.ClientSession, role: str) -> None:
    g = await emu("sglang", role, max_model_len=CTX, waiting_timeout_s=30.0)
    url = g.url + "/generate"
    room = 2000
    for body, message in SGLANG_CASES:
        if role != "both":
            room += 1
            body = body | {"bootstrap_host": "127.0.0.1", "bootstrap_port": g.bootstrap_port or 1}
            body |= {"bootstrap_room": room}
        s, raw = await asyncio.wait_for(post(http, url, body), 5)
        assert s == 400 and json.loads(raw) == {"error": {"message": message}}, (body, raw)
        s, raw = await asyncio.wait_for(post(http, url, body | {"stream": True}), 5)
        err = {"message": message, "type": "invalid_request_error", "code": 400, "retryable": False}
        assert s == 200, raw
        assert sse_events(raw) == [json.dumps({"error": err}, separators=(",", ":")), "[DONE]"], raw
    await no_work_done(g)


@pytest.mark.parametrize("role", ["both", "prefill"])
async def test_sglang_max_req_input_len_in_every_role(
    emu: Factory, http: aiohttp.ClientSession, role: str
) -> None:
    """A prompt within the context but at or over ``max_req_input_len`` (min(context, KV pool) - 1
    - 5 = 58 here) is refused by the scheduler's ``validate_input_length``, which
    ``handle_generate_request`` runs in every disaggregation mode: a colocated server refuses it
    as a prefill does (the tokenizer manager's length checks pass it)."""
    g = await emu("sglang", role, max_model_len=CTX, waiting_timeout_s=30.0)
    limit = CTX - 1 - 5
    message = (
        f"Input length (60 tokens) exceeds the maximum allowed length ({limit} tokens). "
        "Use a shorter input or enable --allow-auto-truncate."
    )
    boot = {} if role == "both" else {"bootstrap_host": "127.0.0.1", "bootstrap_port": g.bootstrap_port}
    body = {"input_ids": [5] * 60, "sampling_params": {"max_new_tokens": 2}, **boot}
    s, raw = await post(http, g.url + "/generate", body | {"bootstrap_room": 1})
    assert s == 400 and json.loads(raw) == {"error": {"message": message}}, raw
    # streamed: the scheduler's abort, with the prompt it left (one token), then [DONE]
    s, raw = await post(http, g.url + "/generate", body | {"bootstrap_room": 2, "stream": True})
    events = sse_events(raw)
    assert s == 200 and len(events) == 2 and events[1] == "[DONE]", raw
    meta = json.loads(events[0])["meta_info"]
    assert (
        meta["finish_reason"]
        == {
            "type": "abort",
            "message": message,
            "status_code": 400,
            "err_type": "BadRequestError",
        }
        and meta["prompt_tokens"] == 1
    ), raw
    openai = [
        (C, {"prompt": [5] * 60}),
        (CHAT, {"messages": chat_of(60)}),
    ]
    for path, fields in openai:
        b = {"model": "m", "max_tokens": 2, **boot, "bootstrap_room": 3, **fields}
        s, raw = await post(http, g.url + path, b)
        assert s == 400 and json.loads(raw)["message"] == message, (path, raw)
        # streamed: the abort is the stream's first chunk (yielded, not raised), so the 200 is
        # out; the route makes it an error event in SGLang's words (json.dumps: spaced), the
        # usage chunk counts the one-token prompt the abort left, then [DONE]
        b |= {"stream": True, "stream_options": {"include_usage": True}}
        s, raw = await post(http, g.url + path, b)
        err = {"object": "error", "message": message, "type": "BAD_REQUEST", "param": None, "code": 400}
        events = raw.split("\n\n")
        assert s == 200 and events[0] == "data: " + json.dumps({"error": err}), (path, raw)
        usage = json.loads(events[1][6:])
        assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 1, (path, raw)
        assert events[2:] == ["data: [DONE]", ""], (path, raw)
    await no_work_done(g)
    # one token under the limit, it is served
    if role == "both":
        s, raw = await post(http, g.url + "/generate", body | {"input_ids": [5] * (limit - 1)})
        assert s == 200, raw


async def test_sglang_max_req_input_len_refuses_one_prompt_of_a_streamed_generate_batch(
    emu: Factory, http: aiohttp.ClientSession
) -> None:
    """The scheduler judges a batch's requests one by one, and a streamed abort is yielded, not
    raised (tokenizer_manager.py `_handle_abort_finish_reason`, `_stream_batch_responses`): the
    refused prompt's one abort event, the other prompts served, [DONE]. Not streamed, the abort
    raises: a 400."""
    g = await emu("sglang", "both", max_model_len=CTX)
    limit = CTX - 1 - 5
    body = {"input_ids": [[5] * 4, [5] * 60, [6] * 4], "sampling_params": {"max_new_tokens": 2}}
    s, raw = await post(http, g.url + "/generate", body)
    assert s == 400 and f"Input length (60 tokens) exceeds the maximum allowed length ({limit}" in raw, raw
    s, raw = await post(http, g.url + "/generate", body | {"stream": True})
    events = sse_events(raw)
    assert s == 200 and events[-1] == "[DONE]", raw
    finals = {
        ev["index"]: ev["meta_info"]
        for ev in map(json.loads, events[:-1])
        if ev["meta_info"]["finish_reason"]
    }
    assert finals[1]["finish_reason"]["type"] == "abort" and finals[1]["prompt_tokens"] == 1, raw
    assert finals[0]["completion_tokens"] == finals[2]["completion_tokens"] == 2, raw
