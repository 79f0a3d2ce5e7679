"""Predicted prefill work per worker: a fluid queue drained at the worker's measured prefill rate.

Every routed request adds its uncached prompt tokens to its worker's backlog; the backlog drains
at the worker's prefill rate (tokens per second) as time passes, so no "prefill finished" event
is needed (Dynamo's decaying active-prefill tokens). The predicted time to first token of a
request on a worker is then

    ttft(w) = (backlog(w) + uncached(w)) / rate(w)

in seconds, the unit-consistent cost the cache-aware policy minimises (the anchors' cache-vs-load
constants become one quantity: SMG's expected wait, Mooncake's T_queue + T_prefill).

The rate is learned from what requests took: a request routed when the worker's backlog was `B`
with `U` uncached tokens, whose prefill ended `t` seconds later (its first token, or a P/D
prefill's answer), saw the worker prefill about `(B + U) / t` tokens per second (an
exponentially weighted average, only from requests with enough work to dominate their fixed
overheads; clamped to a sane range). A worker with no measurement yet is taken to prefill at the
mean of the measured workers' rates (the pool is usually alike), `default_rate` while none is
measured: a fixed guess next to measured rates would make a new or idle worker look faster or
slower than it is, and a worker that looks slower is never sent the request that would measure
it.
Work is counted in dense-token equivalents, not tokens (`policies.estimators.prefill_work`, the
cost model's): a prefill's FLOPs are
`2 x params x U` for the matmuls plus `4 x layers x hidden x U x (C + U / 2)` for attention over
the causal context (`C` cached tokens before the `U` new ones), so

    work(U, C) = U x (1 + (C + U / 2) / crossover_tokens),  crossover_tokens = params / (2 x layers x hidden)

(about 30,500 for Llama-3-8B, 53,000 for Llama-3-70B: the context length at which attention
costs as much as the matmuls). Counting tokens instead makes one rate wrong for every length:
a 191k-token prompt prefills at a third of a 20k one's tokens per second, so its backlog was
predicted to drain three times too fast and the requests sent after it to its worker (cache
hits, cheap on paper) waited seconds that no prediction showed.

The engine's own report of waiting requests puts a floor under the backlog (work other gateway
replicas sent): `waiting * mean uncached tokens per request`.

With `fit` (`prefill_fit = "line"`) the rate is the slope of a line fitted per worker instead,

    seconds = overhead(w) + (backlog + work) / rate(w)

(`policies.estimators.LinearFit`, exponentially weighted least squares, every request
measured): a prefill's fixed cost (the engine's step and the request's round trip, ~4 ms at
20 tokens on the emulated H100) is the intercept, not a slower rate. The single-rate average
took each small request's fixed cost for slowness (a 351-token prompt measured ~55k work/s, a
38k one ~125k), and a rate pulled low predicted a backlog that had already drained, which the
next short request then measured as a rate 5x too fast (590k work/s in one sample): over a
replay a quarter of the decisions ran on a rate outside 100-140k work/s, their predicted TTFT
off 1.4-2x (docs/benchmarks.md, "The learned prefill rate"). Every sample after the first
counts as at most `CLIP` x slower than the line predicted, and once the line has `CLIP_AFTER`
samples as at most `CLIP` x faster, so one sample moves the line a bounded step. The asymmetry:
a young line is too slow (its first sample is often a small prefill, mostly fixed cost: through
the origin 5-10x too slow), so a faster sample is what it needs, at once; a slower one is most
often a request queued behind work the gateway did not count, which only ever adds seconds.
Unclipped, one such (105 work units in 205 ms, its four-sample line predicting 6 ms) tipped the
least-squares slope to its floor: the rate jumped from 35k to the 10M work/s cap, the worker's
backlog looked drained at once, it was sent 50 of the next 64 requests and ended with 1.5x the
mean prefill work (docs/benchmarks.md, "Why the line lost on the defaults").
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.base import Completed
from policies.estimators import LinearFit

CLIP = 2.0  # with `fit`: a sample after the first counts as at most this factor slower than the line
CLIP_AFTER = 5  # ... and, once the line has this many samples, at most this factor faster


@dataclass(frozen=True, slots=True)
class RateSettings:
    default_rate: float = 10_000.0  # work (dense-token equivalents) per second before any measurement
    min_rate: float = 100.0
    max_rate: float = 10_000_000.0
    learn_min_tokens: int = 256  # requests with less work are not measured (overheads dominate)
    smoothing: float = 0.2  # weight of a new measurement
    fit: bool = False  # a line per worker (fixed cost + work / rate) instead of the EWMA rate
    fit_forget: float = 0.05  # with `fit`: each sample scales the older ones by 1 - this
    max_overhead_s: float = 0.1  # with `fit`: the fixed cost's upper bound


class PrefillQueues:
    """Per worker: queued prefill tokens (fluid), its prefill rate, and the mean request size.

    Reads (`backlog`, `rate`, `ttft`) take `now` and change nothing; `add`, `learn` and
    `forget` are called from the policy's `observe`.
    """

    __slots__ = (
        "_fits",
        "_mean_uncached",
        "_prior",
        "_queue",
        "_rate",
        "_rate_sum",
        "changes",
        "changes_epoch",
        "settings",
    )

    LOG_LIMIT = 4096  # `changes` is cleared (and `changes_epoch` moves on) past this many

    def __init__(self, settings: RateSettings | None = None) -> None:
        self.settings = settings or RateSettings()
        self._queue: dict[str, tuple[float, float]] = {}  # worker -> (tokens, as of)
        self._rate: dict[str, float] = {}
        self._fits: dict[str, LinearFit] = {}  # with `settings.fit`
        self._rate_sum = 0.0
        self._prior = self.settings.default_rate  # an unmeasured worker's: the measured ones' mean
        self._mean_uncached = 1024.0  # SMG's mean_prefill_tokens default, until measured
        # the workers whose queue or rate changed, in order (repeats kept), for readers that keep
        # their own order of the workers (policies/cache_pool_order.py); a reader that saw another
        # `changes_epoch` starts over
        self.changes: list[str] = []
        self.changes_epoch = 0

    def _changed(self, worker_id: str) -> None:
        log = self.changes
        if len(log) >= self.LOG_LIMIT:
            log.clear()
            self.changes_epoch += 1
        log.append(worker_id)

    @property
    def prior(self) -> float:
        """The rate of a worker not measured yet."""
        return self._prior

    def queued(self, worker_id: str) -> tuple[float, float] | None:
        """(tokens, as of) of the worker's fluid queue; None: nothing was ever queued."""
        return self._queue.get(worker_id)

    def drains_at(self, worker_id: str) -> tuple[float, float] | None:
        """(rate, when its fluid queue is empty at that rate) for a measured worker (-inf: no queue
        ever); None for a worker not measured yet (its rate is `prior`, which moves)."""
        rate = self._rate.get(worker_id)
        if rate is None:
            return None
        q = self._queue.get(worker_id)
        return rate, (q[1] + q[0] / rate if q is not None else float("-inf"))

    def rate(self, worker_id: str) -> float:
        return self._rate.get(worker_id, self._prior)

    def overhead(self, worker_id: str) -> float:
        """With `fit`: the fitted fixed seconds of a prefill on the worker (0: not fitted)."""
        f = self._fits.get(worker_id)
        return 0.0 if f is None else f.coefficients()[0]

    def backlog(self, worker_id: str, now: float, waiting: int = 0) -> float:
        """Tokens still queued for prefill on the worker at `now`."""
        q = self._queue.get(worker_id)
        fluid = 0.0
        if q is not None:
            tokens, at = q
            fluid = max(0.0, tokens - self.rate(worker_id) * max(0.0, now - at))
        return max(fluid, waiting * self._mean_uncached)

    def backlog_rate(self, worker_id: str, now: float, waiting: int = 0) -> tuple[float, float]:
        """(backlog, rate) in one call (the policy's loop over candidates)."""
        rate = self._rate.get(worker_id, self._prior)
        q = self._queue.get(worker_id)
        fluid = 0.0
        if q is not None:
            fluid = q[0] - rate * (now - q[1])
            if fluid < 0.0:
                fluid = 0.0
        floor = waiting * self._mean_uncached
        return (fluid if fluid > floor else floor), rate

    def ttft(self, worker_id: str, uncached: float, now: float, waiting: int = 0) -> float:
        """Predicted seconds to the first token of a request with `uncached` tokens to prefill."""
        return (self.backlog(worker_id, now, waiting) + uncached) / self.rate(worker_id)

    def add(self, worker_id: str, tokens: float, now: float) -> None:
        self._queue[worker_id] = (self.backlog(worker_id, now) + tokens, now)
        self._changed(worker_id)
        m = self._mean_uncached
        self._mean_uncached = m + 0.05 * (tokens - m)

    def learn(self, worker_id: str, work_tokens: float, seconds: float) -> None:
        """A request that had `work_tokens` (backlog + its own uncached) ahead of its first token
        took `seconds`."""
        s = self.settings
        if s.fit:
            if work_tokens > 0 and seconds > 0:
                self._fit(worker_id, work_tokens, seconds)
            return
        if work_tokens < s.learn_min_tokens or seconds <= 0:
            return
        sample = min(max(work_tokens / seconds, s.min_rate), s.max_rate)
        old = self._rate.get(worker_id)
        new = sample if old is None else old + s.smoothing * (sample - old)
        self._set_rate(worker_id, new)

    def _fit(self, worker_id: str, work: float, seconds: float) -> None:
        """`learn` with `fit`: the sample, clipped (`CLIP`, `CLIP_AFTER`), joins the worker's
        line; its rate is 1 / the slope. The first sample starts the line through the origin at
        its own rate (the EWMA's first value)."""
        s = self.settings
        f = self._fits.get(worker_id)
        if f is None:
            slope = min(max(seconds / work, 1.0 / s.max_rate), 1.0 / s.min_rate)
            f = self._fits[worker_id] = LinearFit(
                0.0,
                slope,
                work,
                prior_weight=0.5,
                forget=s.fit_forget,
                b_min=1.0 / s.max_rate,
                b_max=1.0 / s.min_rate,
                a_max=s.max_overhead_s,
            )
        else:
            predicted = f.predict(work)
            seconds = min(seconds, predicted * CLIP)
            if f.samples >= CLIP_AFTER:
                seconds = max(seconds, predicted / CLIP)
        f.add(work, seconds)
        self._set_rate(worker_id, 1.0 / f.coefficients()[1])

    def _set_rate(self, worker_id: str, new: float) -> None:
        old = self._rate.get(worker_id)
        self._rate[worker_id] = new
        self._reprior(new - (old or 0.0))
        self._changed(worker_id)

    def forget(self, worker_id: str) -> None:
        self._queue.pop(worker_id, None)
        self._fits.pop(worker_id, None)
        old = self._rate.pop(worker_id, None)
        if old is not None:
            self._reprior(-old)
        self._changed(worker_id)

    def _reprior(self, change: float) -> None:
        rates = self._rate
        self._rate_sum = self._rate_sum + change if rates else 0.0
        self._prior = self._rate_sum / len(rates) if rates else self.settings.default_rate


def prefill_seconds(ev: Completed) -> float | None:
    """How long after it was routed the request's prefill ended, where the gateway saw it: a P/D
    prefill's answer, else a stream's first token. None for a whole answer (its first byte is
    its last: decode included) and where no timings came. (Not `Completed.ttft_s`: it counts from
    the request's arrival, admission included, and a P/D request's is its decode's first token.)"""
    t = ev.timings
    if t is None:
        return None
    return t.prefill_s if t.prefill_s is not None else t.first_token_s
