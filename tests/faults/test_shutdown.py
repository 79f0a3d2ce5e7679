"""Graceful shutdown under load: stop accepting, let running streams finish within the grace
period, then cut the rest with a clear error (an SSE error event mid-stream, a 503 before the
first byte) and leave no request running on any engine. In process (`Gateway.stop`) and as
users run it (`pd-gateway serve`, SIGTERM)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.config import LimitsConfig, TimeoutsConfig
from tests.integration.conftest import Cluster, build_cluster, stop_cluster

MODELS = ("m-sglang", "m-vllm", "m-colocated")
BIN = Path(sys.executable).parent / "pd-gateway"


def body(model: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": "a long tale",
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }


class Stream:
    """A streamed request whose first body bytes have arrived (`started`) and whose rest is read
    by `done`."""

    def __init__(self, url: str, model: str, max_tokens: int) -> None:
        self.started = asyncio.Event()
        self.status = 0
        self.done = asyncio.create_task(self._run(url, body(model, max_tokens)))

    async def _run(self, url: str, b: dict[str, Any]) -> bytes:
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=b) as r:
            self.status = r.status
            first = await r.content.readany()
            self.started.set()
            try:
                rest = await r.content.read()
            except aiohttp.ClientPayloadError:
                rest = b"<payload error>"
            return first + rest


async def open_streams(url: str, n: int, max_tokens: int) -> list[Stream]:
    streams = [Stream(url, MODELS[i % len(MODELS)], max_tokens) for i in range(n)]
    async with asyncio.timeout(10):
        await asyncio.gather(*(s.started.wait() for s in streams))
    return streams


def finished_ok(raw: bytes) -> bool:
    return raw.rstrip().endswith(b"data: [DONE]") and b'"error"' not in raw


def cut_with_error(raw: bytes) -> bool:
    """Ended by a final SSE error event (code shutting_down), never a clean [DONE]."""
    events = [line[5:].strip() for line in raw.split(b"\n") if line.startswith(b"data:")]
    if not events or events[-1] == b"[DONE]":
        return False
    last = json.loads(events[-1])
    return bool(last.get("error", {}).get("code") == "shutting_down")


async def emulators_idle(c: Cluster, within_s: float = 3.0) -> dict[str, int]:
    deadline = time.monotonic() + within_s
    while True:
        counts = {n: (await h.stats())["in_flight"] for n, h in c.emulators.items()}
        if not any(counts.values()) or time.monotonic() > deadline:
            return counts
        await asyncio.sleep(0.02)


# -- in process --------------------------------------------------------------------------------


async def test_stop_lets_running_streams_finish_within_the_grace_period() -> None:
    c = await build_cluster(time_scale=1.0)
    try:
        streams = await open_streams(c.url, 32, 60)  # ~0.6 s each
        t0 = time.monotonic()
        stopping = asyncio.create_task(c.gateway.stop(grace_s=10.0))
        await asyncio.sleep(0.05)
        with pytest.raises(aiohttp.ClientConnectionError):  # no longer accepting
            async with aiohttp.ClientSession() as s, s.get(c.url + "/health") as r:
                await r.read()
        results = await asyncio.gather(*(s.done for s in streams))
        await stopping
        took = time.monotonic() - t0
        assert all(s.status == 200 for s in streams)
        bad = [r[-200:] for r in results if not finished_ok(r)]
        assert not bad, bad
        assert took < 3.0  # returned once idle, not after the whole grace period
        assert await emulators_idle(c) == dict.fromkeys(c.emulators, 0)
    finally:
        await stop_cluster(c)


async def test_after_the_grace_period_streams_are_cut_with_an_sse_error_and_engines_stop() -> None:
    c = await build_cluster(time_scale=1.0)
    try:
        streams = await open_streams(c.url, 32, 500)  # ~4.5 s each: longer than the grace
        t0 = time.monotonic()
        await c.gateway.stop(grace_s=0.3)
        took = time.monotonic() - t0
        results = await asyncio.wait_for(asyncio.gather(*(s.done for s in streams)), 3.0)
        assert 0.3 <= took < 2.0
        bad = [r[-300:] for r in results if not cut_with_error(r)]
        assert not bad, bad
        assert await emulators_idle(c) == dict.fromkeys(c.emulators, 0)
        # counted as cut by the shutdown, not as clients that left (a probe saw client_gone)
        outcomes = [
            line.split('outcome="')[1].split('"')[0]
            for line in c.gateway.metrics.render().decode().splitlines()
            if line.startswith("pdgw_requests_total{") and not line.endswith(" 0.0")
        ]
        assert set(outcomes) == {"shutting_down"}, outcomes
    finally:
        await stop_cluster(c)


async def test_requests_before_their_first_byte_get_a_503_and_queued_ones_too() -> None:
    # the SGLang prefill hangs: those requests are in the prefill phase when the grace expires
    c = await build_cluster(
        time_scale=1.0,
        faults={"sgl-p": ["hang_before_first_byte"]},
        timeouts=TimeoutsConfig(prefill_s=30.0),
        limits=LimitsConfig(max_concurrent=4, max_queue=16, queue_timeout_s=30.0),
    )
    try:

        async def post() -> tuple[int, dict[str, str], bytes]:
            b = body("m-sglang", 8) | {"stream": False}
            async with aiohttp.ClientSession() as s, s.post(c.url + "/v1/completions", json=b) as r:
                return r.status, dict(r.headers), await r.read()

        tasks = [asyncio.create_task(post()) for _ in range(8)]  # 4 run (hung), 4 queue
        for _ in range(200):
            st = c.gateway.admission.stats()
            if st.active == 4 and st.queued == 4:
                break
            await asyncio.sleep(0.01)
        assert (st.active, st.queued) == (4, 4)
        await c.gateway.stop(grace_s=0.3)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 3.0)
        for status, headers, raw in results:
            assert status == 503, raw
            err = json.loads(raw)["error"]
            assert err["code"] == "shutting_down" and err["type"] == "server_error"
            assert headers["Retry-After"]
        assert c.gateway.admission.stats().shed["shutting_down"] == 4
        assert await emulators_idle(c) == dict.fromkeys(c.emulators, 0)
    finally:
        await stop_cluster(c)


# -- SIGTERM to `pd-gateway serve` -------------------------------------------------------------


def spawn(cfg: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [str(BIN), "serve", "--config", str(cfg), "--log-level", "warning"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


async def serve(c: Cluster, tmp_path: Path, grace_s: float) -> tuple[subprocess.Popen[bytes], str]:
    """`pd-gateway serve` as a subprocess in front of this cluster's emulators."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    lines = [f"shutdown_grace_s = {grace_s}", "", "[listen]", 'host = "127.0.0.1"', f"port = {port}"]
    for wc in c.gateway.cfg.workers:
        lines += ["", "[[workers]]", f'url = "{wc.url}"', f'role = "{wc.role.value}"']
        lines += [f'engine = "{wc.engine.value}"', f'id = "{wc.worker_id}"']
        if wc.bootstrap_port is not None:
            lines.append(f"bootstrap_port = {wc.bootstrap_port}")
    cfg = tmp_path / "gw.toml"
    cfg.write_text("\n".join(lines) + "\n")
    proc = spawn(cfg)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.get(url + "/readiness") as r:
                    if r.status == 200:
                        return proc, url
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise AssertionError(proc.communicate()[0].decode())
            await asyncio.sleep(0.1)


