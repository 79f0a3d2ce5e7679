"""The concurrent shape (SGLang): prefill and decode start together; the decode's bytes are held
until the prefill's verdict is in (its response arrives once the KV has been shipped), or, for a
stream with `guards.prefill_verdict = "before_end"`, only the stream's end is (gate.py).

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
from gateway.orchestration.gate import PrefillGate
from gateway.orchestration.legs import Handoff, Leg
from gateway.orchestration.relay import relay
from gateway.orchestration.services import Services, engine_headers
from gateway.orchestration.shadow import decode_check, start_early
from gateway.orchestration.verify import DecodeCheck
from gateway.registry import Worker

# Enum members as module constants on the request path: on Python 3.11 a class attribute of an
# Enum goes through EnumType.__getattr__'s slot hook, unspecialised; a global does not
# (gateway/breaker.py)
_PREFILL, _DECODE, _CONCURRENT = Role.PREFILL, Role.DECODE, LegShape.CONCURRENT
_HANDOFF = Phase.HANDOFF

# How long a refused SGLang prefill waits for its decode's answer to the same body: a decode
# that refuses it too (within this) makes it the request's fault, not a guard's catch.
_AGREEMENT_S = 0.25


async def run_concurrent(s: Services, ctx: RequestContext, p: Worker, d: Worker, hctx: HandoffCtx) -> None:
    req = ctx.req
    pbody, dbody = d.adapter.handoff_bodies(req, hctx)
    # the prefill counts as in flight until its answer is in, not until the decode's end
    pleg = Leg(s, ctx, p, ctx.view.prompt_tokens, _PREFILL, _CONCURRENT)
    dleg = Leg(s, ctx, d, ctx.view.prompt_tokens + ctx.view.max_tokens, _DECODE, _CONCURRENT)  # ctx.tokens
    async with Handoff(s, ctx, pleg, dleg, concurrent=True) as h:
        # Futures, not Tasks: on pooled connections both requests are written right here and
        # resolved from the connections' callbacks.
        # never re-sent by the pool: each leg names a bootstrap room, used once (a copy of a leg
        # the engine already took would wait for KV that never comes); a retry gets a new room
        headers = ctx.headers
        # (a worker without its own API key, the usual case, is sent them as they are)
        ph = headers if p.authorization is None else engine_headers(p, headers)
        dh = headers if d.authorization is None else engine_headers(d, headers)
        pleg.call = p.pool.fetch("POST", req.path, ph, pbody, replay=False)
        dleg.call = d.pool.start("POST", req.path, dh, dbody, replay=False)
        # a sampled verification re-run starts with the legs (shadow.start_early), not at the
        # prefill's verdict; whatever way the attempt ends, it is not left running
        early = start_early(s, req, ctx.view, hctx)
        try:
            if req.stream and s.cfg.guards.prefill_verdict == "before_end":
                gate = await _decode_first(s, ctx, h, hctx, early)
                if gate is not None:
                    assert dleg.resp is not None
                    await relay(s, ctx, dleg.resp, d, phase="decode", gate=gate)
                    dleg.complete()
                    return
            prefill_out = await _through_handoff(s, ctx, h, hctx, early)
            s.metrics.phase_handoff.observe(time.monotonic() - ctx.attempt.prefill_done_at)
            assert dleg.resp is not None
            transform = d.adapter.decode_transformer(req, prefill_out)
            await relay(s, ctx, dleg.resp, d, phase="decode", transform=transform, check=h.check)
            dleg.complete()
        finally:
            if early is not None:
                early.cancel()


async def _through_handoff(
    s: Services, ctx: RequestContext, h: Handoff, hctx: HandoffCtx, early: asyncio.Task[bytes | None] | None
) -> bytes:
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
            _observe_hold(s, dleg.call)
            if not verdict.ok:
                await _refused(s, h, hctx, status, verdict)
            pleg.complete()
            in_handoff = True
            a.phase = _HANDOFF
            h.check = decode_check(s, hctx, ctx.req, p.adapter, out, ctx.view, early, drawn=True)
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
            raise _no_verdict(s, p, d) from None
        raise UpstreamTimeout(
            f"decode {d.id} sent no response headers within {wait_s:g}s of the prefill's verdict",
            phase="handoff",
            worker=d.id,
            public=f"the decode sent no response headers within {wait_s:g}s of the prefill's verdict",
        ) from None
    return out


def _observe_hold(s: Services, decode_call: asyncio.Future[UpstreamResponse] | None) -> None:
    """The prefill's verdict is in: how long the decode's first bytes waited for it."""
    waited = 0.0
    if decode_call is not None and decode_call.done() and not decode_call.cancelled():
        if decode_call.exception() is None:
            at = decode_call.result().first_data_at
            if at:
                # (the future's loop: asyncio.get_running_loop() costs a getpid() on Python 3.11)
                waited = max(0.0, decode_call.get_loop().time() - at)
    s.metrics.hold_first_byte.observe(waited)


async def _decode_first(
    s: Services, ctx: RequestContext, h: Handoff, hctx: HandoffCtx, early: asyncio.Task[bytes | None] | None
) -> PrefillGate | None:
    """`prefill_verdict = "before_end"`: the decode's response headers, awaited beside the
    prefill's answer. A gate (`dleg.resp` set) when the decode answered 200 first: its stream is
    relayed at once and the verdict judged before its end. None when the prefill answered first,
    the decode failed or refused, or its bytes are rewritten with the prefill's answer (SGLang's
    logprob merge): the held path (`_through_handoff`) takes it from there."""
    pleg, dleg = h.prefill, h.decode
    p, d = pleg.worker, dleg.worker
    pcall, dcall = pleg.call, dleg.call
    assert pcall is not None and dcall is not None
    if d.adapter.decode_transformer(ctx.req, b"") is not None:
        return None
    t0 = time.monotonic()
    try:
        with ctx.wheel.after(s.cfg.timeouts.prefill_s, ctx.task):
            await asyncio.wait((pcall, dcall), return_when=asyncio.FIRST_COMPLETED)
    except TimeoutError:
        raise _no_verdict(s, p, d) from None
    if pcall.done() or dcall.cancelled() or dcall.exception() is not None or dcall.result().status != 200:
        return None
    dleg.resp = dcall.result()
    req = ctx.req

    def sound(status: int, body: bytes) -> bool:
        return p.adapter.judge_prefill(req, hctx, status, body).ok

    async def settle(gate: PrefillGate) -> DecodeCheck | None:
        return await _settle(s, ctx, h, hctx, gate, t0, early)

    keep = s.cfg.guards.decode_consistency and req.verifiable
    return PrefillGate(pcall, settle, sound, hctx.stream_usage, keep)


async def _settle(
    s: Services,
    ctx: RequestContext,
    h: Handoff,
    hctx: HandoffCtx,
    gate: PrefillGate,
    t0: float,
    early: asyncio.Task[bytes | None] | None = None,
) -> DecodeCheck | None:
    """The prefill's verdict on a stream already relayed: awaited (within what is left of
    `prefill_s`) and judged; a bad one raises the handoff's error. Returns the decode check."""
    pleg, dleg = h.prefill, h.decode
    p, d = pleg.worker, dleg.worker
    assert pleg.call is not None
    held = not gate.stopped and not pleg.call.done()  # the stream's end waits for the verdict
    since = time.monotonic()
    left = max(0.0, t0 + s.cfg.timeouts.prefill_s - since)
    try:
        with ctx.wheel.after(left, ctx.task):
            status, out = await _await_prefill(pleg.call, dleg.call, p, d)
    except TimeoutError:
        raise _no_verdict(s, p, d) from None
    if not gate.stopped:
        s.metrics.hold_end.observe(time.monotonic() - since if held else 0.0)
    verdict = _judge(s, ctx, pleg, hctx, status, out, t0)
    if not verdict.ok:
        stage = "mid_stream" if ctx.res.started else "before_first_byte"
        await _refused(s, h, hctx, status, verdict, decode_refused=gate.decode_refused, stage=stage)
    pleg.complete()
    h.check = gate.check = decode_check(s, hctx, ctx.req, p.adapter, out, ctx.view, early, drawn=True)
    return h.check


