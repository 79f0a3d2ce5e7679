"""`cache_aware`: route to the worker with the lowest predicted time to first token.

For a request and each candidate worker `w` (the pool that prefills: prefill workers in P/D,
colocated workers, a vLLM decode prefilling itself):

    cached(w)   = prompt tokens w is predicted to hold: the precise index built from its
                  engine's KV events where that is live and verified, else the approximate
                  index of what the gateway sent it; 0 below `cache_threshold` of the prompt
                  (sglang-router's meaning: a match counts only when match / prompt exceeds it),
                  at most prompt - 1 (an engine always computes the last token)
    uncached(w) = prompt - cached(w)
    ttft(w)     = (backlog(w) + uncached(w)) / rate(w)       (policies/prefill_cost.py)
    cost(w)     = ttft(w) * (1 + inflight_factor * inflight(w))

and picks the lowest cost (score `min cost / cost(w)` in (0, 1]; ties: fewer requests in
flight, then at random). `inflight(w)` is the gateway's count of requests in flight on w (a
prefill worker's until its prefill answered); the factor is LMetric's multiplicative batch term
(`uncached x (in flight + 1)` at 1.0, no weights to tune): a worker already busy with many
requests needs a proportionally larger cache saving to take one more, which keeps a prefix
every request shares (a system prompt) from pulling all of them onto one worker. 0 leaves the
predicted TTFT alone. Affinity is never a reason to overload a worker:

- a worker whose queued prefill alone takes longer than `saturation_wait_s` is **saturated**:
  filtered out while any worker is not (`SaturationFilter`);
- sglang-router's balance rule on in-flight requests, per decision: when the chosen worker has
  more than `balance_abs_threshold` requests more than the least loaded candidate **and** more
  than `balance_rel_threshold` times as many, the least loaded one is taken instead
  (`BalanceGatePicker`).

In P/D the decode pool is chosen on load alone (`LoadScorer`, as `least_load`): its cache does
not save prefill work. The decider (`min_prefill_tokens`) is given the decode worker's
predicted cache, so a vLLM decode that already holds most of a prompt can prefill it itself.

Scale: a pool of at most `scan_limit` candidates is scored whole. A larger pool is narrowed
first to the workers holding the deepest matches (at most `max_candidates`, from the indexes'
top lists) plus `sample` workers drawn at random (the power of d choices for the load side), so
a decision costs O(max_candidates + sample) lookups whatever the pool size, plus one pass over
the pool to find the matched workers' current states.

State (`CacheState`, shared by the role selectors of one policy, mutated only in `observe`):
the approximate index, the prefill queues and rates, the requests in flight with their
predictions (so that an outcome can be compared with what was predicted), and the prediction
accuracy per worker and source.
"""

from __future__ import annotations

import random as _random
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from policies.approx_index import ApproxIndex
from policies.base import (
    EVENT_TYPES,
    Completed,
    Failed,
    Needs,
    NoCandidates,
    PolicyEvent,
    Routed,
    WorkerGone,
)
from policies.least_load import LoadScorer, LoadWeights
from policies.prefill_cost import PrefillQueues, RateSettings
from policies.prefix_source import EMPTY_LOOKUP, NO_LOOKUP, Lookup, PrefixSource
from policies.prompt_key import PromptKey
from policies.snapshot import RequestView, WorkerState


@dataclass(frozen=True, slots=True)
class CacheAwareSettings:
    """The knobs (`policies.config.CacheAwareCfg` documents each)."""

    cache_threshold: float = 0.0
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_s: float = 120.0
    max_tree_size: int = 1 << 24
    block_tokens: int = 16
    chars_per_token: float = 4.0
    worker_cache_tokens: int | None = None
    prefill_rate: float = 10_000.0
    inflight_factor: float = 1.0
    saturation_wait_s: float = 10.0
    max_candidates: int = 16
    scan_limit: int = 64
    sample: int = 4
    use_kv_events: bool = True
    max_pending: int = 100_000


# ---- predictions -------------------------------------------------------------------------------


class Estimate(msgspec.Struct, frozen=True, gc=False):
    """One candidate as the policy saw it (a row of a `DecisionRecord`)."""

    worker: str
    cached_tokens: int  # predicted, before `cache_threshold`
    source: str  # "kv_events", "approx" or "none"
    backlog_tokens: float
    rate: float  # tokens/s
    ttft_s: float  # predicted
    inflight: int
    cost: float  # ttft_s * (1 + inflight_factor * inflight)
    saturated: bool


