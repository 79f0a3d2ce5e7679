"""One prompt, one sample: the request that P/D hands off. A prefill (``do_remote_decode``)
computes the prompt and one token and holds the KV for its decode; a decode
(``do_remote_prefill``) reads that KV and generates the whole answer; a colocated server (or a
request without ``kv_transfer_params``) does both. Whole or streamed."""

from __future__ import annotations

import secrets
import time
from typing import Any

from aiohttp import web

from emulator import model
from emulator.echo import NO_ECHO, vllm_chat_echo, vllm_prompt_logprobs
from emulator.faults import Fault
from emulator.generation import MidStreamFault, tokens
from emulator.kvtransfer import TransferError
from emulator.scheduler import Aborted, EngineDead, Seq, TooLarge
from emulator.stops import Stopper
from emulator.vllm.chunks import Shape, answer_text, finish_of, release, stop_reason_of, token_choice, usage
from emulator.vllm.errors import ENGINE_DEAD_MSG, HandoffError, error, failed
from emulator.vllm.handoff import pull_kv, skip_remote_kv
from emulator.vllm.request import Parsed, echo_of, sample_seed
from emulator.vllm.state import VllmState
from emulator.wire import end_sse, json_response, start_sse


class SingleCall:
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
        self.engine = s.engine
        self.request = request
        self.body = body
        self.chat = chat
        self.hit = hit
        self.parsed = parsed
        self.prompt = prompt = parsed.prompts[0]
        self.max_new = api.lengths.max_new_for(prompt, parsed.limits, chat)
        self.ec = echo_of(prompt, body, chat, parsed.ask)
        self.chat_echo = vllm_chat_echo(body) if chat else ""
        self.scoring = parsed.plp_k is not None  # prompt logprobs: no cached prefix, no remote KV is read
        xrid = request.headers.get("X-Request-Id")
        base = xrid if xrid else secrets.token_hex(8)
        oid = ("chatcmpl-" if chat else "cmpl-") + base
        self.engine_rid = f"{oid}-{secrets.token_hex(4)}" if chat else f"{oid}-0-{secrets.token_hex(4)}"
        self.ktp = ktp = body.get("kv_transfer_params") or {}
        # Only the P/D roles run the NixlConnector. A colocated server (`both`) runs none, and
        # vLLM without a KV connector reads no kv_transfer_params: its scheduler consults no
        # connector (Scheduler._connector_finished answers (False, None) when self.connector is
        # None), so the request is served whole and its answer's kv_transfer_params is null
        self.remote_decode = bool(ktp.get("do_remote_decode")) and s.role == "prefill"
        self.remote_prefill = bool(ktp.get("do_remote_prefill")) and s.role == "decode"
        self.stream = bool(body.get("stream")) and not self.remote_decode
        self.seq = Seq(self.engine_rid, prompt, 1 if self.remote_decode else self.max_new, sample_seed(body))
        self.shape = Shape(
            oid,
            int(time.time()),
            body.get("model") or s.model_name,
            chat,
            s.fingerprint,
            body,
            details=s.spec.enable_prompt_tokens_details,
        )
        self.out: list[int] = []
        self.params_out: dict[str, Any] | None = None
        self.held = False  # a prefill's blocks are held for its decode
        self.reached_prefill = False  # decode: the prefill's blocks were read or it was notified
        self.resp: web.StreamResponse | None = None
        self.stopper = Stopper(parsed.stop) if parsed.stop is not None else None

    async def run(self) -> web.StreamResponse:
        self.api.seqs[self.engine_rid] = self.seq
        try:
            await self._obtain_kv()
            n = 1 if self.remote_decode else self.max_new
            if self.stream and self.resp is None:
                self.resp = await start_sse(self.request)
            await self._generate(n)
            # Some of vLLM's KV connectors (Mooncake's) hand over a prefill's KV only when the
            # engine core ended it capped by length (FINISHED_LENGTH_CAPPED in request_finished).
            # With its one token a stop id, 0.32 still caps it by length first (and a stop string
            # is the front end's finding, after that); newer vLLM judges the stop id first: the
            # prefill frees its blocks and answers `kv_transfer_params: null`
            stopper = self.stopper
            stopped_first = (
                self.s.spec.stop_checks_first and stopper is not None and isinstance(stopper.matched, int)
            )
            if self.remote_decode and not stopped_first:
                self.params_out = self.api.handoffs.hold(self.seq, self.engine_rid, self.hit)
                self.held = True
        except HandoffError as e:
            if e.fatal:
                self.s.fatal()
            return await failed(self.resp, str(e))
        except TooLarge as e:
            return error(400, str(e))
        except EngineDead:
            return await failed(self.resp, ENGINE_DEAD_MSG)
        except MidStreamFault as e:
            if e.kind != "error_mid_stream":
                raise
            return await failed(self.resp, ENGINE_DEAD_MSG)  # as EngineDead, for this request alone
        except Aborted:
            self.engine.counters.aborted += 1
        finally:
            self._end()
        if self.resp is not None:
            return await self._end_stream(self.resp)
        return self._whole()

    def _end(self) -> None:
        self.api.seqs.pop(self.engine_rid, None)
        if not self.held:
            self.engine.release(self.seq)
        if self.remote_prefill and not self.reached_prefill and not self.s.dead:
            # ended before its KV was read (aborted, cancelled, refused by the engine): vLLM's
            # connector still notifies the prefill, which frees the blocks it holds for it
            self.api.reject_remote_prefill(self.body)

    async def _obtain_kv(self) -> None:
        """The prompt's KV: computed here, or read from the prefill (a decode computing the
        prompt's logprobs computes it here too and only notifies the prefill)."""
        engine, seq = self.engine, self.seq
        await engine.admit(seq, read_cache=not self.scoring)
        if self.remote_prefill and self.scoring:
            self.reached_prefill = True
            await skip_remote_kv(self.s, self.ktp)
            await engine.prefill(seq)
        elif self.remote_prefill:
            await self._pull()
        else:
            truncated = self.remote_decode and "silent_truncation" in self.hit
            await engine.prefill(seq, truncate_to=1 if truncated else None)

    async def _pull(self) -> None:
        engine, seq = self.engine, self.seq
        groups = self.ktp.get("remote_block_ids")
        ids = groups[0] if isinstance(groups, list) and groups and isinstance(groups[0], list) else []
        if len(ids) < seq.n_prompt_blocks:
            # vLLM: assert num_decode_blocks <= len(prefill_group) kills the EngineCore
            raise HandoffError(ENGINE_DEAD_MSG, fatal=True)
        if self.stream:
            self.resp = await start_sse(self.request)
        self.reached_prefill = True
        try:
            contents = await engine.abortable(seq, pull_kv(self.s, seq, self.ktp, self.hit))
            engine.counters.kv_transfers_ok += 1
        except TransferError as e:
            engine.counters.kv_transfers_failed += 1
            if e.kind != "aborted":
                raise HandoffError("Internal server error") from e
            contents = []
        engine.load_remote_kv(seq, contents)
        if "abort_during_transfer" in self.hit or (not contents):
            seq.max_new = 1
            self.max_new = 1

    async def _generate(self, n: int) -> None:
        prompt, stopper = self.prompt, self.stopper
        first = True
        shown = 0  # tokens whose text a stream has shown (a stop string's start is held back)
        # the first token is sampled by the step that computed the prompt here; a decode handed
        # the prompt's KV computes its last token again in a step of its own to sample it
        local = not self.remote_prefill or self.scoring
        steps = tokens(self.s, self.seq, n, self.hit, self.parsed.stop, first_ready=local)
        try:
            async for tok in steps:
                if first and self.remote_prefill and "tie_flip" in self.hit and prompt:
                    # the decode's own pass over the prompt's last token (vLLM recomputes
                    # it to sample) lands on the other side of a near tie
                    if model.tie_gap(prompt[-1], tok) is not None:
                        tok = model.runner_up(tok)
                self.out.append(tok)
                stopped = stopper is not None and stopper.feed(tok)
                last = stopped or len(self.out) == n
                if self.resp is not None:
                    shown = await self._emit(self.resp, shown, last, first)
                first = False
                if stopped:
                    break
        finally:
            await steps.aclose()

    async def _emit(self, resp: web.StreamResponse, shown: int, last: bool, first: bool) -> int:
        """The stream's chunks after the newest token; returns the tokens shown from now on."""
        shape, prompt, out = self.shape, self.prompt, self.out
        ec = self.ec
        now, new, text, lp = release(out, shown, last, self.stopper, self.parsed.ask, prompt, ec, first)
        if self.chat and first:
            await resp.write(shape.role_chunk(0, prompt))
            if self.chat_echo:
                await resp.write(shape.echo_chunk(0, self.chat_echo, len(prompt)))
        if new or (last and not self.chat) or (first and ec is not NO_ECHO):
            choice = token_choice(
                0, self.chat, text, lp, new, last, self.stopper, shown, prompt, shape.return_ids
            )
            await resp.write(shape.token_chunk(choice, last, len(prompt), len(out)))
            return now
        return shown

    async def _end_stream(self, resp: web.StreamResponse) -> web.StreamResponse:
        shape, n_prompt, ct = self.shape, len(self.prompt), len(self.out)
        if self.chat:
            stopper = self.stopper
            await resp.write(shape.finish_chunk(0, finish_of(stopper), stop_reason_of(stopper), n_prompt, ct))
        if shape.include_usage:
            await resp.write(shape.usage_chunk(n_prompt, ct, self.seq.cached_tokens))
        return await end_sse(resp)

    def _whole(self) -> web.Response:
        shape, prompt, stopper, plp_k = self.shape, self.prompt, self.stopper, self.parsed.plp_k
        text, lps = answer_text(self.out, stopper, self.parsed.ask, prompt, self.ec, self.chat_echo)
        prompt_lps = vllm_prompt_logprobs(prompt, plp_k) if plp_k is not None else None
        choice = shape.choice(0, text, lps, finish_of(stopper), stopper, self.out, prompt, prompt_lps)
        u = usage(len(prompt), len(self.out), self.seq.cached_tokens, False, shape.details)
        return json_response(shape.whole([choice], u, prompt, prompt_lps, self.params_out))
