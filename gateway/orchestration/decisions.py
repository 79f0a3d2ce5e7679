"""A request's decision record (policies/explain.py): logged at debug level, and returned in
an `x-pdgw-decision` header (compact JSON) to a client that asked with `x-pdgw-explain`
where `explain_header` is on. Only computed then: nothing on the usual request path."""

from __future__ import annotations

import json

import msgspec

from gateway.logging import get_logger
from gateway.orchestration.context import RequestContext
from gateway.orchestration.services import Services
from policies.explain import explain
from policies.snapshot import Colocated, Disaggregated

log = get_logger("pd_gateway.decision")

HEADER = b"x-pdgw-decision"


def explain_plan(s: Services, ctx: RequestContext, plan: Colocated | Disaggregated) -> None:
    """Record why `plan` chose its prefilling worker (before the policy observes the plan)."""
    excl = frozenset(ctx.exclude) | s.registry.full()
    rec = explain(s.policy, ctx.view, s.registry.snapshot(), plan, excl)
    ctx.extra = ()  # (an earlier attempt's record does not describe this one)
    if rec is None:
        return
    data = msgspec.to_builtins(rec)
    for row in data["candidates"]:
        for k in ("backlog_tokens", "rate", "ttft_s", "cost"):
            row[k] = round(row[k], 6)
    data["scores"] = {name: {w: round(v, 6) for w, v in sc.items()} for name, sc in data["scores"].items()}
    log.debug("route.decision", request_id=ctx.request_id, attempt=ctx.attempt_no, **data)
    if ctx.explain:
        # ASCII only (worker ids may not be): a header value
        ctx.extra = ((HEADER, json.dumps(data, separators=(",", ":"), ensure_ascii=True).encode()),)
