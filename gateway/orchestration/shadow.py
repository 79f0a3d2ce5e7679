"""Shadow verification (docs/guards.md, guard 4): a greedy answer re-run for a few tokens on a
colocated worker (else on a decode whose engine answers alone, without KV params) and compared.

A re-run is a whole prefill of the prompt on the worker it lands on, so it is placed and booked
like one: the policy picks among the candidates where it weighs re-runs (the cost-model decider:
the fewest running decodes pushed over their TPOT SLO, then the earliest answer), else the least
loaded; while it runs it counts in flight on its worker (`Registry.acquire`) and the policy's
decider books it as a local prefill there (`observe_rerun`: `Routed`, then one `Completed` or
`Failed` however it ends).

Two uses: before delivery (`decode_check` starts the run beside the decode for a suspect pair
or a sampled share; the relay holds the answer's end until `verified` says it agrees), and after
delivery (`maybe_shadow`, sampled: a mismatch opens the pair's breaker and makes it suspect).
The re-run's body and the answers' text are read by the adapter, which owns the wire format.
"""

from __future__ import annotations

import asyncio
import hashlib

import msgspec

from adapters import EngineAdapter, HandoffCtx
from common.request import ParsedRequest
from common.summary import Summary
from common.workers import Role, RouteKind, WorkerState
from gateway.breaker import BreakerState
from gateway.guards import Guard
from gateway.http.errors import UpstreamConnectError, UpstreamProtocolError
from gateway.logging import get_logger
from gateway.orchestration.services import Services, engine_headers
from gateway.orchestration.verify import DecodeCheck
from gateway.registry import Worker
from policies.base import Completed, Failed, routed_event
from policies.cost_model import RERUN_REASON
from policies.snapshot import Colocated, RequestView

# the request id a re-run is booked under (`<request id>-verify`)
RERUN_SUFFIX = "-verify"

log = get_logger("pd_gateway.request")


def decode_check(
    s: Services,
    ctx: HandoffCtx,
    req: ParsedRequest,
    prefill_adapter: EngineAdapter,
    prefill_body: bytes,
    view: RequestView | None = None,
    early: asyncio.Task[bytes | None] | None = None,
    drawn: bool = False,
) -> DecodeCheck | None:
    """The decode-consistency check for one handoff, or None where it does not apply. `early`:
    the sampled re-run started with the prefill (`start_early`), which the answer then waits
    for; `drawn`: the handoff's sampling draw was made then (`early` None: not picked)."""
    if not (req.single and s.cfg.guards.decode_consistency):  # the guard watches one answer
        return None
    c = DecodeCheck(
        ctx,
        prefill_adapter,
        req,
        prefill_adapter.summarize_prefill(req, prefill_body),
        ctx.decode.context_length,
        s.registry.suspect_epoch,
        view=view,
    )
    c.on_tie = lambda check, decode: _near_tie(s, check, decode)
    if not req.verifiable:
        return c
    if drawn:
        if early is not None and not early.cancelled() and not early.cancelling():
            c.verify = early
            return c
        # picked, and its re-run dropped with a moved decode's first handoff: again, now
        picked = early is not None
    else:
        # a sampled share is verified before delivery too (`shadow_before_delivery`, the
        # default); an unsampled request pays one countdown step here
        picked = s.sample_before_delivery and s.verify_share.due()
    suspects = s.registry.suspect_pairs()  # a shared empty set while no pair is suspect
    suspect = suspects and f"{ctx.prefill.id}|{ctx.decode.id}" in suspects
    if suspect or picked:
        # verified before delivery: a colocated re-run of the first tokens starts now, beside
        # the decode, and the answer is released only if it agrees
        if not _verify_now(s, c, sampled=not suspect):
            s.metrics.child(s.metrics.shadow_runs, "before_delivery", "unavailable").inc()
            if suspect:
                log.info("verify.unavailable", request_id=ctx.request_id, reason="no colocated worker")
    return c


def verify_late(s: Services, c: DecodeCheck) -> None:
    """A whole answer is in, unverified, and some pair became suspect since its handoff
    started: if it was this answer's pair, a re-run starts now and the answer waits for it (the
    answers already on their way when a pair is caught are not delivered unverified)."""
    c.epoch = s.registry.suspect_epoch
    if not c.req.verifiable or f"{c.ctx.prefill.id}|{c.ctx.decode.id}" not in s.registry.suspect_pairs():
        return
    _verify_now(s, c)


