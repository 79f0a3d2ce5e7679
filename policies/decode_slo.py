"""SLO-aware colocated routing for `cache_aware`: the SLO misses a prefill is predicted to cause.

A worker that both prefills and decodes (a colocated worker, a vLLM decode prefilling itself)
runs a new request's prefill in the steps of the decodes running there, and they wait for it:
on SGLang a step with prefill work decodes nothing (managers/scheduler.py `get_next_batch_to_run`,
mixed chunks off by default), so each decode running there is held for all of it; on vLLM for
at most one prefill chunk per token it has left. A long prompt sent to a worker decoding short
answers puts them past their time-per-output-token SLO, however good the worker's cache is.

Per candidate worker `w`, for this request's prefill of `seconds` after `wait` (cache_aware's
own predictions):

    best(w)       = the least time per output token of w's latest streams (unloaded)
    tpot_slo(w)   = tpot_slo_s + tpot_slo_x x best(w)
    budget_i      = (tokens_i - 1) x (tpot_slo(w) - best(w))   each request i decoding on w whose
                                                               answer has not come
    stall_i       = prefill-first (SGLang): the prefill seconds routed to w after i's own (a
                    request in the waiting queue holds every decode step there until no prefill
                    is left, wherever i's window was predicted); vLLM: the P/D decider's model
                    (`policies.cost_model.CostModel`: i's predicted window and the prefill
                    overlapping it, at most a chunk per token left), fed the same events
    added_i       = seconds (SGLang); the overlap of [now + wait, + seconds) (vLLM)
    broken(w)     = requests i with stall_i <= budget_i < stall_i + added_i
    ttft_slo      = ttft_slo_s + ttft_slo_x x (work(P, 0) / rate): the prompt computed whole on
                    an idle worker, what `bench replay`'s relative SLOs are multiples of
    misses(w)     = broken(w) + (1 if wait + seconds > ttft_slo else 0)
                    (with `ttft_after_tpot`: 2 x broken(w) + that 1 or 0, `ttft_rank`)

`tokens_i` is the decider's expected output (`max_tokens` x the learned share a request fills).

With `prefilled` (`slo_cache = "prefilled"`), a prefill's seconds here count as cached only
what the engine will have when it schedules it: a prefix that a prefill still running on `w`
(routed, its predicted prefill not ended) is writing is computed again. A chunked engine takes
the next waiting prompt's first chunk in the step of the holder's last, and matches it then,
before the holder's blocks are registered (the emulator's `_plan_step`; SGLang forms a prefill
batch the same way). The index counts the prompt as `w`'s from its routing on, so a turn sent
right behind its predecessor was predicted a few milliseconds of prefill where it took the
whole prompt's (docs/benchmarks.md, "Why the predicted-clean breaks were predicted clean").

`cache_aware` with an SLO configured picks among the candidates with the fewest misses by its
cost (policies/cache_aware.py); with none configured nothing here is built or run.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from policies.base import Completed, Failed, PolicyEvent, Routed, WorkerGone
from policies.cost_model import CostModel, CostPriors
from policies.estimators import prefill_work
from policies.prompt_key import PromptKey
from policies.snapshot import RequestView, WorkerState
from policies.turn_keep import TurnKeep

HORIZON_S = 600.0  # a request whose outcome never came is forgotten after this
MAX_HELD = 100_000  # requests decoding the model keeps (the oldest go first)
TPOT_SAMPLES = 64  # streams per worker whose time per token `best` is taken from
MIN_TOKENS = 16  # the shortest stream measured (a short one's tokens come together more often)


@dataclass(frozen=True, slots=True)
class SloSettings:
    """The SLOs `cache_aware` is told (`policies.config.CacheAwareCfg` documents each); a limit
    with both parts 0 is not checked."""

    ttft_slo_s: float = 0.0
    ttft_slo_x: float = 0.0
    tpot_slo_s: float = 0.0
    tpot_slo_x: float = 0.0
    prefilled: bool = False  # a prefix a running prefill writes is not cached for the SLO term
    pool_best: bool = False  # best(w) of a worker with < 10 streams: the pool's least (`best`)
    queue_prefilled: bool = False  # a routed prefill queues the work of `prefilled`'s view (`queued_work`)
    ttft_after_tpot: bool = False  # `misses` ranks (decodes broken, own TTFT miss), not their sum
    keep: TurnKeep = field(
        default_factory=TurnKeep
    )  # a cached turn's holder kept beside the fewest (policies/turn_keep.py)

    @property
    def on(self) -> bool:
        return self.ttft_on or self.tpot_on

    @property
    def ttft_on(self) -> bool:
        return self.ttft_slo_s > 0.0 or self.ttft_slo_x > 0.0

    @property
    def tpot_on(self) -> bool:
        return self.tpot_slo_s > 0.0 or self.tpot_slo_x > 0.0


class HeldDecode(msgspec.Struct, frozen=True, gc=False):
    """A request decoding on a prefill-first worker as `DecodeSlo` sees it when a new prefill is
    weighed there (a row of a decision record's candidate; bench/replay/attribution.py compares
    it with what happened)."""

    request_id: str
    tokens: int  # its expected output tokens
    budget_s: float  # the stall it may take within its TPOT SLO: (tokens - 1) x (limit - best)
    stall_s: float  # the stall predicted so far: the prefill seconds routed there after its own
    broken: bool  # the prefill weighed is predicted to put it over its budget


class DecodeSlo:
    """The decode windows on each worker and the misses a new prefill there would cause."""

    def __init__(
        self,
        settings: SloSettings,
        *,
        crossover_tokens: float,
        prefill_rate: float,
        cached: Callable[[Routed, str], int],
        rate: Callable[[str], float],
        clock: Callable[[], float] = time.monotonic,
        wait: Callable[[str, float], float] | None = None,
        chain: Callable[[PromptKey], tuple[int, ...]] | None = None,
        block_tokens: int = 16,
    ) -> None:
        self.settings = settings
        self.crossover = crossover_tokens
        self.clock = clock
        self._cached = cached
        self._rate = rate
        # prefill-first workers (SGLang): per worker, the prefill seconds routed there so far,
        # and each request decoding there whose answer has not come: (output tokens, that sum
        # once its own prefill was routed)
        self._routed_s: dict[str, float] = {}
        self._held: dict[str, dict[str, tuple[int, float]]] = {}
        self._where: OrderedDict[str, tuple[str, float]] = OrderedDict()  # request -> (worker, at)
        # `prefilled`: per worker, the prefills predicted still running there: request ->
        # (predicted end, tokens it found cached, its prompt); `wait(w, now)` is w's queue in
        # seconds, `chain` the index's block keys of a prompt (`ApproxIndex.chain`)
        self._wait = wait
        self._chain = chain
        self._block_tokens = block_tokens
        self._filling: dict[str, dict[str, tuple[float, int, PromptKey]]] = {}
        self._filling_on: dict[str, str] = {}
        self.model = CostModel(
            priors=CostPriors(prefill_rate=prefill_rate, crossover_tokens=crossover_tokens),
            clock=clock,
            cached=cached,
            min_step=self.best,
        )
        # per worker: the time per output token of its latest streams as measured, stalls and
        # all, and their low percentile, the unloaded time per token (`best`). Not a floor that
        # falls at once: a stream read in one burst (its tokens came together) measures ~0. Not
        # the cost model's, which takes its predicted stalls out and reaches 0 where it
        # over-predicts them
        self._tpot: dict[str, deque[float]] = {}
        self._best: dict[str, float] = {}
        self._pool_best: float | None = None  # the least of every worker's streams (`pool_best`)
        self._prior_tpot = CostPriors().tpot_s

    def observe(self, event: PolicyEvent) -> None:
        match event:
            case Routed():
                self._routed(event)
            case Completed() | Failed():
                self._done(event.request_id)
                if (wid := self._filling_on.pop(event.request_id, None)) is not None:
                    self._filling.get(wid, {}).pop(event.request_id, None)
            case WorkerGone():
                self._routed_s.pop(event.worker_id, None)
                for rid in self._filling.pop(event.worker_id, {}):
                    self._filling_on.pop(rid, None)
                for rid in self._held.pop(event.worker_id, {}):
                    self._where.pop(rid, None)
        self.model.observe(event)
        if isinstance(event, Completed) and event.timings is not None and event.worker_ids:
            t = event.timings
            counted = t.output_tokens if t.output_tokens is not None else (event.output_tokens or t.chunks)
            if t.decode_s is not None and counted >= MIN_TOKENS:
                wid = event.worker_ids[-1]
                seen = self._tpot.get(wid)
                if seen is None:
                    seen = self._tpot[wid] = deque(maxlen=TPOT_SAMPLES)
                seen.append(t.decode_s / (counted - 1))
                n = len(seen)  # the median until there are 10
                self._best[wid] = min(seen) if n >= 10 else sorted(seen)[n // 2]
                if self.settings.pool_best and n < 10:  # the least of the pool's, once it has 10
                    pooled = [v for d in self._tpot.values() for v in d]
                    if len(pooled) >= 10:
                        self._pool_best = min(pooled)
                elif self.settings.pool_best and self._pool_best is not None:
                    self._pool_best = min(self._pool_best, seen[-1])

    def _routed(self, ev: Routed) -> None:
        wid = ev.worker_ids[0]
        prompt = max(1, ev.prompt_tokens)
        cached = min(prompt - 1, max(0, self._cached(ev, wid)))
        now = self.clock()
        key = ev.prompt_key
        if self.settings.prefilled and key is not None:
            cached = self.engine_cached(key, wid, cached, now)
        seconds = prefill_work(prompt - cached, cached, self.crossover) / self._rate(wid)
        if self.settings.prefilled and key is not None and self._wait is not None:
            self._filling.setdefault(wid, {})[ev.request_id] = (
                now + self._wait(wid, now) + seconds,
                cached,
                key,
            )
            self._filling_on[ev.request_id] = wid
        total = self._routed_s[wid] = self._routed_s.get(wid, 0.0) + seconds
        if ev.disaggregated:  # its decode is elsewhere and prefills nothing there (SGLang)
            return
        self._done(ev.request_id)  # routed again (a retry): its new place only
        out = self.model.output_tokens(ev.max_tokens) if ev.max_tokens > 0 else 1
        self._held.setdefault(wid, {})[ev.request_id] = (out, total)
        where = self._where
        where[ev.request_id] = (wid, now)
        while where:  # forget what never answered (a lost outcome) after the horizon
            rid, (_, at) = next(iter(where.items()))
            if at >= now - HORIZON_S and len(where) <= MAX_HELD:
                break
            self._done(rid)

    def _done(self, rid: str) -> None:
        got = self._where.pop(rid, None)
        if got is not None:
            held = self._held.get(got[0])
            if held is not None:
                held.pop(rid, None)

    def engine_cached(self, key: PromptKey, worker_id: str, cached: int, now: float) -> int:
        """Of the `cached` tokens the index predicts `worker_id` holds of the prompt `key`, those
        its engine will have when it schedules the prompt (`prefilled`, module docstring): at most
        what a prefill still running there found cached itself, where that prefill shares more
        of the prompt than that."""
        running = self._filling.get(worker_id)
        if not running or cached <= 0 or self._chain is None:
            return cached
        mine: tuple[int, ...] | None = None
        for rid, (end, found, other) in list(running.items()):
            if end <= now:
                del running[rid]
                self._filling_on.pop(rid, None)
                continue
            if found >= cached:
                continue
            if mine is None:
                mine = self._chain(key)
            if shared_blocks(mine, self._chain(other)) * self._block_tokens > found:
                cached = found
        return cached

    def queued_work(self, ev: Routed, worker_id: str, cached: int, work: float) -> float:
        """With `queue_prefilled` (the caller checks it), the prefill work a request just routed
        to `worker_id` queues there: its work for the cached tokens `_routed` predicted the
        engine finds (`prefilled`'s view) where fewer than `cached` (the index's view, whose
        work is `work`), else `work`."""
        got = self._filling.get(worker_id, {}).get(ev.request_id)
        if got is None or got[1] >= cached:
            return work
        return prefill_work(max(1, ev.prompt_tokens) - got[1], got[1], self.crossover)

    def seconds(
        self, key: PromptKey | None, prompt: int, cached: int, w: WorkerState, own: float, now: float
    ) -> float:
        """The prefill seconds on `w` the SLO term weighs: `own` (cache_aware's, for `cached`
        tokens found), or with `prefilled` the engine's view's where a running prefill shares
        the prefix."""
        if not self.settings.prefilled or key is None or cached <= 0:
            return own
        got = self.engine_cached(key, w.id, cached, now)
        if got >= cached:
            return own
        return prefill_work(prompt - got, got, self.crossover) / self._rate(w.id)

    def weigh(
        self, w: WorkerState, req: RequestView, cached: int, own: float, wait: float, limit: float, now: float
    ) -> tuple[float, int, float, tuple[HeldDecode, ...]]:
        """A decision record's SLO figures for the request's prefill on `w` after `wait` (`own`
        seconds for `cached` tokens found, as cache_aware predicts; `limit` its TTFT SLO): (the prefill
        seconds weighed, `misses`, `best(w)`, `held`)."""
        seconds = self.seconds(req.prompt_key, max(1, req.prompt_tokens), cached, w, own, now)
        return seconds, self.misses(w, now, wait, seconds, limit), self.best(w.id), self.held(w, seconds)

    def best(self, worker_id: str) -> float:
        """The worker's unloaded time per output token: the least that its latest streams of at
        least `MIN_TOKENS` took per token, the median of fewer than 10 (without samples of its own, the least
        of its peers', else the prior). With `pool_best`, while it has fewer than 10 the least of
        all the pool's streams once they are 10 (a worker's first streams ran under load: their
        median was 1.5-2.7x the unloaded TPOT early in the x3 replay, docs/benchmarks.md)."""
        got = self._best.get(worker_id)
        pool = self._pool_best
        if pool is not None and len(self._tpot.get(worker_id, ())) < 10:  # (`pool_best`)
            return pool if got is None else min(got, pool)
        if got is not None:
            return got
        return min(self._best.values()) if self._best else self._prior_tpot

    def ttft_limit(self, prompt: int, rate: float) -> float:
        """The request's TTFT SLO in seconds (inf when none is set): `rate` is the prefill work
        per second of an idle worker (the caller's measure)."""
        s = self.settings
        if not s.ttft_on:
            return math.inf
        unloaded = prefill_work(prompt, 0, self.crossover) / rate if s.ttft_slo_x > 0.0 else 0.0
        return s.ttft_slo_s + s.ttft_slo_x * unloaded

    def broken(self, w: WorkerState, start: float, seconds: float) -> int:
        """Decodes routed to `w` within their TPOT SLO that a prefill over [start, start +
        seconds) is predicted to put over it."""
        s = self.settings
        if not s.tpot_on:
            return 0
        m = self.model
        base = self.best(w.id)
        limit = s.tpot_slo_s + s.tpot_slo_x * base
        n = 0
        if not w.decodes_beside_prefill:
            # a prefill-first worker: a request in its waiting queue holds every decode step
            # there until no prefill is left, so each decode whose answer has not come waits
            # for all of this one, and has waited for all routed there after its own
            slack = limit - base
            total = self._routed_s.get(w.id, 0.0)
            for out, at in self._held.get(w.id, {}).values():
                if out < 2:
                    continue
                budget = (out - 1) * slack
                stall = total - at
                if stall <= budget < stall + seconds:
                    n += 1
            return n
        a, b = m.prefill_fit(w.id)
        chunk = m.chunk_s(w, a, b)
        for stall, added, tokens in m.stalls(w, start, seconds, chunk, m.clock()):
            if added <= 0.0:
                continue
            steps = tokens - 1 if tokens > 1 else 1
            if base + stall / steps <= limit < base + (stall + added) / steps:
                n += 1
        return n

    def held(self, w: WorkerState, seconds: float) -> tuple[HeldDecode, ...]:
        """The decodes on prefill-first `w` whose TPOT `broken` weighs against a prefill of
        `seconds` there, with their predicted budgets and stalls (for decision records; empty
        where the TPOT SLO is off or `w` decodes beside its prefills)."""
        s = self.settings
        if not s.tpot_on or w.decodes_beside_prefill:
            return ()
        base = self.best(w.id)
        slack = s.tpot_slo_s + s.tpot_slo_x * base - base
        total = self._routed_s.get(w.id, 0.0)
        rows = []
        for rid, (out, at) in self._held.get(w.id, {}).items():
            if out < 2:
                continue
            budget, stall = (out - 1) * slack, total - at
            rows.append(HeldDecode(rid, out, budget, stall, stall <= budget < stall + seconds))
        return tuple(rows)

    def misses(self, w: WorkerState, now: float, wait: float, seconds: float, ttft_limit: float) -> int:
        """`broken(w)` plus 1 where this request's own predicted TTFT is over `ttft_limit`; with
        `ttft_after_tpot`, the rank `ttft_rank` gives them."""
        own = 1 if wait + seconds > ttft_limit else 0
        broken = self.broken(w, now + wait, seconds)
        return ttft_rank(broken, own) if self.settings.ttft_after_tpot else own + broken


def ttft_rank(broken: int, own: int) -> int:
    """`misses` with `ttft_slo_rank = "after_tpot"`: `2 x broken + own` (`own` 0 or 1), so the
    fewest orders the candidates by the decodes they break first and by the request's own TTFT
    miss only among those breaking as few (a lexicographic order as one int: the selectors'
    "fewest misses" filter is unchanged). Summed, an own TTFT miss saved by a worker that breaks
    one decode ties with the clean worker and the cost then picks, most often the cache holder
    that breaks it: on the x3 replay summing raised the TPOT misses by 11-13 a repeat
    (docs/benchmarks.md, "The TTFT SLO again, on the corrected rate")."""
    return 2 * broken + own


def shared_blocks(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """The leading blocks two chains of prefix-chained keys share (key `j` stands for blocks
    `0..j`, so equal keys at `j` mean equal keys below it: a binary search)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


NO_SLO: tuple[float, int, float, tuple[HeldDecode, ...]] = (0.0, 0, 0.0, ())  # `weigh` with no SLO set

__all__ = ["NO_SLO", "DecodeSlo", "HeldDecode", "SloSettings", "shared_blocks", "ttft_rank"]
