"""The sequential shape (vLLM with NIXL): the prefill (`max_tokens` 1) runs to its end, its
`kv_transfer_params` are judged, then the decode is sent them.

A decode that the request never reached (connection refused, its pool closed by a removal)
leaves the prefill's KV untouched, held for a decode to pull: the decode leg goes to another
decode of the pool with the same `kv_transfer_params` (they name the prefill, not a decode)
instead of prefilling again elsewhere, which would leave this KV held until the engine's lease
ends (`pdgw_fallbacks_total{rung="other_decode"}`, log event `request.decode_moved`).
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from adapters import HandoffCtx, PrefillVerdict
from common.errors import UpstreamFailure, UpstreamTimeout
from common.workers import Role
from gateway.guards import Guard
from gateway.http.errors import UpstreamConnectError, UpstreamProtocolError
from gateway.logging import get_logger
from gateway.orchestration.attempts import other_decode
from gateway.orchestration.blame import DecodeUnreached, LegShape, leg_failure, prefill_refusal
from gateway.orchestration.context import Phase, RequestContext
from gateway.orchestration.feedback import reported
from gateway.orchestration.legs import Handoff, Leg
from gateway.orchestration.relay import relay
from gateway.orchestration.services import Services, engine_headers
from gateway.orchestration.shadow import decode_check, start_early
from gateway.orchestration.verify import DecodeCheck
from gateway.registry import Worker
from policies.base import Failed, routed_event

# Enum members as module constants on the request path: on Python 3.11 a class attribute of an
# Enum goes through EnumType.__getattr__'s slot hook, unspecialised; a global does not
# (gateway/breaker.py)
_PREFILL, _DECODE, _HANDOFF = Role.PREFILL, Role.DECODE, Phase.HANDOFF
_ALONE, _SEQUENTIAL = LegShape.ALONE, LegShape.SEQUENTIAL

log = get_logger("pd_gateway.request")


async def run_sequential(s: Services, ctx: RequestContext, p: Worker, d: Worker, hctx: HandoffCtx) -> None:
    t0 = time.monotonic()
    # the prefill counts as in flight until its answer is in (its KV is ready to pull), with the
    # prompt's tokens: it generates none of the answer
    pleg = Leg(s, ctx, p, ctx.view.prompt_tokens, _PREFILL, _ALONE)
    # a sampled verification re-run starts with the prefill (shadow.start_early); whatever
    # way the attempt ends, it is not left running (a decode check that took it has awaited it)
    early = start_early(s, ctx.req, ctx.view, hctx)
    try:
        verdict, out, hctx = await _prefill(s, ctx, pleg, d, hctx)
        a = ctx.attempt
        a.prefill_done_at = time.monotonic()
        a.phase = _HANDOFF
        s.metrics.phase_prefill.observe(a.prefill_done_at - t0)
        tried = {d.id}
        while True:
            try:
                await _decode(s, ctx, pleg, d, hctx, verdict, out, early)
                return
            except DecodeUnreached as e:
                d = _move_decode(s, ctx, p, d, tried, e)
    finally:
        if early is not None:
            early.cancel()


async def _prefill(
    s: Services, ctx: RequestContext, pleg: Leg, d: Worker, hctx: HandoffCtx
) -> tuple[PrefillVerdict, bytes, HandoffCtx]:
    """The prefill leg to its end: (its verdict, its body, the handoff as it was asked)."""
    p, req = pleg.worker, ctx.req
    t = s.cfg.timeouts
    pbody = p.adapter.prefill_body(req, hctx)
    async with pleg:
        try:
            with ctx.wheel.after(t.prefill_s, ctx.task):
                status, out = await _call_whole(p, ctx, pbody)
                verdict = p.adapter.judge_prefill(req, hctx, status, out)
                if verdict.refused_ask:
                    # the worker takes no near-tie logprobs: asked no more, and this request's
                    # prefill goes again without them (it refused before doing any work)
                    p.near_ties = False
                    log.warning("worker.refuses_near_tie_logprobs", worker=p.id, reason=verdict.reason)
                    hctx = msgspec.structs.replace(hctx, near_ties=0)
                    status, out = await _call_whole(p, ctx, p.adapter.prefill_body(req, hctx))
                    verdict = p.adapter.judge_prefill(req, hctx, status, out)
        except TimeoutError:
            raise UpstreamTimeout(
                f"prefill {p.id} did not answer within {t.prefill_s:g}s",
                phase="prefill",
                worker=p.id,
                public=f"the prefill did not answer within {t.prefill_s:g}s",
            ) from None
        if not verdict.ok:
            if status == 200 and not verdict.handoff:  # it kept a broken handoff from the client
                s.guard_failed(
                    Guard.PREFILL_VERDICT,
                    "before_first_byte",
                    hctx.request_id,
                    verdict.reason,
                    prefill=p.id,
                    decode=d.id,
                )
            raise prefill_refusal(p.id, d.id, verdict, decode_took=False)
        pleg.complete()
    ctx.attempt.cached = reported(p, verdict.cached, ctx.view.prompt_tokens)
    return verdict, out, hctx


async def _call_whole(w: Worker, ctx: RequestContext, body: bytes) -> tuple[int, bytes]:
    """The prefill call read to the end: (status, body)."""
    try:
        # (a worker without its own API key, the usual case, is sent them as they are)
        hdrs = ctx.headers if w.authorization is None else engine_headers(w, ctx.headers)
        return await w.pool.fetch("POST", ctx.req.path, hdrs, body)
    except (UpstreamConnectError, UpstreamProtocolError) as e:
        raise leg_failure(e, f"prefill {w.id}", "prefill", w.id) from None


async def _decode(
    s: Services,
    ctx: RequestContext,
    pleg: Leg,
    d: Worker,
    hctx: HandoffCtx,
    verdict: PrefillVerdict,
    out: bytes,
    early: asyncio.Task[bytes | None] | None = None,
) -> None:
    """The decode leg after a good prefill: `DecodeUnreached` when the request never reached
    decode `d`. `early`: its sampled re-run, started with the prefill."""
    req = ctx.req
    p = pleg.worker
    dbody = d.adapter.decode_body(req, hctx, verdict)
    dleg = Leg(s, ctx, d, ctx.tokens, _DECODE, _SEQUENTIAL)
    async with Handoff(s, ctx, pleg, dleg, concurrent=False) as h:
        h.check = _check(s, ctx, hctx, p, d, verdict, out, early)
        wait_s = s.head_budget(req, d, s.cfg.timeouts.handoff_s)
        try:
            with ctx.wheel.after(wait_s, ctx.task):
                hdrs = ctx.headers if d.authorization is None else engine_headers(d, ctx.headers)
                dleg.resp = await d.pool.request("POST", req.path, hdrs, dbody)
        except TimeoutError:
            raise UpstreamTimeout(
                f"decode {d.id} sent no response headers within {wait_s:g}s",
                phase="handoff",
                worker=d.id,
                public=f"the decode sent no response headers within {wait_s:g}s",
            ) from None
        except (UpstreamConnectError, UpstreamProtocolError) as e:
            failure = leg_failure(e, f"decode {d.id}", "decode", d.id)
            if isinstance(e, UpstreamConnectError) and type(failure) is UpstreamFailure:
                failure = DecodeUnreached(failure.detail, phase="decode", worker=d.id)
            raise failure from None
        s.metrics.phase_handoff.observe(time.monotonic() - ctx.attempt.prefill_done_at)
        await relay(s, ctx, dleg.resp, d, phase="decode", check=h.check)
        dleg.complete()


def _check(
    s: Services,
    ctx: RequestContext,
    hctx: HandoffCtx,
    p: Worker,
    d: Worker,
    verdict: PrefillVerdict,
    out: bytes,
    early: asyncio.Task[bytes | None] | None = None,
) -> DecodeCheck | None:
    """The decode's consistency check. A prefill that ended on its first token (EOS or a stop id)
    hands over no KV: the decode computes the prompt itself, with the client's whole request, and
    nothing was handed over for a check."""
    if verdict.kv_params is None:
        log.info("request.prefill_stopped", request_id=hctx.request_id, prefill=p.id, decode=d.id)
        if early is not None:
            early.cancel()  # nothing was handed over to verify
        return None
    check = decode_check(s, hctx, ctx.req, p.adapter, out, ctx.view, early, drawn=True)
    if check is None and early is not None:
        early.cancel()
    if check is not None:
        if not verdict.same_first_token:
            check.prefill.first_token_id = None  # its token is no measure of the decode's
            check.prefill.first_text = None
        check.prefill.ties = verdict.ties
    return check


def _move_decode(
    s: Services, ctx: RequestContext, p: Worker, d: Worker, tried: set[str], e: DecodeUnreached
) -> Worker:
    """Another decode for the prefill's KV, when the request never reached `d`; raises `e` when
    there is none (or the response has started, or the client left, or enough were tried)."""
    if ctx.responded or ctx.closed or len(tried) >= s.cfg.retries.max_attempts:
        raise e
    plan = other_decode(s, ctx.view, ctx.req, p, tried)
    if plan is None:
        raise e
    s.policy.observe(Failed(ctx.request_id, (p.id, d.id), e.phase, legs=tuple(ctx.attempt.legs)))
    s.metrics.child(s.metrics.upstream_errors, d.id, e.phase, e.code.value).inc()
    s.metrics.child(s.metrics.fallbacks, "other_decode").inc()
    log.info(
        "request.decode_moved",
        request_id=ctx.request_id,
        prefill=p.id,
        decode=d.id,
        to=plan.decode.id,
        error=e.detail,
    )
    a = ctx.attempt
    a.moved_from = [*(a.moved_from or ()), d.id]
    d = s.registry.get(plan.decode.id)
    tried.add(d.id)
    a.decode = d.id
    ctx.planned = (p.id, d.id)
    s.policy.observe(routed_event(ctx.view, plan))
    return d
