"""Fuzz the gateway's request path: hypothesis-made bodies (valid-ish requests with wrong types,
huge numbers, odd unicode and nested junk; arbitrary JSON; garbage bytes) and headers, sent over
raw sockets to a running gateway in front of emulated engines.

The properties: the gateway never crashes (every request gets a complete HTTP response, the
server logs no handler failure, `/health` answers at the end), never answers a 5xx of its own
making (a 5xx must carry an engine's failure: `upstream_*` codes), every error is OpenAI-shaped
JSON, every stream is well-formed SSE, and no engine request is left running.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import Counter
from typing import Any

import pytest
import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.config import AdminConfig, BreakerConfig
from tests.http._util import RawResponse, request
from tests.integration.conftest import Cluster, build_cluster, stop_cluster

EXAMPLES = int(os.environ.get("PDGW_FUZZ_EXAMPLES", "300"))  # more for a longer hunt
MODELS = ["m-sglang", "m-vllm", "m-colocated"]
ROUTES = ["/v1/chat/completions", "/v1/completions", "/generate"]
OTHER_PATHS = ["/v1/models", "/health", "/readiness", "/metrics", "/admin/workers", "/v1/../generate", "/"]
ENGINE_5XX_CODES = {
    "upstream_error",
    "upstream_timeout",
    "upstream_protocol_error",
    "upstream_connect_error",
    "prefill_failed",
    "kv_integrity_violation",
}
FIELDS = [
    "model",
    "prompt",
    "messages",
    "text",
    "input_ids",
    "max_tokens",
    "max_completion_tokens",
    "max_new_tokens",
    "n",
    "best_of",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "echo",
    "logprobs",
    "top_logprobs",
    "return_logprob",
    "logprob_start_len",
    "sampling_params",
    "rid",
    "user",
    "session_id",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "kv_transfer_params",
    "response_format",
    "tools",
    "ignore_eos",
]

# -- strategies ------------------------------------------------------------------------------

huge_ints = st.sampled_from([0, -1, 1, 2**31, 2**31 - 1, -(2**31), 2**53 + 1, 2**63, 2**64, -(2**63), 10**30])
odd_floats = st.sampled_from([0.0, -0.0, 1e-320, 1e308, -1e308, 0.5, 2.0, 1e10])
texts = st.one_of(
    st.text(max_size=40),
    st.sampled_from(
        ["", " ", "\u0000", "\ud800", "\U0001f600" * 20, "\u202e\u0301", "a" * 3000, "\U0001d54f" * 100]
    ),
)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-1000, 1000), huge_ints, odd_floats, texts)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.sampled_from([*FIELDS, "x", "role", "content"]), inner, max_size=4),
    ),
    max_leaves=12,
)


@st.composite
def valid_ish(draw: st.DrawFn, route: str) -> dict[str, Any]:
    """A valid request for `route`, then a few fields replaced by junk or removed."""
    model = draw(st.sampled_from(MODELS)) if draw(st.integers(0, 7)) else draw(st.sampled_from(["nope", ""]))
    if route == "/v1/chat/completions":
        content = draw(st.one_of(texts, st.just("hello")))
        body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": content}]}
    elif route == "/v1/completions":
        body = {"model": model, "prompt": draw(st.one_of(texts, st.lists(texts, min_size=1, max_size=3)))}
    else:
        body = {"model": model, "text": draw(texts), "sampling_params": {"max_new_tokens": 4}}
    body["max_tokens"] = draw(st.integers(1, 16))
    body["temperature"] = 0
    body["stream"] = draw(st.booleans())
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2, 3]))):
        key = draw(st.sampled_from(FIELDS))
        if draw(st.integers(0, 4)) == 0:
            body.pop(key, None)
        else:
            body[key] = draw(json_values)
    return body


@st.composite
def body_bytes(draw: st.DrawFn, route: str) -> bytes:
    kind = draw(st.integers(0, 9))
    if kind <= 6:
        value: Any = draw(valid_ish(route))
    elif kind <= 7:
        value = draw(json_values)
    else:
        return draw(
            st.one_of(st.binary(max_size=200), st.sampled_from([b"", b"{", b"[1,", b"null", b'{"a":']))
        )
    ascii_only = draw(st.booleans())
    try:
        raw = json.dumps(value, ensure_ascii=ascii_only, allow_nan=True).encode("utf-8", "surrogatepass")
    except (ValueError, RecursionError):
        raw = b"{}"
    if draw(st.integers(0, 19)) == 0:  # truncated JSON
        raw = raw[: draw(st.integers(0, len(raw)))]
    return raw


header_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_", min_size=1, max_size=20)
header_values = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF), max_size=60)


@st.composite
def headers(draw: st.DrawFn) -> list[tuple[str, str]]:
    h: list[tuple[str, str]] = []
    others = [
        "application/json; charset=utf-8",
        "APPLICATION/JSON",
        "text/plain",
        "multipart/form-data; b=x",
        "",
    ]
    ctype = "application/json" if draw(st.integers(0, 4)) else draw(st.sampled_from([*others, None]))
    if ctype is not None:
        h.append(("content-type", ctype))
    for name in ("x-request-id", "x-correlation-id", "authorization", "accept", "user-agent"):
        if draw(st.integers(0, 3)) == 0:
            h.append((name, draw(st.one_of(header_values, st.just("a" * 500), st.just("ok-id_1.2:3")))))
    h += draw(st.lists(st.tuples(header_names, header_values), max_size=4))
    return h


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, str, list[tuple[str, str]], bytes]:
    if draw(st.integers(0, 9)) == 0:
        path = draw(st.sampled_from(OTHER_PATHS))
        method = draw(st.sampled_from(["GET", "POST", "HEAD", "DELETE", "PUT"]))
    else:
        path = draw(st.sampled_from(ROUTES))
        method = "POST" if draw(st.integers(0, 19)) else draw(st.sampled_from(["GET", "PUT", "DELETE"]))
    return method, path, draw(headers()), draw(body_bytes(path if path in ROUTES else ROUTES[0]))


# -- the oracle ------------------------------------------------------------------------------


def check_error_shape(resp: RawResponse, where: str) -> dict[str, Any]:
    ctype = resp.header(b"content-type") or b""
    assert ctype.startswith(b"application/json"), (where, resp.status, ctype, resp.body[:200])
    doc = json.loads(resp.body)
    err = doc["error"]
    assert isinstance(err, dict) and set(err) >= {"message", "type", "param", "code"}, (where, doc)
    assert isinstance(err["message"], str) and err["message"], (where, doc)
    assert isinstance(err["type"], str) and err["type"], (where, doc)
    return err


def check_sse(body: bytes, where: str) -> None:
    for line in body.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            continue
        doc = json.loads(payload)
        if isinstance(doc, dict) and "error" in doc:
            assert isinstance(doc["error"], dict) and doc["error"].get("message"), (where, doc)


def check(resp: RawResponse, method: str, path: str, engine_failed: bool, stats: Counter[str]) -> None:
    """`engine_failed`: an engine failed while this request ran (the gateway counted an upstream
    error), so a 5xx may be that engine's."""
    where = f"{method} {path}"
    stats[f"{resp.status // 100}xx"] += 1
    if method == "HEAD":  # no body to look at
        assert resp.status < 500 or path == "/readiness", (where, resp.status)
        return
    if path == "/readiness" and method == "GET":  # 200 or 503 by contract, with its own body
        json.loads(resp.body)
        return
    if resp.status >= 500:
        err = check_error_shape(resp, where)
        # never a 5xx of the gateway's own making: an engine failed during this request (the
        # gateway counted it) and the answer names that failure (or, once the failed worker is
        # excluded from the retry, "no usable worker" for that same failure)
        assert engine_failed and (err["code"] in ENGINE_5XX_CODES or err["code"] == "no_worker_available"), (
            where,
            resp.status,
            err,
            engine_failed,
        )
        stats["engine_5xx"] += 1
        return
    if resp.status >= 400:
        check_error_shape(resp, where)
        return
    ctype = resp.header(b"content-type") or b""
    if ctype.startswith(b"text/event-stream"):
        check_sse(resp.body, where)
    elif ctype.startswith(b"application/json"):
        json.loads(resp.body)


