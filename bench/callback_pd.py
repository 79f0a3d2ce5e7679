"""The floor of any Python P/D proxy on this machine: callbacks only, no Task, no Future.

`bench/bare_pd.py` measures the handoff on the gateway's own HTTP layer (a Task per request,
Futures per upstream exchange, flow control, limits). This module rebuilds the proxy measured
on 2026-11-29 as "design b" (docs/benchmarks.md, "The starting point") from its description, to
measure what Python can do
at the least: asyncio Protocols with httptools parsers on uvloop, every step run from the
transports' data callbacks, keep-alive pools of upstream connections, the body spliced as bytes,
SSE relayed piece by piece as chunks with the upstream paused while the client's buffer is full.

It takes every shortcut a product cannot: no timeouts, no retries, no request ids of the
client's, no header filtering, no error mapping (an upstream that fails closes the client's
connection), no pipelining, no limits, no metrics, no logs. Not a product and not a fallback: a
measuring stick for `pd-gateway bench overhead --targets callback-pd`.

    python -m bench.callback_pd --engine sglang --port 8100 --prefill http://127.0.0.1:30001 \\
        --bootstrap-port 8998 --decode http://127.0.0.1:30002
"""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httptools  # noqa: E402
import msgspec  # noqa: E402

from bench.bare_pd import KV_ASK, prefill_params, raw_fields, run_cli  # noqa: E402

_enc = msgspec.json.Encoder()


class _Exchange:
    """What one upstream response is for: told its head, each body piece, its end, or a failure."""

    __slots__ = ()

    def head(self, status: int, ctype: bytes, up: _Up) -> None:
        pass

    def data(self, piece: bytes) -> None:
        pass

    def done(self) -> None:
        pass

    def failed(self) -> None:
        pass


class _Up(asyncio.Protocol):
    """One keep-alive upstream connection; one exchange at a time."""

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.exchange: _Exchange | None = None
        self.ctype = b""
        self.sink: _Client | None = None  # the client a stream from here is relayed to

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._fail()
        sink = self.sink
        if sink is not None:
            sink.flush()  # the pieces of one read leave in one write

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) == 12 and name.lower() == b"content-type":
            self.ctype = value

    def on_headers_complete(self) -> None:
        if self.exchange is not None:
            self.exchange.head(self.parser.get_status_code(), self.ctype, self)
        self.ctype = b""

    def on_body(self, body: bytes) -> None:
        if self.exchange is not None:
            self.exchange.data(body)

    def on_message_complete(self) -> None:
        ex, self.exchange = self.exchange, None
        if self.parser.should_keep_alive() and self.transport is not None:
            self.pool.idle.append(self)
        elif self.transport is not None:
            self.transport.close()
        if ex is not None:
            ex.done()

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.pool.idle:
            self.pool.idle.remove(self)
        self.transport = None
        self._fail()

    def _fail(self) -> None:
        ex, self.exchange = self.exchange, None
        if ex is not None:
            ex.failed()
        if self.transport is not None:
            self.transport.close()


class _Pool:
    """Idle keep-alive connections to one upstream; a new one only when none is idle."""

    def __init__(self, url: str) -> None:
        u = urlsplit(url)
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 80
        self.idle: list[_Up] = []
        self.head = b"POST %%s HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: application/json\r\n" % (
            self.host.encode(),
            self.port,
        )

    def send(self, path: bytes, extra: bytes, body: bytes, ex: _Exchange) -> None:
        req = self.head % path + extra + b"content-length: %d\r\n\r\n" % len(body) + body
        if self.idle:
            up = self.idle.pop()
            up.exchange = ex
            assert up.transport is not None
            up.transport.write(req)
            return
        asyncio.get_running_loop().create_task(self._connect(req, ex))

    async def _connect(self, req: bytes, ex: _Exchange) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, up = await loop.create_connection(lambda: _Up(self), self.host, self.port)
        except OSError:
            ex.failed()
            return
        up.exchange = ex
        assert up.transport is not None
        up.transport.write(req)


class _Drop(_Exchange):
    """The SGLang prefill's answer: read to its end and dropped; its end or failure told to the
    decode's relay."""

    __slots__ = ("relay",)

    def __init__(self, relay: _Relay) -> None:
        self.relay = relay

    def done(self) -> None:
        self.relay.prefill_done()

    def failed(self) -> None:
        self.relay.failed()


class _Relay(_Exchange):
    """The decode's answer to the client: a JSON body whole, an SSE stream piece by piece."""

    __slots__ = ("answered", "client", "ctype", "ended", "parts", "status", "stream", "waiting")

    def __init__(self, client: _Client, waiting: bool) -> None:
        self.client = client
        self.stream = False
        self.status = 502
        self.ctype = b"application/json"
        self.parts: list[bytes] = []
        self.waiting = waiting  # SGLang: the prefill's answer is not in yet
        self.ended = False  # the decode's answer is in
        self.answered = False

    def head(self, status: int, ctype: bytes, up: _Up) -> None:
        self.status = status
        self.ctype = ctype or self.ctype
        if ctype.startswith(b"text/event-stream"):
            self.stream = True
            self.client.start_stream(status, ctype, up)

    def data(self, piece: bytes) -> None:
        if self.stream:
            self.client.chunk(piece)
        else:
            self.parts.append(piece)

    def done(self) -> None:
        self.ended = True
        self._finish()

    def prefill_done(self) -> None:
        self.waiting = False
        self._finish()

    def _finish(self) -> None:
        # a JSON answer waits for the prefill's (SGLang); a stream ends when the decode's does
        if self.answered or not self.ended or (self.waiting and not self.stream):
            return
        self.answered = True
        if self.stream:
            self.client.end_stream()
        else:
            self.client.send(self.status, self.ctype, b"".join(self.parts))

    def failed(self) -> None:
        self.client.abort()