def start_early(
    s: Services, req: ParsedRequest, view: RequestView, hctx: HandoffCtx
) -> asyncio.Task[bytes | None] | None:
    """The sampled re-run of a handoff, started with its legs (vLLM: with the prefill, before
    the decode; SGLang: beside both) instead of at the prefill's verdict: it then runs while the
    prefill does, and the answer's held end rarely waits for it (started at the verdict, a
    re-run of a long prompt ended long after a short answer, whose time per token it made).
    None where the request is not sampled (or not verifiable), or no worker can run it. The
    caller cancels it where the attempt ends before its decode check takes it
    (`decode_check`'s `early`)."""
    if (
        not (req.verifiable and s.sample_before_delivery and s.cfg.guards.decode_consistency)
        or not s.verify_share.due()
    ):
        return None
    w = _pick(s, req, view, hctx.decode, sampled=True)
    if w is None:
        s.metrics.child(s.metrics.shadow_runs, "before_delivery", "unavailable").inc()
        return None
    return asyncio.create_task(_rerun(s, req, view, hctx.request_id, w))


def _verify_now(s: Services, c: DecodeCheck, sampled: bool = False) -> bool:
    """Start the re-run `c`'s answer waits for before delivery; False where no worker can run it."""
    worker = shadow_worker(s, c, sampled)
    if worker is None:
        return False
    c.verify = asyncio.ensure_future(shadow_run(s, c, worker))
    return True


def _near_tie(s: Services, c: DecodeCheck, decode: Summary) -> None:
    """The decode started on another token than the prefill, one the prefill's logprobs put
    within the near-tie margin of its own: not a failure, but counted and logged."""
    s.metrics.child(s.metrics.near_ties).inc()
    log.info(
        "guard.near_tie",
        request_id=c.ctx.request_id,
        prefill=c.ctx.prefill.id,
        decode=c.ctx.decode.id,
        prefill_token=c.prefill.first_text,
        decode_start=(decode.first_text or "")[:16],
    )


def shadow_worker(s: Services, c: DecodeCheck, sampled: bool = False) -> Worker | None:
    """Where a shadow re-run of `c`'s answer goes (`_pick`)."""
    return _pick(s, c.req, c.view, c.ctx.decode, sampled)


def _pick(
    s: Services, req: ParsedRequest, view: RequestView | None, decode: WorkerState, sampled: bool = False
) -> Worker | None:
    """Where a shadow re-run goes: a colocated worker of the model, else a decode of the
    model whose engine's decode answers alone (without KV params; the handoff's `decode` among
    them). A sampled re-run (not one for a suspect pair) goes to no worker at its in-flight cap.
    Among them, the policy's choice where it places re-runs, else the least loaded."""
    snap = s.registry.snapshot()
    model = req.model
    targets: tuple[WorkerState, ...] = snap.pool(Role.COLOCATED, model)
    if not targets and decode.decode_alone:
        targets = tuple(
            w for w in snap.pool(Role.DECODE, model) if w.decode_alone and w.engine is decode.engine
        ) or (decode,)
    if sampled and targets:
        full = s.registry.full()
        if full:
            targets = tuple(t for t in targets if t.id not in full)
    if not targets:
        return None
    pick: WorkerState | None = None
    if s.reruns is not None and view is not None and len(targets) > 1:
        pick = s.reruns.place_rerun(_rerun_view(s, view), targets)
    if pick is None:
        least = min(w.inflight for w in targets)
        pick = s.rng.choice([w for w in targets if w.inflight == least])
    return s.registry.find(pick.id)


def _rerun_view(s: Services, view: RequestView) -> RequestView:
    """The re-run as routing sees it: the request's prompt, `shadow_tokens` tokens."""
    return msgspec.structs.replace(
        view, request_id=view.request_id + RERUN_SUFFIX, max_tokens=s.cfg.guards.shadow_tokens, stream=False
    )


async def verified(s: Services, c: DecodeCheck, body: bytes, stream: bool = False) -> str | None:
    """Why the answer (a whole body, or a stream's bytes) disagrees with its verification
    run, or None (it agrees, or there is no verdict)."""
    assert c.verify is not None
    out = await c.verify
    c.verify = None
    got = c.adapter.answer_text(c.req, body, stream=stream)
    want = _disagrees(s, c, "before_delivery", got, out)
    if want is None or got is None:
        return None
    log.warning(
        "verify.mismatch",
        request_id=c.ctx.request_id,
        delivered_sha1=_sha1(got),
        shadow_sha1=_sha1(want),
    )
    return "the answer differs from a colocated re-run of its first tokens"


def maybe_shadow(s: Services, c: DecodeCheck, delivered: bytes) -> None:
    """Shadow verification after delivery: re-run a sampled share of greedy answers and compare
    their first tokens (in the background)."""
    req = c.req
    if not s.sample_after_delivery or not req.greedy or req.route is RouteKind.GENERATE or c.tied:
        return
    if not s.verify_share.due():
        return
    worker = shadow_worker(s, c)
    if worker is None:
        return
    s.spawn(_after_delivery(s, c, worker, delivered))


