"""A closed-loop HTTP/1.1 load generator on raw asyncio Protocols + httptools.

Each of `conns` keep-alive connections sends one request, waits for the whole response
(Content-Length or chunked, SSE included), and sends the next one at once. Per request the
client costs one write, the parser callbacks and one future; it stays well below the cost of
what it measures, so that at one connection `target p50 - direct p50` is the latency the
target adds.

Only responses that *complete* inside the measurement window count; the warm-up before it
fills connection pools and JITs nothing but lets everything reach a steady state.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import httptools


@dataclass
class LoadResult:
    duration_s: float
    completed: int
    errors: int
    latencies_s: list[float] = field(repr=False)
    error_samples: list[str] = field(default_factory=list)
    cpu_s: dict[str, float] = field(default_factory=dict)  # name -> CPU seconds over the window
    # Percentiles a foreign load generator (wrk) reported, when there is no latency list.
    fixed_percentiles_ms: dict[float, float] = field(default_factory=dict)

    @property
    def rps(self) -> float:
        return self.completed / self.duration_s if self.duration_s > 0 else 0.0

    def percentile_ms(self, q: float) -> float:
        if self.fixed_percentiles_ms:
            return self.fixed_percentiles_ms.get(q, float("nan"))
        return percentile(self.latencies_s, q) * 1000.0


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of unsorted `values`: the smallest value with at
    least q % of the values at or below it; NaN if empty."""
    if not values:
        return float("nan")
    s = sorted(values)
    # ceil(q * n / 100), with a tolerance for float error; round() rounded half to even, so
    # p99 of 100 values was the 100th
    k = max(0, min(len(s) - 1, math.ceil(q * len(s) / 100.0 - 1e-9) - 1))
    return s[k]


def build_request(host: str, port: int, path: str, body: bytes, extra_headers: str = "") -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\n"
        f"Host: {host}:{port}\r\n"
        "Content-Type: application/json\r\n"
        "Accept: */*\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"{extra_headers}"
        "\r\n"
    )
    return head.encode("latin-1") + body


CLIENTS = ("openai", "raw", "raw-quickack")

# The header fields the `openai` Python client (AsyncOpenAI 3.60.0 on httpx/httpcore, CPython
# 3.11, Linux) sends with a completion, in its order, as captured on loopback; `{host}`, `{port}`
# and `{length}` are filled in per request.
OPENAI_HEAD = (
    "POST {path} HTTP/1.1\r\n"
    "Host: {host}:{port}\r\n"
    "Accept-Encoding: gzip, deflate\r\n"
    "Connection: keep-alive\r\n"
    "authorization: Bearer unused\r\n"
    "accept: application/json\r\n"
    "content-type: application/json\r\n"
    "user-agent: AsyncOpenAI/Python 3.60.0\r\n"
    "x-stainless-lang: python\r\n"
    "x-stainless-package-version: 3.60.0\r\n"
    "x-stainless-os: Linux\r\n"
    "x-stainless-arch: x64\r\n"
    "x-stainless-runtime: CPython\r\n"
    "x-stainless-runtime-version: 3.11.7\r\n"
    "x-stainless-async: async:asyncio\r\n"
    "x-stainless-retry-count: 0\r\n"
    "x-stainless-read-timeout: 600\r\n"
    "Content-Length: {length}\r\n"
    "\r\n"
)


def client_request(client: str, host: str, port: int, path: str, body: bytes) -> tuple[bytes, ...]:
    """One request as a client sends it, as the pieces it writes one `send` each.

    `raw`: four header fields, head and body in one write (as wrk and the emulator's routers
    do). `openai`: what the `openai` client sends: its seventeen header fields, then the body in
    a second write (httpcore writes h11's events one by one: the head, then the body; with
    TCP_NODELAY each goes out as its own segment, so a server mostly reads them apart).
    `raw-quickack` is `raw` on a socket that acknowledges every segment at once (TCP_QUICKACK
    set after each request is sent; see `_ClientProtocol`): no client does this, it shows what a
    target costs when its own Nagle algorithm never waits for a delayed ACK."""
    if client in ("raw", "raw-quickack"):
        return (build_request(host, port, path, body),)
    if client == "openai":
        head = OPENAI_HEAD.format(path=path, host=host, port=port, length=len(body))
        return (head.encode("latin-1"), body)
    raise ValueError(f"unknown client {client!r} (choose from {', '.join(CLIENTS)})")


