"""The replay client: streamed completions, timed per token, open- or closed-loop.

Built on the load generator's HTTP/1.1 protocol (bench/loadgen.py: raw asyncio + httptools,
keep-alive connections) with a body callback that cuts the SSE stream into events as they
arrive, so that TTFT is the first event carrying text and TPOT the spread of the events after
it. The final usage chunk (`stream_options.include_usage`) gives the engine's own
`prompt_tokens` and `completion_tokens`.

Open loop: request i is due at start + t_i / rate whatever happened before (its lateness, the
*send lag*, is recorded: a client that falls behind measures itself, not the target). Closed
loop: `concurrency` clients, each sending its next request when its last one ended.

Dispatchers: `FrontEnd` (a router or gateway's one address) and `Direct`, the baseline
without a front end: round robin over colocated workers, or over (prefill, decode) pairs with
the client doing the engine's handoff itself (SGLang: both legs at once with a bootstrap room;
vLLM: the prefill with `max_tokens` 1 and `do_remote_decode`, then the decode with the
returned `kv_transfer_params`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import msgspec

from bench.loadgen import _ClientProtocol, _splice, build_request
from bench.replay.stats import Record
from bench.replay.trace import Row

PATH = "/v1/completions"


@dataclass
class Item:
    """One request ready to send: its row and its body (built before the run)."""

    index: int
    row: Row
    body: bytes
    prefill_body: bytes | None = None  # the vLLM handoff's prefill leg (Direct only)


def request_dict(model: str, prompt: str, row: Row) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": row.output_length,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if row.session_id:
        body["user"] = row.session_id
    return body


def encode(obj: Any) -> bytes:
    return msgspec.json.encode(obj)


# --------------------------------------------------------------------------- SSE timing


class _Details(msgspec.Struct):
    cached_tokens: int = 0


class _Usage(msgspec.Struct):
    prompt_tokens: int = -1
    completion_tokens: int = 0
    prompt_tokens_details: _Details | None = None  # (an engine leaves it out when 0 are cached)


class _Choice(msgspec.Struct):
    text: str | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: Any = None
    object: str = ""
    message: str = ""


_chunk_decoder = msgspec.json.Decoder(_Chunk)


class _TimedProtocol(_ClientProtocol):
    """A keep-alive connection whose body callback times SSE events into a `Record`."""

    def __init__(self) -> None:
        super().__init__(None)
        self.rec: Record | None = None
        self.buf = b""
        self.events = 0
        self.err_body = b""

    def start(self, rec: Record | None) -> None:
        self.rec, self.buf, self.events, self.err_body = rec, b"", 0, b""

    def on_body(self, body: bytes) -> None:
        if self.collect is not None:
            self.collect.append(body)
            return
        rec = self.rec
        if rec is None:
            return
        if self.status != 200:
            if len(self.err_body) < 400:
                self.err_body += body[:400]
            return
        t = time.perf_counter()
        buf = self.buf + body
        while True:
            i = buf.find(b"\n\n")
            if i < 0:
                break
            self._event(buf[:i], t, rec)
            buf = buf[i + 2 :]
        self.buf = buf

    def _event(self, event: bytes, t: float, rec: Record) -> None:
        event = event.strip()
        if not event.startswith(b"data:"):
            return
        data = event[5:].strip()
        if data == b"[DONE]":
            return
        try:
            chunk = _chunk_decoder.decode(data)
        except msgspec.DecodeError:
            rec.error = rec.error or f"bad stream event: {data[:120]!r}"
            return
        if chunk.error is not None or chunk.object == "error":
            rec.error = rec.error or f"stream error: {str(chunk.error or chunk.message)[:200]}"
            return
        if any(c.text for c in chunk.choices):
            if not rec.first_token:
                rec.first_token = t
            rec.last_token = t
            self.events += 1
        if chunk.usage is not None:
            rec.prompt_tokens = chunk.usage.prompt_tokens
            rec.completion_tokens = chunk.usage.completion_tokens
            details = chunk.usage.prompt_tokens_details
            rec.cached_tokens = details.cached_tokens if details is not None else 0


class Pool:
    """Keep-alive connections to one origin; a request takes an idle one or opens another."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: list[_TimedProtocol] = []

    async def _get(self) -> _TimedProtocol:
        while self.idle:
            p = self.idle.pop()
            if p.transport is not None and not p.transport.is_closing():
                return p
        loop = asyncio.get_running_loop()
        _, proto = await loop.create_connection(_TimedProtocol, self.host, self.port)
        return cast(_TimedProtocol, proto)

    async def post(
        self,
        body: bytes,
        *,
        rec: Record | None = None,
        collect: list[bytes] | None = None,
        headers: str = "",
        mark_sent: bool = False,
    ) -> int:
        """POST `body`; stream events are timed into `rec`, or the body goes into `collect`."""
        proto = await self._get()
        proto.start(rec)
        req = build_request(self.host, self.port, PATH, body, headers)
        if mark_sent and rec is not None:
            rec.sent = time.perf_counter()
        try:
            status, keep = await proto.send(req, collect)
        except BaseException:
            if proto.transport is not None:
                proto.transport.close()
            raise
        if rec is not None and status != 200 and proto.err_body:
            rec.error = f"HTTP {status}: {proto.err_body[:200].decode('utf-8', 'replace')}"
        proto.start(None)
        if keep and proto.transport is not None and not proto.transport.is_closing():
            self.idle.append(proto)
        elif proto.transport is not None:
            proto.transport.close()
        return status

    def close(self) -> None:
        for p in self.idle:
            if p.transport is not None:
                p.transport.close()
        self.idle.clear()


