"""The concurrent shape (SGLang): prefill and decode start together; the decode's bytes are held
until the prefill's verdict is in (its response arrives once the KV has been shipped).

One deadline covers both phases: `prefill_s` to the prefill's verdict, then (rescheduled) the
decode's response headers within `handoff_s` (plus `per_token_s` per token of a non-streamed
answer). A prefill that refuses the request is told apart from one that fails: when its decode
refuses the same body too, the refusal is the request's own (`_refused_too`).
"""

from __future__ import annotations

import asyncio
import time

from adapters import HandoffCtx, PrefillVerdict
from common.errors import UpstreamTimeout
from common.workers import Role
from gateway.guards import Guard
from gateway.http.client import UpstreamResponse
from gateway.http.errors import UpstreamConnectError, UpstreamProtocolError
from gateway.orchestration.blame import LegShape, leg_failure, prefill_refusal, upstream_status_error
from gateway.orchestration.context import Phase, RequestContext
from gateway.orchestration.feedback import reported
from gateway.orchestration.legs import Handoff, Leg
from gateway.orchestration.relay import relay
from gateway.orchestration.services import Services, engine_headers
from gateway.orchestration.shadow import decode_check
from gateway.registry import Worker

# How long a refused SGLang prefill waits for its decode's answer to the same body: a decode
# that refuses it too (within this) makes it the request's fault, not a guard's catch.
_AGREEMENT_S = 0.25


async def run_concurrent(s: Services, ctx: RequestContext, p: Worker, d: Worker, hctx: HandoffCtx) -> None:
    req = ctx.req
    pbody, dbody = d.adapter.handoff_bodies(req, hctx)
    # the prefill counts as in flight until its answer is in, not until the decode's end
    pleg = Leg(s, ctx, p, ctx.view.prompt_tokens, Role.PREFILL, LegShape.CONCURRENT)
    dleg = Leg(s, ctx, d, ctx.tokens, Role.DECODE, LegShape.CONCURRENT)
    async with Handoff(s, ctx, pleg, dleg, concurrent=True) as h:
        # Futures, not Tasks: on pooled connections both requests are written right here and
        # resolved from the connections' callbacks.
        # never re-sent by the pool: each leg names a bootstrap room, used once (a copy of a leg
        # the engine already took would wait for KV that never comes); a retry gets a new room
        pleg.call = p.pool.fetch("POST", req.path, engine_headers(p, ctx.headers), pbody, replay=False)
        dleg.call = d.pool.start("POST", req.path, engine_headers(d, ctx.headers), dbody, replay=False)
        prefill_out = await _through_handoff(s, ctx, h, hctx)
        s.metrics.child(s.metrics.phase, "handoff").observe(time.monotonic() - ctx.attempt.prefill_done_at)
        assert dleg.resp is not None
        transform = d.adapter.decode_transformer(req, prefill_out)
        await relay(s, ctx, dleg.resp, d, phase="decode", transform=transform, check=h.check)
        dleg.complete()


async def _through_handoff(s: Services, ctx: RequestContext, h: Handoff, hctx: HandoffCtx) -> bytes:
    """To the decode's response headers, past the prefill's verdict; returns the prefill's body."""
    pleg, dleg = h.prefill, h.decode
    p, d = pleg.worker, dleg.worker
    t = s.cfg.timeouts
    a = ctx.attempt
    t0 = time.monotonic()
    wait_s = t.handoff_s
    in_handoff = False
    try:
        # One timer for both phases (rescheduled at the verdict) instead of one each.
        with ctx.wheel.after(t.prefill_s, ctx.task) as deadline:
            status, out = await _await_prefill(pleg.call, dleg.call, p, d)
            verdict = _judge(s, ctx, pleg, hctx, status, out, t0)
            if not verdict.ok:
                await _refused(s, h, hctx, status, verdict)
            pleg.complete()
            in_handoff = True
            a.phase = Phase.HANDOFF
            h.check = decode_check(s, hctx, ctx.req, p.adapter, out)
            decode_call = dleg.call
            assert decode_call is not None
            if not decode_call.done():
                wait_s = s.head_budget(ctx.req, d, t.handoff_s)
                deadline.reschedule(ctx.wheel.loop.time() + wait_s)
            try:
                dleg.resp = await decode_call
            except (UpstreamConnectError, UpstreamProtocolError) as e:
                raise leg_failure(e, f"decode {d.id}", "decode", d.id) from None
    except TimeoutError:
        if not in_handoff:
            raise UpstreamTimeout(
                f"prefill {p.id} gave no verdict within {t.prefill_s:g}s (an SGLang prefill "
                f"answers once its KV reached decode {d.id}: either may be the one stuck)",
                phase="prefill",
                worker=p.id,
                public=f"the prefill gave no verdict within {t.prefill_s:g}s",
            ) from None
        raise UpstreamTimeout(
            f"decode {d.id} sent no response headers within {wait_s:g}s of the prefill's verdict",
            phase="handoff",
            worker=d.id,
            public=f"the decode sent no response headers within {wait_s:g}s of the prefill's verdict",
        ) from None
    return out