async def wait_exit(proc: subprocess.Popen[bytes], within_s: float) -> int:
    deadline = time.monotonic() + within_s
    while proc.poll() is None:
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError("the gateway did not exit after SIGTERM")
        await asyncio.sleep(0.02)
    return proc.returncode


@pytest.mark.parametrize("cut", [False, True])
async def test_sigterm_during_streams(tmp_path: Path, cut: bool) -> None:
    c = await build_cluster(time_scale=1.0)
    proc, url = await serve(c, tmp_path, grace_s=0.3 if cut else 10.0)
    try:
        streams = await open_streams(url, 16, 500 if cut else 60)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        assert await wait_exit(proc, 8.0) == 0
        took = time.monotonic() - t0
        results = await asyncio.wait_for(asyncio.gather(*(s.done for s in streams)), 3.0)
        check = cut_with_error if cut else finished_ok
        bad = [r[-300:] for r in results if not check(r)]
        assert not bad, bad
        assert took < (2.5 if cut else 4.0)
        assert await emulators_idle(c) == dict.fromkeys(c.emulators, 0)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        await stop_cluster(c)


async def test_a_second_sigterm_ends_the_grace_period_now(tmp_path: Path) -> None:
    c = await build_cluster(time_scale=1.0)
    proc, url = await serve(c, tmp_path, grace_s=60.0)
    try:
        streams = await open_streams(url, 16, 500)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        await asyncio.sleep(0.3)
        assert proc.poll() is None  # still within its (long) grace period
        os.killpg(proc.pid, signal.SIGTERM)
        assert await wait_exit(proc, 8.0) == 0
        assert time.monotonic() - t0 < 3.0
        results = await asyncio.wait_for(asyncio.gather(*(s.done for s in streams)), 3.0)
        bad = [r[-300:] for r in results if not cut_with_error(r)]
        assert not bad, bad
        assert await emulators_idle(c) == dict.fromkeys(c.emulators, 0)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        await stop_cluster(c)