def _no_verdict(s: Services, p: Worker, d: Worker) -> UpstreamTimeout:
    t = s.cfg.timeouts.prefill_s
    return UpstreamTimeout(
        f"prefill {p.id} gave no verdict within {t:g}s (an SGLang prefill answers once its KV "
        f"reached decode {d.id}: either may be the one stuck)",
        phase="prefill",
        worker=p.id,
        public=f"the prefill gave no verdict within {t:g}s",
    )


def _judge(
    s: Services, ctx: RequestContext, pleg: Leg, hctx: HandoffCtx, status: int, out: bytes, t0: float
) -> PrefillVerdict:
    """The prefill's answer is in: its leg no longer counts as in flight, and its adapter judges
    whether it is a sound basis for the decode."""
    pleg.free()
    a = ctx.attempt
    a.prefill_done_at = time.monotonic()
    s.metrics.phase_prefill.observe(a.prefill_done_at - t0)
    verdict = pleg.worker.adapter.judge_prefill(ctx.req, hctx, status, out)
    a.cached = reported(pleg.worker, verdict.cached, ctx.view.prompt_tokens)
    return verdict


async def _refused(
    s: Services,
    h: Handoff,
    hctx: HandoffCtx,
    status: int,
    verdict: PrefillVerdict,
    *,
    decode_refused: bool | None = None,
    stage: str = "before_first_byte",
) -> None:
    """Raise the error of a prefill answer that is no basis for the decode. The decode, sent the
    same body, is waiting for this KV: it is aborted on the way out. The guard's catch, unless
    the decode refused the request too (the request's fault; `decode_refused`: known already, as
    for a stream relayed before the verdict) or the prefill failed (5xx: an upstream error)."""
    p, d, decode_call = h.prefill.worker, h.decode.worker, h.decode.call
    assert decode_call is not None
    if decode_refused is None:
        took = status != 200 and status < 500 and not await _refused_too(d, decode_call, _AGREEMENT_S)
    else:
        took = status != 200 and status < 500 and not decode_refused
    if (status == 200 or took) and not verdict.handoff:
        s.guard_failed(
            Guard.PREFILL_VERDICT,
            stage,
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
