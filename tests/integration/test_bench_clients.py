"""The benchmark's clients send what the clients they stand for send.

`--client openai` (the default of `pd-gateway bench overhead`) must send the header fields the
real `openai` client sends, in its order, head and body in two writes; a stream's events from
`--upstream nginx --token-interval-ms` must leave one per write; the wake-ups a target pays are
counted from its threads.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from bench import nginx_upstream, procs
from bench.loadgen import OPENAI_HEAD, SimpleSession, client_request, new_event_loop, run_load
from bench.overhead import Row, processes_table
from bench.wrk import client_headers


def _names(head: bytes) -> list[str]:
    lines = head.decode("latin-1").split("\r\n")[1:]
    return [ln.split(":", 1)[0].lower() for ln in lines if ln]


class _Capture:
    """A raw HTTP/1.1 server on loopback that records each recv() and answers every request
    with a one-event SSE stream."""

    def __init__(self) -> None:
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen()
        self.port = self.srv.getsockname()[1]
        self.reads: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.srv.accept()
        conn.settimeout(10)
        buf = b""
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                self.reads.append(data)
                buf += data
                head, sep, body = buf.partition(b"\r\n\r\n")
                if not sep:
                    continue
                length = int(
                    next(
                        ln.split(b":")[1]
                        for ln in head.split(b"\r\n")
                        if ln.lower().startswith(b"content-length")
                    )
                )
                if len(body) < length:
                    continue
                buf = b""
                ev = b'data: {"id":"x","object":"text_completion","created":0,"model":"m","choices":[{"index":0,"text":"a","logprobs":null,"finish_reason":"length"}]}\n\n'
                done = b"data: [DONE]\n\n"
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                    + b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(ev), ev, len(done), done)
                )

    def close(self) -> None:
        self.srv.close()


def test_the_openai_client_sends_the_fields_the_load_generator_sends() -> None:
    from openai import AsyncOpenAI

    cap = _Capture()
    try:

        async def two_streams() -> None:
            client = AsyncOpenAI(base_url=f"http://127.0.0.1:{cap.port}/v1", api_key="unused", max_retries=0)
            for _ in range(2):  # the second on the same (kept-alive) connection
                async for _ in await client.completions.create(
                    model="m", prompt="hi", max_tokens=1, stream=True
                ):
                    pass
            await client.close()

        asyncio.run(two_streams())
    finally:
        cap.close()
    sent = b"".join(cap.reads)
    first = sent.split(b"\r\n\r\n", 1)[0]
    assert _names(first) == _names(OPENAI_HEAD.encode())
    assert sent.count(b"POST /v1/completions HTTP/1.1") == 2  # one connection for both


def test_the_openai_shaped_request_goes_as_head_then_body_and_raw_as_one() -> None:
    body = b'{"model":"m"}'
    head, rest = client_request("openai", "127.0.0.1", 1234, "/v1/completions", body)
    assert rest == body and head.endswith(b"\r\n\r\n") and b"Content-Length: 13\r\n" in head
    (raw,) = client_request("raw", "127.0.0.1", 1234, "/v1/completions", body)
    assert raw.endswith(b"\r\n\r\n" + body)
    assert client_request("raw-quickack", "127.0.0.1", 1234, "/p", body) == client_request(
        "raw", "127.0.0.1", 1234, "/p", body
    )
    wrk = client_headers("openai")
    assert wrk["x-stainless-lang"] == "python" and "Content-Length" not in wrk and "Host" not in wrk
    with pytest.raises(ValueError):
        client_request("curl", "h", 1, "/", body)


def test_the_load_generator_writes_the_openai_request_in_two_sends() -> None:
    """One transport write per piece (uvloop sends each at once: two segments with TCP_NODELAY,
    as httpcore's two writes are)."""
    from bench.loadgen import _ClientProtocol

    class Recorder:
        def __init__(self) -> None:
            self.writes: list[bytes] = []

        def get_extra_info(self, name: str) -> None:
            return None

        def write(self, data: bytes) -> None:
            self.writes.append(data)

    async def go() -> list[bytes]:
        proto = _ClientProtocol(None)
        t = Recorder()
        proto.connection_made(t)  # type: ignore[arg-type]
        proto.send(client_request("openai", "127.0.0.1", 1, "/v1/completions", b"{}"))
        proto.send(client_request("raw", "127.0.0.1", 1, "/v1/completions", b"{}"))
        return t.writes

    writes = asyncio.run(go())
    assert len(writes) == 3 and writes[0].endswith(b"\r\n\r\n") and writes[1] == b"{}"
    assert writes[2].endswith(b"\r\n\r\n{}")


@pytest.mark.skipif(nginx_upstream.available() is not None, reason="needs nginx and its echo module")
def test_paced_nginx_streams_leave_one_event_per_write(tmp_path: Path) -> None:
    with procs.process_group() as g:
        _, layout, _ = nginx_upstream.start(
            g,
            ["sglang"],
            ["stream64"],
            prompt_tokens=10,
            max_tokens=8,
            cpus=None,
            log_dir=tmp_path,
            token_interval_ms=2,
        )
        port = layout[("sglang", "stream64")].decode
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
            reads, data, t0 = 0, b"", time.monotonic()
            while not data.endswith(b"0\r\n\r\n"):
                chunk = s.recv(65536)
                assert chunk
                reads += 1
                data += chunk
            took = time.monotonic() - t0
    assert data.count(b"data: ") == 65  # 64 events and [DONE]
    assert reads >= 60 and took >= 0.1  # apart, ~2 ms each


def test_wakeups_are_counted_per_thread() -> None:
    before = procs.tree_wakeups(os.getpid())
    for _ in range(20):
        time.sleep(0.001)  # each sleep blocks: one voluntary context switch
    assert procs.tree_wakeups(os.getpid()) >= before + 20


def test_the_processes_table_puts_two_processes_beside_one_and_the_router() -> None:
    def row(target: str, cpu: float, rps: float, vs: float | None, preempted: float) -> Row:
        r = Row(target, "sglang", "nonstream", 64, rps, 1.0, 2.0, 3.0, 100, 0, cpu, 10.0)
        r.cpu_vs_router = vs
        r.preempted_per_req = preempted
        return r

    table = processes_table(
        [
            row("sglang-router", 200.0, 1000, None, 0.01),
            row("gateway", 250.0, 900, 1.25, 0.008),
            row("gateway-x2", 275.0, 1500, 1.375, 0.0625),
        ]
    )
    line = table.splitlines()[-1]
    assert line == (
        "| sglang | nonstream | 64 | 200 | 250 (1.25x) | 275 (1.38x) | 1.10x | 900 | 1500 | 5000 | 4000 | 3636 "
        "| 0.008 | 0.062 |"
    )


def test_run_load_counts_requests_with_the_openai_client_shape() -> None:
    cap = _Capture()
    req = client_request("openai", "127.0.0.1", cap.port, "/v1/completions", b'{"stream":true}')
    loop = new_event_loop()
    try:
        res = loop.run_until_complete(
            run_load(
                lambda: SimpleSession("127.0.0.1", cap.port, req, b"[DONE]"),
                conns=1,
                duration_s=0.3,
                warmup_s=0.1,
            )
        )
    finally:
        loop.close()
        cap.close()
    assert res.completed > 0 and res.errors == 0


def test_preemptions_are_counted_apart_from_wake_ups() -> None:
    """Two threads of this process that both have work (hashing releases the GIL), pinned to one
    CPU, take turns: the scheduler preempts them (involuntary context switches)."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("needs sched_setaffinity")
    import hashlib

    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(saved)})
    try:
        before = procs.tree_preemptions(os.getpid())
        data = bytes(1 << 20)

        def spin() -> None:
            t = time.monotonic()
            while time.monotonic() - t < 0.15:
                hashlib.sha256(data).digest()

        threads = [threading.Thread(target=spin) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert procs.tree_preemptions(os.getpid()) > before
    finally:
        os.sched_setaffinity(0, saved)
