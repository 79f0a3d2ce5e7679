"""`cache_aware`'s cold-prompt placement (`cold_slack_s`): where a prompt that matches nowhere goes.

A prompt no candidate is predicted to hold (no match above `cache_threshold`) saves no prefill
anywhere, but its KV evicts what the chosen worker holds. sglang-router sends such a prompt to
the worker with the smallest tree (the one sent the least new text), which evens out eviction
pressure; the cost alone sends it to the least waiting worker. With `cold_slack_s > 0`, of the
candidates whose cost is within `cold_slack_s` seconds of the cheapest (unsaturated ones while
any is), the one with the least

    turned(w) = written(w) / pool(w)

is chosen, `written(w)` the new KV tokens (uncached prompt plus, colocated, `max_tokens`) sent
to `w` over `cold_window_s`, exponentially decayed (policies/turnover.py), `pool(w)` its KV pool
in tokens (reported, else `worker_cache_tokens`; unknown: 1, raw tokens); ties to the cheaper.
The slack bounds what the placement may cost the request; the balance rule is not applied to
it (the cheapest's in-flight count is within the slack's reach). Matched prompts are untouched.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from policies.cache_state import CacheState, Estimate
from policies.snapshot import WorkerState


def cold_pick(state: CacheState, rows: Sequence[tuple[float, WorkerState]], now: float) -> WorkerState:
    """Of (cost, worker) rows (not empty), the least turned over within the slack of the cheapest."""
    top = min(c for c, _ in rows) + state.settings.cold_slack_s
    turnover = state.cold_turnover
    factor = turnover.factor(now)
    written = turnover.scaled
    chosen, low, low_cost = rows[0][1], math.inf, math.inf
    for cost, w in rows:
        if cost > top:
            continue
        turned = written.get(w.id, 0.0) * factor / (state.capacity(w) or 1)
        if turned < low or (turned == low and cost < low_cost):
            chosen, low, low_cost = w, turned, cost
    return chosen


def cold_choice(
    state: CacheState,
    prompt_tokens: int,
    pairs: Sequence[tuple[WorkerState, Estimate]],
    ok: Sequence[tuple[WorkerState, Estimate]],
) -> WorkerState | None:
    """The recorded path's placement: None unless on and no candidate of `pairs` (all of them)
    holds a match above the threshold; else `cold_pick` of `ok` (the candidates left after the
    saturation and SLO filters)."""
    s = state.settings
    if s.cold_slack_s <= 0.0:
        return None
    threshold = s.cache_threshold * max(1, prompt_tokens)
    if any(e.cached_tokens > threshold for _, e in pairs):
        return None
    return cold_pick(state, [(e.cost, w) for w, e in ok], state.clock())
