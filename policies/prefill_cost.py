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
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.base import Completed


@dataclass(frozen=True, slots=True)
class RateSettings:
    default_rate: float = 10_000.0  # work (dense-token equivalents) per second before any measurement
    min_rate: float = 100.0
    max_rate: float = 10_000_000.0
    learn_min_tokens: int = 256  # requests with less work are not measured (overheads dominate)
    smoothing: float = 0.2  # weight of a new measurement


class PrefillQueues:
    """Per worker: queued prefill tokens (fluid), its prefill rate, and the mean request size.

    Reads (`backlog`, `rate`, `ttft`) take `now` and change nothing; `add`, `learn` and
    `forget` are called from the policy's `observe`.
    """

    __slots__ = (
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
        if work_tokens < s.learn_min_tokens or seconds <= 0:
            return
        sample = min(max(work_tokens / seconds, s.min_rate), s.max_rate)
        old = self._rate.get(worker_id)
        new = sample if old is None else old + s.smoothing * (sample - old)
        self._rate[worker_id] = new
        self._reprior(new - (old or 0.0))
        self._changed(worker_id)

    def forget(self, worker_id: str) -> None:
        self._queue.pop(worker_id, None)
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