class DecisionRecord(msgspec.Struct, frozen=True, gc=False):
    """A routing decision: the candidates with their predictions, the per-scorer scores, the
    choice and why (`min_ttft`, `balance_gate`, `all_saturated`, `load`)."""

    role: str
    prompt_tokens: int
    keyed: str | None  # "tokens", "text" or None (no prompt key)
    candidates: tuple[Estimate, ...]
    scores: dict[str, dict[str, float]]
    chosen: str
    reason: str


@dataclass(slots=True)
class _Pending:
    at: float  # when routed
    worker: str
    model: str
    predicted: int
    source: str
    work_tokens: float  # backlog + uncached at routing
    uncached: float
    capacity: int | None


# upper bounds of the hit-ratio buckets (reported cached tokens / prompt tokens)
HIT_RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)


class PredictionStats:
    """Predicted vs reported cached tokens, per (worker, source); with the prompt tokens of the
    same requests (the hit rate) and a histogram of each request's hit ratio."""

    __slots__ = ("_by",)

    def __init__(self) -> None:
        # [n, sum |err|, sum predicted, sum reported, sum prompt, sum ratio, bucket counts...]
        self._by: dict[tuple[str, str], list[float]] = {}

    def record(self, worker: str, source: str, predicted: int, reported: int, prompt: int = 0) -> None:
        row = self._by.get((worker, source))
        if row is None:
            row = self._by[(worker, source)] = [0.0] * (6 + len(HIT_RATIO_BUCKETS))
        row[0] += 1
        row[1] += abs(predicted - reported)
        row[2] += predicted
        row[3] += reported
        row[4] += prompt
        ratio = min(1.0, reported / prompt) if prompt > 0 else 0.0
        row[5] += ratio
        for i, bound in enumerate(HIT_RATIO_BUCKETS):
            if ratio <= bound:
                row[6 + i] += 1
                break

    def rows(self) -> dict[tuple[str, str], tuple[float, ...]]:
        """(worker, source) -> (requests, sum |error|, predicted, reported, prompt tokens, sum of
        the hit ratios, then the requests per bucket of `HIT_RATIO_BUCKETS`, not cumulative)."""
        return {k: tuple(v) for k, v in self._by.items()}

    def forget(self, worker: str) -> None:
        for k in [k for k in self._by if k[0] == worker]:
            del self._by[k]

    def summary(self) -> dict[tuple[str, str], tuple[int, float, float, float]]:
        """(worker, source) -> (requests, mean |error| tokens, total predicted, total reported)."""
        return {k: (int(v[0]), v[1] / v[0] if v[0] else 0.0, v[2], v[3]) for k, v in self._by.items()}