# --------------------------------------------------------------------------- dispatchers


class Dispatcher(Protocol):
    async def send(self, item: Item, rec: Record) -> None: ...

    def close(self) -> None: ...


def _host_port(url: str) -> tuple[str, int]:
    rest = url.split("://", 1)[-1].split("/", 1)[0]
    host, _, port = rest.rpartition(":")
    return host.strip("[]"), int(port)


class FrontEnd:
    """Every request to one address (a router or the gateway)."""

    def __init__(self, url: str) -> None:
        self.pool = Pool(*_host_port(url))

    async def send(self, item: Item, rec: Record) -> None:
        # the row's index as the request id (`replay-<row>`): a front end that logs request ids
        # (the gateway's access log at info) says where each row went
        rid = f"X-Request-Id: replay-{item.index}\r\n" if item.index >= 0 else ""
        rec.status = await self.pool.post(item.body, rec=rec, mark_sent=True, headers=rid)
        rec.done = time.perf_counter()

    def close(self) -> None:
        self.pool.close()


@dataclass
class PrefillAddr:
    url: str
    bootstrap_port: int | None = None


class Direct:
    """No front end: round robin over colocated workers, or over (prefill, decode) pairs with
    the engine's handoff done here."""

    def __init__(
        self,
        engine: str,
        workers: Sequence[str] = (),
        prefill: Sequence[PrefillAddr] = (),
        decode: Sequence[str] = (),
    ) -> None:
        if workers and (prefill or decode):
            raise ValueError("the direct baseline takes colocated workers or a P/D pool, not both")
        if not workers and not (prefill and decode):
            raise ValueError("the direct baseline needs colocated workers or prefill and decode workers")
        self.engine = engine
        self.workers = [Pool(*_host_port(u)) for u in workers]
        self.prefill = [(Pool(*_host_port(p.url)), p) for p in prefill]
        self.decode = [Pool(*_host_port(u)) for u in decode]
        self.n = 0
        self.rng = random.Random()

    async def send(self, item: Item, rec: Record) -> None:
        i = self.n
        self.n += 1
        if self.workers:
            pool = self.workers[i % len(self.workers)]
            rec.status = await pool.post(item.body, rec=rec, mark_sent=True)
        elif self.engine == "sglang":
            await self._sglang(item, rec, i)
        else:
            await self._vllm(item, rec, i)
        rec.done = time.perf_counter()

    async def _sglang(self, item: Item, rec: Record, i: int) -> None:
        ppool, addr = self.prefill[i % len(self.prefill)]
        dpool = self.decode[i % len(self.decode)]
        room = self.rng.getrandbits(63)
        host = ppool.host
        extra = (
            f'"bootstrap_host":"{host}","bootstrap_port":{addr.bootstrap_port},"bootstrap_room":{room}'
        ).encode()
        body = _splice(item.body, extra)
        sink: list[bytes] = []
        rec.sent = time.perf_counter()
        fp = asyncio.ensure_future(ppool.post(body, collect=sink))
        try:
            rec.status = await dpool.post(body, rec=rec)
        except BaseException:
            fp.cancel()  # its connection closes: the prefill is not waited for
            raise
        pstatus = await fp
        if pstatus != 200 and not rec.error:
            rec.error = f"prefill HTTP {pstatus}: {b''.join(sink)[:200].decode('utf-8', 'replace')}"

    async def _vllm(self, item: Item, rec: Record, i: int) -> None:
        ppool, _ = self.prefill[i % len(self.prefill)]
        dpool = self.decode[i % len(self.decode)]
        rid = f"X-Request-Id: replay-{self.rng.getrandbits(64):016x}\r\n"
        sink: list[bytes] = []
        assert item.prefill_body is not None
        rec.sent = time.perf_counter()
        pstatus = await ppool.post(item.prefill_body, collect=sink, headers=rid)
        raw = b"".join(sink)
        if pstatus != 200:
            rec.status = pstatus
            rec.error = f"prefill HTTP {pstatus}: {raw[:200].decode('utf-8', 'replace')}"
            return
        params = json.loads(raw).get("kv_transfer_params")
        if not params:
            rec.error = "the prefill returned no kv_transfer_params"
            return
        body = _splice(item.body, b'"kv_transfer_params":' + encode(params))
        rec.status = await dpool.post(body, rec=rec, headers=rid)

    def close(self) -> None:
        for pool in [*self.workers, *(p for p, _ in self.prefill), *self.decode]:
            pool.close()


# --------------------------------------------------------------------------- runs


