"""`cache_aware`: route to the worker with the lowest predicted time to first token.

For a request and each candidate worker `w` (the pool that prefills: prefill workers in P/D,
colocated workers, a vLLM decode prefilling itself):

    cached(w)   = prompt tokens w is predicted to hold: the precise index built from its
                  engine's KV events where that is live and verified, else the approximate
                  index of what the gateway sent it; 0 below `cache_threshold` of the prompt
                  (sglang-router's meaning: a match counts only when match / prompt exceeds it),
                  at most prompt - 1 (an engine always computes the last token)
    uncached(w) = prompt - cached(w)
    work(w)     = uncached(w) x (1 + (cached(w) + uncached(w) / 2) / crossover_tokens)
                  (dense-token equivalents: attention grows with the context, policies/prefill_cost.py)
    ttft(w)     = (backlog(w) + work(w)) / rate(w)
    cost(w)     = backlog(w) / rate(w) + work(w) / rate(w) * (1 + inflight_factor * inflight(w))
                  + K * work(w) + evict(w) + tail(w)

and picks the lowest cost (score `min cost / cost(w)` in (0, 1]; ties: fewer requests in
flight, then at random). `inflight(w)` is the gateway's count of requests in flight on w (a
prefill worker's until its prefill answered); the factor is LMetric's multiplicative batch term
(`uncached x (in flight + 1)` at 1.0, no weights to tune) on the request's own prefill: while
it runs, the requests already on the worker wait (an SGLang step that prefills decodes
nothing), so a worker busy with many requests needs a proportionally larger cache saving to
take one more, which keeps a prefix every request shares (a system prompt) from pulling all of
them onto one worker. The queue ahead is not multiplied: it delays this request, and it is
there whichever worker is chosen (multiplying it too scattered a conversation's turns away from
their cache whenever its worker had a little queued: 35-45 % reuse on the Mooncake slice
against 45-47 % this way). 0 leaves the predicted TTFT alone. `K * work(w)` is what the
request's prefill costs the requests that arrive after it while the pool is busy
(policies/pool_pressure.py: `K = queue_externality x arrivals/s x mean wait / ((1 - rho) x pool
rate)`, 0 when no worker has a queue; `queue_wait = "shared"`: the wait over the workers later
arrivals share, a worker too backed up to rejoin them left out): under load a turn sent away
from its cache holder makes the pool compute its prefix again, and every later arrival pays for
that. `evict(w)` (0 unless `evict_price` is set) prices what the request's new KV pushes out
of w's cache:
`evict_price x uncached(w) / rate(w) x written(w) / pool(w)`, `written(w)` the new KV tokens sent
to w over the last `evict_window_s` (decayed; policies/turnover.py): a worker whose cache turns
over fast evicts prefixes still to be asked for. `tail(w)` (0 unless `tail_price` is set,
policies/tail_price.py) is `tail_price x max(0, ttft(w) - tail_ttft_s)`: the request's own wait
beyond a threshold, priced above the mean's. Affinity is never a reason to overload a worker:

- a worker whose queued prefill alone takes longer than `saturation_wait_s` is **saturated**:
  filtered out while any worker is not (`SaturationFilter`);
- sglang-router's balance rule on in-flight requests, per decision: when the chosen worker has
  more than `balance_abs_threshold` requests more than the least loaded candidate **and** more
  than `balance_rel_threshold` times as many, the least loaded one is taken instead
  (`BalanceGatePicker`).

In P/D the decode pool is chosen on load alone (`LoadScorer`, as `least_load`): its cache does
not save prefill work. The decider (`min_prefill_tokens`) is given the decode worker's
predicted cache, so a vLLM decode that already holds most of a prompt can prefill it itself.

Scale: a pool of at most `scan_limit` candidates is scored whole. A larger one is, with
`large_pool = "sample"` (the default), narrowed to the workers holding the deepest matches (at
most `max_candidates`, from the indexes' top lists) plus `sample` workers drawn at random (the
power of d choices for the load side); with `large_pool = "exact"`, searched
(policies/cache_pool_order.py): the workers holding the prompt are scored by prefix group, the
rest in order of a lower bound on their cost kept sorted across decisions, until no worker left
can beat the cheapest found; the choice is the one scoring every worker makes (a property test
compares them), at the cost of the workers read, not the pool.

State (`CacheState`, shared by the role selectors of one policy, mutated only in `observe`):
the approximate index, the prefill queues and rates, the requests in flight with their
predictions (so that an outcome can be compared with what was predicted), and the prediction
accuracy per worker and source.
"""

