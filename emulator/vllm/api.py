"""vLLM 0.32/0.33's OpenAI-compatible surface with the NixlConnector P/D handoff: one method per
route. A single prompt with one sample is :class:`SingleCall` (the one P/D hands off); batches
of prompts and ``n > 1`` are :class:`MultiCall`, served locally.

Completions' ``echo`` and the prompt logprobs (``echo`` with ``logprobs``, ``prompt_logprobs``)
are shaped by :mod:`emulator.echo`. A request computing prompt logprobs reads no cached prefix
(vLLM's ``skip_reading_prefix_cache``): on a P/D decode it ignores the prefill's KV, computes the
whole prompt itself and only notifies the prefill, which frees the blocks it held.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from typing import Any

import msgspec
from aiohttp import web

from emulator import tokenizer
from emulator.faults import Fault
from emulator.generation import MidStreamFault
from emulator.lax import (
    VLLM_NO_NULL_CHAT,
    VLLM_NO_NULL_COMPLETIONS,
    coerce_openai,
    normalize_openai_prompt,
    vllm_seed_error,
)
from emulator.sampling_checks import vllm_refusal
from emulator.server import EmulatorServer
from emulator.vllm.errors import ENGINE_DEAD_MSG, error, error_dict
from emulator.vllm.metrics import render_vllm
from emulator.vllm.multi import MultiCall
from emulator.vllm.request import Parsed, parse
from emulator.vllm.single import SingleCall
from emulator.vllm.state import VllmState
from emulator.wire import crash, end_sse, hang_forever, json_response, sse_error, start_sse


class VllmApi:
    def __init__(self, server: EmulatorServer) -> None:
        self.s = server
        self.engine = server.engine
        self.state = VllmState(server)
        self.lengths = self.state.lengths

    def register(self, r: web.UrlDispatcher) -> None:
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_get("/v1/models", self.models)
        r.add_get("/health", self.health)
        r.add_get("/metrics", self.metrics)
        r.add_post("/tokenize", self.tokenize)
        r.add_post("/detokenize", self.detokenize)
        r.add_post("/emulator/abort", self.abort)

    # ------------------------------------------------------------------ generation routes
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=True)

    async def _handle(self, request: web.Request, chat: bool) -> web.StreamResponse:
        """Count the request, read and check its body, apply the entry faults, then serve it."""
        s, engine = self.s, self.engine
        with s.tracked():
            if s.dead:
                return error(500, ENGINE_DEAD_MSG)
            try:
                raw = await request.read()
                body = msgspec.json.decode(raw) if raw else {}
                if not isinstance(body, dict):
                    raise ValueError("body must be a JSON object")
            except (msgspec.DecodeError, ValueError) as e:
                return error(400, f"Invalid request: {e}")
            bad = _model_refusal(body, chat)
            if bad is not None:
                return bad
            hit = s.faults.draw()
            early = await s.apply_entry_faults(hit, lambda st, msg: error(st, msg))
            if early is not None:
                engine.counters.errors += 1
                return early
            try:
                resp = await self._run(request, body, chat, hit)
            except MidStreamFault as e:
                if e.kind == "crash_mid_stream":
                    crash(request)
                await hang_forever()
                raise
            except asyncio.CancelledError:
                engine.counters.aborted += 1
                raise
            if resp.status >= 400:
                engine.counters.errors += 1
            else:
                engine.counters.completed += 1
            return resp

    async def _run(
        self, request: web.Request, body: dict[str, Any], chat: bool, hit: dict[str, Fault]
    ) -> web.StreamResponse:
        parsed = parse(body, chat, self.s.spec.max_logprobs)
        if isinstance(parsed, web.StreamResponse):
            return parsed
        refused = self._refusal(body, chat, parsed)
        if refused is not None:
            return refused
        if (why := self.lengths.engine_refusal(parsed.prompts)) is not None:
            # raised by the engine's generate() when the response's generator first reads it: a
            # 400 (the app's exception handler), or when streaming a 200 with one error event
            # (completion/serving.py:497-503)
            if not body.get("stream"):
                self.state.reject_remote_prefill(body)
                return error(400, why)
            failed = await start_sse(request)
            await failed.write(sse_error(error_dict(400, why)))
            return await end_sse(failed)
        if len(parsed.prompts) > 1 or parsed.n > 1:
            return await MultiCall(self.state, request, body, chat, hit, parsed).run()
        return await SingleCall(self.state, request, body, chat, hit, parsed).run()

    def _refusal(self, body: dict[str, Any], chat: bool, parsed: Parsed) -> web.Response | None:
        """The renderer's checks (its params, then each prompt), then SamplingParams' (per
        prompt): _verify_args, then _verify_greedy_sampling. Each one raised inside create_*:
        the KV connector is told (reject_remote_prefill), but of the greedy-sampling refusal."""
        lengths = self.lengths
        bad = lengths.check_output_limit(body, chat)
        for pr, is_text in zip(parsed.prompts, parsed.texts, strict=True):
            if bad is None:
                bad = lengths.check_length(pr, is_text)
        if bad is not None:
            self.state.reject_remote_prefill(body)
            return bad
        # SamplingParams.max_tokens: get_max_tokens' value, 1 for an echo without generation
        # (completion/protocol.py:395)
        max_tokens = [1 if parsed.echo_only else lengths.max_new_for(pr, body, chat) for pr in parsed.prompts]
        refused = vllm_refusal(body, max_tokens)
        if refused is not None:
            self.state.reject_remote_prefill(body)
            return error(400, refused[0], param=refused[1])
        temperature = body.get("temperature")
        if parsed.n > 1 and isinstance(temperature, int | float) and temperature < 1e-5:
            # vLLM 0.32 SamplingParams._verify_greedy_sampling (seen on the real engine)
            return error(400, f"n must be 1 when using greedy sampling, got {parsed.n}.")
        return None

    # ------------------------------------------------------------------ other routes
    async def models(self, request: web.Request) -> web.Response:
        now = int(time.time())
        served = self.s.model_name
        permission = {
            "id": f"modelperm-{secrets.token_hex(8)}",
            "object": "model_permission",
            "created": now,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        model = {
            "id": served,
            "object": "model",
            "created": now,
            "owned_by": "vllm",
            "root": served,
            "parent": None,
            "max_model_len": self.lengths.max_len,
            "permission": [permission],
        }
        return json_response({"object": "list", "data": [model]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.s.dead else 200)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=render_vllm(self.s), content_type="text/plain", charset="utf-8")

    async def tokenize(self, request: web.Request) -> web.Response:
        body = msgspec.json.decode(await request.read())
        if "messages" in body:
            ids = tokenizer.encode_chat(body["messages"])
        else:
            ids = tokenizer.encode(
                str(body.get("prompt", "")), add_bos=bool(body.get("add_special_tokens", True))
            )
        return json_response(
            {"count": len(ids), "max_model_len": self.lengths.max_len, "tokens": ids, "token_strs": None}
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        body = msgspec.json.decode(await request.read())
        return json_response({"prompt": tokenizer.decode(body.get("tokens", []))})

    async def abort(self, request: web.Request) -> web.Response:
        body = msgspec.json.decode(await request.read() or b"{}")
        rid = str(body.get("request_id", body.get("rid", "")))
        for key, seq in list(self.state.seqs.items()):
            key = re.sub(r"^\d+_", "", key)  # a child of an n > 1 request: "{index}_{parent}"
            if key == rid or key.startswith(rid + "-"):
                self.engine.abort_seq(seq)
        return web.Response(status=200)


def _model_refusal(body: dict[str, Any], chat: bool) -> web.Response | None:
    """pydantic's request model: a refused field is a 400 while parsing, before any work."""
    refused = coerce_openai(body, chat, VLLM_NO_NULL_CHAT if chat else VLLM_NO_NULL_COMPLETIONS)
    if (why := normalize_openai_prompt(body, chat) or refused) is not None:
        return error(400, why)
    if (why := vllm_seed_error(body)) is not None:
        return error(400, why, param="seed")
    if not isinstance(body.get("kv_transfer_params", {}), dict | None):
        # the request model's `kv_transfer_params: dict[str, Any] | None`
        return error(400, "1 validation error: kv_transfer_params: Input should be a valid dictionary")
    return None
