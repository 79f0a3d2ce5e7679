"""The request path's inputs to a cache-aware policy: each request's prompt key
(gateway/orchestration/keying.py) and the cached tokens an engine's answer reports
(adapters/_cached.py, gateway/orchestration/feedback.py). Table-driven, on real parsed requests
and on answer bodies shaped as the engines write them (SGLang 0.5 `meta_info.cached_tokens`,
`usage.prompt_tokens_details.cached_tokens` which SGLang's --enable-cache-report and vLLM's
--enable-prompt-tokens-details fill only when above 0)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from adapters import ADAPTERS
from adapters._cached import generate_cached, openai_cached, stream_cached
from common.request import parse_request
from common.summary import CachedTokens
from common.workers import Engine, Role, RouteKind
from gateway.orchestration.keying import prompt_key
from gateway.registry import Worker
from policies.prompt_key import PromptKey

PATHS = {
    RouteKind.GENERATE: "/generate",
    RouteKind.CHAT: "/v1/chat/completions",
    RouteKind.COMPLETIONS: "/v1/completions",
}


def parsed(route: RouteKind, body: dict[str, Any]) -> Any:
    """`body` (model "m" unless it names one) as the gateway parses it on `route`'s path."""
    return parse_request(
        route,
        PATHS[route],
        json.dumps({"model": "m", **body}).encode(),
        default_model="m",
        max_n=8,
        max_tokens_cap=None,
    )


def key_of(route: RouteKind, body: dict[str, Any]) -> PromptKey | None:
    return prompt_key(parsed(route, body))


# ---- prompt keys ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("route", "body", "expected"),
    [
        (RouteKind.COMPLETIONS, {"prompt": [5, 6, 7]}, PromptKey.from_token_ids([5, 6, 7])),
        (RouteKind.COMPLETIONS, {"prompt": "hello world"}, PromptKey.from_text("hello world")),
        # escapes are decoded: the key is the text, not its JSON spelling
        (RouteKind.COMPLETIONS, {"prompt": 'say "hi"\n'}, PromptKey.from_text('say "hi"\n')),
        (RouteKind.COMPLETIONS, {"prompt": "caf\u00e9 \u2603"}, PromptKey.from_text("caf\u00e9 \u2603")),
        (RouteKind.GENERATE, {"text": "abc"}, PromptKey.from_text("abc")),
        (RouteKind.GENERATE, {"input_ids": [1, 2]}, PromptKey.from_token_ids([1, 2])),
        # SGLang reads input_ids whenever they are given, on /generate and on its chat
        (RouteKind.GENERATE, {"text": "abc", "input_ids": [9]}, PromptKey.from_token_ids([9])),
        (
            RouteKind.CHAT,
            {"messages": [{"role": "user", "content": "x"}], "input_ids": [4, 4]},
            PromptKey.from_token_ids([4, 4]),
        ),
        (
            RouteKind.CHAT,
            {"messages": [{"role": "user", "content": "x"}]},
            PromptKey.from_chat([{"role": "user", "content": "x"}]),
        ),
        (
            RouteKind.CHAT,
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            PromptKey.from_chat([{"role": "user", "content": "x"}], [{"type": "function"}]),
        ),
        # batches are not keyed
        (RouteKind.COMPLETIONS, {"prompt": ["a", "b"]}, None),
        (RouteKind.GENERATE, {"text": ["a", "b"]}, None),
    ],
)
def test_prompt_key(route: RouteKind, body: dict[str, Any], expected: PromptKey | None) -> None:
    got = key_of(route, {"model": "m", **body})
    if expected is None:
        assert got is None
        return
    assert got is not None
    assert (got.kind, got.data, got.units, got.token_ids) == (
        expected.kind,
        expected.data,
        expected.units,
        expected.token_ids,
    )


def test_a_conversations_turns_share_a_prefix_and_tools_change_it() -> None:
    turn1 = [{"role": "system", "content": "S" * 200}, {"role": "user", "content": "q1" * 50}]
    turn2 = [*turn1, {"role": "assistant", "content": "a1" * 50}, {"role": "user", "content": "q2"}]
    k1 = key_of(RouteKind.CHAT, {"messages": turn1})
    k2 = key_of(RouteKind.CHAT, {"messages": turn2})
    k3 = key_of(RouteKind.CHAT, {"messages": turn2, "tools": [{"type": "function", "name": "f"}]})
    assert k1 is not None and k2 is not None and k3 is not None
    c1, c2, c3 = k1.approx_chain(16), k2.approx_chain(16), k3.approx_chain(16)
    assert len(c1) >= 8 and c2[: len(c1)] == c1  # turn 2 extends turn 1's blocks
    assert c3[0] != c2[0]  # tools come first: another prefix


def test_the_same_words_as_chat_and_as_completion_share_nothing() -> None:
    text = key_of(RouteKind.COMPLETIONS, {"prompt": "user says hello " * 20})
    chat = key_of(RouteKind.CHAT, {"messages": [{"role": "user", "content": "user says hello " * 20}]})
    assert text is not None and chat is not None
    assert text.approx_chain(16)[0] != chat.approx_chain(16)[0]


# ---- cached tokens in answers -------------------------------------------------------------------


