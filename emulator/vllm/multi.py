"""A batch of prompts and/or ``n > 1`` samples, served locally (the gateway sends these to one
worker without ``kv_transfer_params``). Choice ``k = prompt_index * n + sample_index``; sample
``j`` is a child request seeded ``seed + j`` (vLLM's ``ParentRequest``)."""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

from aiohttp import web

from emulator import model
from emulator.echo import NO_ECHO, vllm_chat_echo, vllm_prompt_logprobs
from emulator.faults import Fault
from emulator.generation import MidStreamFault, tokens
from emulator.scheduler import Aborted, EngineDead, Seq, TooLarge
from emulator.stops import Stopper
from emulator.vllm.chunks import Shape, answer_text, release, stop_reason_of, token_choice, usage
from emulator.vllm.errors import ENGINE_DEAD_MSG, error, failed
from emulator.vllm.request import Parsed, echo_of, sample_seed
from emulator.vllm.state import VllmState
from emulator.wire import end_sse, json_response, start_sse


class MultiCall:
    def __init__(
        self,
        api: VllmState,
        request: web.Request,
        body: dict[str, Any],
        chat: bool,
        hit: dict[str, Fault],
        parsed: Parsed,
    ) -> None:
        s = api.s
        self.api = api
        self.s = s
        self.request = request
        self.body = body
        self.chat = chat
        self.hit = hit
        self.parsed = parsed
        xrid = request.headers.get("X-Request-Id")
        self.oid = ("chatcmpl-" if chat else "cmpl-") + (xrid if xrid else secrets.token_hex(8))
        self.shape = Shape(
            self.oid,
            int(time.time()),
            body.get("model") or s.model_name,
            chat,
            s.fingerprint,
            body,
            details=s.spec.enable_prompt_tokens_details,
        )
        self.stream = bool(body.get("stream"))
        self.chat_echo = vllm_chat_echo(body) if chat else ""
        self.resp: web.StreamResponse | None = None
        self.children: list[tuple[int, Seq]] = []

    def _make_children(self) -> web.Response | None:
        """A child per (prompt, sample), or the 400 of a prompt that can never fit."""
        parsed, oid = self.parsed, self.oid
        base_seed = sample_seed(self.body)
        for i, prompt in enumerate(parsed.prompts):
            max_new = self.api.lengths.max_new_for(prompt, parsed.limits, self.chat)
            try:
                self.s.engine.check_fits(len(prompt), max_new)
            except TooLarge as e:
                return error(400, str(e))
            parent = f"{oid}-{secrets.token_hex(4)}" if self.chat else f"{oid}-{i}-{secrets.token_hex(4)}"
            for j in range(parsed.n):
                rid = parent if parsed.n == 1 else f"{j}_{parent}"
                self.children.append((max_new, Seq(rid, prompt, max_new, model.sample_seed(base_seed, j))))
        return None

    async def run(self) -> web.StreamResponse:
        refused = self._make_children()
        if refused is not None:
            return refused
        children = [_Child(self, k, max_new, seq) for k, (max_new, seq) in enumerate(self.children)]
        if self.stream:
            self.resp = await self._start_stream()
        tasks = [asyncio.ensure_future(c.run()) for c in children]
        try:
            await asyncio.gather(*tasks)
        except EngineDead:
            return await failed(self.resp, ENGINE_DEAD_MSG)
        except MidStreamFault as e:
            if e.kind != "error_mid_stream":
                raise
            return await failed(self.resp, ENGINE_DEAD_MSG)  # as EngineDead, for this request alone
        finally:
            for t in tasks:
                t.cancel()
        pt = sum(len(p) for p in self.parsed.prompts)
        ct = sum(len(c.out) for c in children)
        cached = sum(seq.cached_tokens for _, seq in self.children[:: self.parsed.n])
        if self.resp is not None:
            if self.shape.include_usage:
                await self.resp.write(self.shape.usage_chunk(pt, ct, cached))
            return await end_sse(self.resp)
        return self._whole(children, usage(pt, ct, cached, False, self.shape.details))

    async def _start_stream(self) -> web.StreamResponse:
        """The stream and, on chat, every choice's role chunk, then every choice's echo."""
        resp = await start_sse(self.request)
        if self.chat:
            first = self.parsed.prompts[0]
            for k in range(len(self.children)):
                await resp.write(self.shape.role_chunk(k, first))
            for k in range(len(self.children) if self.chat_echo else 0):  # after all the role chunks
                await resp.write(self.shape.echo_chunk(k, self.chat_echo, len(first)))
        return resp

    def _whole(self, children: list[_Child], usage_: dict[str, Any]) -> web.Response:
        plp_k = self.parsed.plp_k
        choices: list[dict[str, Any]] = []
        for c in children:
            prompt = c.seq.prompt
            text, lps = answer_text(c.out, c.stopper, self.parsed.ask, prompt, c.ec, self.chat_echo)
            prompt_lps = vllm_prompt_logprobs(prompt, plp_k) if plp_k is not None else None
            choices.append(self.shape.choice(c.k, text, lps, c.finish, c.stopper, c.out, prompt, prompt_lps))
        first = self.parsed.prompts[0]
        chat_plp = vllm_prompt_logprobs(first, plp_k) if plp_k is not None else None
        return json_response(self.shape.whole(choices, usage_, first, chat_plp, None))


