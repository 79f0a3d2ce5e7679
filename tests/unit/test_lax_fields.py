"""The OpenAI routes' scalar fields in every form the engines' pydantic models (lax mode) take
(common/lax.py): msgspec's lax mode refused `"stream": "yes"`, `"max_tokens": " 3 "` and
`"temperature": true` with a 400 the engine would not give. Each rule is checked against the
installed pydantic, and what pydantic refuses stays a 400 naming the field."""

from __future__ import annotations

import json
import math
import random
from typing import Any

import msgspec
import pytest
from pydantic import TypeAdapter

from common import lax
from common.errors import BadRequest
from common.lax import lax_bool, lax_float, lax_int
from common.request import ParsedRequest, parse_request
from common.workers import RouteKind

REFUSED = object()
INF = math.inf

# (JSON text of the value, what pydantic's lax mode makes of it; REFUSED: a validation error)
BOOLS: list[tuple[str, Any]] = [
    ("true", True),
    ("0", False),
    ("1", True),
    ("1.0", True),
    ("0.0", False),
    ("-0.0", False),
    ('"yes"', True),
    ('"YES"', True),
    ('"on"', True),
    ('"oN"', True),
    ('"Y"', True),
    ('"t"', True),
    ('"TrUe"', True),
    ('"1"', True),
    ('"no"', False),
    ('"OFF"', False),
    ('"n"', False),
    ('"F"', False),
    ('"false"', False),
    ('"0"', False),
    ('" true "', REFUSED),  # bool strings are not stripped
    ('"true "', REFUSED),
    ('" 1"', REFUSED),
    ('"2"', REFUSED),
    ('"00"', REFUSED),
    ('"1.0"', REFUSED),
    ('"abc"', REFUSED),
    ('""', REFUSED),
    ('"\\u0131"', REFUSED),  # (no Unicode case folding)
    ("2", REFUSED),
    ("-1", REFUSED),
    ("2.5", REFUSED),
    ("0.9999999999999999", REFUSED),
    ("1e400", REFUSED),
    ("[]", REFUSED),
    ("{}", REFUSED),
]
INTS: list[tuple[str, Any]] = [
    ("3", 3),
    ("true", 1),
    ("false", 0),
    ("3.0", 3),
    ("-0.0", 0),
    ("9.2e18", 9200000000000000000),
    ('"3"', 3),
    ('" 3 "', 3),  # int strings are stripped (Unicode White_Space, as Rust's trim)
    ('"\\t3\\n"', 3),
    ('"\\u00a03"', 3),
    ('"\\u30003"', 3),
    ('"\\u00853"', 3),
    ('"+3"', 3),
    ('"-3"', -3),
    ('"3.0"', 3),
    ('" +3.00 "', 3),
    ('"00012"', 12),
    ('"1_000"', 1000),
    ('" 1_000 "', 1000),
    ('"1_0.0"', 10),
    ('"0__1"', 1),  # (pydantic-core's leading-zero stripping skips underscores)
    ('"0-1"', -1),  # (and stops at a minus sign: a quirk, kept)
    ('"99999999999999999999999"', 99999999999999999999999),
    ("2.5", REFUSED),
    ("1e19", REFUSED),  # past int64 as a float
    ("1e400", REFUSED),
    ('"2.5"', REFUSED),
    ('"3."', REFUSED),
    ('".0"', REFUSED),
    ('"3.0_0"', REFUSED),
    ('"1e2"', REFUSED),
    ('"0x10"', REFUSED),
    ('"abc"', REFUSED),
    ('"yes"', REFUSED),
    ('"true"', REFUSED),
    ('""', REFUSED),
    ('" "', REFUSED),
    ('"_1"', REFUSED),
    ('"1_"', REFUSED),
    ('"1__0"', REFUSED),
    ('"+_1"', REFUSED),
    ('"--3"', REFUSED),
    ('"+-3"', REFUSED),
    ('"\\u06633"', REFUSED),  # a non-ASCII digit
    ('"\\uff13"', REFUSED),
    ('"\\u001c3"', REFUSED),  # Python's str.strip takes \x1c, Rust's trim does not
    ('"\\u200b3"', REFUSED),
    ('"1' + "0" * 4300 + '"', REFUSED),  # more than 4300 digits
    ("[3]", REFUSED),
]
FLOATS: list[tuple[str, Any]] = [
    ("true", 1.0),
    ("false", 0.0),
    ("1", 1.0),
    ("0.5", 0.5),
    ("1e400", INF),
    ("1" + "0" * 400, INF),
    ('"0.5"', 0.5),
    ('" 0.5 "', 0.5),
    ('"\\u30000.5\\u2029"', 0.5),
    ('".5"', 0.5),
    ('"5."', 5.0),
    ('"+.5e-1"', 0.05),
    ('"1E2"', 100.0),
    ('"1e400"', INF),
    ('"inf"', INF),
    ('"-Infinity"', -INF),
    ('"1_000"', 1000.0),
    ('"1_0.5"', 10.5),
    ('"1_e5"', 100000.0),
    ('" 1_000 "', REFUSED),  # underscores only without the whitespace
    ('"1__0"', REFUSED),
    ('"_1"', REFUSED),
    ('"abc"', REFUSED),
    ('"yes"', REFUSED),
    ('"true"', REFUSED),
    ('"0x10"', REFUSED),
    ('"1,5"', REFUSED),
    ('"infin"', REFUSED),
    ('"1e"', REFUSED),
    ('"."', REFUSED),
    ('"\\u0663"', REFUSED),
    ('"\\u001c3"', REFUSED),
    ('""', REFUSED),
    ("[0.5]", REFUSED),
]
RULES = [("bool", lax_bool, BOOLS), ("int", lax_int, INTS), ("float", lax_float, FLOATS)]
ADAPTERS = {"bool": TypeAdapter(bool), "int": TypeAdapter(int), "float": TypeAdapter(float)}