async def test_a_keep_alive_request_during_shutdown_is_answered_503_and_logged() -> None:
    """Raw sockets: a client holding an idle keep-alive connection sends its next request while
    the gateway drains (a stream keeps the grace period going). It gets a 503 `shutting_down`
    with Connection: close and Retry-After, not a reset; the refusal has its access-log line
    and is counted. A request pipelined behind the running stream's own request, on its
    connection, is answered the same way after the stream."""
    from structlog.testing import capture_logs

    from tests.http._util import read_response

    c = await build_cluster(time_scale=1.0)
    try:
        host, port = "127.0.0.1", c.gateway.port
        idle_r, idle_w = await asyncio.open_connection(host, port)
        idle_w.write(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n")
        assert (await read_response(idle_r)).status == 200
        stream = (await open_streams(c.url, 1, 60))[0]  # ~0.6 s: the grace period runs meanwhile
        busy_r, busy_w = await asyncio.open_connection(host, port)
        req = json.dumps(body("m-colocated", 30)).encode()
        busy_w.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(req), req)
        )
        await asyncio.sleep(0.1)  # its stream has started
        with capture_logs() as logs:
            stopping = asyncio.create_task(c.gateway.stop(grace_s=10.0))
            await asyncio.sleep(0.05)
            idle_w.write(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\nx-request-id: late-1\r\n\r\n")
            busy_w.write(b"GET /health HTTP/1.1\r\nHost: gw\r\nx-request-id: late-2\r\n\r\n")
            late = await asyncio.wait_for(read_response(idle_r), 5)
            first = await asyncio.wait_for(read_response(busy_r), 5)
            second = await asyncio.wait_for(read_response(busy_r), 5)
            await stream.done
            await stopping
        assert late.status == 503, late.body
        assert late.header(b"connection") == b"close" and late.header(b"retry-after") == b"1"
        assert late.header(b"x-request-id") == b"late-1"
        assert json.loads(late.body)["error"]["code"] == "shutting_down"
        assert await asyncio.wait_for(idle_r.read(), 5) == b""  # then closed, not reset
        assert first.status == 200  # (its head went out before the shutdown began)
        assert second.status == 503 and second.header(b"x-request-id") == b"late-2"
        done = [e for e in logs if e.get("event") == "request.done" and e.get("outcome") == "shutting_down"]
        assert {e["request_id"] for e in done} >= {"late-1", "late-2"}, done
        assert all(
            e["status"] == 503 and e["stage"] == "http" for e in done if e["request_id"].startswith("late")
        )
    finally:
        await stop_cluster(c)
