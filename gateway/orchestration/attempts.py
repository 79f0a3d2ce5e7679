"""Attempts: planning with what failed left out, the fallback ladder, and the backoff between tries.

After a failure before the first byte reached the client, the request is planned again with the
failed worker or pair excluded (`blame.exclusions`); the plan that comes back is a rung of the
ladder (`rung`: another pair, a colocated worker, a decode prefilling itself), tried only where
the configured ladder has it; with none left the request is shed (503 + Retry-After naming the
failure) or fails with its last error (`out_of_rungs`).
"""

from __future__ import annotations

import random

from common.errors import GatewayError, NoWorker, UpstreamFailure
from common.request import ParsedRequest
from common.workers import Role
from gateway.config import RetriesConfig
from gateway.orchestration.checks import fits_quietly
from gateway.orchestration.services import Services
from gateway.registry import Worker
from policies.snapshot import Colocated, Disaggregated, Reject, RequestView

Plan = Colocated | Disaggregated | Reject


def backoff_s(attempt: int, r: RetriesConfig, rng: random.Random) -> float:
    """Delay before attempt `attempt + 1` (attempt counts from 1): exponential with jitter."""
    base = min(r.backoff_max_s, r.backoff_initial_s * r.multiplier ** (attempt - 1))
    return max(0.0, base * (1.0 + r.jitter * (2.0 * rng.random() - 1.0)))


def rung(plan: Plan) -> str | None:
    """Which fallback rung a plan made after a failure is."""
    if isinstance(plan, Disaggregated):
        return "other_pair"
    if isinstance(plan, Colocated):
        return "decode_self_prefill" if plan.worker.role is Role.DECODE else "colocated"
    return None


def out_of_rungs(s: Services, last: UpstreamFailure) -> GatewayError:
    """No rung left: shed with 503 + Retry-After naming what failed, or the failure itself
    (or what it says the client should be told instead)."""
    if last.instead is not None:
        return last.instead
    if "shed" not in s.cfg.fallback.ladder:
        return last
    s.metrics.child(s.metrics.fallbacks, "shed").inc()
    return NoWorker(
        f"{last.message}; no fallback left",
        code=last.code,
        retry_after_s=s.cfg.limits.retry_after_s,
        detail=f"{last.detail} (phase {last.phase}); no fallback left",
    )


def plan(s: Services, view: RequestView, req: ParsedRequest, failed: set[str]) -> Plan:
    """The policy's plan. Pairs under KV suspicion are avoided, while any other route exists,
    by requests whose answers cannot be verified (sampling, n > 1, batches) and by streams
    (whose tokens would flow before the verdict; a failed one ends in an error event, so a
    colocated answer is better)."""
    registry = s.registry
    snap = registry.snapshot()
    excl = registry.exclusions(req.route, failed)
    if req.local_prefill is not None and req.local_prefill.all_engines:
        alone = registry.decodes_not_alone()
        if alone:
            excl = excl | alone
    suspects = registry.suspect_pairs()
    if suspects and (req.stream or not req.verifiable):
        p = s.policy.plan(view, snap, excl | suspects)
        if not isinstance(p, Reject) or p.status == 404:
            return p
    return s.policy.plan(view, snap, excl)


def other_decode(
    s: Services, view: RequestView, req: ParsedRequest, p: Worker, tried: set[str]
) -> Disaggregated | None:
    """Another decode for prefill `p`'s KV, chosen by the policy with every other prefill
    left out (the plan pairing them); None when it plans anything else (no such decode, or
    a colocated answer)."""
    if "other_pair" not in s.cfg.fallback.ladder:
        return None
    others = {w.id for w in s.registry.workers() if w.role is Role.PREFILL and w.id != p.id}
    got = plan(s, view, req, tried | others)
    if not isinstance(got, Disaggregated) or got.prefill.id != p.id or got.decode.id in tried:
        return None
    if not fits_quietly(s, req, (got.prefill, got.decode)):  # the checks the first plan passed
        return None
    return got