def decoded(raw: str) -> Any:
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:  # past msgspec's range, as common/lax.py reads it
        return lax._number(raw.encode())


def pydantic_reads(kind: str, raw: str) -> Any:
    try:
        return ADAPTERS[kind].validate_json(raw)
    except ValueError:  # (pydantic.ValidationError)
        return REFUSED


def same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and (a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)))


@pytest.mark.parametrize(
    ("kind", "raw", "want"),
    [(kind, raw, want) for kind, _, cases in RULES for raw, want in cases],
    ids=lambda x: x if isinstance(x, str) and len(x) < 30 else None,
)
def test_each_rule_reads_a_value_as_pydantic_does(kind: str, raw: str, want: Any) -> None:
    rule = {"bool": lax_bool, "int": lax_int, "float": lax_float}[kind]
    assert same(pydantic_reads(kind, raw), want), "the table disagrees with the installed pydantic"
    got = rule(decoded(raw))
    assert same(REFUSED if got is None else got, want), (raw, got)


def test_the_rules_agree_with_pydantic_on_random_strings() -> None:
    rng = random.Random(11)
    alphabet = [*"0123456789" * 2, *"_.+-eE \t\xa0\u3000\x1cYtfx", "inf", "nan", "yes", "on"]
    for _ in range(3000):
        raw = json.dumps("".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 7))))
        for kind, rule, _ in RULES:
            got = rule(decoded(raw))
            assert same(REFUSED if got is None else got, pydantic_reads(kind, raw)), (kind, raw, got)


def parse(route: RouteKind, body: bytes | dict[str, Any]) -> ParsedRequest:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_request(route, "/x", raw, default_model="m", max_n=8, max_tokens_cap=None)


def refused(route: RouteKind, body: bytes | dict[str, Any]) -> BadRequest:
    with pytest.raises(BadRequest) as e:
        parse(route, body)
    return e.value


def test_openai_requests_are_read_as_the_engines_read_them() -> None:
    raw = (
        b'{"model": "m", "prompt" :  "caf\\u00e9  \\n au lait", "stream": "yes", "max_tokens": " 3 ",'
        b' "temperature": true, "echo": "t", "n": "1", "stream_options": {"include_usage": "on"}}'
    )
    req = parse(RouteKind.COMPLETIONS, raw)
    assert (req.stream, req.max_tokens, req.n, req.include_usage) == (True, 3, 1, True)
    assert (req.fields.temperature, req.fields.echo, req.greedy) == (1.0, True, False)
    assert req.body is raw  # the engines are sent the client's bytes, to read themselves
    assert bytes(req.fields.prompt) == b'"caf\\u00e9  \\n au lait"'  # its JSON text, as sent
    plain = parse(RouteKind.COMPLETIONS, {"model": "m", "prompt": "caf\u00e9  \n au lait"})
    assert (req.prompt_units, req.prompt_peak) == (plain.prompt_units, plain.prompt_peak)

    messages = [{"role": "user", "content": [{"type": "text", "text": "hi \u00e9"}]}]
    chat = {
        "model": "m",
        "messages": messages,
        "stream": "ON",
        "max_completion_tokens": "1_000",
        "top_k": 1.0,
    }
    req = parse(RouteKind.CHAT, {**chat, "temperature": " 0 "})
    assert (req.stream, req.max_tokens, req.greedy) == (True, 1000, True)
    assert msgspec.json.decode(bytes(req.fields.messages)) == messages
    assert parse(RouteKind.CHAT, {**chat, "temperature": "1e400"}).fields.temperature == INF