def usage(details: Any = "absent") -> dict[str, Any]:
    u: dict[str, Any] = {"prompt_tokens": 100, "completion_tokens": 2, "total_tokens": 102}
    if details != "absent":
        u["prompt_tokens_details"] = details
    return u


def sse(*events: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"choices": [], "usage": usage({"cached_tokens": 64})}, CachedTokens(64, "details", 100)),
        ({"choices": [], "usage": usage(None)}, CachedTokens(0, "usage", 100)),  # SGLang: null when 0
        ({"choices": [], "usage": usage()}, CachedTokens(0, "usage", 100)),  # vLLM: left out when 0
        ({"choices": []}, None),  # no usage at all
        ({"error": {"message": "x"}}, None),
    ],
)
def test_openai_answers(body: dict[str, Any], expected: CachedTokens | None) -> None:
    assert openai_cached(json.dumps(body).encode()) == expected


def test_generate_answers_report_the_field() -> None:
    one = {"text": "x", "meta_info": {"prompt_tokens": 40, "cached_tokens": 32}}
    assert generate_cached(json.dumps(one).encode()) == CachedTokens(32, "field", 40)
    batch = [one, {"text": "y", "meta_info": {"cached_tokens": 0}}]
    assert generate_cached(json.dumps(batch).encode()) == CachedTokens(32, "field", 40)
    assert generate_cached(b'{"text": "x", "meta_info": {}}') is None
    assert generate_cached(b"not json") is None


def test_a_streams_end_is_read_for_its_usage_chunk() -> None:
    chunk = {"choices": [{"index": 0, "delta": {"content": "a"}}], "usage": None}
    last = {"choices": [], "usage": usage({"cached_tokens": 48})}
    tail = sse(chunk, chunk, last)
    assert stream_cached(tail, generate=False) == CachedTokens(48, "details", 100)
    # the end cut inside the usage event: nothing whole to read
    assert stream_cached(tail[: tail.index(b'"usage": {')] + b'"usage": {"pro', generate=False) is None
    assert stream_cached(sse(chunk), generate=False) is None  # no usage chunk asked


def test_a_generate_streams_last_event_has_the_count() -> None:
    ev = [{"text": "a" * i, "meta_info": {"cached_tokens": 16, "completion_tokens": i}} for i in range(3)]
    assert stream_cached(sse(*ev), generate=True) == CachedTokens(16, "field")


@pytest.mark.parametrize("engine", [Engine.SGLANG, Engine.VLLM])
def test_adapters_read_colocated_answers(engine: Engine) -> None:
    adapter = ADAPTERS[engine]
    req = parsed(RouteKind.CHAT, {"messages": [{"role": "user", "content": "x"}]})
    body = json.dumps({"choices": [], "usage": usage({"cached_tokens": 7})}).encode()
    assert adapter.answer_cached(req, body, stream=False) == CachedTokens(7, "details", 100)
    assert adapter.answer_cached(req, sse({"choices": [], "usage": usage()}), stream=True) == CachedTokens(
        0, "usage", 100
    )


def test_sglang_generate_answers_through_the_adapter() -> None:
    req = parsed(RouteKind.GENERATE, {"text": "x"})
    body = json.dumps({"text": "x", "meta_info": {"cached_tokens": 5}}).encode()
    assert ADAPTERS[Engine.SGLANG].answer_cached(req, body, stream=False) == CachedTokens(5, "field")


# ---- what counts as a report ----------------------------------------------------------------------


def test_details_left_out_count_as_zero_only_from_a_worker_known_to_send_them() -> None:
    from gateway.orchestration.feedback import reported

    w = Worker("w", "http://127.0.0.1:1", Role.COLOCATED, Engine.SGLANG)
    assert reported(w, None, 100) is None
    assert reported(w, CachedTokens(0, "usage"), 100) is None  # the flag may be off: unknown
    assert reported(w, CachedTokens(12, "field"), 100) == 12  # /generate's meta_info: always there
    assert not w.reports_details
    assert reported(w, CachedTokens(30, "details", 100), 100) == 30
    assert w.reports_details
    assert reported(w, CachedTokens(0, "usage"), 100) == 0  # now a 0 left out
    # a text prompt the gateway estimated at 25 tokens, 100 for the engine: the same share
    assert reported(w, CachedTokens(80, "details", 100), 25) == 20
    assert reported(w, CachedTokens(100, "details", 100), 25) == 25


# ---- each worker's KV capacity, from its probes --------------------------------------------------


def test_the_probes_read_each_engines_kv_capacity() -> None:
    from adapters.base import ProbeInfo

    sgl = ADAPTERS[Engine.SGLANG].parse_info(
        "/server_info",
        json.dumps({"max_total_num_tokens": 426784, "context_length": 8192}).encode(),
        ProbeInfo(),
    )
    assert sgl.kv_capacity_tokens == 426784
    metrics = (
        b'vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",'
        b'num_gpu_blocks="8192",enable_prefix_caching="True"} 1.0\n'
    )
    vll = ADAPTERS[Engine.VLLM].parse_info("/metrics", metrics, ProbeInfo())
    assert (vll.block_size, vll.kv_capacity_tokens) == (16, 16 * 8192)