async def shadow_run(s: Services, c: DecodeCheck, w: Worker) -> bytes | None:
    """The first `shadow_tokens` tokens of `c`'s request on `w` (`_rerun`)."""
    return await _rerun(s, c.req, c.view, c.ctx.request_id, w)


async def _rerun(
    s: Services, req: ParsedRequest, rview: RequestView | None, request_id: str, w: Worker
) -> bytes | None:
    """The request's first `shadow_tokens` tokens, greedy, on `w` alone; None if it failed.
    Counted in flight on `w` and booked with the policy while it runs (module docstring)."""
    body = w.adapter.shadow_body(req, s.cfg.guards.shadow_tokens)
    headers = [
        (b"content-type", b"application/json"),
        (b"x-request-id", f"{request_id}-shadow".encode()),
    ]
    view = None if rview is None else _rerun_view(s, rview)
    tokens = 0 if view is None else view.prompt_tokens + view.max_tokens
    book = s.reruns.observe_rerun if s.reruns is not None and view is not None else None
    # counted in flight on its worker; not on one whose breaker is not closed (a half-open
    # worker's one trial is a request's, whose outcome the breaker waits for)
    counted = w.breaker.state is BreakerState.CLOSED
    if counted:
        s.registry.acquire(w, tokens)
    out: bytes | None = None
    try:
        if book is not None:
            assert view is not None
            book(routed_event(view, Colocated(w.state(), reason=RERUN_REASON)))
        try:
            async with asyncio.timeout(s.cfg.timeouts.prefill_s):
                status, out = await w.pool.fetch("POST", req.path, engine_headers(w, headers), body)
        except (TimeoutError, UpstreamConnectError, UpstreamProtocolError) as e:
            log.info("shadow.skipped", request_id=request_id, worker=w.id, error=str(e))
            return None
        if status != 200:
            log.info("shadow.skipped", request_id=request_id, worker=w.id, error=f"HTTP {status}")
            out = None
        return out
    finally:
        if counted:
            s.registry.release(w, tokens)
        if book is not None:
            assert view is not None
            if out is not None:
                book(Completed(view.request_id, (w.id,), output_tokens=view.max_tokens))
            else:
                book(Failed(view.request_id, (w.id,), phase="verify"))


def texts_agree(got: str, want: str) -> bool:
    """Does an answer's text agree with a shadow re-run's? One is a prefix of the other (the
    shadow generates a few tokens, the answer as many as it asked for). A trailing U+FFFD is
    left out: a finished SGLang answer whose last token ends inside a character shows that
    character's bytes so far as U+FFFD (its detokenizer holds them back only while unfinished),
    which the shadow's few tokens often do where the answer goes on with the whole character."""
    want, got = want.rstrip("\ufffd"), got.rstrip("\ufffd")
    return got.startswith(want) or want.startswith(got)


def _disagrees(
    s: Services, c: DecodeCheck, when: str, got: str | None, shadow_body: bytes | None
) -> str | None:
    """The shadow's text when it contradicts the delivered text `got`, else None; counted in
    `pdgw_shadow_runs_total{when,outcome}`. One is a prefix of the other when they agree
    (the shadow generates `shadow_tokens`, the answer as many as it asked for)."""
    if shadow_body is None:
        s.metrics.child(s.metrics.shadow_runs, when, "failed").inc()
        return None  # the re-run failed: nothing to compare (logged there)
    want = c.adapter.answer_text(c.req, shadow_body, stream=False)
    if got is None or want is None or texts_agree(got, want):
        s.metrics.child(s.metrics.shadow_runs, when, "agreed").inc()
        return None
    s.metrics.child(s.metrics.shadow_runs, when, "differed").inc()
    return want


async def _after_delivery(s: Services, c: DecodeCheck, w: Worker, delivered: bytes) -> None:
    """After delivery: compare, and on a mismatch count it and take the pair out."""
    got = c.adapter.answer_text(c.req, delivered, stream=False)
    want = _disagrees(s, c, "after_delivery", got, await shadow_run(s, c, w))
    if want is None or got is None:
        return
    s.metrics.child(s.metrics.guard_failures, Guard.SHADOW.value, "after_delivery").inc()
    p, d = c.ctx.prefill.id, c.ctx.decode.id
    log.warning(
        "guard.failed",
        guard=Guard.SHADOW.value,
        stage="after_delivery",
        request_id=c.ctx.request_id,
        prefill=p,
        decode=d,
        shadow_worker=w.id,
        delivered_sha1=_sha1(got),
        shadow_sha1=_sha1(want),
        delivered_chars=len(got),
        shadow_chars=len(want),
    )
    s.registry.pair_breaker(p, d).force_open()
    s.registry.mark_suspect(f"{p}|{d}", s.cfg.guards.suspect_window_s)
    s.registry.changed()


def _sha1(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:12]
