"""The gateway under engine faults (injected by the emulator): nothing hangs, every client gets a
complete answer or a clear error within its deadline, and no engine request is left running."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import aiohttp
import msgspec
import pytest

from gateway.config import BreakerConfig, LimitsConfig, RetriesConfig, TimeoutsConfig
from tests.integration.conftest import Cluster, build_cluster, stop_cluster

FAST = TimeoutsConfig(
    connect_s=0.5, prefill_s=1.0, handoff_s=1.0, idle_s=0.5, client_stall_s=5.0, total_s=5.0
)


async def post(url: str, body: dict[str, object]) -> tuple[int, bytes, float]:
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        raw = await r.read()
        return r.status, raw, time.monotonic() - t0


def body(model: str, stream: bool = False, max_tokens: int = 8) -> dict[str, object]:
    return {
        "model": model,
        "prompt": "fault test prompt",
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }


async def settled(c: Cluster, names: tuple[str, ...], within_s: float = 3.0) -> dict[str, int]:
    """Wait until the named emulators have nothing in flight; return their in_flight counts."""
    deadline = time.monotonic() + within_s
    while True:
        counts = {n: (await c.emulators[n].stats())["in_flight"] for n in names if not c.emulators[n].dead}
        if not any(counts.values()) or time.monotonic() > deadline:
            return counts
        await asyncio.sleep(0.02)


@pytest.fixture
async def fast_cluster() -> Cluster:
    c = await build_cluster(timeouts=FAST, retries=RetriesConfig(max_attempts=2, backoff_initial_s=0.01))
    yield c  # type: ignore[misc]
    await stop_cluster(c)


@pytest.mark.parametrize(
    ("model", "prefill", "decode"), [("m-sglang", "sgl-p", "sgl-d"), ("m-vllm", "vllm-p", "vllm-d")]
)
async def test_hung_prefill_is_a_prefill_timeout_and_leaves_nothing_running(
    fast_cluster: Cluster, model: str, prefill: str, decode: str
) -> None:
    c = fast_cluster
    await c.emulators[prefill].set_faults(["hang_before_first_byte"])
    results = await asyncio.gather(*(post(c.url + "/v1/completions", body(model)) for _ in range(8)))
    for status, raw, took in results:
        assert took < FAST.total_s
        if model == "m-vllm":
            # the ladder's last rung for vLLM: the decode worker prefills itself (no kv_transfer_params)
            assert status == 200, raw
            continue
        assert status == 503, raw  # the ladder's last rung: shed, naming the failure
        err = json.loads(raw)["error"]
        assert "prefill" in err["message"] and err["code"] == "upstream_timeout"
    assert await settled(c, (prefill, decode)) == {prefill: 0, decode: 0}
    if model == "m-sglang":  # a request that failed for good is counted under the plan it tried
        text = c.gateway.metrics.render().decode()
        line = next(x for x in text.splitlines() if x.startswith("pdgw_requests_total{") and "m-sglang" in x)
        assert 'plan="disaggregated"' in line and 'outcome="upstream_timeout"' in line, line


@pytest.mark.parametrize(("model", "decode"), [("m-sglang", "sgl-d"), ("m-vllm", "vllm-d")])
async def test_decode_crash_mid_stream_ends_with_an_error_event_not_done(
    fast_cluster: Cluster, model: str, decode: str
) -> None:
    c = fast_cluster
    await c.emulators[decode].set_faults(["crash_mid_stream"])
    status, raw, _ = await post(c.url + "/v1/completions", body(model, stream=True, max_tokens=32))
    assert status == 200
    events = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
    assert events and events[-1] != "[DONE]"
    assert "error" in json.loads(events[-1])


@pytest.mark.parametrize(("model", "decode"), [("m-sglang", "sgl-d"), ("m-vllm", "vllm-d")])
async def test_stalled_stream_hits_the_idle_deadline(fast_cluster: Cluster, model: str, decode: str) -> None:
    c = fast_cluster
    await c.emulators[decode].set_faults(["hang_mid_stream"])
    status, raw, took = await post(c.url + "/v1/completions", body(model, stream=True, max_tokens=32))
    assert status == 200 and took < 3.0
    last = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")][-1]
    assert "the engine sent nothing" in json.loads(last)["error"]["message"]
    assert (await settled(c, (decode,)))[decode] == 0


async def test_a_stream_stalled_before_its_first_event_is_no_mid_stream_stall() -> None:
    """vLLM's decode waiting for KV that never comes has sent its headers, not one event: the
    client gets a 504 that says so (it was never sent a byte), not a "mid-stream" stall."""
    c = await build_cluster(timeouts=FAST, retries=RetriesConfig(max_attempts=1))
    try:
        await c.emulators["vllm-p"].set_faults(["transfer_stall"])
        status, raw, _ = await post(c.url + "/v1/completions", body("m-vllm", stream=True))
        assert status == 504, raw
        err = json.loads(raw)["error"]
        assert err["code"] == "upstream_timeout" and "after its response headers" in err["message"], err
        assert (await settled(c, ("vllm-d",)))["vllm-d"] == 0
    finally:
        await stop_cluster(c)


@pytest.mark.parametrize(
    ("model", "prefill", "decode"), [("m-sglang", "sgl-p", "sgl-d"), ("m-vllm", "vllm-p", "vllm-d")]
)
async def test_dead_prefill_gives_a_clear_5xx_fast(
    fast_cluster: Cluster, model: str, prefill: str, decode: str
) -> None:
    c = fast_cluster
    await c.emulators[prefill].stop()
    for _ in range(4):
        status, raw, took = await post(c.url + "/v1/completions", body(model))
        assert took < FAST.total_s
        if model == "m-vllm":
            assert status == 200, raw  # served by the decode worker alone
            continue
        assert status in (502, 503), raw
        assert json.loads(raw)["error"]["message"]
    assert (await settled(c, (decode,)))[decode] == 0


@pytest.mark.parametrize(("model", "prefill"), [("m-sglang", "sgl-p"), ("m-vllm", "vllm-p")])
async def test_prefill_5xx_is_a_clear_error_not_a_hang(
    fast_cluster: Cluster, model: str, prefill: str
) -> None:
    c = fast_cluster
    await c.emulators[prefill].set_faults(["http_error:1,status=503"])
    status, raw, took = await post(c.url + "/v1/completions", body(model))
    assert took < FAST.total_s
    if model == "m-vllm":
        assert status == 200, raw  # served by the decode worker alone
    else:
        assert status == 503 and "prefill" in json.loads(raw)["error"]["message"], raw
    await c.emulators[prefill].set_faults([])
    status, raw, _ = await post(c.url + "/v1/completions", body(model))
    assert status == 200, raw


async def test_per_worker_inflight_cap_sheds_with_retry_after() -> None:
    """At its cap a worker takes no more (the KV-transfer cliff at high concurrency, sglang #9266):
    the excess is shed at once with 503 + Retry-After instead of piling onto the engines."""
    c = await build_cluster(time_scale=0.2, timeouts=FAST, limits=LimitsConfig(max_inflight_per_worker=2))
    try:
        async with aiohttp.ClientSession() as s:

            async def one() -> tuple[int, str | None]:
                async with s.post(c.url + "/v1/completions", json=body("m-vllm", True, 64)) as r:
                    await r.read()
                    return r.status, r.headers.get("Retry-After")

            results = await asyncio.gather(*(one() for _ in range(6)))
        statuses = sorted(st for st, _ in results)
        assert statuses.count(200) >= 2 and 503 in statuses, statuses
        assert all(ra for st, ra in results if st == 503)
        assert (await c.emulators["vllm-d"].stats())["received"] <= 4
    finally:
        await stop_cluster(c)


async def test_vllm_transfer_failures_fall_back_to_the_decode_prefilling_itself(
    fast_cluster: Cluster,
) -> None:
    """A decode that answers 500 because it could not pull the KV (prefill gone after handing out
    its params, say) is up: the request falls back to that decode doing its own prefill, and
    the decode's breaker is not charged with the handoff's failure."""
    c = fast_cluster
    await c.emulators["vllm-d"].set_faults(["transfer_fail"])
    for _ in range(8):
        status, raw, _ = await post(c.url + "/v1/completions", body("m-vllm"))
        assert status == 200, raw
    decode = c.gateway.registry.get("vllm-d")
    assert decode.breaker.state.value == "closed"
    text = c.gateway.metrics.render().decode()
    assert 'pdgw_fallbacks_total{rung="decode_self_prefill"}' in text


def n_body(stream: bool, max_tokens: int = 8) -> dict[str, object]:
    return body("m-sglang", stream, max_tokens) | {"n": 3}


async def test_sglang_n_samples_hung_prefill_leaves_nothing_running(fast_cluster: Cluster) -> None:
    """n > 1 on SGLang P/D runs one handoff per sample: all of them end (and are aborted on the
    engines) when they fail, and the client gets one clear error."""
    c = fast_cluster
    await c.emulators["sgl-p"].set_faults(["hang_before_first_byte"])
    status, raw, took = await post(c.url + "/v1/completions", n_body(False))
    assert status == 503 and took < FAST.total_s, raw
    assert json.loads(raw)["error"]["code"] == "upstream_timeout"
    assert await settled(c, ("sgl-p", "sgl-d")) == {"sgl-p": 0, "sgl-d": 0}


async def test_sglang_n_samples_decode_crash_mid_stream_is_an_error_event() -> None:
    """The decode drops its connection after the client's stream has started: the client gets
    an error event and no [DONE]. Real delays (time_scale 1) and a crash 8 tokens in make sure
    the stream has started first; with instant engines the crash could beat the prefill's
    answer, so the gateway (rightly) had not committed yet and answered 503 instead."""
    c = await build_cluster(
        timeouts=FAST, retries=RetriesConfig(max_attempts=2, backoff_initial_s=0.01), time_scale=1.0
    )
    try:
        await c.emulators["sgl-d"].set_faults(["crash_mid_stream,after=8"])
        status, raw, _ = await post(c.url + "/v1/completions", n_body(True, max_tokens=32))
        assert status == 200, raw
        events = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
        assert events and "[DONE]" not in events
        assert any(json.loads(e).get("choices") for e in events[:-1]), "tokens came before the error"
        assert "error" in json.loads(events[-1])
    finally:
        await stop_cluster(c)


async def test_sglang_n_samples_client_gone_mid_stream_stops_every_sample() -> None:
    c = await build_cluster(time_scale=1.0)  # real delays: the samples are still running when we leave
    try:
        before = await c.emulators["sgl-d"].stats()
        async with aiohttp.ClientSession() as s:
            async with s.post(c.url + "/v1/completions", json=n_body(True, max_tokens=2000)) as r:
                assert r.status == 200
                seen: set[int] = set()
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        seen.update(ch["index"] for ch in json.loads(line[6:])["choices"])
                    if len(seen) == 3:
                        break
            # leaving the block closes the connection mid-stream
        assert seen == {0, 1, 2}
        assert await settled(c, ("sgl-p", "sgl-d")) == {"sgl-p": 0, "sgl-d": 0}
        after = await c.emulators["sgl-d"].stats()
        # every sample stopped, none ran to its 2000 tokens
        assert after["completed"] == before["completed"]
        assert after["generation_tokens_total"] - before["generation_tokens_total"] < 600
    finally:
        await stop_cluster(c)


@pytest.mark.parametrize("fault", ["http_error", "health_ok_but_hung"])
async def test_a_failing_sglang_decode_does_not_open_its_healthy_prefills_breaker(fault: str) -> None:
    """Both SGLang legs run at once, so a decode that fails (an error at once, or hanging while
    its prefill waits to hand over the KV) cuts its prefill short. That is no verdict on the
    prefill: its breaker stays closed (it used to open, taking P/D away from every healthy
    decode too), the pair's breaker counts the failures, and clients are served colocated."""
    c = await build_cluster(
        colocated_fallback=True,
        timeouts=FAST,
        retries=RetriesConfig(max_attempts=2, backoff_initial_s=0.01),
        breaker=BreakerConfig(failure_threshold=2, open_s=60.0),
    )
    try:
        await c.emulators["sgl-d"].set_faults([fault])
        for _ in range(4):
            status, raw, _ = await post(c.url + "/v1/completions", body("m-sglang"))
            assert status == 200, raw  # the colocated rung
        reg = c.gateway.registry
        assert reg.get("sgl-p").breaker.state.value == "closed"
        assert "sgl-p|sgl-d" in reg.open_pairs()
        await c.emulators["sgl-d"].set_faults([])
    finally:
        await stop_cluster(c)


@pytest.mark.parametrize("model", ["m-sglang", "m-vllm", "m-colocated"])
async def test_a_long_non_streamed_answer_is_not_cut_by_the_first_byte_deadlines(model: str) -> None:
    """A non-streamed answer's headers come with its last token. Its wait is the phase's
    deadline plus `per_token_s` per token it may generate, so a generation longer than
    `handoff_s` (P/D) or `prefill_s` (colocated) is served, not failed with a 503 after being
    run to the end up to three times; a stream of the same length was served all along."""
    timeouts = TimeoutsConfig(
        prefill_s=0.5, handoff_s=0.5, idle_s=5.0, client_stall_s=20.0, total_s=20.0, per_token_s=0.5
    )
    c = await build_cluster(time_scale=1.0, timeouts=timeouts)
    try:
        for name in ("sgl-d", "vllm-d", "col"):
            await c.emulators[name].set_faults(["slow,factor=40"])
        t0 = time.monotonic()
        status, raw, _ = await post(c.url + "/v1/completions", body(model, max_tokens=6))
        took = time.monotonic() - t0
        assert status == 200, raw
        assert took > 0.5 + 0.2  # it did run past the first-byte deadline
        got = json.loads(raw)
        assert got["usage"]["completion_tokens"] == 6 and got["choices"][0]["finish_reason"] == "length"
        text = c.gateway.metrics.render().decode()
        retries = [x for x in text.splitlines() if x.startswith("pdgw_retries_total{")]
        assert not retries, retries  # served by its first attempt
    finally:
        await stop_cluster(c)


async def test_a_non_streamed_answer_still_has_a_head_deadline() -> None:
    """The allowance is per token it may generate: a decode that hangs is still cut at
    handoff_s + per_token_s x max_tokens, long before the total deadline."""
    timeouts = TimeoutsConfig(
        prefill_s=1.0, handoff_s=0.3, idle_s=5.0, client_stall_s=20.0, total_s=20.0, per_token_s=0.1
    )
    c = await build_cluster(
        faults={"vllm-d": ["hang_before_first_byte"]},
        timeouts=timeouts,
        retries=RetriesConfig(max_attempts=1),
    )
    try:
        status, raw, took = await post(c.url + "/v1/completions", body("m-vllm", max_tokens=4))
        assert status == 504 and took < 5.0, raw
        err = json.loads(raw)["error"]
        assert err["code"] == "upstream_timeout" and "within 0.7s" in err["message"], err
    finally:
        await stop_cluster(c)


@pytest.mark.timeout(360)
@pytest.mark.parametrize("model", ["m-colocated", "m-vllm", "m-sglang"])
async def test_a_client_that_stops_reading_is_no_silent_worker(model: str) -> None:
    """A client that reads its stream slowly (TCP backpressure) for longer than `idle_s`: the
    gateway stops reading the upstream for it, so the upstream's silence is the client's doing.
    It used to end the stream with "sent nothing for 0.5 s mid-stream" and count it against the
    healthy worker's breaker (found by the fault probe). Now the stream completes. FAST's idle
    deadline; room for the other phases and the whole stream (FAST's prefill and total deadlines
    were too short on a loaded 2-core machine)."""
    slow_ok = msgspec.structs.replace(FAST, prefill_s=30.0, handoff_s=30.0, total_s=120.0)
    c = await build_cluster(timeouts=slow_ok, retries=RetriesConfig(max_attempts=2, backoff_initial_s=0.01))
    try:
        await _read_slowly(c, model)
    finally:
        await stop_cluster(c)


async def _read_slowly(c: Cluster, model: str) -> None:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    host, port = c.url.removeprefix("http://").split(":")
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock)
    payload = json.dumps(
        {
            "model": model,
            "prompt": "a long story",
            "max_tokens": 7000,  # ~11 MB of events: more than the kernel's buffers take
            "n": 8,
            "temperature": 0.7,
            "seed": 3,
            "stream": True,
        }
    ).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(payload) + payload
    )
    await writer.drain()
    first = await reader.read(2000)
    assert first.startswith(b"HTTP/1.1 200"), first
    await asyncio.sleep(1.5)  # three idle deadlines without reading
    rest = b""
    async with asyncio.timeout(100):  # ~11 MB through a 4 KB window, on a loaded machine
        while not rest.endswith(b"0\r\n\r\n"):
            chunk = await reader.read(1 << 20)
            if not chunk:
                break
            rest += chunk
    writer.close()
    assert b"data: [DONE]" in rest and b'"error"' not in rest, rest[-400:]
    assert "upstream_timeout" not in c.gateway.metrics.render().decode()  # nothing held against a worker


