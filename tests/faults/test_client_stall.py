"""A client that stops reading its answer (`timeouts.client_stall_s`): real sockets, emulated
engines, the gateway in this process (tests/integration/conftest.py).

The client is a raw socket with a tiny receive buffer that sends its request and never reads:
the gateway's writes to it back up (the kernel's send queue, then the transport's buffer) until
the transport pauses writing. Past `client_stall_s` with no byte taken, the gateway stops the
request as it stops one whose client went away (its engine legs aborted), closes the
connection, gives back the workers' in-flight counts, logs `request.client_stalled` and counts
the request with outcome `client_stalled`. A client that keeps reading, however slowly, is not
cut."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import pytest
from structlog.testing import capture_logs

from gateway.config import TimeoutsConfig
from tests.integration.conftest import Cluster, build_cluster, stop_cluster

STALL = 0.5
# the other deadlines far away: only the stall may end these requests
TIMEOUTS = TimeoutsConfig(
    connect_s=2.0, prefill_s=30.0, handoff_s=30.0, idle_s=30.0, total_s=120.0, client_stall_s=STALL
)
# modelled delays: a generation takes seconds, so the engines are still at it when the client
# stalls (the kernel takes ~3 MB of a loopback stream before the gateway's writes pause)
TIME_SCALE = 0.2
TOKENS = 7000
LOGPROBS = 20  # ~0.7 KB per token and sample: the buffers fill in a second or two


def _completion(model: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": "a long story",
        "max_tokens": TOKENS,
        "temperature": 0.7,
        "seed": 3,
        "n": 4,
        "ignore_eos": True,
        "logprobs": LOGPROBS,
        "stream": True,
    } | extra


def _chat(model: str) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "a long story"}],
        "max_tokens": TOKENS,
        "temperature": 0.7,
        "seed": 3,
        "n": 4,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": LOGPROBS,
        "stream": True,
    }


def _generate() -> dict[str, Any]:
    # one greedy answer (the decode-consistency guard watches it); each event carries the text and
    # logprobs so far
    return {
        "text": "a long story",
        "sampling_params": {"max_new_tokens": TOKENS, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "top_logprobs_num": LOGPROBS,
        "stream": True,
    }


# (route, body, its workers); m-colocated is a colocated vLLM worker, m-sglang and m-vllm P/D pairs
CASES = {
    "colocated-completions": ("/v1/completions", _completion("m-colocated"), ("col",)),
    "colocated-chat": ("/v1/chat/completions", _chat("m-colocated"), ("col",)),
    "sglang-pd-completions-n4": ("/v1/completions", _completion("m-sglang"), ("sgl-p", "sgl-d")),
    "sglang-pd-generate": ("/generate", _generate(), ("sgl-p", "sgl-d")),
    "vllm-pd-chat": ("/v1/chat/completions", _chat("m-vllm"), ("vllm-p", "vllm-d")),
}


async def _client(c: Cluster) -> socket.socket:
    """A connected socket that reads (if at all) through a 4 KB receive buffer."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", c.gateway.port))
    return sock


