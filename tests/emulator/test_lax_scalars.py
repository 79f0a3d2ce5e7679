"""Scalar fields of the OpenAI routes as the engines' pydantic request models (lax mode) read them:
what pydantic refuses is a 400 while the request is parsed, in the route's error shape, before
any work (not a 500 from a later `int("abc")`, nor a silently truncated `2.5`); what it takes is
served. Found by the API probes."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from emulator.lax import Invalid, lax_bool, lax_float, lax_int
from tests.emulator.conftest import Factory
from tests.emulator.test_sampling_checks import no_work_done, post

C = "/v1/completions"
CHAT = "/v1/chat/completions"
INT_PARSING = "Input should be a valid integer, unable to parse string as an integer"
INT_FROM_FLOAT = "Input should be a valid integer, got a number with a fractional part"
BOOL_PARSING = "Input should be a valid boolean, unable to interpret input"

# (route, fields, what the message names)
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    (C, {"max_tokens": "abc"}, f"max_tokens: {INT_PARSING}"),
    (CHAT, {"max_tokens": "abc"}, f"max_tokens: {INT_PARSING}"),
    (CHAT, {"max_completion_tokens": "1e3"}, f"max_completion_tokens: {INT_PARSING}"),
    (C, {"temperature": "warm"}, "temperature: Input should be a valid number, unable to parse string"),
    (C, {"top_p": [0.5]}, "top_p: Input should be a valid number"),
    (C, {"n": "two"}, f"n: {INT_PARSING}"),
    (C, {"seed": {"a": 1}}, "seed: Input should be a valid integer"),
    (C, {"logprobs": "x"}, f"logprobs: {INT_PARSING}"),
    (CHAT, {"logprobs": "maybe"}, f"logprobs: {BOOL_PARSING}"),
    (CHAT, {"logprobs": True, "top_logprobs": "\u0663"}, f"top_logprobs: {INT_PARSING}"),  # int() takes it
    (C, {"stream": True, "stream_options": {"include_usage": "sure"}}, "stream_options.include_usage"),
    (C, {"echo": 2}, f"echo: {BOOL_PARSING}"),
    # a fractional count: pydantic's int_from_float, not int(2.5) == 2
    (C, {"max_tokens": 2.5}, f"max_tokens: {INT_FROM_FLOAT}"),
    (CHAT, {"max_tokens": 2.5}, f"max_tokens: {INT_FROM_FLOAT}"),
    (CHAT, {"max_completion_tokens": 1.5}, f"max_completion_tokens: {INT_FROM_FLOAT}"),
    (C, {"n": 1.5}, f"n: {INT_FROM_FLOAT}"),
    (C, {"min_tokens": 0.5}, f"min_tokens: {INT_FROM_FLOAT}"),
    (C, {"top_k": 2.5}, f"top_k: {INT_FROM_FLOAT}"),
    (C, {"seed": 1.5}, f"seed: {INT_FROM_FLOAT}"),
    (C, {"logprobs": 1.5}, f"logprobs: {INT_FROM_FLOAT}"),
    (CHAT, {"logprobs": True, "top_logprobs": 1.5}, f"top_logprobs: {INT_FROM_FLOAT}"),
    # a flag's string is not stripped (an int's or a float's is)
    (C, {"stream": " true "}, f"stream: {BOOL_PARSING}"),
    (CHAT, {"stream": "true\n"}, f"stream: {BOOL_PARSING}"),
    (C, {"echo": " 1"}, f"echo: {BOOL_PARSING}"),
]


def message_of(engine: str, raw: str) -> str:
    """The route's error shape: vLLM's `{"error": {...}}`, SGLang's `{"object": "error", ...}`."""
    got = json.loads(raw)
    if engine == "vllm":
        assert got["error"]["type"] == "BadRequestError" and got["error"]["code"] == 400, got
        return str(got["error"]["message"])
    assert got["object"] == "error" and got["type"] == "Bad Request" and got["code"] == 400, got
    return str(got["message"])


