"""What clients send that the engines accept, and what HTTP asks of the answers.

- No `model`: vLLM answers with its served model and SGLang with its own default, so clients
  written against one engine often leave it out. Where the gateway serves one model it does the
  same (and names that model to the engine); where it serves several it is a 400 saying so.
- 405 answers carry `Allow`; a compressed request body is a 415 naming its encoding (the engines
  do not take one either), not a confusing "not UTF-8" or JSON error.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from gateway.config import AdminConfig
from tests.integration.conftest import Cluster, build_cluster, stop_cluster
from tests.integration.test_gateway import post, sse_events

TOKEN = "compat-admin-token"
OTHERS = {"m-sglang": ("vllm-p", "vllm-d", "col"), "m-vllm": ("sgl-p", "sgl-d", "col")}


@pytest.fixture
async def admin_cluster() -> AsyncIterator[Cluster]:
    c = await build_cluster(admin=AdminConfig(token=TOKEN))
    try:
        yield c
    finally:
        await stop_cluster(c)


async def keep_only(c: Cluster, model: str) -> None:
    """Remove every worker of the other models through the admin API."""
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as s:
        for wid in OTHERS[model]:
            async with s.delete(f"{c.url}/admin/workers/{wid}") as r:
                assert r.status == 200, await r.text()
        async with s.get(c.url + "/v1/models") as r:
            assert [m["id"] for m in (await r.json())["data"]] == [model]


def text_of(raw: bytes, stream: bool, chat: bool) -> str:
    objs = [json.loads(raw)] if not stream else [e for e in sse_events(raw) if e != "[DONE]"]
    out = ""
    for o in objs:
        for ch in o.get("choices", []):
            if chat:
                out += (ch.get("delta") if stream else ch["message"]).get("content") or ""
            else:
                out += ch.get("text") or ""
    return out


async def test_missing_model_is_a_400_where_several_are_served_on_the_route(cluster: Cluster) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": "hi", "max_tokens": 3}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
    ):
        s, _, raw = await post(cluster.url + path, body)
        err = json.loads(raw)["error"]
        assert s == 400 and err["param"] == "model", (path, raw)
        assert "more than one model is served" in err["message"]
    # SGLang's /generate has no `model` field: it goes to the one model served on that route
    # (m-sglang; m-vllm's workers do not answer /generate), the same answer as naming it
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    s, _, unnamed = await post(cluster.url + "/generate", body)
    _, _, named = await post(cluster.url + "/generate", {**body, "model": "m-sglang"})
    assert s == 200, unnamed
    assert json.loads(unnamed)["text"] == json.loads(named)["text"] != ""


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("model", ["m-sglang", "m-vllm"])
async def test_missing_model_means_the_one_served(admin_cluster: Cluster, model: str, stream: bool) -> None:
    """Through the P/D pair, without `model`, the answer equals the one with it, token for token,
    and names the served model as the engine would."""
    c = admin_cluster
    await keep_only(c, model)
    bodies: list[tuple[str, dict[str, Any]]] = [
        ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 8}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Say something"}], "max_tokens": 8},
        ),
    ]
    for path, body in bodies:
        body = {**body, "temperature": 0, "stream": stream}
        s1, _, named = await post(c.url + path, {**body, "model": model})
        s2, _, unnamed = await post(c.url + path, body)
        assert s1 == s2 == 200, (path, unnamed)
        chat = path.endswith("chat/completions")
        assert text_of(unnamed, stream, chat) == text_of(named, stream, chat) != ""
        first = json.loads(unnamed) if not stream else sse_events(unnamed)[0]
        assert first["model"] == model, first
    s, _, raw = await post(c.url + "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4}})
    if model == "m-sglang":
        assert s == 200 and json.loads(raw)["meta_info"]["completion_tokens"] == 4, raw
    else:  # the one model has no /generate: the answer says so (not "more than one model")
        err = json.loads(raw)["error"]
        assert s == 400 and "SGLang's native route" in err["message"], raw
    # and the official client, which always sends `model`, is unaffected
    client = AsyncOpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0)
    try:
        r = await client.completions.create(model=model, prompt="abc", max_tokens=3, temperature=0)
        assert r.choices[0].text
    finally:
        await client.close()


async def test_method_not_allowed_names_the_allowed_methods(admin_cluster: Cluster) -> None:
    c = admin_cluster
    async with aiohttp.ClientSession() as s:
        for method, path, allow in (
            ("GET", "/v1/completions", "POST"),
            ("PUT", "/v1/chat/completions", "POST"),
            ("POST", "/v1/models", "GET, HEAD"),
            ("DELETE", "/v1/models/m-vllm", "GET, HEAD"),
            ("PUT", "/admin/workers", "GET, POST"),
        ):
            async with s.request(method, c.url + path, headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                body = await r.json()
                assert r.status == 405, (method, path, body)
                assert r.headers.get("Allow") == allow, (method, path, dict(r.headers))
                assert body["error"]["code"] == "method_not_allowed"


@pytest.mark.parametrize("coding", ["gzip", "deflate", "br"])
async def test_compressed_request_body_is_a_415(cluster: Cluster, coding: str) -> None:
    raw = json.dumps({"model": "m-vllm", "prompt": "hi", "max_tokens": 3}).encode()
    data = gzip.compress(raw) if coding == "gzip" else raw
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            cluster.url + "/v1/completions",
            data=data,
            headers={"Content-Type": "application/json", "Content-Encoding": coding},
        ) as r,
    ):
        body = await r.json()
    assert r.status == 415, body
    err = body["error"]
    assert err["code"] == "unsupported_media_type" and coding in err["message"], err
    # identity is no encoding at all
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            cluster.url + "/v1/completions",
            data=raw,
            headers={"Content-Type": "application/json", "Content-Encoding": "identity"},
        ) as r,
    ):
        assert r.status == 200, await r.text()


VLLM_DECODE_ONLY_CHECKS = [
    ({"stream_options": {"include_usage": True}}, "stream_options", "Stream options can only be defined"),
    (
        {"min_tokens": 9, "max_tokens": 4},
        "min_tokens",
        "min_tokens must be less than or equal to max_tokens=4, got 9.",
    ),
    ({"min_tokens": -1}, "min_tokens", "min_tokens must be greater than or equal to 0, got -1."),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(("extra", "param", "message"), VLLM_DECODE_ONLY_CHECKS)
async def test_vllm_refusals_only_the_decode_would_see_come_before_the_prefill(
    cluster: Cluster, path: str, extra: dict[str, Any], param: str, message: str
) -> None:
    """vLLM's prefill goes without `stream_options` and `min_tokens`, so the engine's checks of
    them would fire on the decode only, after the prefill's work and with its KV blocks held for
    nobody. The gateway makes the same checks first: vLLM's 400, and no leg is sent."""
    prompt: dict[str, Any] = (
        {"prompt": "hello there"}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    body = {"model": "m-vllm", "max_tokens": 6, "temperature": 0, **prompt, **extra}
    p, d = cluster.emulators["vllm-p"], cluster.emulators["vllm-d"]
    before = ((await p.stats())["received"], (await d.stats())["received"])
    s, _, raw = await post(cluster.url + path, body)
    err = json.loads(raw)["error"]
    assert s == 400 and err["param"] == param and message in err["message"], raw
    assert ((await p.stats())["received"], (await d.stats())["received"]) == before
    # the engine itself says the same, in the same words (the colocated reference server)
    s, _, raw = await post(cluster.reference["m-vllm"].url + path, body)
    assert s == 400 and message in json.loads(raw)["error"]["message"], raw
    # and what is allowed still goes through the pair
    fixed = {**body, "stream": True} if param == "stream_options" else {**body, "min_tokens": 2}
    s, _, raw = await post(cluster.url + path, fixed)
    assert s == 200, raw
    assert (await p.stats())["received"] == before[0] + 1


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_vllm_null_min_tokens_is_refused_by_the_prefill_before_its_work(
    cluster: Cluster, path: str
) -> None:
    """vLLM refuses `"min_tokens": null` (an int field). The prefill is sent it as the client
    sent it and refuses it at once, in vLLM's words; the decode is never sent the request (it
    used to be the decode's refusal, after the prefill's work, its KV held for nobody)."""
    prompt: dict[str, Any] = (
        {"prompt": "hello there"}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    body = {"model": "m-vllm", "max_tokens": 6, "temperature": 0, "min_tokens": None, **prompt}
    p, d = cluster.emulators["vllm-p"], cluster.emulators["vllm-d"]
    before = ((await p.stats())["received"], (await d.stats())["received"])
    s, _, raw = await post(cluster.url + path, body)
    assert s == 400 and "min_tokens" in raw.decode(), raw
    _, _, ref = await post(cluster.reference["m-vllm"].url + path, body)
    assert json.loads(raw)["error"]["message"] == json.loads(ref)["error"]["message"]
    assert ((await p.stats())["received"], (await d.stats())["received"]) == (before[0] + 1, before[1])


def guard_hits(c: Cluster) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in c.gateway.metrics.render().decode().splitlines()
        if line.startswith("pdgw_guard_failures_total{")
    )


SGLANG_REFUSED = [
    (
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": 4, "temperature": -1}},
        "temperature must be",
    ),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": 4, "top_p": 3}},
        "top_p must be in (0, 1]",
    ),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "min_tokens": 9}, "min_new_tokens must be in"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 5},
        "presence_penalty",
    ),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("path", "body", "message"), SGLANG_REFUSED)