def _judge(
    s: Services, ctx: RequestContext, pleg: Leg, hctx: HandoffCtx, status: int, out: bytes, t0: float
) -> PrefillVerdict:
    """The prefill's answer is in: its leg no longer counts as in flight, and its adapter judges
    whether it is a sound basis for the decode."""
    pleg.free()
    a = ctx.attempt
    a.prefill_done_at = time.monotonic()
    s.metrics.child(s.metrics.phase, "prefill").observe(a.prefill_done_at - t0)
    verdict = pleg.worker.adapter.judge_prefill(ctx.req, hctx, status, out)
    a.cached = reported(pleg.worker, verdict.cached, ctx.view.prompt_tokens)
    return verdict


async def _refused(s: Services, h: Handoff, hctx: HandoffCtx, status: int, verdict: PrefillVerdict) -> None:
    """Raise the error of a prefill answer that is no basis for the decode. The decode, sent the
    same body, is waiting for this KV: it is aborted on the way out. The guard's catch, unless
    the decode refused the request too (the request's fault) or the prefill failed (5xx: an
    upstream error)."""
    p, d, decode_call = h.prefill.worker, h.decode.worker, h.decode.call
    assert decode_call is not None
    took = status != 200 and status < 500 and not await _refused_too(d, decode_call, _AGREEMENT_S)
    if (status == 200 or took) and not verdict.handoff:
        s.guard_failed(
            Guard.PREFILL_VERDICT,
            "before_first_byte",
            hctx.request_id,
            verdict.reason,
            prefill=p.id,
            decode=d.id,
        )
    raise prefill_refusal(p.id, d.id, verdict, decode_took=took)


async def _await_prefill(
    prefill_call: asyncio.Future[tuple[int, bytes]] | None,
    decode_call: asyncio.Future[UpstreamResponse] | None,
    p: Worker,
    d: Worker,
) -> tuple[int, bytes]:
    """The prefill's (status, body); fails early if the decode fails before it.

    Awaits the prefill directly (one wake-up); a decode that fails or refuses first cancels
    the prefill (which aborts its leg, as the failure would anyway) to wake this up early."""
    assert prefill_call is not None and decode_call is not None

    def on_decode(f: asyncio.Future[UpstreamResponse]) -> None:
        if not prefill_call.done() and (
            f.cancelled() or f.exception() is not None or f.result().status != 200
        ):
            prefill_call.cancel()

    decode_call.add_done_callback(on_decode)
    try:
        return await prefill_call
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if not decode_call.done() or decode_call.cancelled() or (task is not None and task.cancelling()):
            raise  # the client went away or a deadline expired
        exc = decode_call.exception()
        if exc is not None:
            if isinstance(exc, UpstreamConnectError | UpstreamProtocolError):
                raise leg_failure(exc, f"decode {d.id}", "decode", d.id) from None
            raise exc from None
        resp = decode_call.result()
        if resp.status == 200:
            raise
        # The decode refused before the prefill finished: its answer is final.
        body = await resp.read()
        resp.release()
        raise upstream_status_error(resp.status, body, d.id, "decode") from None
    except (UpstreamConnectError, UpstreamProtocolError) as e:
        raise leg_failure(e, f"prefill {p.id}", "prefill", p.id) from None
    finally:
        decode_call.remove_done_callback(on_decode)


async def _refused_too(d: Worker, decode: asyncio.Future[UpstreamResponse], within_s: float) -> bool:
    """Whether the decode refused the request as well, waiting up to `within_s` for it: a 4xx,
    or a stream its adapter reads as a refusal (SGLang's /generate refuses a streamed request
    with one error event)."""
    end = time.monotonic() + within_s
    if not decode.done():
        await asyncio.wait((decode,), timeout=within_s)
    if not decode.done() or decode.cancelled() or decode.exception() is not None:
        return False
    resp = decode.result()
    if 400 <= resp.status < 500:
        return True
    if resp.status != 200 or not (resp.header(b"content-type") or b"").startswith(b"text/event-stream"):
        return False
    try:  # (the caller aborts this leg whatever it holds)
        body = await asyncio.wait_for(resp.read(), max(0.0, end - time.monotonic()))
    except (TimeoutError, UpstreamConnectError, UpstreamProtocolError):
        return False
    return d.adapter.refused_in_stream(body)