from __future__ import annotations

import math
import random as _random
from collections.abc import Iterable, Mapping, Sequence

from policies.base import (
    EVENT_TYPES,
    Needs,
    NoCandidates,
    PolicyEvent,
)
from policies.cache_narrow import PositionMemo, narrow
from policies.cache_pool_order import PoolOrders, choose_exact
from policies.cache_state import (
    HIT_RATIO_BUCKETS,
    CacheAwareSettings,
    CacheState,
    DecisionRecord,
    Estimate,
    PredictionStats,
)
from policies.least_load import LoadScorer, LoadWeights
from policies.prefix_source import IndexLookup, Lookup
from policies.snapshot import RequestView, WorkerState
from policies.tail_price import tail_s
from policies.turn_keep import keep_estimates, keep_parts


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


_NOTHING: Mapping[str, int] = {}  # (never written)


class _NoEvent:
    """Never sent: `observes` of a selector whose state another selector forwards events to."""


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
        self.orders = PoolOrders(s.inflight_factor)
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
        pool = len(cands)
        if pool > state.settings.scan_limit:
            if state.settings.exact_large_pool:
                whole = cands if isinstance(cands, list) else list(cands)
                got = choose_exact(
                    state, self.orders, req, whole, lookups, self.rng, self.picker.abs_threshold
                )
                if got is not None:
                    chosen, scored = got
                    return chosen, (self._record(req, scored, lookups, chosen, pool) if record else None)
            else:
                precise, approx = lookups
                wanted: Iterable[tuple[str, int]] = approx.top  # one row per worker
                if precise is not None:
                    both = dict.fromkeys([*(t[0] for t in precise.top), *(t[0] for t in approx.top)])
                    wanted = [(wid, 0) for wid in both]
                cands = narrow(cands, wanted, state.settings.sample, self.rng, self.memo)
        if not record:
            return self._choose(req, cands, lookups, pool), None
        est = state.estimates(req, cands, lookups, pool=pool)
        pairs = list(zip(cands, est, strict=True))
        ok = [(w, e) for w, e in pairs if not e.saturated]
        all_saturated = not ok
        if all_saturated:
            ok = pairs
        if (slo := state.slo) is not None:  # the fewest predicted SLO misses first (decode_slo.py,
            prompt = max(1, req.prompt_tokens)  # a far cheaper holder of a turn too: turn_keep.py)
            ok = keep_estimates(slo.settings.keep, prompt, state.settings.cache_threshold * prompt, ok)
        scores = ttft_scores([e for _, e in ok])
        chosen, why = self.picker.pick_why([(w, scores[w.id]) for w, _ in ok])
        return chosen, self._record_of(req, est, scores, chosen, "all_saturated" if all_saturated else why)

    def _record(
        self,
        req: RequestView,
        scored: Sequence[WorkerState],
        lookups: tuple[Lookup | None, Lookup],
        chosen: WorkerState,
        pool: int,
    ) -> DecisionRecord:
        """The record of a large pool's decision: the workers the search scored."""
        est = self.state.estimates(req, scored, lookups, pool=pool)
        all_saturated = all(e.saturated for e in est)
        scores = ttft_scores([e for e in est if all_saturated or not e.saturated])
        return self._record_of(req, est, scores, chosen, "all_saturated" if all_saturated else "min_ttft")

    def _record_of(
        self,
        req: RequestView,
        est: Sequence[Estimate],
        scores: dict[str, float],
        chosen: WorkerState,
        reason: str,
    ) -> DecisionRecord:
        key = req.prompt_key
        return DecisionRecord(
            role=self.name,
            prompt_tokens=req.prompt_tokens,
            keyed=None if key is None else key.kind,
            candidates=tuple(est),
            scores={"predicted_ttft": scores},
            chosen=chosen.id,
            reason=reason,
        )

    def _choose(
        self,
        req: RequestView,
        cands: Sequence[WorkerState],
        lookups: tuple[Lookup | None, Lookup],
        pool: int | None = None,
    ) -> WorkerState:
        """`decide` without the record, in one loop (the same choice: the tests compare them)."""
        state = self.state
        s = state.settings
        now = state.clock()
        prompt = req.prompt_tokens if req.prompt_tokens > 0 else 1
        saturation = s.saturation_wait_s
        parts, wait_sum, rate_sum = self._parts(prompt, cands, lookups, now)
        waits = [p[0] for p in parts] if s.shared_wait else None
        k = state.externality_k(wait_sum, rate_sum, len(parts), now, pool, waits)
        if (slo := state.slo) is not None:  # the fewest predicted SLO misses first (decode_slo.py)
            ttft_limit = slo.ttft_limit(prompt, rate_sum / len(parts))  # (the mean rate of all)
            parts = [p for p in parts if p[0] <= saturation] or parts
            if slo.settings.prefilled:  # the engine's view of the cache (policies/decode_slo.py)
                secs = _slo_seconds(state, req, prompt, lookups, parts, now)
                counted = [
                    slo.misses(p[4], now, p[0], sec, ttft_limit) for p, sec in zip(parts, secs, strict=True)
                ]
            else:
                counted = [slo.misses(w, now, wait, seconds, ttft_limit) for wait, seconds, _, _, w in parts]
            parts = keep_parts(
                slo.settings.keep, prompt, parts, counted, k, s.inflight_factor, state, lookups
            )
        return self._rank(parts, k, s.inflight_factor, saturation)

    def _parts(
        self,
        prompt: int,
        cands: Sequence[WorkerState],
        lookups: tuple[Lookup | None, Lookup],
        now: float,
    ) -> tuple[list[tuple[float, float, float, float, WorkerState]], float, float]:
        """`_choose`'s loop over the candidates: their (wait, prefill s, work, eviction + tail
        price s, w) parts, and the sums of their waits and rates."""
        state = self.state
        s = state.settings
        limit = prompt - 1
        # `cached > threshold` for an int: the same as against the float's floor, but int to int
        threshold = math.floor(s.cache_threshold * prompt)
        attention = s.crossover_tokens
        backlog_rate = state.queues.backlog_rate
        precise, approx = lookups
        from_precise = None if precise is None else precise.cached_tokens
        from_approx = approx.cached_tokens
        # the approximate lookup's listed workers: `from_approx`'s first read, without its call
        listed = approx.listed() if precise is None and isinstance(approx, IndexLookup) else _NOTHING
        parts: list[tuple[float, float, float, float, WorkerState]] = []
        wait_sum = rate_sum = 0.0
        price = s.evict_price
        if price > 0.0:  # the eviction price (policies/turnover.py): written / pool, decayed
            written = state.turnover.scaled
            price *= state.turnover.factor(now)
            default_pool = s.worker_cache_tokens
        evict = 0.0
        tail, tau = s.tail_price, s.tail_ttft_s
        for w in cands:
            wid = w.id
            if (from_precise is None or (cached := from_precise(wid)) is None) and (
                cached := listed.get(wid)
            ) is None:
                cached = from_approx(wid) or 0
            if cached > limit:
                cached = limit
            backlog, rate = backlog_rate(wid, now, w.load.waiting)
            wait = backlog / rate
            credit = cached if cached > threshold else 0
            new = float(prompt - credit)  # (exact: float arithmetic below, no int-float mixing)
            if price > 0.0:
                pool_tokens = w.kv_capacity_tokens if w.kv_capacity_tokens is not None else default_pool
                evict = price * new / rate * written.get(wid, 0.0) / pool_tokens if pool_tokens else 0.0
            if attention > 0.0:  # prefill_work, inlined (the hot loop)
                new *= 1.0 + (float(credit) + 0.5 * new) / attention
            seconds = new / rate
            if tail > 0.0:  # the tail price rides with the eviction price (policies/tail_price.py)
                parts.append((wait, seconds, new, evict + tail_s(wait + seconds, tail, tau), w))
            else:
                parts.append((wait, seconds, new, evict, w))
            wait_sum += wait
            rate_sum += rate
        return parts, wait_sum, rate_sum

    def _rank(
        self,
        parts: list[tuple[float, float, float, float, WorkerState]],
        k: float,
        factor: float,
        saturation: float,
    ) -> WorkerState:
        """Of `_choose`'s (wait, prefill s, work, eviction s, worker) parts, costed as (cost, in flight,
        worker) rows, unsaturated ones if any: the cheapest, ties within 1e-12 to the fewest in
        flight, then drawn in row order; unless the balance rule takes the least loaded (fewest
        in flight, then cheapest, the first such). The rows, the cheapest and the least loaded
        come from one loop."""
        rows: list[tuple[float, int, WorkerState]] = []
        saturated: list[tuple[float, int, WorkerState]] = []
        best = 0.0
        least: tuple[float, int, WorkerState] | None = None
        least_n, least_cost = 0, 0.0  # (least's in flight and cost, as locals: no subscripts)
        for wait, seconds, work, evict, w in parts:  # (the SLO filter above kept one side only)
            n = w.inflight
            cost = wait + seconds * (1.0 + factor * n) + k * work + evict
            r = (cost, n, w)
            if wait > saturation:
                saturated.append(r)
            elif least is None:
                rows.append(r)
                best, least, least_n, least_cost = cost, r, n, cost
            else:
                rows.append(r)
                if cost < best:
                    best = cost
                if n < least_n or (n == least_n and cost < least_cost):
                    least, least_n, least_cost = r, n, cost
        if least is None:  # every candidate saturated: the same rule over them
            rows = saturated
            best, least = rows[0][0], rows[0]
            for r in rows:
                if r[0] < best:
                    best = r[0]
                if r[1] < least[1] or (r[1] == least[1] and r[0] < least[0]):
                    least = r
        if len(rows) == 1:
            return least[2]
        top = best * (1.0 + 1e-12)
        ties = []  # (a loop, not a comprehension: no call)
        for r in rows:
            if r[0] <= top:
                ties.append(r)
        if len(ties) > 1:
            fewest = min([r[1] for r in ties])
            ties = [r for r in ties if r[1] == fewest]
        chosen = ties[0][2] if len(ties) == 1 else self.rng.choice(ties)[2]
        p = self.picker
        if chosen.inflight - least[1] > p.abs_threshold and chosen.inflight > p.rel_threshold * least[1]:
            return least[2]
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
        if len(cands) > self.settings.scan_limit:
            cands = narrow(cands, (), self.settings.sample, self.rng, self.memo)
        scores = self.scorer.score(req, cands)
        return self.picker.pick(req, [(w, scores[w.id]) for w in cands])

    def observe(self, event: PolicyEvent) -> None:
        return None


def _slo_seconds(
    state: CacheState,
    req: RequestView,
    prompt: int,
    lookups: tuple[Lookup | None, Lookup],
    parts: Sequence[tuple[float, float, float, float, WorkerState]],
    now: float,
) -> list[float]:
    """Each candidate's prefill seconds as `DecodeSlo` weighs them with `slo_cache = "prefilled"`."""
    slo = state.slo
    assert slo is not None
    threshold = math.floor(state.settings.cache_threshold * prompt)
    out = []
    for _, seconds, _, _, w in parts:
        cached = min(state.cached(lookups, w.id)[0], prompt - 1)
        out.append(slo.seconds(req.prompt_key, prompt, cached if cached > threshold else 0, w, seconds, now))
    return out


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
