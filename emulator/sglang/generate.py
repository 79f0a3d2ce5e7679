"""SGLang's native ``POST /generate``: one prompt or a batch (``text``/``input_ids``), whole or
streamed (an event per ``--stream-interval`` tokens, each carrying the output so far)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web

from emulator import tokenizer
from emulator.faults import Fault
from emulator.sampling_checks import sglang_generate_refusal
from emulator.sglang.errors import error_generate, error_openai
from emulator.sglang.items import (
    Item,
    Result,
    make_items,
    max_new_of,
    num_samples,
    per_prompt_params,
    prompt_refusal,
    sampling_seed,
)
from emulator.sglang.meta import generate_obj
from emulator.sglang.runner import SglangRunner
from emulator.stops import stop_spec
from emulator.wire import end_sse, json_response, sse, start_sse


class GenerateCall:
    """One ``/generate`` request: `held` collects the rids it holds (released by the caller),
    `named` the rids it names (a stream's are aborted 2 s after its answer)."""

    def __init__(
        self,
        runner: SglangRunner,
        request: web.Request,
        body: dict[str, Any],
        hit: dict[str, Fault],
        held: list[str],
    ) -> None:
        self.runner = runner
        self.request = request
        self.body = body
        self.hit = hit
        self.held = held
        self.named: list[str] = []
        self.stream = bool(body.get("stream"))
        self.batch = False

    async def answer(self) -> web.StreamResponse:
        resp = await self._answer()
        if self.stream:
            self.runner.rids.abort_later(
                self.named
            )  # a StreamingResponse's background task, refusals included
        return resp

    async def _answer(self) -> web.StreamResponse:
        body, runner = self.body, self.runner
        if (why := prompt_refusal(body)) is not None:
            return await self._refuse(why)
        if body.get("text") == []:
            return await self._empty_batch()
        parsed = self._items()
        if isinstance(parsed, web.StreamResponse):
            return parsed
        items, refused, n = parsed
        self.named.extend(it.rid for it in items)
        why = runner.rids.hold(items, self.held)
        if why is None:
            why = runner.refusal(items, refused, n)
        if why is not None:
            return await self._refuse(why)
        runner.crash_on_bad_ids(items, self.request)
        sched = runner.scheduler_refusals(items, self.hit)
        if sched and not self.stream:
            # the batch's first abort raises in _collect_batch_responses (a 400)
            return error_generate(400, next(iter(sched.values()))[1])
        if not self.stream:
            return await self._whole(items)
        return await self._streamed(items, {k: msg for k, (_, msg) in sched.items()})

    async def _refuse(self, why: str) -> web.StreamResponse:
        """A ValueError out of the tokenizer manager's generate_request (the request's
        normalization, a duplicate rid, its length or sampling params): a 400, or when
        streaming a 200 with one error event and [DONE] (http_server.py:949-975)."""
        if not self.stream:
            return error_generate(400, why)
        resp = await start_sse(self.request)
        err = {"message": why, "type": "invalid_request_error", "code": 400, "retryable": False}
        await resp.write(sse({"error": err}))
        return await end_sse(resp)

    async def _empty_batch(self) -> web.StreamResponse:
        """An empty batch (its size is text's when given): normalize_batch_and_arguments takes
        it and _handle_batch_request sends nothing and gathers no answer (tokenizer_manager.py)."""
        if not self.stream:
            return json_response([])
        resp = await start_sse(self.request)  # no event before http_server's [DONE]
        return await end_sse(resp)

    def _items(self) -> tuple[list[Item], list[str | None], int] | web.Response:
        """The request's items (prompt-major, `n` samples each), each prompt's sampling-params
        refusal and `n`; or a 400 for sampling params SGLang cannot even read."""
        body = self.body
        if body.get("input_ids") is not None:
            ids = body["input_ids"]
            self.batch = bool(ids) and isinstance(ids[0], list)
            prompts = ids if self.batch else [ids]
        else:
            text = body.get("text", "")
            self.batch = isinstance(text, list)
            prompts = [tokenizer.encode(t) for t in (text if self.batch else [text])]
        try:
            sps = per_prompt_params(body.get("sampling_params"), len(prompts), self.batch)
            n = num_samples(sps[0].get("n"))
            if any(num_samples(sp.get("n")) != n for sp in sps):
                raise ValueError(
                    "The parallel_sample_num should be the same for all samples in sample params."
                )
            stops = [stop_spec(sp, "no_stop_trim", "min_new_tokens") for sp in sps]
        except (TypeError, ValueError) as e:
            return error_generate(400, str(e))
        self.batch = self.batch or n > 1  # SGLang turns a single prompt with n > 1 into a batch
        max_new = [max_new_of(sp) for sp in sps]
        items = make_items(body, prompts, max_new, [sampling_seed(sp) for sp in sps], n, stops, self.batch)
        return items, [sglang_generate_refusal(sp) for sp in sps], n

    async def _whole(self, items: list[Item]) -> web.Response:
        role = self.runner.s.role
        results = await self.runner.run_whole(items, self.hit)
        for res in results:
            if res.error_status:
                return (
                    error_generate(res.error_status, res.error_message)
                    if res.error_status == 400
                    else error_openai(res.error_status, res.error_message)
                )
        objs = [generate_obj(role, it, res, True) for it, res in zip(items, results, strict=True)]
        return json_response(objs if self.batch else objs[0])

    async def _streamed(self, items: list[Item], sched: dict[int, str]) -> web.StreamResponse:
        resp = await start_sse(self.request)
        streams = [_ItemStream(self, resp, idx, it) for idx, it in enumerate(items)]
        await asyncio.gather(*(st.run(sched.get(st.idx)) for st in streams))
        return await end_sse(resp)


class _ItemStream:
    """The events of one item of a streamed ``/generate`` (with its `index` in a batch)."""

    def __init__(self, call: GenerateCall, resp: web.StreamResponse, idx: int, item: Item) -> None:
        self.call = call
        self.resp = resp
        self.idx = idx
        self.item = item
        self.t0 = 0.0

    async def run(self, refused: str | None) -> None:
        call, it = self.call, self.item
        self.t0 = time.time()
        if refused is not None:
            # the scheduler's abort of this prompt, streamed as its one event
            # (_handle_abort_finish_reason returns a stream's abort instead of raising);
            # the batch's other prompts are served (_stream_batch_responses)
            abort = {"type": "abort", "message": refused, "status_code": 400, "err_type": "BadRequestError"}
            # set_finish_with_abort leaves the prompt one token
            res = Result([], abort, 0, 1, self.t0, 0.0)
        else:
            res = await call.runner.execute(it, call.hit, self.on_token)
        await self._write(res, True)

    async def on_token(self, out: list[int]) -> None:
        cached = self.call.runner.rids.cached_tokens(self.item.rid)
        await self._write(Result(out, None, cached, len(self.item.prompt), self.t0, time.time()), False)

    async def _write(self, res: Result, final: bool) -> None:
        obj = generate_obj(self.call.runner.s.role, self.item, res, final)
        if self.call.batch:
            obj["index"] = self.idx
        await self.resp.write(sse(obj))