def build(method: str, path: str, hdrs: list[tuple[str, str]], body: bytes) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nhost: gw\r\nconnection: close\r\n"
    head += "".join(f"{n}: {v}\r\n" for n, v in hdrs)
    head += f"content-length: {len(body)}\r\n\r\n"
    return head.encode("latin-1") + body


def upstream_errors(c: Cluster) -> float:
    return sum(
        s.value
        for m in c.gateway.metrics.upstream_errors.collect()
        for s in m.samples
        if s.name.endswith("_total")
    )


def test_fuzz_gateway(caplog: pytest.LogCaptureFixture) -> None:
    runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    # Breakers out of the way: fuzzed requests make the emulator itself fail (a 500 on negative
    # token ids), and an open breaker would turn later requests into 503s that are correct but
    # not this request's engine failure. Breakers vs client errors: test_client_errors_do_not_open_breakers.
    cluster: Cluster = runner.run(build_cluster(breaker=BreakerConfig(failure_threshold=1_000_000)))
    stats: Counter[str] = Counter()
    t0 = time.monotonic()

    async def one(raw: bytes, head: bool) -> RawResponse:
        async with asyncio.timeout(10):  # nothing hangs
            resp, _, writer = await request(cluster.gateway.port, raw, head=head)
            writer.close()
            return resp

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(requests())
    def fuzz(req: tuple[str, str, list[tuple[str, str]], bytes]) -> None:
        method, path, hdrs, body = req
        before = upstream_errors(cluster)
        resp = runner.run(one(build(method, path, hdrs, body), method == "HEAD"))
        check(resp, method, path, upstream_errors(cluster) > before, stats)

    try:
        with caplog.at_level(logging.ERROR, logger="gateway.http.server"):
            fuzz()

        async def after() -> None:
            health, _, w = await request(cluster.gateway.port, b"GET /health HTTP/1.1\r\nhost: gw\r\n\r\n")
            w.close()
            assert health.status == 200
            deadline = time.monotonic() + 3
            while True:
                counts = {n: (await h.stats())["in_flight"] for n, h in cluster.emulators.items()}
                if not any(counts.values()) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.02)
            assert not any(counts.values()), counts
            st_ = cluster.gateway.admission.stats()
            assert st_.active == 0 and st_.queued == 0

        runner.run(after())
        # the gateway's own loggers only: an emulator crashing on a request is the emulator's bug
        # (and then its 5xx is checked above like any engine's)
        failures = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("gateway")]
        assert not failures, [r.getMessage() for r in failures]
    finally:
        runner.run(stop_cluster(cluster))
        runner.close()
    took = time.monotonic() - t0
    print("FUZZSTATS", dict(stats), round(took, 2))
    assert stats["2xx"] > 0 and stats["4xx"] > 0, stats
    assert took < 30 * max(1.0, EXAMPLES / 300)  # bounded: ~300 examples in well under 30 s