def body_for(path: str, **fields: Any) -> dict[str, Any]:
    b: dict[str, Any] = {"model": "m", "max_tokens": 3}
    if path == CHAT:
        b["messages"] = [{"role": "user", "content": "hello"}]
    else:
        b["prompt"] = "hello"
    return b | fields


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_a_value_pydantic_refuses_is_a_400_before_any_work(
    emu: Factory, http: aiohttp.ClientSession, engine: str
) -> None:
    h = await emu(engine, "both")
    for path, fields, named in REFUSED:
        s, raw = await post(http, h.url + path, body_for(path, **fields))
        assert s == 400, (fields, raw)
        message = message_of(engine, raw)
        assert message.startswith("1 validation error: ") and named in message, (fields, message)
    # every refused field is named
    s, raw = await post(http, h.url + C, body_for(C, max_tokens="x", n=1.5, stream=" true "))
    assert s == 400 and message_of(engine, raw).startswith("3 validation errors: "), raw
    await no_work_done(h)
    assert not h.dead


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_the_values_pydantic_takes_are_served(
    emu: Factory, http: aiohttp.ClientSession, engine: str
) -> None:
    h = await emu(engine, "both")
    # ints and floats from strings are stripped of (Unicode) whitespace; "5.00" and 3.0 are ints
    for fields in (
        {"max_tokens": " 3 "},
        {"max_tokens": "\u30003"},
        {"max_tokens": "3.00"},
        {"max_tokens": 3.0},
        {"max_tokens": "+3"},
        {"max_tokens": 3, "temperature": " 0.5 ", "seed": "1_000"},
        {"max_tokens": 3, "n": True},
    ):
        s, raw = await post(http, h.url + C, body_for(C, **fields))
        assert s == 200, (fields, raw)
        assert json.loads(raw)["usage"]["completion_tokens"] == 3, (fields, raw)
    # flags: any case of the words, not stripped
    for word in ("TRUE", "Yes", "on", "1", "t", "Y"):
        async with http.post(h.url + C, json=body_for(C, stream=word)) as r:
            assert r.status == 200 and r.content_type == "text/event-stream", word
            await r.read()
    for word in ("FALSE", "No", "OFF", "0", "f", "N"):
        s, raw = await post(http, h.url + C, body_for(C, stream=word))
        assert s == 200 and json.loads(raw)["object"] == "text_completion", (word, raw)


# pydantic-core's own readings, including its corner cases (checked against pydantic 2.14)
INTS: list[tuple[Any, int | None]] = [
    ("5", 5), (" 5\n", 5), ("\xa05", 5), ("\x1c5", None), ("+5", 5), ("-5", -5), ("5.000", 5),
    ("5.", None), ("5.5", None), ("1_000", 1000), ("1__0", None), ("_1", None), ("1e3", None),
    ("\u0665", None), ("²", None), ("0x10", None), ("", None), ("0-9", -9), ("0+5", None), ("+-1", None),
    ("00012", 12), ("5" * 4300, int("5" * 4300)), ("5" * 4301, None), (True, 1), (5.0, 5),
    (2.5, None), (9.3e18, None), ([5], None),
]  # fmt: skip
FLOATS: list[tuple[Any, float | None]] = [
    ("0.5", 0.5), (" 1e3 ", 1000.0), (".5", 0.5), ("1.", 1.0), ("inf", float("inf")),
    ("-Infinity", float("-inf")), ("1_0.5", 10.5), ("1e_3", 1000.0), (" 1_0", None), ("\u0665", None),
    ("0x1p3", None), ("warm", None), (True, 1.0), (2, 2.0), (2**1024, None), ([1], None),
]  # fmt: skip
BOOLS: list[tuple[Any, bool | None]] = [
    ("true", True), ("TRUE", True), ("yes", True), ("on", True), ("1", True), ("t", True), ("y", True),
    ("false", False), ("Off", False), ("n", False), ("0", False), (" true ", None), ("true\n", None),
    ("2", None), ("", None), (1, True), (0, False), (2, None), (1.0, True), (0.5, None), (None, None),
]  # fmt: skip


def test_the_lax_readings_are_pydantics() -> None:
    for conv, cases in ((lax_int, INTS), (lax_float, FLOATS), (lax_bool, BOOLS)):
        for value, want in cases:
            got = conv(value)
            if want is None:
                assert isinstance(got, Invalid), (conv.__name__, value, got)
            else:
                assert got == want and type(got) is type(want), (conv.__name__, value, got)


def test_the_lax_readings_agree_with_the_installed_pydantic() -> None:
    pydantic = pytest.importorskip("pydantic")

    class M(pydantic.BaseModel):
        i: int | None = None
        f: float | None = None
        b: bool | None = None

    values: list[Any] = [v for cases in (INTS, FLOATS, BOOLS) for v, _ in cases if v is not None]
    values += ["0_5", "00.0", "-0.0", "0__5", "-01", "+0-1", "1_000.0", "1.0_0", "NaN", "1e400", 9.2e18]
    for field, conv in (("i", lax_int), ("f", lax_float), ("b", lax_bool)):
        for v in values:
            try:
                want: Any = getattr(M(**{field: v}), field)
            except pydantic.ValidationError as e:
                want = Invalid(e.errors()[0]["msg"])
            got = conv(v)
            same = got == want or (isinstance(got, float) and got != got and want != want)
            assert same and type(got) is type(want), (field, v, got, want)
