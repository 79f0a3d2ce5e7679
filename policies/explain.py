"""Why a plan chose the worker that prefills: its `DecisionRecord`, for debugging (the gateway's
opt-in `x-pdgw-decision` response header).

Computed after the plan, from the same state the choice was made on (nothing is observed in
between): the pool the prefilling role chose from (the plan's model, usable workers, what the
request excluded; in P/D the prefill workers of the decode's engine), each candidate's
predicted cached tokens, TTFT and cost, its score, and the reason the chosen one won. Only a
role chosen by `cache_aware` keeps such figures; for others there is no record (None).

The reason: `min_ttft` (the best score), `balance_gate` (sglang-router's balance rule took the
least loaded instead), `all_saturated` (every candidate was saturated), `other` (none of these:
a larger pool sampled without the chosen worker's rivals).
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import Policy, pair_id
from policies.cache_aware import CacheState, DecisionRecord, ttft_scores
from policies.snapshot import ClusterSnapshot, Colocated, Disaggregated, RequestView, Role, WorkerState


def explain(
    policy: Policy,
    req: RequestView,
    snap: ClusterSnapshot,
    plan: Colocated | Disaggregated,
    exclude: frozenset[str] = frozenset(),
) -> DecisionRecord | None:
    """The record of `plan`'s prefilling choice; None where that role keeps no figures."""
    if isinstance(plan, Disaggregated):
        role, chosen = "prefill", plan.prefill
        engine = plan.decode.engine
        pool = [
            w
            for w in _usable(snap, req.model, Role.PREFILL, exclude)
            if w.engine is engine and pair_id(w.id, plan.decode.id) not in exclude
        ]
    else:
        chosen = plan.worker
        if chosen.role is not Role.COLOCATED:
            return None  # a decode prefilling itself: chosen on load alone
        role, pool = "colocated", _usable(snap, req.model, Role.COLOCATED, exclude)
    selector = getattr(policy, role, None)
    state = getattr(selector, "state", None)
    if not isinstance(state, CacheState) or not pool:
        return None
    return record(state, f"{getattr(selector, 'name', role)}", req, pool, chosen)


def record(
    state: CacheState, role: str, req: RequestView, pool: Sequence[WorkerState], chosen: WorkerState
) -> DecisionRecord:
    est = state.estimates(req, pool)
    ok = [e for e in est if not e.saturated]
    all_saturated = not ok
    scores = ttft_scores(ok or est)
    by_id = {e.worker: e for e in est}
    mine = by_id.get(chosen.id)
    if all_saturated:
        reason = "all_saturated"
    elif mine is not None and scores.get(chosen.id, 0.0) >= 1.0 - 1e-9:
        reason = "min_ttft"
    elif mine is not None and chosen.inflight == min(e.inflight for e in ok):
        reason = "balance_gate"
    else:
        reason = "other"
    key = req.prompt_key
    return DecisionRecord(
        role=role,
        prompt_tokens=req.prompt_tokens,
        keyed=None if key is None else key.kind,
        candidates=tuple(sorted(est, key=lambda e: e.cost)),
        scores={"predicted_ttft": scores},
        chosen=chosen.id,
        reason=reason,
    )


def _usable(snap: ClusterSnapshot, model: str, role: Role, exclude: frozenset[str]) -> list[WorkerState]:
    return [
        w
        for w in snap.workers
        if w.role is role
        and (w.model is None or w.model == model)
        and w.healthy
        and not w.draining
        and w.id not in exclude
    ]


__all__ = ["explain", "record"]
