"""The split shape: `n > 1` or a batch on an engine whose P/D cannot pair several samples
(`splits_samples` on the adapter: SGLang). One handoff per prompt and sample (the adapter cuts
the request into units), each in its own task with its own room, deadlines and guards, merged
into one answer (gateway/samples.py).

At most `split_concurrency` units are in flight at once (each is two upstream connections: a
batch of 100 prompts with `n` = 128 must not open 25,600 of them); the first failure cancels
the other units. A stream starts once every unit of that first wave is past its engines'
refusals: a unit refused before then is the request's error, not an error event after other
units' tokens.
"""

from __future__ import annotations

import asyncio

from adapters import HandoffCtx
from common.request import ParsedRequest
from gateway.ids import new_room
from gateway.orchestration.concurrent import run_concurrent
from gateway.orchestration.context import Phase, RequestContext, request_view
from gateway.orchestration.services import Services
from gateway.registry import Worker
from gateway.samples import SampleMerger
from policies.snapshot import Disaggregated


async def run_split(s: Services, ctx: RequestContext, p: Worker, d: Worker, plan: Disaggregated) -> None:
    req = ctx.req
    # every unit is built (and checked) before any starts: a unit the engine would refuse is
    # the request's 400, not an error after other units' tokens went out
    units = d.adapter.split_units(req)
    width = min(len(units), s.cfg.limits.split_concurrency)
    merger = SampleMerger(
        req,
        ctx.res,
        first_wave=width,
        head=((b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), ctx.echo),
    )
    started: list[RequestContext] = []

    async def one(j: int, ureq: ParsedRequest) -> None:
        task: asyncio.Task[None] = asyncio.current_task()  # type: ignore[assignment]
        sink = merger.sink(j, task)
        uid = f"{ctx.request_id}-{j}"  # each unit's own, in logs and engine rids
        # its own prompt and budget, in the workers' accounting
        cpt = s.cfg.guards.chars_per_token_estimate
        view = request_view(ureq, uid, cpt, s.needs.prompt_key, tokenizer=s.tokenizer())
        u = ctx.unit(ureq, uid, sink, task, view)
        started.append(u)
        hctx = HandoffCtx(
            request_id=uid,
            prefill=plan.prefill,
            decode=plan.decode,
            room=new_room(s.rng),
            stream_usage=ureq.usage_unasked and s.cfg.guards.decode_consistency,
        )
        await run_concurrent(s, u, p, d, hctx)

    todo = iter(enumerate(units))

    async def runner() -> None:
        for k, ureq in todo:  # shared: each runner takes the next unit not yet started
            await one(k, ureq)

    tasks = [asyncio.ensure_future(runner()) for _ in range(width)]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for u in started:
            u.attempt.cut = True  # cancelled for a sibling's failure (or with the request): no verdict
        for t in tasks:
            t.cancel()
        raise
    a = ctx.attempt
    a.prefill_done_at = max(u.attempt.prefill_done_at for u in started)
    if req.stream:
        merger.end_stream()
    else:
        merger.send_whole()
    a.first_byte_at = merger.first_byte_at
    a.phase = Phase.STREAMING if req.stream else Phase.DONE
