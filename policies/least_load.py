"""`least_load`: each role picks the worker with the lowest weighted load.

Load of a worker (all terms from the frozen snapshot):

    load = (inflight_weight * inflight            # requests the gateway has in flight on it
            + inflight_tokens_weight * inflight_tokens   # their prompt + max tokens
            + waiting_weight * load.waiting       # engine-reported queue (scraped /metrics)
            + running_weight * load.running)      # engine-reported running requests
           / weight                               # the worker's configured capacity weight

`LoadScorer` maps it onto [0, 1] relative to the candidates: `1 - load / max_load` (all 1.0
when every load is 0). `MaxScorePicker` takes the highest score; ties go to the first candidate
in snapshot order, so the choice is deterministic.

Parameters (`LoadWeights`): `inflight_weight` 1.0, `inflight_tokens_weight` 0.001 (a thousand
tokens weigh as much as one request), `waiting_weight` 2.0 (a queued request is worse than a
running one), `running_weight` 0.5 (the engine's running count overlaps the gateway's own).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from policies.base import Profile
from policies.pd import PDPolicy
from policies.snapshot import RequestView, WorkerState


@dataclass(frozen=True, slots=True)
class LoadWeights:
    inflight_weight: float = 1.0
    inflight_tokens_weight: float = 0.001
    waiting_weight: float = 2.0
    running_weight: float = 0.5


def load_of(w: WorkerState, weights: LoadWeights) -> float:
    """The weighted load of one worker (see the module docstring)."""
    raw = (
        weights.inflight_weight * w.inflight
        + weights.inflight_tokens_weight * w.inflight_tokens
        + weights.waiting_weight * w.load.waiting
        + weights.running_weight * w.load.running
    )
    return raw / max(w.weight, 1e-9)


class LoadScorer:
    name = "load"

    def __init__(self, weights: LoadWeights | None = None) -> None:
        self.weights = weights if weights is not None else LoadWeights()

    def score(self, req: RequestView, cands: Sequence[WorkerState]) -> Mapping[str, float]:
        loads = {w.id: load_of(w, self.weights) for w in cands}
        top = max(loads.values(), default=0.0)
        if top <= 0.0:
            return dict.fromkeys(loads, 1.0)
        return {wid: 1.0 - load / top for wid, load in loads.items()}


class MaxScorePicker:
    name = "max_score"

    def pick(self, req: RequestView, scored: Sequence[tuple[WorkerState, float]]) -> WorkerState:
        best, best_score = scored[0]
        for w, s in scored[1:]:
            if s > best_score:
                best, best_score = w, s
        return best


def least_load_profile(weights: LoadWeights | None = None, name: str = "least_load") -> Profile:
    return Profile(name=name, picker=MaxScorePicker(), scorers=((LoadScorer(weights), 1.0),))


def make_policy(weights: LoadWeights | None = None) -> PDPolicy:
    """A whole least-load policy."""
    return PDPolicy(
        "least_load",
        decode=least_load_profile(weights),
        prefill=least_load_profile(weights),
        colocated=least_load_profile(weights),
    )
