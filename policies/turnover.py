"""How fast each worker's KV cache turns over: the new KV tokens the gateway sent it, decayed.

A prefill that writes `U` new tokens to a worker whose pool is full pushes its `U` least
recently used tokens out (both engines' prefix caches evict LRU). Those are worth more on a
worker whose cache turns over fast: its oldest entries are young, often the prefix of a
conversation whose next turn has not come yet. `cache_aware`'s eviction price (`evict_price`,
policies/cache_aware.py) is

    evict(w) = evict_price x new(w) / rate(w) x written(w) / pool(w)

`new(w) / rate(w)`: the seconds of prefill the evicted tokens take to compute again;
`written(w) / pool(w)`: the share of its pool the worker was sent as new KV over the last
`window_s` (an exponentially decayed sum, this class), standing for how likely what it evicts
is asked for again. An idle cache (nothing written lately) evicts what nobody asked for in a
while: no price; a worker rewritten faster than its pool within the window evicts prefixes
whose next turn is still to come.

The sums are kept scaled by `exp((t - t0) / window)` so that a read is one multiply by a factor
computed once per decision (the hot loop reads one dict entry per candidate); `t0` moves
forward (every sum rescaled) before the scale can overflow.
"""

from __future__ import annotations

import math

_REBASE = 50.0  # windows: exp(50) ~ 5e21, far from a float's range


class Turnover:
    """Per worker: new KV tokens sent to it, exponentially decayed over `window_s`."""

    __slots__ = ("_scaled", "_t0", "window_s")

    def __init__(self, window_s: float = 10.0) -> None:
        if not (math.isfinite(window_s) and window_s > 0):
            raise ValueError(f"window_s must be a finite number > 0, got {window_s}")
        self.window_s = window_s
        self._scaled: dict[str, float] = {}
        self._t0: float | None = None

    def add(self, worker: str, tokens: float, now: float) -> None:
        if tokens <= 0.0:
            return
        if self._t0 is None:
            self._t0 = now
        e = (now - self._t0) / self.window_s
        if e > _REBASE:
            k = math.exp(-e)
            self._scaled = {w: v * k for w, v in self._scaled.items() if v * k > 1e-9}
            self._t0, e = now, 0.0
        self._scaled[worker] = self._scaled.get(worker, 0.0) + tokens * math.exp(e)

    def factor(self, now: float) -> float:
        """The multiplier that turns `scaled` values into tokens as of `now`."""
        if self._t0 is None:
            return 0.0
        return math.exp((self._t0 - now) / self.window_s)

    @property
    def scaled(self) -> dict[str, float]:
        return self._scaled

    def tokens(self, worker: str, now: float) -> float:
        """The decayed new KV tokens sent to `worker` as of `now`."""
        return self._scaled.get(worker, 0.0) * self.factor(now)

    def forget(self, worker: str) -> None:
        self._scaled.pop(worker, None)