class _ClientProtocol(asyncio.Protocol):
    """One keep-alive connection; `send()` returns a future resolved at the end of the response."""

    def __init__(self, check_tail: bytes | None, quickack: bool = False) -> None:
        self.quickack = quickack
        self.sock: socket.socket | None = None
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.fut: asyncio.Future[tuple[int, bool]] | None = None
        self.status = 0
        self.tail = b""
        self.check_tail = check_tail
        self.collect: list[bytes] | None = None
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    # asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock = sock

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"parse error: {exc}")
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(f"connection lost: {exc}")
        if not self.lost.done():
            self.lost.set_result(None)

    # httptools callbacks
    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.collect is not None:
            self.collect.append(body)
        if self.check_tail is not None:
            self.tail = (self.tail + body)[-64:]

    def on_message_complete(self) -> None:
        ok = self.status == 200 and (self.check_tail is None or self.check_tail in self.tail)
        keep = self.parser.should_keep_alive()
        fut, self.fut = self.fut, None
        self.tail = b""
        if fut is not None and not fut.done():
            fut.set_result((self.status if ok or self.status != 200 else -1, keep))

    def _fail(self, why: str) -> None:
        fut, self.fut = self.fut, None
        if fut is not None and not fut.done():
            fut.set_exception(ConnectionError(why))

    def send(
        self, request: bytes | tuple[bytes, ...], collect: list[bytes] | None = None
    ) -> asyncio.Future[tuple[int, bool]]:
        """Write the request (a tuple: one write per piece) and return the response's future."""
        fut: asyncio.Future[tuple[int, bool]] = asyncio.get_running_loop().create_future()
        self.fut = fut
        self.collect = collect
        assert self.transport is not None
        if isinstance(request, bytes):
            self.transport.write(request)
        else:
            for piece in request:
                self.transport.write(piece)
        if self.quickack and self.sock is not None:
            # out of Linux's "pingpong" (interactive) mode, which a request sent soon after the
            # last answer puts the socket in: the answer's first segment is ACKed at once, so
            # a server's Nagle algorithm never holds the next one for a delayed ACK (~40 ms)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
        return fut


async def run_load(
    make_session: Callable[[], Session],
    *,
    conns: int,
    duration_s: float,
    warmup_s: float = 1.0,
    cpu_probes: dict[str, Callable[[], float]] | None = None,
    request_timeout_s: float = 30.0,
) -> LoadResult:
    """Drive `conns` closed-loop sessions; measure the window after `warmup_s`."""
    loop = asyncio.get_running_loop()
    now = time.perf_counter
    t_start = now() + warmup_s
    t_end = t_start + duration_s
    latencies: list[float] = []
    counters = {"completed": 0, "errors": 0}
    samples: list[str] = []
    cpu_probes = cpu_probes or {}
    cpu_at_start: dict[str, float] = {}
    cpu_at_end: dict[str, float] = {}
    window_bounds: list[float] = []

    def snap(into: dict[str, float]) -> None:
        window_bounds.append(now())
        for name, probe in cpu_probes.items():
            into[name] = probe()

    def note_error(msg: str) -> None:
        t = now()
        if t_start <= t <= t_end:
            counters["errors"] += 1
        if len(samples) < 5:
            samples.append(msg)

    async def one_connection() -> None:
        session = make_session()
        try:
            while now() < t_end:
                t0 = now()
                try:
                    status = await session.once()
                except (ConnectionError, OSError, ValueError) as exc:
                    note_error(f"{type(exc).__name__}: {exc}")
                    session.close()
                    await asyncio.sleep(0.01)
                    continue
                t1 = now()
                if status == 200:
                    if t_start <= t1 <= t_end:
                        latencies.append(t1 - t0)
                        counters["completed"] += 1
                else:
                    note_error(f"HTTP {status}" if status > 0 else "bad body (no end marker)")
        finally:
            session.close()

    h1 = loop.call_at(loop.time() + warmup_s, snap, cpu_at_start)
    h2 = loop.call_at(loop.time() + warmup_s + duration_s, snap, cpu_at_end)
    tasks = [asyncio.ensure_future(one_connection()) for _ in range(conns)]
    try:
        # After the window, in-flight requests get `request_timeout_s` to finish; the ones
        # still running then are hung and count as errors.
        _, pending = await asyncio.wait(tasks, timeout=warmup_s + duration_s + request_timeout_s)
        for t in pending:
            t.cancel()
            counters["errors"] += 1
            if len(samples) < 5:
                samples.append(f"no response after {request_timeout_s:g}s")
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        h1.cancel()
        h2.cancel()
    if len(window_bounds) < 2:  # the loop was too busy to fire the timers (should not happen)
        snap(cpu_at_end)
    window = window_bounds[-1] - window_bounds[0] if len(window_bounds) >= 2 else duration_s
    cpu = {k: cpu_at_end.get(k, 0.0) - cpu_at_start.get(k, 0.0) for k in cpu_probes}
    return LoadResult(
        duration_s=window,
        completed=counters["completed"],
        errors=counters["errors"],
        latencies_s=latencies,
        error_samples=samples,
        cpu_s=cpu,
    )


class Conn:
    """A keep-alive connection to one origin, reopened when the server closes it."""

    def __init__(self, host: str, port: int, check_tail: bytes | None = None, quickack: bool = False) -> None:
        self.host, self.port, self.check_tail, self.quickack = host, port, check_tail, quickack
        self.proto: _ClientProtocol | None = None

    async def ready(self) -> _ClientProtocol:
        p = self.proto
        if p is None or p.transport is None or p.transport.is_closing():
            loop = asyncio.get_running_loop()
            _, p = await loop.create_connection(
                lambda: _ClientProtocol(self.check_tail, self.quickack), self.host, self.port
            )
            self.proto = p
        return p

    def after(self, keep: bool) -> None:
        if not keep:
            self.close()

    def close(self) -> None:
        if self.proto is not None and self.proto.transport is not None:
            self.proto.transport.close()
        self.proto = None


