"""A bare P/D proxy on the gateway's own HTTP layer: the floor for `pd-gateway bench overhead`.

Only what any P/D proxy must do, on `gateway.http` (the server and upstream pools the gateway
uses) and nothing else: one fixed pair, no routing choice, request ids, deadlines, retries,
breakers, guards, metrics or logs.

- SGLang: the client's body with `bootstrap_host`, `bootstrap_port` and a random
  `bootstrap_room` spliced in, sent to prefill and decode at once; the prefill's answer is read
  and dropped, the decode's relayed (a stream chunk by chunk).
- vLLM: the prefill with `max_tokens: 1`, `stream: false` and `do_remote_decode`, then the
  client's body plus the `kv_transfer_params` it returned to the decode, relayed.

Not a product and not a fallback: a measuring stick. What the gateway costs above this row is
the price of its features; what this row costs against a Rust router is the price of the
HTTP layer and Python.

    python -m bench.bare_pd --engine sglang --port 8100 --prefill http://127.0.0.1:30001 \\
        --bootstrap-port 8998 --decode http://127.0.0.1:30002
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402
import uvloop  # noqa: E402

from gateway.http import HttpRequest, HttpResponder, UpstreamPool, start_server  # noqa: E402
from gateway.http.client import UpstreamResponse  # noqa: E402

_JSON = (b"content-type", b"application/json")
KV_ASK = msgspec.Raw(
    b'{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,'
    b'"remote_block_ids":null,"remote_host":null,"remote_port":null}'
)
raw_fields = msgspec.json.Decoder(dict[str, msgspec.Raw])
_enc = msgspec.json.Encoder()


class PrefillOut(msgspec.Struct):
    kv_transfer_params: msgspec.Raw = msgspec.Raw(b"null")


prefill_params = msgspec.json.Decoder(PrefillOut)


def _pool(url: str) -> UpstreamPool:
    u = urlsplit(url)
    return UpstreamPool(u.hostname or "127.0.0.1", u.port or 80, max_idle=1024)


async def _relay(up_call: asyncio.Future[UpstreamResponse], res: HttpResponder) -> None:
    up = await up_call
    try:
        ctype = up.header(b"content-type") or b"application/json"
        if ctype.startswith(b"text/event-stream"):
            res.start_stream(up.status, [(b"content-type", ctype)])
            await up.pipe(res.write, flow=res, batch=res)
            res.end()
        else:
            body = await up.read()
            res.send(up.status, [(b"content-type", ctype)], body)
    finally:
        up.release()


Handler = Callable[[HttpRequest, HttpResponder], Coroutine[Any, Any, None]]


def make_handler(
    engine: str, pp: UpstreamPool, dp: UpstreamPool, prefill_host: str, bootstrap_port: int | None
) -> Handler:
    """The whole proxy: one handler over the prefill's and the decode's pools."""
    headers = (_JSON,)
    prefix = b',"bootstrap_host":%s,"bootstrap_port":%d,"bootstrap_room":' % (
        _enc.encode(prefill_host),
        bootstrap_port or 0,
    )
    rnd = random.getrandbits
    n = 0

    async def handler(req: HttpRequest, res: HttpResponder) -> None:
        nonlocal n
        if req.method == "GET":
            res.send(200, [_JSON], b'{"status":"ok"}')
            return
        body = req.body.rstrip()
        if engine == "sglang":
            spliced = body[:-1] + prefix + b"%d}" % rnd(63)
            pf = pp.fetch("POST", req.path, headers, spliced)
            df = dp.start("POST", req.path, headers, spliced)
            try:
                await pf
            except BaseException:
                df.cancel()
                raise
            await _relay(df, res)
            return
        n += 1
        rid = ((b"x-request-id", b"bare-%d" % n),)
        fields = raw_fields.decode(body)
        fields.pop("stream_options", None)
        fields["max_tokens"] = msgspec.Raw(b"1")
        fields["stream"] = msgspec.Raw(b"false")
        fields["kv_transfer_params"] = KV_ASK
        status, out = await pp.fetch("POST", req.path, headers + rid, _enc.encode(fields))
        if status != 200:
            res.send(status, [_JSON], out)
            return
        params = bytes(prefill_params.decode(out).kv_transfer_params)
        dbody = body[:-1] + b',"kv_transfer_params":' + params + b"}"
        await _relay(dp.start("POST", req.path, headers + rid, dbody), res)

    return handler


async def serve(engine: str, port: int, prefill: str, decode: str, bootstrap_port: int | None) -> None:
    host = urlsplit(prefill).hostname or "127.0.0.1"
    handler = make_handler(engine, _pool(prefill), _pool(decode), host, bootstrap_port)
    server = await start_server(handler, "127.0.0.1", port)
    try:
        await asyncio.Event().wait()
    finally:
        await server.close()


Serve = Callable[[str, int, str, str, "int | None"], Coroutine[Any, Any, None]]


def run_cli(serve_fn: Serve, description: str, argv: list[str] | None = None) -> int:
    """The command line of a floor proxy (this one and `bench/callback_pd.py`)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--engine", choices=("sglang", "vllm"), required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--bootstrap-port", type=int, default=None)
    ap.add_argument("--decode", required=True)
    args = ap.parse_args(argv)
    try:
        uvloop.run(serve_fn(args.engine, args.port, args.prefill, args.decode, args.bootstrap_port))
    except KeyboardInterrupt:
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(serve, __doc__.split("\n\n")[0], argv)


if __name__ == "__main__":
    raise SystemExit(main())