def test_the_last_of_a_repeated_key_counts_as_pydantic_reads_it() -> None:
    assert parse(RouteKind.COMPLETIONS, b'{"prompt": "p", "stream": "yes", "stream": false}').stream is False
    assert parse(RouteKind.COMPLETIONS, b'{"prompt": "p", "stream": false, "stream": "y"}').stream is True
    body = b'{"prompt": "p", "stream": true, "stream_options": {"include_usage": 2, "include_usage": "on"}}'
    assert parse(RouteKind.COMPLETIONS, body).include_usage is True


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"max_tokens": 2.5}, "max_tokens", "Expected `int | null`, got `float` - at `$.max_tokens`"),
        ({"max_tokens": "abc"}, "max_tokens", "Expected `int | null`, got `str` - at `$.max_tokens`"),
        ({"n": "2.5"}, "n", "Expected `int | null`, got `str` - at `$.n`"),
        ({"echo": " true "}, "echo", "Expected `bool | null`, got `str` - at `$.echo`"),
        ({"temperature": "hot"}, "temperature", "Expected `float | null`, got `str` - at `$.temperature`"),
        (
            {"stream_options": {"include_usage": "sure"}},
            "stream_options",
            "Expected `bool | null`, got `str` - at `$.stream_options.include_usage`",
        ),
        ({"model": 5}, "model", "Expected `str | null`, got `int` - at `$.model`"),
        ({"user": 7}, "user", "Expected `str | null`, got `int` - at `$.user`"),
    ],
)
def test_what_pydantic_refuses_is_still_a_400_naming_its_field(
    extra: dict[str, Any], param: str, message: str
) -> None:
    # after a field only pydantic's lax mode takes: the 400 names the field that is wrong
    for route, prompt in ((RouteKind.COMPLETIONS, {"prompt": "p"}), (RouteKind.CHAT, {"messages": []})):
        e = refused(route, {"stream": "yes", **prompt, **extra})
        assert (e.param, e.message) == (param, f"invalid request: {message}"), route


def test_generate_keeps_msgspecs_lax_mode() -> None:
    """SGLang's /generate is a dataclass (no pydantic): the forms msgspec refuses stay refused."""
    body = {"text": "p", "stream": "yes", "sampling_params": {"max_new_tokens": 3}}
    assert parse(RouteKind.COMPLETIONS, {"prompt": "p", "stream": "yes"}).stream is True
    e = refused(RouteKind.GENERATE, body)
    assert (e.param, e.message) == (
        "stream",
        "invalid request: Expected `bool | null`, got `str` - at `$.stream`",
    )


def test_only_an_openai_body_the_fast_decode_refused_takes_the_slow_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[bytes] = []
    real = lax.coerce_openai_fields

    def spy(body: bytes) -> bytes | None:
        calls.append(body)
        return real(body)

    monkeypatch.setattr("common.request.coerce_openai_fields", spy)
    req = parse(RouteKind.COMPLETIONS, {"prompt": "p", "stream": "true", "max_tokens": "3", "temperature": 0})
    assert (req.stream, req.max_tokens, req.greedy, calls) == (True, 3, True, [])  # msgspec's forms
    assert parse(RouteKind.COMPLETIONS, {"prompt": "p", "stream": "yes"}).stream is True
    assert len(calls) == 1
    refused(RouteKind.GENERATE, {"text": "p", "stream": "yes"})
    assert len(calls) == 1
    # no JSON object, or one too deeply nested to be read as raw values: the first decode's 400
    e = refused(RouteKind.COMPLETIONS, b"[1]")
    assert (e.param, e.message) == (None, "invalid request: Expected `object`, got `array`")
    deep = b'{"stream": "yes", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    e = refused(RouteKind.COMPLETIONS, deep)
    assert (e.param, e.message) == (
        "stream",
        "invalid request: Expected `bool | null`, got `str` - at `$.stream`",
    )
    assert len(calls) == 3