class Session:
    """One closed-loop client: `once()` runs one request and returns its status (200 = ok)."""

    async def once(self) -> int:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class SimpleSession(Session):
    """The same request, again and again, on one keep-alive connection."""

    def __init__(
        self,
        host: str,
        port: int,
        request: bytes | tuple[bytes, ...],
        check_tail: bytes | None = None,
        *,
        quickack: bool = False,
    ) -> None:
        self.conn = Conn(host, port, check_tail, quickack)
        self.request = request

    async def once(self) -> int:
        proto = await self.conn.ready()
        status, keep = await proto.send(self.request)
        self.conn.after(keep)
        return status

    def close(self) -> None:
        self.conn.close()


def _splice(body: bytes, extra: bytes) -> bytes:
    """Add members to a JSON object given as bytes: `{...}` + `,"k":v` before the brace."""
    return body[:-1] + b"," + extra + b"}"


def vllm_prefill_dict(body: dict[str, object]) -> dict[str, object]:
    """The prefill leg of vLLM's NIXL handoff, as its toy proxy builds it."""
    p = dict(body)
    p.update(max_tokens=1, stream=False)
    p.pop("stream_options", None)
    p["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    return p


class SglangPDSession(Session):
    """The SGLang handoff done by the client itself: the same body, with a fresh bootstrap
    room, to prefill and decode at once; the decode's answer is the result, the prefill's is
    read fully. The lower bound for any SGLang P/D router on these upstreams."""

    def __init__(
        self,
        prefill: tuple[str, int],
        decode: tuple[str, int],
        bootstrap_port: int,
        path: str,
        body: bytes,
        check_tail: bytes | None = None,
    ) -> None:
        self.pconn = Conn(*prefill)
        self.dconn = Conn(*decode, check_tail)
        self.path = path
        self.body = body
        self.prefix = (
            f'"bootstrap_host":"{prefill[0]}","bootstrap_port":{bootstrap_port},"bootstrap_room":'.encode()
        )
        self.rng = random.Random()

    async def once(self) -> int:
        room = self.rng.getrandbits(63)
        body = _splice(self.body, self.prefix + str(room).encode())
        p = await self.pconn.ready()
        d = await self.dconn.ready()
        fp = p.send(build_request(self.pconn.host, self.pconn.port, self.path, body))
        fd = d.send(build_request(self.dconn.host, self.dconn.port, self.path, body))
        try:
            dstatus, dkeep = await fd
        finally:
            pstatus, pkeep = await fp
        self.pconn.after(pkeep)
        self.dconn.after(dkeep)
        return dstatus if pstatus == 200 else pstatus

    def close(self) -> None:
        self.pconn.close()
        self.dconn.close()


class VllmPDSession(Session):
    """The vLLM (NIXL) handoff done by the client itself: prefill with `max_tokens: 1` and
    `do_remote_decode`, then the original body plus the returned `kv_transfer_params` to the
    decode, with one `X-Request-Id` on both legs."""

    def __init__(
        self,
        prefill: tuple[str, int],
        decode: tuple[str, int],
        path: str,
        body: dict[str, object],
        check_tail: bytes | None = None,
    ) -> None:
        self.pconn = Conn(*prefill)
        self.dconn = Conn(*decode, check_tail)
        self.path = path
        self.pbody = json.dumps(vllm_prefill_dict(body), separators=(",", ":")).encode()
        self.dbody = json.dumps(body, separators=(",", ":")).encode()
        self.n = 0
        self.tag = f"{random.getrandbits(32):08x}"

    async def once(self) -> int:
        self.n += 1
        rid = f"X-Request-Id: bench-{self.tag}-{self.n}\r\n"
        p = await self.pconn.ready()
        chunks: list[bytes] = []
        pstatus, pkeep = await p.send(
            build_request(self.pconn.host, self.pconn.port, self.path, self.pbody, rid), chunks
        )
        self.pconn.after(pkeep)
        if pstatus != 200:
            return pstatus
        params = json.loads(b"".join(chunks)).get("kv_transfer_params")
        if not params:
            raise ValueError("the prefill returned no kv_transfer_params")
        body = _splice(self.dbody, b'"kv_transfer_params":' + json.dumps(params).encode())
        d = await self.dconn.ready()
        dstatus, dkeep = await d.send(build_request(self.dconn.host, self.dconn.port, self.path, body, rid))
        self.dconn.after(dkeep)
        return dstatus

    def close(self) -> None:
        self.pconn.close()
        self.dconn.close()


def new_event_loop() -> asyncio.AbstractEventLoop:
    with contextlib.suppress(ImportError):
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()