class Progress(Protocol):
    def update(self, n: int = 1) -> Any: ...

    def set_postfix_str(self, s: str, refresh: bool = True) -> Any: ...

    def close(self) -> Any: ...


class _NoProgress:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str, refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, desc: str, enabled: bool) -> Progress:
    if not enabled:
        return _NoProgress()
    from tqdm import tqdm

    bar: Progress = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, dynamic_ncols=True, leave=False)
    return bar


@dataclass
class RunControl:
    """How a run is bounded and stopped."""

    stop: asyncio.Event
    duration_s: float | None = None  # no new request after this long
    drain_s: float = 600.0  # then this long for the ones in flight
    request_timeout_s: float = 1800.0
    warmup_s: float = 0.0  # requests due in the first warmup_s are sent but not measured


async def _one(
    dispatch: Dispatcher,
    item: Item,
    rec: Record,
    ctl: RunControl,
    on_done: Callable[[Record], None],
) -> None:
    try:
        await asyncio.wait_for(dispatch.send(item, rec), ctl.request_timeout_s)
    except TimeoutError:
        rec.error = rec.error or f"no complete answer after {ctl.request_timeout_s:g}s"
    except (ConnectionError, OSError, ValueError) as exc:
        rec.error = rec.error or f"{type(exc).__name__}: {exc}"
    on_done(rec)


async def _drain(tasks: set[asyncio.Task[None]], ctl: RunControl) -> None:
    """Wait for the requests in flight (up to drain_s, or until stopped), then cancel the rest:
    they stay unfinished in the records."""
    if tasks:
        stopper = asyncio.ensure_future(ctl.stop.wait())
        try:
            pending: set[asyncio.Future[Any]] = set(tasks)
            deadline = time.perf_counter() + ctl.drain_s
            while pending and not ctl.stop.is_set():
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                _, pending = await asyncio.wait(
                    pending | {stopper}, timeout=left, return_when=asyncio.FIRST_COMPLETED
                )
                pending.discard(stopper)
        finally:
            stopper.cancel()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _new_record(item: Item) -> Record:
    return Record(index=item.index, input_length=item.row.input_length, output_length=item.row.output_length)


async def open_loop(
    items: Sequence[Item],
    dispatch: Dispatcher,
    ctl: RunControl,
    *,
    rate: float = 1.0,
    progress: Progress | None = None,
) -> list[Record]:
    """Send each item at its arrival / `rate`; returns a record per item sent."""
    bar = progress or _NoProgress()
    records: list[Record] = []
    tasks: set[asyncio.Task[None]] = set()
    counts = {"done": 0, "errors": 0}

    def on_done(rec: Record) -> None:
        counts["done"] += 1
        if not rec.ok:
            counts["errors"] += 1
        bar.update(1)
        bar.set_postfix_str(f"in flight {len(tasks) - 1}, errors {counts['errors']}", refresh=False)

    now = time.perf_counter
    t0 = now() + 0.05
    for item in items:
        offset = item.row.t_s / rate
        if ctl.duration_s is not None and offset > ctl.duration_s:
            break
        due = t0 + offset
        while not ctl.stop.is_set():
            delay = due - now()
            if delay <= 0:
                break
            await asyncio.sleep(min(delay, 0.2))
        if ctl.stop.is_set():
            break
        rec = _new_record(item)
        rec.scheduled = due
        rec.warmup = offset < ctl.warmup_s
        records.append(rec)
        task = asyncio.ensure_future(_one(dispatch, item, rec, ctl, on_done))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await _drain(set(tasks), ctl)
    return records


async def closed_loop(
    items: Sequence[Item],
    dispatch: Dispatcher,
    ctl: RunControl,
    *,
    concurrency: int,
    progress: Progress | None = None,
) -> list[Record]:
    """`concurrency` clients take the items in order, each the next when its last ended."""
    bar = progress or _NoProgress()
    records: list[Record] = []
    it = iter(items)
    start = time.perf_counter()
    errors = [0]

    def on_done(rec: Record) -> None:
        if not rec.ok:
            errors[0] += 1
        bar.update(1)
        bar.set_postfix_str(f"errors {errors[0]}", refresh=False)

    async def client() -> None:
        for item in it:
            if ctl.stop.is_set():
                return
            elapsed = time.perf_counter() - start
            if ctl.duration_s is not None and elapsed > ctl.duration_s:
                return
            rec = _new_record(item)
            rec.scheduled = time.perf_counter()
            rec.warmup = elapsed < ctl.warmup_s
            records.append(rec)
            await _one(dispatch, item, rec, ctl, on_done)

    tasks = {asyncio.ensure_future(client()) for _ in range(max(1, concurrency))}
    stopper = asyncio.ensure_future(ctl.stop.wait())
    try:
        await asyncio.wait(tasks | {stopper}, return_when=asyncio.FIRST_COMPLETED)
        while not stopper.done() and not all(t.done() for t in tasks):
            await asyncio.wait(tasks | {stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
        for t in tasks:
            t.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*tasks, return_exceptions=True)
    records.sort(key=lambda r: r.index)
    return records