async def test_sglang_refusals_are_the_engines_words_and_no_guard_hit(
    cluster: Cluster, path: str, body: dict[str, Any], message: str, stream: bool
) -> None:
    """An SGLang pair gets the same body on both legs, so both refuse what the engine refuses:
    the client gets the engine's message in OpenAI's shape (SGLang's /generate answers
    `{"error": {"message"}}`, its OpenAI routes a flat object: neither may reach the client as
    a JSON string inside the message), nothing waits in a bootstrap room, and the request's
    fault is not counted as a guard catching a broken handoff."""
    hits = guard_hits(cluster)
    s, _, raw = await post(cluster.url + path, {"model": "m-sglang", "stream": stream, **body})
    assert s == 400, raw
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert message in err["message"] and not err["message"].lstrip().startswith("{"), err
    assert guard_hits(cluster) == hits
    for name in ("sgl-p", "sgl-d"):
        st = await cluster.emulators[name].stats()
        assert st["in_flight"] == 0 and st["pending_rooms"] == 0, (name, st)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
async def test_deeply_nested_json_is_a_400_not_a_500(cluster: Cluster, path: str) -> None:
    """msgspec's decoder recurses per level: ~1,000 levels (2 KB) raised RecursionError, which
    reached the client as a 500 (that the openai client retries) and a logged traceback."""
    deep = b"[" * 3000 + b"]" * 3000
    body = b'{"model":"m-sglang","prompt":"hi","extra":%s}' % deep
    s, _, raw = await post(cluster.url + path, body)
    err = json.loads(raw)["error"]
    assert s == 400 and err["type"] == "invalid_request_error", raw
    assert "nested too deeply" in err["message"]
    s, _, raw = await post(
        cluster.url + "/v1/completions", {"model": "m-sglang", "prompt": "hi", "max_tokens": 2}
    )
    assert s == 200, raw


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("model", ["m-sglang", "m-vllm"])
async def test_max_completion_tokens_is_ignored_on_completions_as_the_engines_do(
    cluster: Cluster, model: str, stream: bool
) -> None:
    """The legacy completions route has no `max_completion_tokens` (OpenAI's, SGLang's and vLLM's
    request models): the engines generate `max_tokens`, 16 by default. The gateway read it as the
    limit, so the decode's 16 tokens ending in "length" looked like an aborted KV transfer: a 503
    (SGLang) or a needless colocated fallback with the pair marked suspect (vLLM)."""
    hits = guard_hits(cluster)
    body = {"model": model, "prompt": "once upon a time", "max_completion_tokens": 30, "temperature": 0}
    body["stream"] = stream
    s, _, got = await post(cluster.url + "/v1/completions", body)
    assert s == 200, got
    s, _, want = await post(cluster.reference[model].url + "/v1/completions", body)
    assert s == 200, want
    assert text_of(got, stream, chat=False) == text_of(want, stream, chat=False) != ""
    if not stream:
        assert json.loads(got)["usage"]["completion_tokens"] == 16
    assert guard_hits(cluster) == hits
    assert not cluster.gateway.registry.suspect_pairs()
    # nor is a value the chat route would refuse a reason to refuse this one
    s, _, got = await post(cluster.url + "/v1/completions", {**body, "max_completion_tokens": 0})
    assert s == 200 and text_of(got, stream, chat=False) == text_of(want, stream, chat=False), got