async def test_prompts_the_prefill_alone_refuses_open_no_breaker() -> None:
    """A prompt between SGLang's `max_req_input_len` (8186 here) and the context (8192): the
    prefill refuses it (400) while its decode takes it and waits for the KV. Each was counted
    against the pair's breaker, so five such client mistakes left every SGLang request a 503 for
    the breaker's cool-down (found by the differential probe). The client still gets the
    engine's 400; the pair keeps serving."""
    c = await build_cluster()
    try:
        long = {"model": "m-sglang", "prompt": "x" * 8190, "max_tokens": 1, "temperature": 0}
        for _ in range(8):
            status, raw, _ = await post(c.url + "/v1/completions", long)
            assert status == 400 and "exceeds the maximum allowed length" in raw.decode(), raw
        good = {"model": "m-sglang", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        status, raw, _ = await post(c.url + "/v1/completions", good)
        assert status == 200, raw
        assert all(state.value == "closed" for _, _, state in c.gateway.registry.pair_states())
    finally:
        await stop_cluster(c)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
async def test_a_decode_error_event_after_the_first_token_is_a_failure_not_relayed(
    fast_cluster: Cluster, route: str
) -> None:
    """Both engines write an OpenAI route's error event spaced (`{"error": {...}}`, Python's
    `json.dumps`), unlike their other events, then `[DONE]`. Mid-stream (the first token already
    out) the gateway must see it: the stream ends with the gateway's own error event and no
    `[DONE]`, and the request counts as failed (the emulator's `error_mid_stream`)."""
    c = fast_cluster
    await c.emulators["vllm-d"].set_faults(["error_mid_stream"])
    b = body("m-vllm", stream=True, max_tokens=32)
    if route.endswith("chat/completions"):
        b["messages"] = [{"role": "user", "content": b.pop("prompt")}]
    status, raw, _ = await post(c.url + route, b)
    assert status == 200
    events = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
    assert events and "[DONE]" not in events, events
    assert any("choices" in json.loads(e) for e in events[:-1])  # tokens went out first
    err = json.loads(events[-1])["error"]
    # the gateway's own event: a stable sentence with the request id (the engine's words are logged)
    assert err["code"] == "upstream_error" and "(phase: decode) (request id" in err["message"], err
    text = c.gateway.metrics.render().decode()
    served = [ln for ln in text.splitlines() if ln.startswith("pdgw_requests_total{") and "m-vllm" in ln]
    assert served and all('outcome="ok"' not in ln for ln in served), served