async def test_client_errors_do_not_open_breakers() -> None:
    """An engine's 4xx is the client's fault, not the worker's: five of them must not open a
    healthy worker's breaker (the model would be unavailable for `breaker.open_s`)."""
    import aiohttp

    c = await build_cluster()
    try:
        col = c.emulators["col"]
        await col.set_faults(["http_error,status=400"])  # the engine refuses each request: 400
        async with aiohttp.ClientSession() as s:
            b = {"model": "m-colocated", "prompt": "hi", "max_tokens": 2}
            for _ in range(8):
                async with s.post(c.url + "/v1/completions", json=b) as r:
                    assert r.status == 400, await r.read()
            await col.set_faults([])
            async with s.post(c.url + "/v1/completions", json=b) as r:
                assert r.status == 200, await r.read()
    finally:
        await stop_cluster(c)


async def test_client_chosen_model_names_do_not_grow_metric_series() -> None:
    """Unknown model names must not each add a metric series (and a cached child) forever."""
    import aiohttp

    c = await build_cluster()
    try:
        async with aiohttp.ClientSession() as s:
            for i in range(20):
                b = {"model": f"no-such-model-{i}", "prompt": "x", "max_tokens": 1}
                async with s.post(c.url + "/v1/completions", json=b) as r:
                    assert r.status == 404
        text = c.gateway.metrics.render().decode()
        assert "no-such-model-" not in text
    finally:
        await stop_cluster(c)