LAX = [
    ({"max_tokens": "5"}, 5),
    ({"max_tokens": 5.0}, 5),
    ({"n": 1.0, "max_tokens": 4}, 4),
    ({"stream": "false", "max_tokens": 3}, 3),
    ({"stream": 0, "max_tokens": 3}, 3),
    ({"temperature": "0", "max_tokens": 6}, 6),
    ({"echo": "false", "max_tokens": 2}, 2),
]


@pytest.mark.parametrize(("extra", "tokens"), LAX)
@pytest.mark.parametrize("model", ["m-sglang", "m-vllm"])
async def test_values_the_engines_coerce_are_read_as_they_read_them(
    cluster: Cluster, model: str, extra: dict[str, Any], tokens: int
) -> None:
    """Both engines validate with pydantic in lax mode: `"5"` and `5.0` are 5, `"false"` and 0
    are false. The gateway refused them (400) where the engines serve them, and must read them
    as the engines do (a `stream` of "false" is not a stream)."""
    body = {"model": model, "prompt": "hello there", "temperature": 0, **extra}
    s, h, got = await post(cluster.url + "/v1/completions", body)
    assert s == 200 and h["content-type"].startswith("application/json"), got
    s, _, want = await post(cluster.reference[model].url + "/v1/completions", body)
    assert s == 200, want
    assert text_of(got, False, chat=False) == text_of(want, False, chat=False)
    assert json.loads(got)["usage"]["completion_tokens"] == tokens
    # what neither engine coerces is still refused: a fractional count
    s, _, raw = await post(cluster.url + "/v1/completions", {**body, "max_tokens": 5.5})
    assert s == 400 and json.loads(raw)["error"]["param"] == "max_tokens", raw
