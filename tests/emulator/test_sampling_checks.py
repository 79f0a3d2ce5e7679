"""Invalid sampling parameters are refused as the engines refuse them: vLLM 0.32's
``SamplingParams._verify_args`` (a 400 ``{"error": {message, type, param, code}}`` on both OpenAI
routes, stream or not) and SGLang 0.5.23's ``SamplingParams.verify`` (``/generate``: a 400
``{"error": {"message"}}``, or in a stream a 200 with an error event; the OpenAI routes: a 400
``{"object": "error", ...}``, stream or not). Every role; a refused request does no work (no
admission, no KV transfer, no bootstrap room). Boundary values are still served."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import aiohttp
import pytest

from emulator.api import EmulatorHandle
from emulator.sampling_checks import sglang_generate_refusal, sglang_openai_refusal, vllm_refusal
from tests.emulator.conftest import Factory, sse_events
from tests.emulator.test_sglang import boot
from tests.emulator.test_vllm import PREFILL_KTP

PROMPT = "The capital of France is"
ROLES = ["prefill", "decode", "both"]
C = "/v1/completions"
OPENAI = [C, "/v1/chat/completions"]


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, str]:
    async with http.post(url, json=body) as r:
        return r.status, await r.text()


def openai_body(path: str, stream: bool, **extra: Any) -> dict[str, Any]:
    b: dict[str, Any] = {"model": "m", "max_tokens": 4, "stream": stream}
    if path.endswith("chat/completions"):
        b["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        b["prompt"] = PROMPT
    return b | extra


async def no_work_done(h: EmulatorHandle) -> None:
    st = await h.stats()
    assert st["running"] == 0 and st["kv_blocks_used"] == 0, st
    assert st["prompt_tokens_total"] == 0 and st["kv_transfers_ok"] == st["kv_transfers_failed"] == 0, st
    assert st["held_transfers"] == 0 and st["pending_rooms"] == 0, st


# ------------------------------------------------------------------------------------------ vLLM
def vparam(msg: str, param: str, value: str) -> tuple[str, str]:
    return f"{msg} (parameter={param}, value={value})", param


VLLM_REFUSED: list[tuple[dict[str, Any], tuple[str, str | None]]] = [
    ({"presence_penalty": 3}, ("presence_penalty must be in [-2, 2], got 3.0.", None)),
    ({"presence_penalty": -2.5}, ("presence_penalty must be in [-2, 2], got -2.5.", None)),
    ({"frequency_penalty": 2.01}, ("frequency_penalty must be in [-2, 2], got 2.01.", None)),
    ({"repetition_penalty": 0}, ("repetition_penalty must be greater than zero, got 0.0.", None)),
    ({"repetition_penalty": -1.5}, ("repetition_penalty must be greater than zero, got -1.5.", None)),
    ({"temperature": -1}, vparam("temperature must be non-negative, got -1.0.", "temperature", "-1.0")),
    ({"temperature": 2.5}, vparam("temperature must be in [0, 2], got 2.5.", "temperature", "2.5")),
    ({"top_p": 0}, vparam("top_p must be in (0, 1], got 0.0.", "top_p", "0.0")),
    ({"top_p": 1.5}, vparam("top_p must be in (0, 1], got 1.5.", "top_p", "1.5")),
    ({"top_k": -2}, ("top_k must be 0 (disable), or at least 1, got -2.", None)),
    ({"top_k": -5.0}, ("top_k must be 0 (disable), or at least 1, got -5.", None)),
    ({"min_p": 1.5}, ("min_p must be in [0, 1], got 1.5.", None)),
    ({"min_p": -0.1}, ("min_p must be in [0, 1], got -0.1.", None)),
    ({"min_tokens": -1}, ("min_tokens must be greater than or equal to 0, got -1.", None)),
    ({"min_tokens": 10}, ("min_tokens must be less than or equal to max_tokens=4, got 10.", None)),
    # _verify_args' order: the penalties before the temperature, the temperature before top_p
    (
        {"temperature": -1, "presence_penalty": 9, "top_p": 0},
        ("presence_penalty must be in [-2, 2], got 9.0.", None),
    ),
    ({"temperature": 3, "top_p": 0}, vparam("temperature must be in [0, 2], got 3.0.", "temperature", "3.0")),
]


@pytest.mark.parametrize("role", ROLES)
async def test_vllm_refuses_invalid_sampling_params(
    emu: Factory, http: aiohttp.ClientSession, role: str
) -> None:
    v = await emu("vllm", role)
    for path in OPENAI:
        for stream in (False, True):
            for extra, (message, param) in VLLM_REFUSED:
                s, raw = await post(http, v.url + path, openai_body(path, stream, **extra))
                assert s == 400, (path, stream, extra, raw)
                want = {"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}
                assert json.loads(raw) == want, (path, stream, extra)
    await no_work_done(v)
    st = await v.stats()
    assert st["errors"] == 2 * 2 * len(VLLM_REFUSED) and st["completed"] == 0, st


async def test_vllm_refusal_order_among_its_other_checks(emu: Factory, http: aiohttp.ClientSession) -> None:
    v = await emu("vllm", "both", max_model_len=64)
    url = v.url + "/v1/completions"
    # n > 1 with a negative temperature: _verify_args comes before _verify_greedy_sampling
    s, raw = await post(http, url, openai_body(C, False, n=2, temperature=-1))
    assert s == 400 and json.loads(raw)["error"]["param"] == "temperature", raw
    s, raw = await post(http, url, openai_body(C, False, n=2, temperature=0))
    assert s == 400 and "n must be 1 when using greedy sampling, got 2." in raw, raw
    # the renderer's prompt length check comes before SamplingParams
    s, raw = await post(http, url, openai_body(C, False, prompt="x" * 100, temperature=-1))
    assert s == 400 and json.loads(raw)["error"]["param"] == "input_tokens", raw
    # min_tokens against each prompt's max_tokens as the engine sets it (clamped to the room
    # the prompt leaves; echo without generation: 1)
    s, raw = await post(http, url, openai_body(C, False, prompt=[1] * 60, max_tokens=50, min_tokens=10))
    assert json.loads(raw)["error"]["message"] == (
        "min_tokens must be less than or equal to max_tokens=4, got 10."
    ), raw
    s, raw = await post(http, url, openai_body(C, False, echo=True, max_tokens=0, min_tokens=2))
    assert json.loads(raw)["error"]["message"] == (
        "min_tokens must be less than or equal to max_tokens=1, got 2."
    ), raw
    s, raw = await post(http, url, openai_body(C, False, prompt=[[1, 2, 3], [1] * 62], min_tokens=3))
    assert json.loads(raw)["error"]["message"] == (
        "min_tokens must be less than or equal to max_tokens=2, got 3."
    ), raw


VLLM_VALID: list[dict[str, Any]] = [
    {"temperature": 0},
    {"temperature": 2},
    {"temperature": 0.001},
    {"top_p": 1},
    {"top_p": 0.01},
    {"top_k": -1},
    {"top_k": 0},
    {"top_k": 1},
    {"min_p": 0},
    {"min_p": 1},
    {"presence_penalty": -2, "frequency_penalty": 2},
    {"presence_penalty": 2, "frequency_penalty": -2},
    {"repetition_penalty": 0.01},
    {"repetition_penalty": 5},
    {"min_tokens": 0},
    {"min_tokens": 4},
    {"temperature": None, "top_p": None, "top_k": None, "min_p": None, "repetition_penalty": None},
]


async def test_vllm_serves_boundary_values(emu: Factory, http: aiohttp.ClientSession) -> None:
    v = await emu("vllm", "both")
    for path in OPENAI:
        for stream in (False, True):
            for extra in VLLM_VALID:
                s, raw = await post(http, v.url + path, openai_body(path, stream, **extra))
                assert s == 200, (path, stream, extra, raw)
                assert raw.endswith("data: [DONE]\n\n") if stream else "choices" in json.loads(raw)


async def test_vllm_decode_refusal_frees_the_prefills_blocks(
    emu: Factory, http: aiohttp.ClientSession
) -> None:
    p = await emu("vllm", "prefill")
    d = await emu("vllm", "decode")
    ok = openai_body("/v1/completions", False, temperature=0)
    s, praw = await post(
        http, p.url + "/v1/completions", ok | {"max_tokens": 1, "kv_transfer_params": PREFILL_KTP}
    )
    assert s == 200 and (await p.stats())["held_transfers"] == 1, praw
    ktp = json.loads(praw)["kv_transfer_params"]
    # min_tokens is a decode-only refusal (a prefill with max_tokens 1 is sent without it)
    s, raw = await post(http, d.url + "/v1/completions", ok | {"min_tokens": 9, "kv_transfer_params": ktp})
    assert s == 400 and "min_tokens must be less than or equal to max_tokens=4, got 9." in raw, raw
    await no_work_done(d)
    # the prefill is told (in the background) that its blocks will not be read
    for _ in range(100):
        if (await p.stats())["held_transfers"] == 0:
            break
        await asyncio.sleep(0.02)
    pst = await p.stats()
    assert pst["held_transfers"] == 0 and pst["kv_blocks_used"] == 0 and pst["kv_transfers_ok"] == 0, pst


# ---------------------------------------------------------------------------------------- SGLang
SGLANG_GENERATE_REFUSED: list[tuple[dict[str, Any], str]] = [
    # /generate reports the values as sent (an int stays an int)
    ({"temperature": -1}, "temperature must be a non-negative finite number, got -1."),
    ({"temperature": -0.5}, "temperature must be a non-negative finite number, got -0.5."),
    ({"top_p": 0}, "top_p must be in (0, 1], got 0."),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5."),
    ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5."),
    ({"top_k": 0}, "top_k must be -1 (disable) or at least 1, got 0."),
    ({"top_k": -2}, "top_k must be -1 (disable) or at least 1, got -2."),
    ({"frequency_penalty": 2.5}, "frequency_penalty must be in [-2, 2], got 2.5."),
    ({"presence_penalty": -3}, "presence_penalty must be in [-2, 2], got -3."),
    ({"repetition_penalty": 0}, "repetition_penalty must be in (0, 2] (1.0 = no penalty), got 0."),
    ({"repetition_penalty": 2.5}, "repetition_penalty must be in (0, 2] (1.0 = no penalty), got 2.5."),
    ({"min_new_tokens": -1}, "min_new_tokens must be in [0, max_new_tokens], got -1."),
    ({"max_new_tokens": -1}, "max_new_tokens must be at least 0, got -1."),
    ({"min_new_tokens": 10}, "min_new_tokens must be in [0, max_new_tokens(4)], got 10."),
    ({"sampling_seed": 2**63}, "sampling_seed must be in [-2**63, 2**63 - 1], got 9223372036854775808."),
    # verify's order: temperature, top_p, min_p, top_k, the penalties
    ({"top_k": 0, "top_p": 0, "presence_penalty": 5}, "top_p must be in (0, 1], got 0."),
    ({"top_k": 0, "presence_penalty": 5}, "top_k must be -1 (disable) or at least 1, got 0."),
]


def generate_body(
    stream: bool, sp: dict[str, Any], role: str, h: EmulatorHandle, room: int
) -> dict[str, Any]:
    b: dict[str, Any] = {"text": PROMPT, "sampling_params": {"max_new_tokens": 4} | sp, "stream": stream}
    if role != "both":  # P/D: the refusal comes before the room is offered or waited for
        b |= {"bootstrap_host": "127.0.0.1", "bootstrap_port": h.bootstrap_port or 1, "bootstrap_room": room}
    return b


@pytest.mark.parametrize("role", ROLES)
async def test_sglang_generate_refuses_invalid_sampling_params(
    emu: Factory, http: aiohttp.ClientSession, role: str
) -> None:
    g = await emu("sglang", role, waiting_timeout_s=30.0)
    url = g.url + "/generate"
    room = 1000
    for sp, message in SGLANG_GENERATE_REFUSED:
        room += 1
        s, raw = await asyncio.wait_for(post(http, url, generate_body(False, sp, role, g, room)), 5)
        assert s == 400 and json.loads(raw) == {"error": {"message": message}}, (sp, raw)
        # a stream's ValueError comes out of its generator: 200, an error event, [DONE]
        room += 1
        s, raw = await asyncio.wait_for(post(http, url, generate_body(True, sp, role, g, room)), 5)
        err = {"message": message, "type": "invalid_request_error", "code": 400, "retryable": False}
        assert s == 200 and sse_events(raw) == [json.dumps({"error": err}, separators=(",", ":")), "[DONE]"]
    await no_work_done(g)


async def test_sglang_generate_batch_checks_each_prompts_params(
    emu: Factory, http: aiohttp.ClientSession
) -> None:
    g = await emu("sglang", "both", max_model_len=64)
    sps = [{"max_new_tokens": 4}, {"max_new_tokens": 4, "top_k": 0}]
    s, raw = await post(http, g.url + "/generate", {"text": ["a", "b"], "sampling_params": sps})
    assert s == 400 and json.loads(raw)["error"]["message"] == (
        "top_k must be -1 (disable) or at least 1, got 0."
    ), raw
    # each request's length check before its sampling params' (_validate_one_request first)
    long = {"input_ids": [[1] * 70, [1, 2]], "sampling_params": [{"top_k": 0}, {"max_new_tokens": 1}]}
    s, raw = await post(http, g.url + "/generate", long)
    assert s == 400 and "is longer than the model's context length" in raw, raw
    # n > 1: every sample's params are the prompt's
    s, raw = await post(
        http, g.url + "/generate", {"text": "a", "sampling_params": {"n": 2, "max_new_tokens": 4, "top_p": 0}}
    )
    assert s == 400 and json.loads(raw)["error"]["message"] == "top_p must be in (0, 1], got 0.", raw


SGLANG_OPENAI_REFUSED: list[tuple[dict[str, Any], str]] = [
    # the OpenAI routes' pydantic fields: floats reported as floats
    ({"temperature": -1}, "temperature must be a non-negative finite number, got -1.0."),
    ({"top_p": 0}, "top_p must be in (0, 1], got 0.0."),
    ({"top_p": 1.01}, "top_p must be in (0, 1], got 1.01."),
    ({"min_p": 2}, "min_p must be in [0, 1], got 2.0."),
    ({"top_k": 0}, "top_k must be -1 (disable) or at least 1, got 0."),
    ({"top_k": -3}, "top_k must be -1 (disable) or at least 1, got -3."),
    ({"frequency_penalty": -2.5}, "frequency_penalty must be in [-2, 2], got -2.5."),
    ({"presence_penalty": 3}, "presence_penalty must be in [-2, 2], got 3.0."),
    ({"repetition_penalty": 0}, "repetition_penalty must be in (0, 2] (1.0 = no penalty), got 0.0."),
    ({"repetition_penalty": 3}, "repetition_penalty must be in (0, 2] (1.0 = no penalty), got 3.0."),
    ({"min_tokens": -1}, "min_new_tokens must be in [0, max_new_tokens], got -1."),
    ({"min_tokens": 10}, "min_new_tokens must be in [0, max_new_tokens(4)], got 10."),
    ({"seed": 2**63}, "sampling_seed must be in [-2**63, 2**63 - 1], got 9223372036854775808."),
]


@pytest.mark.parametrize("role", ROLES)
async def test_sglang_openai_refuses_invalid_sampling_params(
    emu: Factory, http: aiohttp.ClientSession, role: str
) -> None:
    g = await emu("sglang", role, waiting_timeout_s=30.0)
    room = 2000
    for path in OPENAI:
        for stream in (False, True):
            for extra, message in SGLANG_OPENAI_REFUSED:
                room += 1
                b = openai_body(path, stream, **extra)
                if role != "both":
                    b |= {"bootstrap_host": "127.0.0.1", "bootstrap_port": g.bootstrap_port or 1}
                    b["bootstrap_room"] = room
                s, raw = await asyncio.wait_for(post(http, g.url + path, b), 5)
                want = {"object": "error", "message": message, "type": "BadRequestError", "param": None}
                assert s == 400 and json.loads(raw) == want | {"code": 400}, (path, stream, extra, raw)
    await no_work_done(g)


async def test_sglang_chat_max_tokens_maps_to_max_new_tokens(
    emu: Factory, http: aiohttp.ClientSession
) -> None:
    g = await emu("sglang", "both")
    path = "/v1/chat/completions"
    # chat: max_new_tokens = max_completion_tokens or max_tokens
    s, raw = await post(http, g.url + path, openai_body(path, False, max_tokens=-2))
    assert s == 400 and json.loads(raw)["message"] == "max_new_tokens must be at least 0, got -2.", raw
    s, raw = await post(http, g.url + path, openai_body(path, True, max_completion_tokens=3, min_tokens=5))
    assert s == 400 and json.loads(raw)["message"] == (
        "min_new_tokens must be in [0, max_new_tokens(3)], got 5."
    ), raw
    # completions: max_tokens <= 0 is its pydantic validator's; min_tokens against the default 16
    s, raw = await post(http, g.url + "/v1/completions", {"prompt": PROMPT, "min_tokens": 17})
    assert json.loads(raw)["message"] == "min_new_tokens must be in [0, max_new_tokens(16)], got 17.", raw


SGLANG_VALID: list[dict[str, Any]] = [
    {"temperature": 0},
    {"temperature": 0, "top_k": 0},  # greedy: top_k becomes 1 before verify
    {"temperature": 0, "top_k": -7},
    {"temperature": 5},  # no upper bound on SGLang
    {"top_p": 1},
    {"top_k": -1},
    {"top_k": 1},
    {"min_p": 0},
    {"min_p": 1},
    {"presence_penalty": -2, "frequency_penalty": 2},
    {"presence_penalty": 2, "frequency_penalty": -2},
    {"repetition_penalty": 2},
    {"repetition_penalty": 0.01},
]


async def test_sglang_serves_boundary_values(emu: Factory, http: aiohttp.ClientSession) -> None:
    g = await emu("sglang", "both")
    for stream in (False, True):
        for extra in [*SGLANG_VALID, {"min_new_tokens": 4}, {"sampling_seed": 2**63 - 1}]:
            b = {"text": PROMPT, "sampling_params": {"max_new_tokens": 4} | extra, "stream": stream}
            s, raw = await post(http, g.url + "/generate", b)
            assert s == 200 and "error" not in raw, (stream, extra, raw)
        for path in OPENAI:
            for extra in [*SGLANG_VALID, {"min_tokens": 4}, {"seed": -(2**63)}]:
                s, raw = await post(http, g.url + path, openai_body(path, stream, **extra))
                assert s == 200 and "error" not in raw, (path, stream, extra, raw)


async def test_sglang_pd_boundary_values_are_served(emu: Factory, http: aiohttp.ClientSession) -> None:
    p = await emu("sglang", "prefill")
    d = await emu("sglang", "decode")
    for path in OPENAI:
        b = openai_body(path, False, temperature=0, top_k=0, top_p=1, repetition_penalty=2) | boot(p)
        (ps, praw), (ds, draw) = await asyncio.gather(
            post(http, p.url + path, b), post(http, d.url + path, b)
        )
        assert ps == 200 and ds == 200, (praw, draw)


# ------------------------------------------------------------------------- values JSON cannot carry
def test_non_finite_values() -> None:
    """The emulator's JSON decoder refuses NaN/Infinity/1e999 itself; the checks still follow
    the engines for them."""
    assert vllm_refusal({"temperature": math.inf}, [4]) == (
        "temperature must be a finite number, got inf. (parameter=temperature, value=inf)",
        "temperature",
    )
    assert vllm_refusal({"repetition_penalty": math.nan}, [4]) == (
        "repetition_penalty must be a finite number, got nan.",
        None,
    )
    assert vllm_refusal({"presence_penalty": math.nan}, [4]) == (
        "presence_penalty must be in [-2, 2], got nan.",
        None,
    )
    assert sglang_generate_refusal({"temperature": math.nan}) == (
        "temperature must be a non-negative finite number, got nan."
    )
    assert sglang_openai_refusal({"temperature": math.inf}, chat=True) == (
        "temperature must be a non-negative finite number, got inf."
    )


def test_nothing_sent_nothing_refused() -> None:
    assert vllm_refusal({}, [16]) is None
    assert sglang_generate_refusal({}) is None
    assert sglang_openai_refusal({}, chat=True) is None and sglang_openai_refusal({}, chat=False) is None
    # types the engines refuse earlier (pydantic, SGLang's JSON contract) are not judged here
    assert vllm_refusal({"temperature": "hot", "top_k": 1.5}, [16]) is None
    assert sglang_generate_refusal({"temperature": True, "top_k": 0.0}) is None


@pytest.mark.parametrize("path", OPENAI)
async def test_vllm_stream_options_need_a_stream(
    emu: Factory, http: aiohttp.ClientSession, path: str
) -> None:
    """The request model's ``validate_stream_options`` (the body as vLLM's own handlers answer it)."""
    v = await emu("vllm", "decode")
    s, raw = await post(http, v.url + path, openai_body(path, False, stream_options={"include_usage": True}))
    assert s == 400 and json.loads(raw) == {
        "error": {
            "message": "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
            "type": "BadRequestError",
            "param": "stream_options",
            "code": 400,
        }
    }
    await no_work_done(v)
    for stream, opts in ((True, {"include_usage": True}), (False, None), (False, {})):
        s, raw = await post(http, v.url + path, openai_body(path, stream, stream_options=opts))
        assert s == 200, raw
