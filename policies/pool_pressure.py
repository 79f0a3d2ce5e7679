"""What one unit of prefill work added to a busy pool costs the requests that come after it.

The predicted TTFT a cache-aware policy minimises is the routed request's own. Sending a turn
away from the worker that holds its prefix can shorten that request's wait, but the pool then
computes the prefix again, and under load that extra work is paid by every request that arrives
while the pool is still busy: the router balances later arrivals over the workers, so each of
them starts about `extra / R` seconds later (`R`: the pool's prefill work per second, the sum of
the workers' rates). How many requests that is follows from the busy period of a queue (M/G/1):
work queued now keeps the pool busy for about `W / (1 - rho)` seconds (`W`: the mean predicted
wait over the pool, `rho`: the share of the pool's capacity that arriving work uses), during
which `lam x W / (1 - rho)` requests arrive (`lam`: arrivals per second). So a request whose
prefill is `work` on some worker costs the others

    externality = work x K,   K = lam x W / ((1 - rho) x R)          (seconds per work unit)

An idle pool (`W = 0`) costs nothing: the choice is the predicted TTFT's, as before. A busy one
charges a worker that would recompute a cached prefix for all the requests the recomputation
delays, so a turn stays on its cache holder unless the holder's own queue costs more than that
(the saturation pin of sglang's newer router, "when every worker is queued diversion buys
nothing", as a price rather than a rule). `rho` is capped (`RHO_MAX`) so that the price stays
finite when the pool is overloaded.

`lam` and the work rate are exponentially decayed counts over `window_s` (`DecayedRate`):
measured by the gateway itself from what it routes, so they need no engine metric.

`W` is what later arrivals wait, and the mean over the pool reads that only while the router
can balance them over every worker. A worker far more backed up than the rest takes none of
them (the cost sends them to the others), so its queue delays none of them: one worker with
seconds queued beside idle ones is not a busy pool. With `queue_wait = "shared"` `W` is the
mean over the workers the arrivals share (`shared_wait`): the others' level `L` (their mean
wait) falls at `1 - rho_s` seconds a second while they take every arrival (`rho_s`: `rho` over
their share of the pool) and a backed-up worker's wait falls at 1, so it rejoins them before
they run dry only when its wait is under `L / (1 - rho_s)`; beyond that it is left out, the
most backed-up first. At `rho_s >= 1` the others fill up to it and every worker counts (the
mean). `R` and `rho` stay the pool's: the worker left out still serves, its own turns and,
once drained, the rest.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

RHO_MAX = 0.9  # the busy-period factor 1 / (1 - rho) stays at most 10


class DecayedRate:
    """Events (and an amount carried by each) per second over an exponential window.

    Until a window has passed since the first event the decayed sums cover less than a window,
    so they are divided by the part they cover, `window x (1 - exp(-elapsed / window))`, at
    least half the window (a gateway that just started reads its rate, not a fraction of it, and
    a lone burst is not read as a steady rate)."""

    __slots__ = ("_amount", "_at", "_count", "_first", "window_s")

    def __init__(self, window_s: float = 10.0) -> None:
        if not (math.isfinite(window_s) and window_s > 0):
            raise ValueError(f"window_s must be a finite number > 0, got {window_s}")
        self.window_s = window_s
        self._count = 0.0
        self._amount = 0.0
        self._at: float | None = None
        self._first = 0.0

    def add(self, amount: float, now: float) -> None:
        if self._at is None:
            self._first = now
        k = self._decay(now)
        self._count = self._count * k + 1.0
        self._amount = self._amount * k + amount
        self._at = now

    def rates(self, now: float) -> tuple[float, float]:
        """(events per second, amount per second) as of `now`."""
        if self._at is None:
            return 0.0, 0.0
        w = self.window_s
        covered = w * -math.expm1((self._first - now) / w) if now > self._first else 0.0
        k = self._decay(now) / max(covered, 0.5 * w)
        return self._count * k, self._amount * k

    def _decay(self, now: float) -> float:
        at = self._at
        if at is None or now <= at:
            return 1.0
        return math.exp((at - now) / self.window_s)


def externality_per_work(
    arrivals_per_s: float, work_per_s: float, mean_wait_s: float, pool_rate: float
) -> float:
    """`K` of the module docstring: seconds of others' delay per unit of prefill work added."""
    if pool_rate <= 0.0 or mean_wait_s <= 0.0 or arrivals_per_s <= 0.0:
        return 0.0
    rho = work_per_s / pool_rate
    if rho > RHO_MAX:
        rho = RHO_MAX
    elif rho < 0.0:
        rho = 0.0
    return arrivals_per_s * mean_wait_s / ((1.0 - rho) * pool_rate)


def shared_wait(waits: Sequence[float], rho: float) -> float:
    """The mean of `waits` (seconds, one a worker of equal rates) over the workers later arrivals
    share at pool load `rho`: the most backed-up left out while its wait exceeds `L / (1 -
    rho_s)` (the module docstring), `L` the rest's mean, `rho_s = rho x n / (rest)`."""
    ws = sorted(waits)
    n = m = len(ws)
    if n == 0:
        return 0.0
    while m > 1:
        rest = m - 1
        load = rho * n / rest
        if load >= 1.0 or ws[rest] * (1.0 - load) <= math.fsum(ws[:rest]) / rest:
            break
        m = rest
    return math.fsum(ws[:m]) / m