async def _send(sock: socket.socket, route: str, body: dict[str, Any], rid: str) -> None:
    payload = json.dumps(body).encode()
    head = (
        f"POST {route} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"X-Request-Id: {rid}\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode()
    await asyncio.get_running_loop().sock_sendall(sock, head + payload)


async def _read_to_end(sock: socket.socket, within_s: float) -> tuple[bytes, bool]:
    """What the socket still gives, and whether the connection ended (EOF or reset) within
    `within_s`."""
    loop = asyncio.get_running_loop()
    got = bytearray()
    try:
        async with asyncio.timeout(within_s):
            while True:
                try:
                    chunk = await loop.sock_recv(sock, 1 << 20)
                except ConnectionResetError:
                    return bytes(got), True
                if not chunk:
                    return bytes(got), True
                got += chunk
    except TimeoutError:
        return bytes(got), False


def _lines(logs: list[dict[str, Any]], event: str, rid: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == event and e.get("request_id") == rid]


async def _wait_for(
    logs: list[dict[str, Any]], event: str, rid: str, within_s: float
) -> list[dict[str, Any]]:
    deadline = time.monotonic() + within_s
    for _ in range(int(within_s / 0.05) + 1):
        if _lines(logs, event, rid) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    return _lines(logs, event, rid)


async def _settled(c: Cluster, names: tuple[str, ...], within_s: float = 5.0) -> dict[str, int]:
    deadline = time.monotonic() + within_s
    while True:
        counts = {n: (await c.emulators[n].stats())["in_flight"] for n in names}
        if not any(counts.values()) or time.monotonic() > deadline:
            return counts
        await asyncio.sleep(0.02)


def _metric(c: Cluster, name: str, *having: str) -> float:
    total = 0.0
    for line in c.gateway.metrics.render().decode().splitlines():
        if line.startswith(name) and all(h in line for h in having):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
async def test_a_client_that_stops_reading_is_cut_and_its_engines_stopped(case: str) -> None:
    route, body, workers = CASES[case]
    c = await build_cluster(time_scale=TIME_SCALE, timeouts=TIMEOUTS)
    sock: socket.socket | None = None
    try:
        before = {n: await c.emulators[n].stats() for n in workers}
        rid = f"stall-{case}"
        with capture_logs() as logs:
            sock = await _client(c)
            await _send(sock, route, body, rid)
            # never read: the gateway must give up on the client within its stall limit (once
            # its writes back up), long before the request's other deadlines
            done = await _wait_for(logs, "request.done", rid, within_s=30.0)
            assert done, f"the gateway still serves a client that reads nothing ({case})"
            stalled = _lines(logs, "request.client_stalled", rid)
        assert len(done) == 1 and done[0]["outcome"] == "client_stalled", done
        assert len(stalled) == 1 and stalled[0]["answered"] is False, stalled
        assert STALL <= stalled[0]["stalled_s"] < STALL + 2.0, stalled
        # the engines were stopped mid-generation, as for a client that went away
        assert await _settled(c, workers) == dict.fromkeys(workers, 0)
        decode = workers[-1]
        after = await c.emulators[decode].stats()
        assert after["completed"] == before[decode]["completed"], (before[decode], after)
        made = after["generation_tokens_total"] - before[decode]["generation_tokens_total"]
        assert made < TOKENS * int(body.get("n", 1)), made  # none ran to its end
        # the gateway's accounting and the client's connection are given back
        assert all(c.gateway.registry.get(n).inflight == 0 for n in workers)
        assert c.gateway.server is not None and c.gateway.server.active_requests == 0
        assert c.gateway.server.connections == 0
        assert c.gateway.admission.stats().active == 0  # its admission slot too
        assert _metric(c, "pdgw_requests_total", 'outcome="client_stalled"') == 1
        assert _metric(c, "pdgw_client_stalls_total") == 1
        # the client, reading at last, finds the stream cut short: no clean end
        rest, ended = await _read_to_end(sock, within_s=10.0)
        assert ended and rest.startswith(b"HTTP/1.1 200"), rest[:200]
        assert b"[DONE]" not in rest and not rest.endswith(b"0\r\n\r\n"), rest[-200:]
    finally:
        if sock is not None:
            sock.close()
        await stop_cluster(c)


@pytest.mark.timeout(120)
async def test_a_slow_client_that_keeps_reading_is_not_cut() -> None:
    """A client that takes a few KB every 0.2 s (through its 4 KB window) holds the gateway's
    writes paused far longer than `client_stall_s` (the transport resumes only once its buffer
    has drained): it is slow, not stalled, and its stream goes on."""
    route, body, workers = CASES["colocated-completions"]
    c = await build_cluster(time_scale=TIME_SCALE, timeouts=TIMEOUTS)
    sock: socket.socket | None = None
    try:
        rid = "slow-reader"
        with capture_logs() as logs:
            sock = await _client(c)
            await _send(sock, route, body, rid)
            assert c.gateway.server is not None
            got = 0
            paused_since: float | None = None
            t0 = time.monotonic()
            # read a little every 0.2 s until the gateway's writes have been paused for six
            # stall limits in a row
            while True:
                assert time.monotonic() - t0 < 60, "the gateway's writes to the client never paused"
                await asyncio.sleep(0.2)
                try:
                    chunk: bytes | None = sock.recv(1 << 16)  # what its 4 KB window let through
                except BlockingIOError:
                    chunk = None  # nothing there yet
                got += len(chunk or b"")
                conns = list(c.gateway.server._conns)  # (looked at, not touched)
                cut = chunk == b"" or not conns or _lines(logs, "request.client_stalled", rid)
                assert not cut, f"the gateway cut a client that reads, after {got} bytes"
                paused = conns[0]._write_paused
                if not paused:
                    paused_since = None
                elif paused_since is None:
                    paused_since = time.monotonic()
                elif time.monotonic() - paused_since > 6 * STALL:
                    break
            assert not _lines(logs, "request.client_stalled", rid)
            assert not _lines(logs, "request.done", rid)  # still streaming
            assert (await c.emulators["col"].stats())["in_flight"] == 1
            sock.close()  # the client leaves: that is a client gone, not a stalled one
            sock = None
            done = await _wait_for(logs, "request.done", rid, within_s=10.0)
        assert len(done) == 1 and done[0]["outcome"] == "client_gone", done
        assert not _lines(logs, "request.client_stalled", rid)
        assert await _settled(c, workers) == {"col": 0}
        assert _metric(c, "pdgw_client_stalls_total") == 0
    finally:
        if sock is not None:
            sock.close()
        await stop_cluster(c)


@pytest.mark.timeout(120)
async def test_a_whole_answer_the_client_does_not_read_closes_its_connection() -> None:
    """A non-streamed answer larger than the socket buffers: the engine's part is done (the answer
    was read whole before it was sent), but the gateway would hold the connection and the
    answer's bytes for as long as the client does not read. Past the stall limit it is closed
    and logged; the request itself was served (outcome ok)."""
    c = await build_cluster(timeouts=TIMEOUTS)  # zero delays: a whole answer is quick to make
    sock: socket.socket | None = None
    try:
        rid = "whole-unread"
        # 16 samples x 1000 tokens with 20 logprobs each: ~7 MB of JSON
        body = _completion("m-colocated", stream=False, n=16, max_tokens=1000)
        with capture_logs() as logs:
            sock = await _client(c)
            await _send(sock, "/v1/completions", body, rid)
            done = await _wait_for(logs, "request.done", rid, within_s=30.0)
            assert len(done) == 1 and done[0]["outcome"] == "ok", done
            stalled = await _wait_for(logs, "request.client_stalled", rid, within_s=15.0)
        assert len(stalled) == 1, "the gateway holds the connection of a client that reads nothing"
        assert stalled[0]["answered"] is True, stalled
        assert STALL <= stalled[0]["stalled_s"] < STALL + 2.0, stalled
        assert c.gateway.server is not None
        for _ in range(100):  # (connection_lost comes a loop turn after the abort)
            if not c.gateway.server.connections:
                break
            await asyncio.sleep(0.05)
        assert c.gateway.server.connections == 0
        assert _metric(c, "pdgw_client_stalls_total") == 1
        assert c.gateway.registry.get("col").inflight == 0
        rest, ended = await _read_to_end(sock, within_s=10.0)
        assert ended and rest.startswith(b"HTTP/1.1 200"), rest[:200]
        head, _, got = rest.partition(b"\r\n\r\n")
        length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:"))[15:])
        assert len(got) < length, (len(got), length)  # cut short
    finally:
        if sock is not None:
            sock.close()
        await stop_cluster(c)
