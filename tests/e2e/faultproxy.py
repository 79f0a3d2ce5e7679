"""Test scaffolding: an HTTP proxy in front of a real prefill server that breaks its answers on demand.

The gateway under test is pointed at this proxy as its prefill worker; the proxy forwards
everything to the real engine and, while armed, corrupts the next prefill exchanges in the ways
the engines' trackers and tests/e2e/README.md ("Failures seen on the real engines") show a real
P/D handoff going wrong:

vLLM (the prefill's `kv_transfer_params`, i.e. what the decode would pull):
- ``stale``: the params of an earlier, already consumed request (real vLLM: 200 with wrong tokens)
- ``foreign``: fresh, unconsumed params of another prompt the proxy prefilled itself (the same)
- ``short``: the block list cut to its first block (real vLLM: the decode engine dies)
- ``empty``: an empty block list ``[[]]`` (the same)

SGLang (the prefill leg, while the real decode waits for the KV):
- ``reject``: the real prefill is made to refuse the request (its output budget is pushed past the
  context length, so its tokenizer answers 400, as when only the prefill's limits are too small);
  real SGLang 0.5.23 then leaves the decode waiting for 300 s
- ``drop``: the connection is closed in the middle of the answer, as when the prefill dies

Not a product component; only tests/e2e uses it. It runs its own event loop in a thread, so the
synchronous e2e tests can drive it.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from typing import Any

import aiohttp
from aiohttp import web

GENERATION_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
VLLM_MODES = ("stale", "foreign", "short", "empty")
SGLANG_MODES = ("reject", "drop")
_HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


class FaultProxy:
    def __init__(self, upstream: str, engine: str, host: str = "127.0.0.1") -> None:
        self.upstream = upstream.rstrip("/")
        self.engine = engine
        self.host = host
        self.url = ""
        self.hits = 0  # prefill exchanges broken so far
        self.forwarded = 0  # generation requests passed on intact
        self.params_seen: list[dict[str, Any]] = []  # vLLM: every kv_transfer_params passed on intact
        self._mode: str | None = None
        self._left = 0
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    # -- control (any thread) ---------------------------------------------------------------------

    def start(self) -> str:
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self.url

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def arm(self, mode: str, count: int = 1) -> None:
        allowed = VLLM_MODES if self.engine == "vllm" else SGLANG_MODES
        if mode not in allowed:
            raise ValueError(f"{self.engine} fault modes are {allowed}, not {mode!r}")
        with self._lock:
            self._mode, self._left = mode, count

    def _take(self) -> str | None:
        with self._lock:
            if self._mode is None or self._left <= 0:
                return None
            self._left -= 1
            self.hits += 1
            return self._mode

    # -- the proxy (its own loop) ----------------------------------------------------------------

    async def _start(self) -> str:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        server = site._server
        assert isinstance(server, asyncio.base_events.Server)
        port = server.sockets[0].getsockname()[1]
        return f"http://{self.host}:{port}"

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _forward(self, request: web.Request, body: bytes) -> tuple[int, dict[str, str], bytes]:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        url = self.upstream + request.path_qs
        async with self._session.request(request.method, url, data=body, headers=headers) as r:
            out_headers = {k: v for k, v in r.headers.items() if k.lower() not in _HOP_HEADERS}
            return r.status, out_headers, await r.read()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        mode = None
        if request.method == "POST" and request.path in GENERATION_PATHS:
            mode = self._take()
            if mode is None:
                with self._lock:
                    self.forwarded += 1
        if mode == "drop":
            # the prefill dies mid-answer: a status line, then the connection is gone (closing
            # before any byte would look like a stale keep-alive connection, which clients
            # rightly resend once)
            if request.transport is not None:
                request.transport.write(b"HTTP/1.1 200 OK\r\n")
                request.transport.close()
            return web.Response(status=500)  # never written: the connection is gone
        if mode == "reject":
            body = _past_the_context(request.path, body)
        status, headers, data = await self._forward(request, body)
        if self.engine == "vllm" and status == 200 and request.path in GENERATION_PATHS:
            data = await self._vllm_answer(request, data, mode)
        return web.Response(status=status, headers=headers, body=data)

    async def _vllm_answer(self, request: web.Request, data: bytes, mode: str | None) -> bytes:
        doc = json.loads(data)
        params = doc.get("kv_transfer_params")
        if not isinstance(params, dict):
            return data
        if mode is None:
            self.params_seen.append(params)
            return data
        if mode == "stale":
            if not self.params_seen:
                raise RuntimeError("fault 'stale' needs an earlier intact handoff through this proxy")
            doc["kv_transfer_params"] = self.params_seen[-1]
        elif mode == "foreign":
            doc["kv_transfer_params"] = await self._fresh_params(request)
        elif mode == "short":
            doc["kv_transfer_params"] = {
                **params,
                "remote_block_ids": [ids[:1] for ids in params["remote_block_ids"]],
            }
        elif mode == "empty":
            doc["kv_transfer_params"] = {**params, "remote_block_ids": [[]]}
        return json.dumps(doc).encode()

    async def _fresh_params(self, request: web.Request) -> dict[str, Any]:
        """Another prompt's prefill, run for real on the same engine: unconsumed params."""
        assert self._session is not None
        body = {
            "model": json.loads(await request.read()).get("model"),
            "prompt": "My favourite colour was a quiet orange over the river",
            "max_tokens": 1,
            "temperature": 0,
            "kv_transfer_params": {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            },
        }
        headers = {"X-Request-Id": f"foreign-{uuid.uuid4().hex}"}
        async with self._session.post(self.upstream + "/v1/completions", json=body, headers=headers) as r:
            doc = await r.json()
        params = doc["kv_transfer_params"]
        assert isinstance(params, dict)
        return params


def _past_the_context(path: str, body: bytes) -> bytes:
    """The same request with an output budget no context holds: the engine's tokenizer refuses it."""
    doc = json.loads(body)
    huge = 10_000_000
    if path == "/generate":
        doc.setdefault("sampling_params", {})["max_new_tokens"] = huge
    else:
        doc.pop("max_completion_tokens", None)
        doc["max_tokens"] = huge
    return json.dumps(doc).encode()