# Examples the fuzzer found (each was a 500 "Internal server error." from the gateway itself).
FOUND = [
    (
        "/v1/completions",
        b'{"model": "m-sglang", "prompt": ["\xed\xa0\x80"], "max_tokens": 1}',
    ),  # CESU-8 surrogate
    ("/v1/completions", b'{"model": "m-vllm", "prompt": [1e400], "max_tokens": 1}'),  # number out of range
    ("/v1/completions", b'{"model": "m-vllm", "prompt": [[1e400]], "max_tokens": 1}'),
    (
        "/v1/chat/completions",
        b'{"model": "m-sglang", "messages": [{"role": "user", "content": ""}], "rid": ["\xed\xa0\x80"]}',
    ),
    ("/v1/completions", b'{"model": "\xff", "prompt": "x"}'),
    ("/generate", b'{"model": "m-sglang", "text": "\xc3", "sampling_params": {"max_new_tokens": 1}}'),
]


async def test_fuzz_findings_are_answered_400() -> None:
    c = await build_cluster()
    try:
        for path, raw in FOUND:
            head = f"POST {path} HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
            head += f"content-length: {len(raw)}\r\nconnection: close\r\n\r\n"
            resp, _, w = await request(c.gateway.port, head.encode() + raw)
            w.close()
            assert resp.status == 400, (raw, resp.status, resp.body)
            err = check_error_shape(resp, path)
            assert err["type"] == "invalid_request_error"
    finally:
        await stop_cluster(c)


ADMIN_TOKEN = "fuzz-admin-token"
worker_keys = st.sampled_from(
    ["url", "role", "engine", "id", "name", "model", "bootstrap_port", "weight", "labels", "api_key_env", "x"]
)
worker_values = st.one_of(
    json_values,
    st.sampled_from(
        [
            "http://127.0.0.1:1",
            "http://127.0.0.1:99999",
            "https://127.0.0.1:1",
            "ftp://127.0.0.1:1",
            "http://[::1",
            "http://",
            "prefill",
            "decode",
            "colocated",
            "sglang",
            "vllm",
            "openai",
        ]
    ),
)


@st.composite
def admin_requests(draw: st.DrawFn) -> tuple[str, str, bool, bytes]:
    method, path = draw(
        st.sampled_from(
            [
                ("POST", "/admin/workers"),
                ("POST", "/admin/workers"),
                ("POST", "/admin/workers?require_healthy=false"),
                ("GET", "/admin/workers"),
                ("POST", "/admin/workers/col/resume"),
                ("DELETE", "/admin/workers/nope?timeout_s=0"),
                ("GET", "/admin/workers/%ZZ"),
                ("GET", "/admin/workers/" + "a" * 300),
                ("POST", "/admin/workers/col/explode"),
                ("GET", "/admin/admission"),
            ]
        )
    )
    base: dict[str, Any] = {"url": "http://127.0.0.1:1", "role": "colocated", "id": "fz"}
    for _ in range(draw(st.integers(0, 3))):
        if draw(st.booleans()):
            base.pop(draw(worker_keys), None)
        else:
            base[draw(worker_keys)] = draw(worker_values)
    raw = json.dumps(base).encode() if draw(st.integers(0, 5)) else draw(body_bytes("/v1/completions"))
    return method, path, draw(st.integers(0, 3)) > 0, raw


def test_fuzz_admin_api(caplog: pytest.LogCaptureFixture) -> None:
    runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    cluster: Cluster = runner.run(build_cluster(admin=AdminConfig(token=ADMIN_TOKEN)))
    registry = cluster.gateway.registry

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(admin_requests())
    def fuzz(req: tuple[str, str, bool, bytes]) -> None:
        method, path, authed, body = req
        auth = f"authorization: Bearer {ADMIN_TOKEN}\r\n" if authed else ""
        raw = build(method, path, [], body).replace(
            b"connection: close\r\n", f"connection: close\r\n{auth}".encode()
        )
        resp = runner.run(asyncio.wait_for(_one(cluster, raw), 10))
        assert resp.status < 500, (req, resp.status, resp.body)
        if not authed:
            assert resp.status == 401, (req, resp.status)
        if resp.status >= 400:
            check_error_shape(resp, path)
        if resp.status == 201:  # added (unhealthy, on request): take it out again
            wid = json.loads(resp.body)["id"]
            runner.run(registry.remove(wid))
        assert registry.find("col") is not None and len(registry) == 5

    try:
        fuzz()
        failures = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("gateway")]
        assert not failures, [r.getMessage() for r in failures]
    finally:
        runner.run(stop_cluster(cluster))
        runner.close()


async def _one(c: Cluster, raw: bytes) -> RawResponse:
    resp, _, writer = await request(c.gateway.port, raw)
    writer.close()
    return resp