class _VllmPrefill(_Exchange):
    """vLLM: the prefill's answer is read whole, then the decode is sent with its params."""

    __slots__ = ("body", "client", "parts", "path", "rid", "status")

    def __init__(self, client: _Client, body: bytes, path: bytes, rid: bytes) -> None:
        self.client = client
        self.body = body
        self.path = path
        self.rid = rid
        self.status = 502
        self.parts: list[bytes] = []

    def head(self, status: int, ctype: bytes, up: _Up) -> None:
        self.status = status

    def data(self, piece: bytes) -> None:
        self.parts.append(piece)

    def done(self) -> None:
        out = b"".join(self.parts)
        c = self.client
        if self.status != 200:
            c.send(self.status, b"application/json", out)
            return
        params = bytes(prefill_params.decode(out).kv_transfer_params)
        dbody = self.body[:-1] + b',"kv_transfer_params":' + params + b"}"
        c.proxy.decode.send(self.path, self.rid, dbody, _Relay(c, waiting=False))

    def failed(self) -> None:
        self.client.abort()


class _Proxy:
    def __init__(self, engine: str, prefill: str, decode: str, bootstrap_port: int | None) -> None:
        self.engine = engine
        self.prefill = _Pool(prefill)
        self.decode = _Pool(decode)
        self.prefix = b',"bootstrap_host":%s,"bootstrap_port":%d,"bootstrap_room":' % (
            _enc.encode(self.prefill.host),
            bootstrap_port or 0,
        )
        self.n = 0


class _Client(asyncio.Protocol):
    """One client connection: a request at a time, its answer written from upstream callbacks."""

    def __init__(self, proxy: _Proxy) -> None:
        self.proxy = proxy
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.parts: list[bytes] = []
        self.streaming_from: _Up | None = None
        self.pending: list[bytes] = []
        self.paused = False  # the client's buffer is above high water

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.abort()

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_body(self, body: bytes) -> None:
        self.parts.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self.parts).rstrip()
        self.parts = []
        if self.parser.get_method() != b"POST":
            self.send(200, b"application/json", b'{"status":"ok"}')
            return
        p = self.proxy
        path = self.url
        if p.engine == "sglang":
            spliced = body[:-1] + p.prefix + b"%d}" % random.getrandbits(63)
            relay = _Relay(self, waiting=True)
            p.prefill.send(path, b"", spliced, _Drop(relay))
            p.decode.send(path, b"", spliced, relay)
            return
        p.n += 1
        rid = b"x-request-id: callback-%d\r\n" % p.n
        fields = raw_fields.decode(body)
        fields.pop("stream_options", None)
        fields["max_tokens"] = msgspec.Raw(b"1")
        fields["stream"] = msgspec.Raw(b"false")
        fields["kv_transfer_params"] = KV_ASK
        p.prefill.send(path, rid, _enc.encode(fields), _VllmPrefill(self, body, path, rid))

    # -- the answer --
    def send(self, status: int, ctype: bytes, body: bytes) -> None:
        if self.transport is not None:
            self.transport.write(
                b"HTTP/1.1 %d OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
                % (status, ctype, len(body))
                + body
            )

    def start_stream(self, status: int, ctype: bytes, up: _Up) -> None:
        self.streaming_from = up
        up.sink = self
        if self.paused and up.transport is not None:
            up.transport.pause_reading()
        if self.transport is not None:
            self.transport.write(
                b"HTTP/1.1 %d OK\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n\r\n" % (status, ctype)
            )

    def chunk(self, piece: bytes) -> None:
        if piece:
            self.pending.append(b"%x\r\n%b\r\n" % (len(piece), piece))

    def flush(self) -> None:
        if self.pending:
            if self.transport is not None:
                self.transport.write(b"".join(self.pending))
            self.pending = []

    def end_stream(self) -> None:
        up, self.streaming_from = self.streaming_from, None
        if up is not None:
            up.sink = None
            if self.paused and up.transport is not None:
                up.transport.resume_reading()  # back in the pool: its next answer must be read
        self.pending.append(b"0\r\n\r\n")
        self.flush()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # -- backpressure: the upstream we relay from is paused while the client's buffer is full --
    def pause_writing(self) -> None:
        self.paused = True
        up = self.streaming_from
        if up is not None and up.transport is not None:
            up.transport.pause_reading()

    def resume_writing(self) -> None:
        self.paused = False
        up = self.streaming_from
        if up is not None and up.transport is not None:
            up.transport.resume_reading()


async def serve(engine: str, port: int, prefill: str, decode: str, bootstrap_port: int | None) -> None:
    proxy = _Proxy(engine, prefill, decode, bootstrap_port)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(proxy), "127.0.0.1", port, backlog=1024)
    try:
        await asyncio.Event().wait()
    finally:
        server.close()


def main(argv: list[str] | None = None) -> int:
    return run_cli(serve, (__doc__ or "").split("\n\n")[0], argv)


if __name__ == "__main__":
    raise SystemExit(main())
