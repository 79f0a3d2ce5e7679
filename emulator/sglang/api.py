"""SGLang 0.5.23's HTTP surface (shapes from the captures in ``tests/fixtures/captures``): one
method per route. The request routes run through :meth:`SglangApi.guarded` (counting, entry
faults, rids released however the answer ends); the work is done by :class:`SglangRunner`."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from emulator import tokenizer
from emulator.faults import Fault
from emulator.generation import MidStreamFault
from emulator.server import EmulatorServer
from emulator.sglang import info
from emulator.sglang.errors import error_generate, error_openai
from emulator.sglang.generate import GenerateCall
from emulator.sglang.items import FAKE_BOOTSTRAP_HOST, Item
from emulator.sglang.metrics import render_sglang
from emulator.sglang.openai import OpenAICall
from emulator.sglang.runner import SglangRunner
from emulator.wire import crash, hang_forever, json_response

BodyFn = Callable[[dict[str, Any], dict[str, Fault], list[str]], Awaitable[web.StreamResponse]]


async def read_json(request: web.Request) -> dict[str, Any]:
    body = await request.read()
    obj = msgspec.json.decode(body) if body else {}
    if not isinstance(obj, dict):
        raise ValueError("body must be a JSON object")
    return obj


class SglangApi:
    def __init__(self, server: EmulatorServer) -> None:
        self.s = server
        self.engine = server.engine
        self.runner = SglangRunner(server)

    def register(self, r: web.UrlDispatcher) -> None:
        r.add_post("/generate", self.generate)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_get("/v1/models", self.models)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        r.add_get("/metrics", self.metrics)
        r.add_post("/abort_request", self.abort_request)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_get("/v1/loads", self.loads)

    async def guarded(
        self, request: web.Request, error: Callable[[int, str], web.Response], body_fn: BodyFn
    ) -> web.StreamResponse:
        """Count the request, read its body, apply the entry faults, then `body_fn`; the rids it
        holds are released however it ends (its client gone: aborted, as SGLang does)."""
        s, engine, rids = self.s, self.engine, self.runner.rids
        with s.tracked():
            if s.dead:
                return error(500, "Engine is dead")
            try:
                body = await read_json(request)
            except (msgspec.DecodeError, ValueError) as e:
                return error(400, f"Invalid request body: {e}")
            hit = s.faults.draw()
            early = await s.apply_entry_faults(hit, error)
            if early is not None:
                engine.counters.errors += 1
                return early
            held: list[str] = []  # the rids this request holds (RidTable.hold)
            try:
                resp = await body_fn(body, hit, held)
            except MidStreamFault as e:
                if e.kind == "crash_mid_stream":
                    crash(request)
                await hang_forever()
                raise
            except asyncio.CancelledError:
                engine.counters.aborted += 1
                rids.client_gone(held)
                raise
            except ConnectionResetError:  # written to a client already gone
                rids.client_gone(held)
                raise
            finally:
                rids.release(held)
            if resp.status >= 400:
                engine.counters.errors += 1
            else:
                engine.counters.completed += 1
            return resp

    # ------------------------------------------------------------------ generation routes
    async def generate(self, request: web.Request) -> web.StreamResponse:
        async def body_fn(body: dict[str, Any], hit: dict[str, Fault], held: list[str]) -> web.StreamResponse:
            return await GenerateCall(self.runner, request, body, hit, held).answer()

        return await self.guarded(request, error_generate, body_fn)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=True)

    async def _openai(self, request: web.Request, chat: bool) -> web.StreamResponse:
        async def body_fn(body: dict[str, Any], hit: dict[str, Fault], held: list[str]) -> web.StreamResponse:
            return await OpenAICall(self.runner, request, body, hit, held, chat).answer()

        return await self.guarded(request, error_openai, body_fn)

    # ------------------------------------------------------------------ information
    async def models(self, request: web.Request) -> web.Response:
        return json_response(info.models(self.s, self.runner.context_length))

    async def model_info(self, request: web.Request) -> web.Response:
        return json_response(info.model_info(self.s))

    async def server_info(self, request: web.Request) -> web.Response:
        return json_response(
            info.server_info(self.s, self.runner.context_length, self.runner.max_req_input_len)
        )

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=render_sglang(self.s), content_type="text/plain", charset="utf-8")

    async def loads(self, request: web.Request) -> web.Response:
        # SGLang 0.5.23's GET /v1/loads (its old /get_load is gone: 404)
        include = request.query.get("include")
        sections = {x.strip() for x in include.split(",")} if include else {"all"}
        if not sections <= info.LOAD_SECTIONS:
            valid = info.LOAD_SECTIONS
            return json_response(
                {"detail": f"Invalid include sections: {sections - valid}. Valid options: {sorted(valid)}"},
                status=400,
            )
        return json_response(info.loads(self.s, sections))

    # ------------------------------------------------------------------ health and control
    async def health(self, request: web.Request) -> web.Response:
        if self.s.dead:
            return web.Response(status=503)
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        s = self.s
        if s.dead:
            return web.Response(status=503)
        if s.faults.has("health_ok_but_hung") or s.faults.has("hang_before_first_byte"):
            if "health_ok_but_hung" in s.faults.draw():
                await hang_forever()
        it = Item(
            f"HEALTH_CHECK_{uuid.uuid4().hex}", tokenizer.encode("h"), 1, None, 0, FAKE_BOOTSTRAP_HOST, None
        )
        res = await self.runner.execute(it, {}, None)
        return web.Response(status=200 if not res.error_status else 503)

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        if body.get("abort_all"):
            self.runner.rids.abort_all()
        else:
            self.runner.rids.abort(str(body.get("rid") or ""))  # by prefix, as the scheduler does
        return web.Response(status=200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.engine.seqs:
            return web.Response(
                status=400, text="Cache not flushed. Please check if there are running requests."
            )
        self.engine.pool.flush()
        return web.Response(
            status=200,
            text="Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n",
        )
