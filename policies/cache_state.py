"""The state of the `cache_aware` policy (policies/cache_aware.py has the model): its settings, the
per-worker predictions (`estimates`), what it learns from outcomes (`observe`)."""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec

from policies.approx_index import ApproxIndex
from policies.base import EVENT_TYPES, Completed, Failed, Needs, PolicyEvent, Routed, WorkerGone
from policies.cache_settings import CacheAwareSettings
from policies.decode_slo import NO_SLO, DecodeSlo, HeldDecode
from policies.estimators import prefill_work
from policies.inflight import InflightPrefills
from policies.pending import expire
from policies.pool_pressure import DecayedRate, externality_per_work, shared_wait
from policies.prefill_cost import PrefillQueues, RateSettings, prefill_seconds
from policies.prefix_source import EMPTY_LOOKUP, NO_LOOKUP, Lookup, PendingSink, PrefixSource
from policies.prompt_key import PromptKey
from policies.snapshot import RequestView, WorkerState
from policies.tail_price import tail_s
from policies.turnover import Turnover

# ---- predictions -------------------------------------------------------------------------------


class Estimate(msgspec.Struct, frozen=True, gc=False):
    """One candidate as the policy saw it (a row of a `DecisionRecord`)."""

    worker: str
    cached_tokens: int  # predicted, before `cache_threshold`
    source: str  # "kv_events", "approx" or "none"
    backlog_tokens: float  # queued prefill work (dense-token equivalents)
    rate: float  # prefill work per second (policies/prefill_cost.py)
    ttft_s: float  # predicted
    inflight: int
    cost: float  # wait + own prefill * (1 + inflight_factor * inflight) + externality + evict + tail
    saturated: bool
    externality_s: float = 0.0  # the delay its prefill work adds to later arrivals (pool_pressure)
    evict_s: float = 0.0  # the price of the cached tokens its new KV evicts (policies/turnover.py)
    tail_s: float = 0.0  # its predicted TTFT's tail price (policies/tail_price.py)
    # SLO misses its prefill there is predicted to cause (policies/decode_slo.py); with
    # ttft_slo_rank = "after_tpot" the rank 2 x decodes broken + own TTFT miss (`ttft_rank`)
    slo_misses: int = 0
    prefill_s: float = 0.0  # its own prefill there, predicted seconds (as the SLO term weighs it)
    tpot_best_s: float = 0.0  # the worker's unloaded time per token (DecodeSlo.best; SLO term on)
    decodes: tuple[HeldDecode, ...] = ()  # the decodes there the TPOT term weighed (DecodeSlo.held)
    # with `source = "kv_events"`: what the approximate index predicts there (-1: not asked), so a
    # record shows where the two indexes differ
    approx_tokens: int = -1


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
    backlog: float  # the worker's queued work when this was routed
    uncached: float  # tokens
    work: float  # its own prefill work (`prefill_work`)
    capacity: int | None
    key: PromptKey | None = None  # recorded in the index when its prefill ends
    recorded: bool = True
    pin: float = 0.0  # KV tokens it holds on its worker that the index does not count


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
        self.sink = self.precise if s.precise_pending and isinstance(self.precise, PendingSink) else None
        self.queues = PrefillQueues(RateSettings(default_rate=s.prefill_rate, fit=s.prefill_fit_line))
        self.accuracy = PredictionStats()
        self.arrivals = DecayedRate(s.pressure_window_s)  # routed requests and their prefill work
        self.turnover = Turnover(s.evict_window_s)  # new KV tokens sent to each worker
        self.decisions: dict[tuple[str, str, bool], int] = {}  # by (prefill role, source, cached > 0)
        self.clock = clock
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._last_sweep = clock()
        self._filling: list[tuple[float, str]] = []
        self._pinned: dict[str, float] = {}  # worker -> KV tokens pinned by requests in flight
        self.inflight = InflightPrefills(s.inflight_hold_s, s.block_tokens) if s.inflight_hold_s > 0 else None
        # the decode windows and SLO misses (policies/decode_slo.py); None unless an SLO is set
        self.slo: DecodeSlo | None = None
        if s.slo.on:
            self.slo = DecodeSlo(
                s.slo,
                crossover_tokens=s.crossover_tokens,
                prefill_rate=s.prefill_rate,
                cached=self._cached_at_routing,
                rate=self.queues.rate,
                clock=clock,
                wait=lambda wid, now: self.queues.backlog(wid, now) / self.queues.rate(wid),
                chain=self.approx.chain,
                block_tokens=s.block_tokens,
            )

    # -- reads (pure, but for the catch-up below) ---------------------------------------------

    def lookups(self, req: RequestView) -> tuple[Lookup | None, Lookup]:
        """(precise, approximate) lookups of the request's prompt. With `record = "prefilled"`
        it first records the prompts whose predicted prefill has ended by now: the same index
        any later read would see, so a plan stays valid (`policies.base.Policy`)."""
        key = req.prompt_key
        if key is None:
            return None, NO_LOOKUP
        if self._filling:
            self._fill(self.clock())
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
        pool: int | None = None,
    ) -> list[Estimate]:
        """Each candidate's prediction; `pool`: the size of the pool `cands` were narrowed from."""
        lookups = self.lookups(req) if lookups is None else lookups
        now = self.clock() if now is None else now
        s = self.settings
        prompt = max(1, req.prompt_tokens)
        threshold = s.cache_threshold * prompt
        factor = s.inflight_factor
        rows = self._rows(prompt, cands, lookups, now)
        rate_sum = sum(r[4] for r in rows)
        waits = [r[5] for r in rows]
        k = self.externality_k(sum(waits), rate_sum, len(rows), now, pool, waits)
        slo = self.slo
        ttft_limit = 0.0 if slo is None or not rows else slo.ttft_limit(prompt, rate_sum / len(rows))
        out: list[Estimate] = []
        approx = lookups[1]
        for w, cached, source, backlog, rate, wait, work, evict in rows:
            own = work / rate
            ext = k * work
            tail = tail_s(wait + own, s.tail_price, s.tail_ttft_s) if s.tail_price > 0.0 else 0.0
            credit = cached if cached > threshold else 0
            slo_s, misses, best, held = (
                NO_SLO if slo is None else slo.weigh(w, req, credit, own, wait, ttft_limit, now)
            )
            out.append(
                Estimate(
                    worker=w.id,
                    cached_tokens=cached,
                    source=source,
                    backlog_tokens=backlog,
                    rate=rate,
                    ttft_s=wait + own,
                    inflight=w.inflight,
                    cost=wait + own * (1.0 + factor * w.inflight) + ext + evict + tail,
                    saturated=wait > s.saturation_wait_s,
                    externality_s=ext,
                    evict_s=evict,
                    tail_s=tail,
                    slo_misses=misses,
                    prefill_s=slo_s if slo is not None else own,
                    tpot_best_s=best,
                    decodes=held,
                    approx_tokens=(approx.cached_tokens(w.id) or 0) if source == "kv_events" else -1,
                )
            )
        return out

    def _rows(
        self, prompt: int, cands: Sequence[WorkerState], lookups: tuple[Lookup | None, Lookup], now: float
    ) -> list[tuple[WorkerState, int, str, float, float, float, float, float]]:
        """`estimates`' parts per candidate: (w, cached, source, backlog, rate, wait, work, evict)."""
        s = self.settings
        limit = prompt - 1
        threshold = s.cache_threshold * prompt
        attention = s.crossover_tokens
        queues = self.queues
        price = s.evict_price * self.turnover.factor(now)  # (as `_choose` computes it)
        written = self.turnover.scaled
        rows: list[tuple[WorkerState, int, str, float, float, float, float, float]] = []
        for w in cands:
            cached, source = self.cached(lookups, w.id)
            if cached > limit:
                cached = limit
            credit = cached if cached > threshold else 0
            wid = w.id
            rate = queues.rate(wid)
            backlog = queues.backlog(wid, now, w.load.waiting)
            work = prefill_work(prompt - credit, credit, attention)
            evict = 0.0
            if price > 0.0 and (pool_tokens := self.capacity(w)):  # (unknown or 0: no price)
                evict = price * (prompt - credit) / rate * written.get(wid, 0.0) / pool_tokens
            rows.append((w, cached, source, backlog, rate, backlog / rate, work, evict))
        return rows

    def externality_k(
        self,
        wait_sum: float,
        rate_sum: float,
        n: int,
        now: float,
        pool: int | None = None,
        waits: Sequence[float] | None = None,
    ) -> float:
        """Seconds of later arrivals' delay per unit of prefill work added to a pool of `pool`
        workers (default `n`) of which `n` candidates wait `wait_sum` seconds (`waits` each,
        read with `queue_wait = "shared"`) and prefill `rate_sum` per second in all
        (policies/pool_pressure.py); 0 with `queue_externality = 0`."""
        weight = self.settings.queue_externality
        if weight <= 0.0 or n <= 0:
            return 0.0
        arrivals, work = self.arrivals.rates(now)
        pool_rate = rate_sum / n * (n if pool is None or pool < n else pool)
        wait = wait_sum / n
        if waits is not None and self.settings.shared_wait and wait > 0.0 and pool_rate > 0.0:
            wait = shared_wait(waits, work / pool_rate)
        return weight * externality_per_work(arrivals, work, wait, pool_rate)

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

    def _cached_at_routing(self, ev: Routed, worker_id: str) -> int:
        """The decode-window model's work of a routed prompt (read before it is recorded)."""
        key = ev.prompt_key
        return 0 if key is None else self.cached_for(ev.model, key, worker_id)

    def observe(self, event: PolicyEvent) -> None:
        if self.slo is not None:  # first: it reads the index as the routing saw it
            self.slo.observe(event)
        if self.inflight is not None and not isinstance(event, Routed):
            self.inflight.observe(event)
        match event:
            case Routed():
                self._routed(event)
            case Completed():
                self._completed(event)
            case Failed():
                p = self._pending.pop(event.request_id, None)
                if p is not None:  # its prefill will not run (or ran and is lost): not queued
                    self.queues.add(p.worker, -p.work, self.clock())
                    self._unpin(p.worker, p.pin)
            case WorkerGone():
                self.approx.forget(event.worker_id)
                self.queues.forget(event.worker_id)
                self.accuracy.forget(event.worker_id)
                self._pinned.pop(event.worker_id, None)
                self.turnover.forget(event.worker_id)
        if self.sink is not None:  # last: a routed prompt's own prediction is read without it
            self.sink.observe(event)
        now = self.clock()
        if now - self._last_sweep >= self.settings.eviction_interval_s:
            self._sweep(now)

    def _fill(self, now: float) -> None:
        filling = self._filling
        while filling and filling[0][0] <= now:
            _, rid = heapq.heappop(filling)
            p = self._pending.get(rid)
            if p is not None and not p.recorded and p.key is not None:
                self._record(p)

    def _record(self, p: _Pending) -> None:
        """Its prefill ended: its blocks are the engine's, counted by the index, not pinned."""
        p.recorded = True
        unpin = min(p.pin, p.uncached)
        p.pin -= unpin
        self._unpin(p.worker, unpin)
        assert p.key is not None
        self.approx.insert(p.model, p.worker, p.key, self._evictable(p.worker, p.capacity))

    def _unpin(self, wid: str, tokens: float) -> None:
        if tokens:
            left = self._pinned.get(wid, 0.0) - tokens
            if left > 0.5:
                self._pinned[wid] = left
            else:
                self._pinned.pop(wid, None)

    def _evictable(self, wid: str, capacity: int | None) -> int | None:
        """The part of the worker's KV pool its engine can keep cached: the pool less what the
        requests in flight there pin and the index does not count."""
        if capacity is None:
            return None
        return max(self.settings.block_tokens, int(capacity - self._pinned.get(wid, 0.0)))

    def _routed(self, ev: Routed) -> None:
        wid = ev.worker_ids[0]  # the worker that prefills (P/D: the prefill; else the one worker)
        w = ev.workers[0] if ev.workers else None
        key = ev.prompt_key
        now = self.clock()
        if self._filling:
            self._fill(now)
        req_tokens = max(1, ev.prompt_tokens)
        cached, source = 0, "none"
        if key is not None:
            precise = None if self.precise is None else self.precise.lookup(ev.model, key, 1)
            approx = self.approx.lookup(ev.model, key, 1)
            cached, source = self.cached((precise, approx if approx is not None else EMPTY_LOOKUP), wid)
            cached = min(cached, req_tokens - 1)
        uncached = req_tokens - cached
        work = prefill_work(uncached, cached, self.settings.crossover_tokens)
        if self.slo is not None and self.settings.slo.queue_prefilled:
            work = self.slo.queued_work(ev, wid, cached, work)
        tally = (ev.roles[0].value, source, cached > 0)
        self.decisions[tally] = self.decisions.get(tally, 0) + 1
        backlog = self.queues.backlog(wid, now, 0 if w is None else w.load.waiting)
        if self.inflight is not None and key is not None and not ev.disaggregated:
            end = now + (backlog + work) / self.queues.rate(wid)
            self.inflight.routed(ev.request_id, wid, self.approx.chain(key), cached, end, now)
        self.queues.add(wid, work, now)
        self.arrivals.add(work, now)
        # the new KV it writes there: its uncached prompt, and a colocated answer's tokens
        self.turnover.add(wid, uncached + (0 if ev.disaggregated else ev.max_tokens), now)
        capacity = None if w is None else self.capacity(w)
        # until its prefill ends the engine holds its prompt pinned, not cached (a request that
        # shares the prefix and is admitted meanwhile computes it again); a colocated answer
        # pins its max_tokens until it ends
        defer = key is not None and self.settings.record_prefilled
        pin = (uncached if defer else 0.0) + (0 if ev.disaggregated else ev.max_tokens)
        self._pinned[wid] = self._pinned.get(wid, 0.0) + pin
        if key is not None and not defer:
            self.approx.insert(ev.model, wid, key, self._evictable(wid, capacity))
        elif key is not None:
            self.approx.fit(ev.model, wid, self._evictable(wid, capacity))
            if cached > 0:  # the prefix it finds is pinned: kept
                self.approx.insert(ev.model, wid, key, self._evictable(wid, capacity), cached)
            heapq.heappush(self._filling, (now + (backlog + work) / self.queues.rate(wid), ev.request_id))
            if ev.disaggregated and len(ev.workers) == 2 and ev.workers[1].decode_alone:
                # a decode that can prefill by itself keeps the prompt's KV it was sent (vLLM's
                # prefix cache): what the P/D decider weighs when it may prefill the next turn
                d = ev.workers[1]
                self.approx.insert(ev.model, d.id, key, self.capacity(d))
        pending = self._pending
        pending[ev.request_id] = _Pending(
            now, wid, ev.model, cached, source, backlog, uncached, work, capacity, key, not defer, pin
        )
        if len(pending) > self.settings.max_pending:
            p = pending.popitem(last=False)[1]
            self._unpin(p.worker, p.pin)

    def _completed(self, ev: Completed) -> None:
        p = self._pending.pop(ev.request_id, None)
        if p is None:
            return
        if p.key is not None and not p.recorded:
            self._record(p)
        self._unpin(p.worker, p.pin)
        if self.settings.touch_done and p.key is not None and len(ev.worker_ids) == 1:
            # colocated: its engine frees its blocks into its LRU now, its prompt the most recent
            self.approx.insert(p.model, p.worker, p.key, self._evictable(p.worker, p.capacity))
        prompt = p.predicted + int(p.uncached)
        seconds = prefill_seconds(ev)
        if seconds is not None:
            work = p.work
            if ev.cached_tokens is not None:  # the work the engine did, not the predicted
                cached = min(ev.cached_tokens, prompt - 1)
                work = prefill_work(prompt - cached, cached, self.settings.crossover_tokens)
            self.queues.learn(p.worker, p.backlog + work, seconds)
        if ev.cached_tokens is not None:
            self.accuracy.record(p.worker, p.source, p.predicted, ev.cached_tokens, prompt)
            if p.source == "approx":
                # a worker with prefill queued when it was routed may still have been computing
                # the prefix predicted (an engine matching at admission computes it again): a
                # shortfall then says nothing about the size of its cache
                self.approx.feedback(
                    p.model, p.worker, p.predicted, ev.cached_tokens, p.capacity, queued=p.backlog > 0.0
                )
            elif p.source == "kv_events" and self.precise is not None:
                self.precise.outcome(p.worker, p.predicted, ev.cached_tokens)

    def _sweep(self, now: float) -> None:
        """Every `eviction_interval`: forget requests routed that long ago whose outcome never came."""
        self._last_sweep = now
        for _, p in expire(self._pending, now - self.settings.eviction_interval_s):
            self._unpin(p.worker, p.pin)


# ---- filter, scorers, pickers -------------------------------------------------------------------