class _Child:
    """One sample of one prompt: choice `k`."""

    def __init__(self, call: MultiCall, k: int, max_new: int, seq: Seq) -> None:
        self.call = call
        self.k = k
        self.max_new = max_new
        self.seq = seq
        self.out: list[int] = []
        self.ec = echo_of(seq.prompt, call.body, call.chat, call.parsed.ask)
        self.finish = "length"
        self.stopper = Stopper(call.parsed.stop) if call.parsed.stop is not None else None

    async def run(self) -> None:
        call, seq = self.call, self.seq
        engine = call.s.engine
        call.api.seqs[seq.rid] = seq
        try:
            await engine.admit(seq, read_cache=call.parsed.plp_k is None)
            await engine.prefill(seq)
            await self._generate()
        except Aborted:
            engine.counters.aborted += 1
            self.finish = "abort"
        finally:
            call.api.seqs.pop(seq.rid, None)
            engine.release(seq)
        if call.resp is not None and call.chat:
            stop_reason = stop_reason_of(self.stopper)
            await call.resp.write(
                call.shape.finish_chunk(self.k, self.finish, stop_reason, len(seq.prompt), len(self.out))
            )

    async def _generate(self) -> None:
        call, stopper = self.call, self.stopper
        shown = 0
        # the first token is sampled by the prefill's last chunk
        steps = tokens(call.s, self.seq, self.max_new, call.hit, call.parsed.stop, first_ready=True)
        try:
            async for tok in steps:
                self.out.append(tok)
                stopped = stopper is not None and stopper.feed(tok)
                if stopped:
                    self.finish = "stop"
                last = stopped or len(self.out) == self.max_new
                if call.resp is not None:
                    shown = await self._emit(call.resp, shown, last)
                if stopped:
                    break
        finally:
            await steps.aclose()

    async def _emit(self, resp: web.StreamResponse, shown: int, last: bool) -> int:
        call, out, prompt = self.call, self.out, self.seq.prompt
        first = len(out) == 1
        now, new, text, lp = release(out, shown, last, self.stopper, call.parsed.ask, prompt, self.ec, first)
        if new or (last and not call.chat) or (first and self.ec is not NO_ECHO):
            choice = token_choice(
                self.k, call.chat, text, lp, new, last, self.stopper, shown, prompt, call.shape.return_ids
            )
            await resp.write(call.shape.token_chunk(choice, last, len(prompt), len(out)))
            return now
        return shown