class CacheState:
    """What the cache-aware selectors of one policy share (see the module docstring)."""

    observes: tuple[type, ...] = EVENT_TYPES
    needs = Needs(prompt_key=True, cached_tokens=True)

    def __init__(
        self,
        settings: CacheAwareSettings | None = None,
        *,
        precise: PrefixSource | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        s = self.settings = settings or CacheAwareSettings()
        self.approx = ApproxIndex(
            block_tokens=s.block_tokens, chars_per_token=s.chars_per_token, budget_tokens=s.max_tree_size
        )
        self.precise = precise if s.use_kv_events else None
        self.queues = PrefillQueues(RateSettings(default_rate=s.prefill_rate))
        self.accuracy = PredictionStats()
        # routing decisions by (role that prefills, prediction source, matched: cached > 0)
        self.decisions: dict[tuple[str, str, bool], int] = {}
        self.clock = clock
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._last_sweep = clock()

    # -- reads (pure) -----------------------------------------------------------------------

    def lookups(self, req: RequestView) -> tuple[Lookup | None, Lookup]:
        """(precise, approximate) lookups of the request's prompt."""
        key = req.prompt_key
        if key is None:
            return None, NO_LOOKUP
        k = self.settings.max_candidates
        precise = None if self.precise is None else self.precise.lookup(req.model, key, k)
        approx = self.approx.lookup(req.model, key, k)
        return precise, approx if approx is not None else EMPTY_LOOKUP

    @staticmethod
    def cached(lookups: tuple[Lookup | None, Lookup], worker_id: str) -> tuple[int, str]:
        precise, approx = lookups
        if precise is not None:
            got = precise.cached_tokens(worker_id)
            if got is not None:
                return got, "kv_events"
        got = approx.cached_tokens(worker_id)
        return (got or 0), ("approx" if approx is not NO_LOOKUP else "none")

    def capacity(self, w: WorkerState) -> int | None:
        return w.kv_capacity_tokens if w.kv_capacity_tokens is not None else self.settings.worker_cache_tokens

    def estimates(
        self,
        req: RequestView,
        cands: Sequence[WorkerState],
        lookups: tuple[Lookup | None, Lookup] | None = None,
        now: float | None = None,
    ) -> list[Estimate]:
        lookups = self.lookups(req) if lookups is None else lookups
        now = self.clock() if now is None else now
        s = self.settings
        prompt = max(1, req.prompt_tokens)
        limit = prompt - 1
        threshold = s.cache_threshold * prompt
        factor = s.inflight_factor
        queues = self.queues
        out: list[Estimate] = []
        for w in cands:
            cached, source = self.cached(lookups, w.id)
            if cached > limit:
                cached = limit
            credit = cached if cached > threshold else 0
            wid = w.id
            rate = queues.rate(wid)
            backlog = queues.backlog(wid, now, w.load.waiting)
            wait = backlog / rate
            ttft = wait + (prompt - credit) / rate
            out.append(
                Estimate(
                    worker=wid,
                    cached_tokens=cached,
                    source=source,
                    backlog_tokens=backlog,
                    rate=rate,
                    ttft_s=ttft,
                    inflight=w.inflight,
                    cost=ttft * (1.0 + factor * w.inflight),
                    saturated=wait > s.saturation_wait_s,
                )
            )
        return out

    def cached_for(self, model: str, key: PromptKey, worker_id: str) -> int:
        """The prompt tokens `worker_id` is predicted to hold of the prompt keyed `key`."""
        precise = None if self.precise is None else self.precise.lookup(model, key, 1)
        approx = self.approx.lookup(model, key, 1)
        return self.cached((precise, approx if approx is not None else EMPTY_LOOKUP), worker_id)[0]

    def cached_tokens(self, req: RequestView, worker: WorkerState) -> int:
        """`CacheEstimator` for the P/D decider: the decode worker's predicted cache."""
        if req.prompt_key is None:
            return 0
        cached, _ = self.cached(self.lookups(req), worker.id)
        return min(cached, max(0, req.prompt_tokens - 1))

    # -- observe ----------------------------------------------------------------------------

    def observe(self, event: PolicyEvent) -> None:
        match event:
            case Routed():
                self._routed(event)
            case Completed():
                self._completed(event)
            case Failed():
                p = self._pending.pop(event.request_id, None)
                if p is not None:  # its prefill will not run (or ran and is lost): not queued
                    self.queues.add(p.worker, -p.uncached, self.clock())
            case WorkerGone():
                self.approx.forget(event.worker_id)
                self.queues.forget(event.worker_id)
                self.accuracy.forget(event.worker_id)
        now = self.clock()
        if now - self._last_sweep >= self.settings.eviction_interval_s:
            self._sweep(now)

    def _routed(self, ev: Routed) -> None:
        wid = ev.worker_ids[0]  # the worker that prefills (P/D: the prefill; else the one worker)
        w = ev.workers[0] if ev.workers else None
        key = ev.prompt_key
        now = self.clock()
        req_tokens = max(1, ev.prompt_tokens)
        cached, source = 0, "none"
        if key is not None:
            precise = None if self.precise is None else self.precise.lookup(ev.model, key, 1)
            approx = self.approx.lookup(ev.model, key, 1)
            cached, source = self.cached((precise, approx if approx is not None else EMPTY_LOOKUP), wid)
            cached = min(cached, req_tokens - 1)
        uncached = req_tokens - cached
        tally = (ev.roles[0].value, source, cached > 0)
        self.decisions[tally] = self.decisions.get(tally, 0) + 1
        backlog = self.queues.backlog(wid, now, 0 if w is None else w.load.waiting)
        self.queues.add(wid, uncached, now)
        capacity = None if w is None else self.capacity(w)
        if key is not None:
            self.approx.insert(ev.model, wid, key, capacity)
            if ev.disaggregated and len(ev.workers) == 2 and ev.workers[1].decode_alone:
                # a decode that can prefill by itself keeps the prompt's KV it was sent (vLLM's
                # prefix cache): what the P/D decider weighs when it may prefill the next turn
                d = ev.workers[1]
                self.approx.insert(ev.model, d.id, key, self.capacity(d))
        pending = self._pending
        pending[ev.request_id] = _Pending(
            now, wid, ev.model, cached, source, backlog + uncached, uncached, capacity
        )
        if len(pending) > self.settings.max_pending:
            pending.popitem(last=False)

    def _completed(self, ev: Completed) -> None:
        p = self._pending.pop(ev.request_id, None)
        if p is None:
            return
        if ev.ttft_s is not None:
            self.queues.learn(p.worker, p.work_tokens, ev.ttft_s)
        if ev.cached_tokens is not None:
            prompt = p.predicted + int(p.uncached)
            self.accuracy.record(p.worker, p.source, p.predicted, ev.cached_tokens, prompt)
            if p.source == "approx":
                self.approx.feedback(p.model, p.worker, p.predicted, ev.cached_tokens, p.capacity)
            elif p.source == "kv_events" and self.precise is not None:
                self.precise.outcome(p.worker, p.predicted, ev.cached_tokens)

    def _sweep(self, now: float) -> None:
        """Every `eviction_interval`: forget requests routed longer ago than that whose outcome
        never came (a cancelled request may send none), oldest first."""
        self._last_sweep = now
        horizon = now - self.settings.eviction_interval_s
        pending = self._pending
        while pending:
            rid, p = next(iter(pending.items()))
            if p.at > horizon:
                break
            del pending[rid]


# ---- filter, scorers, pickers -------------------------------------------------------------------


class SaturationFilter:
    """Drops saturated workers (queued prefill longer than `saturation_wait_s`) unless all are."""

    name = "saturation"

    def __init__(self, state: CacheState) -> None:
        self.state = state

    def filter(self, req: RequestView, cands: Sequence[WorkerState]) -> Sequence[WorkerState]:
        est = self.state.estimates(req, cands)
        keep = [w for w, e in zip(cands, est, strict=True) if not e.saturated]
        return keep or cands


class PredictedTTFTScorer:
    """`min cost / cost(w)`: 1.0 for the cheapest (the predicted TTFT, weighed by the requests
    already in flight)."""

    name = "predicted_ttft"

    def __init__(self, state: CacheState) -> None:
        self.state = state

    def score(self, req: RequestView, cands: Sequence[WorkerState]) -> Mapping[str, float]:
        return ttft_scores(self.state.estimates(req, cands))


def ttft_scores(est: Sequence[Estimate]) -> dict[str, float]:
    best = min((e.cost for e in est), default=0.0)
    return {e.worker: (best / e.cost if e.cost > 0 else 1.0) for e in est}


class BalanceGatePicker:
    """The best score (ties: fewer in flight, then at random), unless sglang-router's balance rule
    fires against it: `inflight - min_inflight > abs` and `inflight > rel * min_inflight`, then
    the least loaded candidate (ties: the better score)."""

    name = "balance_gate"

    def __init__(
        self, abs_threshold: int = 64, rel_threshold: float = 1.5, rng: _random.Random | None = None
    ) -> None:
        self.abs_threshold = abs_threshold
        self.rel_threshold = rel_threshold
        self.rng = rng if rng is not None else _random.Random()

    def pick(self, req: RequestView, scored: Sequence[tuple[WorkerState, float]]) -> WorkerState:
        return self.pick_why(scored)[0]

    def pick_why(self, scored: Sequence[tuple[WorkerState, float]]) -> tuple[WorkerState, str]:
        top = max(s for _, s in scored)
        best = [w for w, s in scored if s >= top - 1e-12]
        fewest = min(w.inflight for w in best)
        best = [w for w in best if w.inflight == fewest]
        chosen = best[0] if len(best) == 1 else self.rng.choice(best)
        least = min(scored, key=lambda ws: (ws[0].inflight, -ws[1]))[0]
        if (
            chosen.inflight - least.inflight > self.abs_threshold
            and chosen.inflight > self.rel_threshold * least.inflight
        ):
            return least, "balance_gate"
        return chosen, "min_ttft"


class RandomTiePicker:
    """The best score; ties at random (not the first candidate: no herd on equal scores)."""

    name = "max_score"

    def __init__(self, rng: _random.Random | None = None) -> None:
        self.rng = rng if rng is not None else _random.Random()

    def pick(self, req: RequestView, scored: Sequence[tuple[WorkerState, float]]) -> WorkerState:
        top = max(s for _, s in scored)
        best = [w for w, s in scored if s >= top - 1e-12]
        return best[0] if len(best) == 1 else self.rng.choice(best)


# ---- role selectors --------------------------------------------------------------------------------


class _NoEvent:
    """Never sent: `observes` of a selector whose state another selector forwards events to."""


class PositionMemo:
    """Where the workers sit in the candidate lists a selector is handed, so that a large pool is
    narrowed to its matched workers without a pass over it (a cache that never changes a result
    it is checked for).

    A layout is recognised by its length and its first and last `WorkerState` objects (the
    registry makes new ones for every worker when membership or health changes); a position is
    used only after checking that the worker is there. A worker the layout did not have when it
    was mapped is taken as absent without a check: the one case a changed layout could go
    unnoticed (two retries excluding different workers of equal count in turn), which can only
    leave a matched worker out of one decision's candidates, never admit an invalid one. Layouts
    are re-mapped every `refresh_every` uses all the same. Up to `layouts` layouts are kept (a
    prefill role sees one per decode engine)."""

    __slots__ = ("_maps", "layouts", "refresh_every")

    def __init__(self, refresh_every: int = 256, layouts: int = 8) -> None:
        self.refresh_every = refresh_every
        self.layouts = layouts
        # (len, first, last) -> [position by id, uses]
        self._maps: OrderedDict[tuple[int, int, int], list[Any]] = OrderedDict()

    def find(self, cands: Sequence[WorkerState], wanted: Iterable[str]) -> list[WorkerState]:
        """The candidates whose id is in `wanted`, in `wanted`'s order."""
        n = len(cands)
        first, last = cands[0], cands[-1]
        shape = (n, id(first), id(last))
        entry = self._maps.get(shape)
        if entry is None or entry[1] >= self.refresh_every or entry[2] is not first or entry[3] is not last:
            entry = self._map(cands, shape)
        entry[1] += 1
        pos: dict[str, int] = entry[0]
        out: list[WorkerState] = []
        for wid in wanted:
            i = pos.get(wid)
            if i is None:
                continue
            w = cands[i] if i < n else None
            if w is None or w.id != wid:  # moved: map this layout again
                pos = self._map(cands, shape)[0]
                i = pos.get(wid)
                if i is None:
                    continue
                w = cands[i]
            out.append(w)
        return out

    def _map(self, cands: Sequence[WorkerState], shape: tuple[int, int, int]) -> list[Any]:
        entry = [{w.id: i for i, w in enumerate(cands)}, 0, cands[0], cands[-1]]
        maps = self._maps
        maps[shape] = entry
        maps.move_to_end(shape)
        if len(maps) > self.layouts:
            maps.popitem(last=False)
        return entry


def _narrow(
    cands: Sequence[WorkerState],
    wanted: Iterable[str],
    settings: CacheAwareSettings,
    rng: _random.Random,
    memo: PositionMemo,
) -> Sequence[WorkerState]:
    """The pool itself when small, else its wanted workers plus a random sample."""
    if len(cands) <= settings.scan_limit:
        return cands
    pool = memo.find(cands, wanted)
    seen = {w.id for w in pool}
    n = len(cands)
    for _ in range(settings.sample):
        w = cands[rng.randrange(n)]
        if w.id not in seen:
            seen.add(w.id)
            pool.append(w)
    return pool


class CacheAwareSelector:
    """The prefill / colocated `RoleSelector` of `cache_aware` (see the module docstring)."""

    needs = Needs(prompt_key=True, cached_tokens=True)

    def __init__(
        self, name: str, state: CacheState, *, rng: _random.Random | None = None, owner: bool = True
    ) -> None:
        self.name = name
        self.state = state
        s = state.settings
        self.rng = rng if rng is not None else _random.Random()
        self.picker = BalanceGatePicker(s.balance_abs_threshold, s.balance_rel_threshold, self.rng)
        self.observes: tuple[type, ...] = EVENT_TYPES if owner else (_NoEvent,)
        self.memo = PositionMemo()

    def select(self, req: RequestView, cands: Sequence[WorkerState]) -> WorkerState:
        return self.decide(req, cands, record=False)[0]

    def decide(
        self, req: RequestView, cands: Sequence[WorkerState], *, record: bool = True
    ) -> tuple[WorkerState, DecisionRecord | None]:
        """The choice, and (with `record`) the decision record."""
        if not cands:
            raise NoCandidates("input")
        state = self.state
        lookups = state.lookups(req)
        if len(cands) > state.settings.scan_limit:
            wanted = dict.fromkeys(wid for lk in lookups if lk is not None for wid, _ in lk.top)
            cands = _narrow(cands, wanted, state.settings, self.rng, self.memo)
        if not record:
            return self._choose(req, cands, lookups), None
        est = state.estimates(req, cands, lookups)
        pairs = list(zip(cands, est, strict=True))
        ok = [(w, e) for w, e in pairs if not e.saturated]
        all_saturated = not ok
        if all_saturated:
            ok = pairs
        scores = ttft_scores([e for _, e in ok])
        chosen, why = self.picker.pick_why([(w, scores[w.id]) for w, _ in ok])
        key = req.prompt_key
        return chosen, DecisionRecord(
            role=self.name,
            prompt_tokens=req.prompt_tokens,
            keyed=None if key is None else key.kind,
            candidates=tuple(est),
            scores={"predicted_ttft": scores},
            chosen=chosen.id,
            reason="all_saturated" if all_saturated else why,
        )

    def _choose(
        self, req: RequestView, cands: Sequence[WorkerState], lookups: tuple[Lookup | None, Lookup]
    ) -> WorkerState:
        """`decide` without the record, in one loop (the same choice: the tests compare them)."""
        state = self.state
        s = state.settings
        now = state.clock()
        prompt = req.prompt_tokens if req.prompt_tokens > 0 else 1
        limit = prompt - 1
        threshold = s.cache_threshold * prompt
        factor = s.inflight_factor
        saturation = s.saturation_wait_s
        backlog_rate = state.queues.backlog_rate
        precise, approx = lookups
        from_precise = None if precise is None else precise.cached_tokens
        from_approx = approx.cached_tokens
        rows: list[tuple[float, int, WorkerState]] = []
        saturated: list[tuple[float, int, WorkerState]] = []
        for w in cands:
            wid = w.id
            cached = from_precise(wid) if from_precise is not None else None
            if cached is None:
                cached = from_approx(wid) or 0
            if cached > limit:
                cached = limit
            backlog, rate = backlog_rate(wid, now, w.load.waiting)
            wait = backlog / rate
            cost = (wait + (prompt - (cached if cached > threshold else 0)) / rate) * (
                1.0 + factor * w.inflight
            )
            (saturated if wait > saturation else rows).append((cost, w.inflight, w))
        if not rows:
            rows = saturated
        best = min(r[0] for r in rows)
        ties = [r for r in rows if r[0] <= best * (1.0 + 1e-12)]
        if len(ties) > 1:
            fewest = min(r[1] for r in ties)
            ties = [r for r in ties if r[1] == fewest]
        chosen = ties[0][2] if len(ties) == 1 else self.rng.choice(ties)[2]
        least = min(rows, key=lambda r: (r[1], r[0]))[2]
        p = self.picker
        if (
            chosen.inflight - least.inflight > p.abs_threshold
            and chosen.inflight > p.rel_threshold * least.inflight
        ):
            return least
        return chosen

    def observe(self, event: PolicyEvent) -> None:
        self.state.observe(event)


class LoadSelector:
    """The decode `RoleSelector` of `cache_aware`: least weighted load (`least_load`'s score),
    ties at random; a pool above `scan_limit` is sampled (`sample` workers: power of d choices)."""

    observes: tuple[type, ...] = (_NoEvent,)

    def __init__(
        self,
        name: str,
        settings: CacheAwareSettings,
        weights: LoadWeights | None = None,
        rng: _random.Random | None = None,
    ) -> None:
        self.name = name
        self.settings = settings
        self.scorer = LoadScorer(weights)
        self.rng = rng if rng is not None else _random.Random()
        self.picker = RandomTiePicker(self.rng)
        self.memo = PositionMemo()

    def select(self, req: RequestView, cands: Sequence[WorkerState]) -> WorkerState:
        if not cands:
            raise NoCandidates("input")
        if len(cands) == 1:
            return cands[0]
        cands = _narrow(cands, (), self.settings, self.rng, self.memo)
        scores = self.scorer.score(req, cands)
        return self.picker.pick(req, [(w, scores[w.id]) for w in cands])

    def observe(self, event: PolicyEvent) -> None:
        return None


__all__ = [
    "HIT_RATIO_BUCKETS",
    "BalanceGatePicker",
    "CacheAwareSelector",
    "CacheAwareSettings",
    "CacheState",
    "DecisionRecord",
    "Estimate",
    "LoadSelector",
    "PredictedTTFTScorer",
    "PredictionStats",
    "RandomTiePicker",
    "SaturationFilter",
    "ttft_scores",
]
