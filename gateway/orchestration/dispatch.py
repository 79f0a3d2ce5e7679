"""Run one attempt's plan: the checks before any leg is sent, then the handoff shape the plan and
the decode's adapter call for.

    Reject          -> the error that says why (checks.rejected)
    Colocated       -> colocated.run_colocated
    Disaggregated   -> the decode's adapter decides:
        cannot split this request (supports_pd false) -> the decode serves it alone (colocated)
        n > 1 or a batch, splits_samples             -> split.run_split (one handoff per unit)
        HandoffMode.CONCURRENT (SGLang)              -> concurrent.run_concurrent
        HandoffMode.SEQUENTIAL (vLLM)                -> sequential.run_sequential
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

from adapters import HandoffCtx, HandoffMode
from common.errors import NoWorker
from gateway.ids import new_room
from gateway.orchestration.checks import check_fits, rejected
from gateway.orchestration.colocated import run_colocated
from gateway.orchestration.concurrent import run_concurrent
from gateway.orchestration.context import Phase, RequestContext
from gateway.orchestration.sequential import run_sequential
from gateway.orchestration.services import Services
from gateway.orchestration.split import run_split
from gateway.registry import Worker
from policies.snapshot import Colocated, Disaggregated, Reject

# Enum members as module constants on the request path: on Python 3.11 a class attribute of an
# Enum goes through EnumType.__getattr__'s slot hook, unspecialised; a global does not
# (gateway/breaker.py)
_PREFILL_PHASE = Phase.PREFILL
_CONCURRENT, _SEQUENTIAL = HandoffMode.CONCURRENT, HandoffMode.SEQUENTIAL


def execute(
    s: Services, ctx: RequestContext, plan: Colocated | Disaggregated | Reject
) -> Coroutine[Any, Any, None]:
    """The coroutine that runs `plan` (to be awaited: the checks and the choice of shape are
    made here, before any leg is sent; a plain function, one frame less per request)."""
    if isinstance(plan, Reject):
        raise rejected(s, ctx.req, plan)
    if isinstance(plan, Colocated):
        check_fits(s, ctx.req, ctx.request_id, (plan.worker,))
        w = s.registry.get(plan.worker.id)
        a = ctx.attempt
        a.plan_kind, a.decode = "colocated", w.id
        return run_colocated(s, ctx, w)
    check_fits(s, ctx.req, ctx.request_id, (plan.prefill, plan.decode))
    return _disaggregated(s, ctx, plan, s.registry.get(plan.prefill.id), s.registry.get(plan.decode.id))


def _disaggregated(
    s: Services, ctx: RequestContext, plan: Disaggregated, p: Worker, d: Worker
) -> Coroutine[Any, Any, None]:
    """The shape that runs a P/D plan."""
    req, a = ctx.req, ctx.attempt
    if not d.adapter.supports_pd(req):
        # e.g. a vLLM batch: the decode worker (kv_both) serves it alone, correctly
        a.plan_kind, a.decode = "decode_self_prefill", d.id
        s.metrics.child(s.metrics.fallbacks, "decode_self_prefill").inc()
        return run_colocated(s, ctx, d)
    a.plan_kind, a.prefill, a.decode = "disaggregated", p.id, d.id
    a.phase = _PREFILL_PHASE
    if (req.n > 1 or req.is_batch) and d.adapter.splits_samples:
        return run_split(s, ctx, p, d, plan)
    g = s.cfg.guards
    hctx = HandoffCtx(
        request_id=ctx.request_id,
        prefill=plan.prefill,
        decode=plan.decode,
        room=new_room(s.rng),
        # (the decode-consistency guard's: `ParsedRequest.single`, `usage_unasked`)
        stream_usage=req.usage_unasked and g.decode_consistency,
        near_ties=g.near_tie_alternatives
        if req.greedy and p.near_ties and g.decode_consistency and req.single
        else 0,
        near_tie_margin=g.near_tie_margin,
    )
    if d.adapter.handoff is _CONCURRENT:
        return run_concurrent(s, ctx, p, d, hctx)
    if d.adapter.handoff is _SEQUENTIAL:
        return run_sequential(s, ctx, p, d, hctx)
    raise NoWorker(f"engine {d.engine.value} has no P/D protocol")
