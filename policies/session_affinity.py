"""`session_affinity`: keep a conversation on the worker that holds its cache, within bounds.

The key is the request's `RequestView.session_key`: the first of the gateway's
`session_headers` the client sent (default `x-session-id`), else the body's `session_id`, else
OpenAI's `user`. Keys match exactly: "session-1" and "session-12" share nothing (no
text-prefix similarity of ids, which would glue unrelated conversations together).

For a request with a key, the candidates are ranked by rendezvous hashing (the highest
`hash(key, worker id)` first: a worker joining or leaving moves only the sessions it wins or
held) and the first one that passes both gates is chosen:

- **bounded load** (consistent hashing with bounded loads, Mirrokni, Thorup and Zadimoghaddam
  2018): a worker takes the request only while its requests in flight stay within
  `ceil(load_factor x (all in flight + 1) / candidates)`, so a hot session cannot pile onto one
  worker while the others idle;
- **SLO gate**: a worker whose predicted prefill queue (its in-flight prompt and output tokens /
  `prefill_rate`, or the engine's waiting requests x `waiting_s` if more) is over `ttft_slo_s`
  is passed over: staying home would break the TTFT SLO.

A request without a key, or whose every candidate fails a gate, goes to the least loaded
(`least_load`'s score). The choice is pure: no state beyond the candidates' loads, so every
gateway replica sends a session to the same worker.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

from policies.base import Profile
from policies.least_load import LoadScorer, LoadWeights
from policies.snapshot import RequestView, WorkerState


def _rank(key: str, worker_id: str) -> int:
    h = hashlib.blake2b(b"%s\0%s" % (key.encode(), worker_id.encode()), digest_size=8)
    return int.from_bytes(h.digest(), "big")


class SessionAffinityPicker:
    name = "session_affinity"

    def __init__(
        self,
        load_factor: float = 1.25,
        ttft_slo_s: float = 2.0,
        prefill_rate: float = 10_000.0,
        waiting_s: float = 0.5,
    ) -> None:
        self.load_factor = load_factor
        self.ttft_slo_s = ttft_slo_s
        self.prefill_rate = prefill_rate
        self.waiting_s = waiting_s

    def home(self, req: RequestView, scored: Sequence[tuple[WorkerState, float]]) -> WorkerState | None:
        """The worker the session stays on, or None (no key, or every candidate over a gate)."""
        key = req.session_key
        if not key:
            return None
        total = sum(w.inflight for w, _ in scored)
        bound = math.ceil(self.load_factor * (total + 1) / len(scored))
        for w, _ in sorted(scored, key=lambda ws: _rank(key, ws[0].id), reverse=True):
            if w.inflight + 1 > bound:
                continue
            if self.queue_s(w) > self.ttft_slo_s:
                continue
            return w
        return None

    def queue_s(self, w: WorkerState) -> float:
        """The predicted wait before a new request's prefill starts on `w`."""
        by_tokens = w.inflight_tokens / self.prefill_rate
        by_waiting = w.load.waiting * self.waiting_s
        return by_tokens if by_tokens > by_waiting else by_waiting

    def pick(self, req: RequestView, scored: Sequence[tuple[WorkerState, float]]) -> WorkerState:
        home = self.home(req, scored)
        if home is not None:
            return home
        best, best_score = scored[0]
        for w, s in scored:
            if s > best_score:
                best, best_score = w, s
        return best


def session_affinity_profile(
    picker: SessionAffinityPicker | None = None,
    weights: LoadWeights | None = None,
    name: str = "session_affinity",
) -> Profile:
    return Profile(
        name=name,
        picker=picker if picker is not None else SessionAffinityPicker(),
        scorers=((LoadScorer(weights), 1.0),),
    )
