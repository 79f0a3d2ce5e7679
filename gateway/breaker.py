"""Circuit breakers, one per worker and one per (prefill, decode) pair: outlier ejection.

closed --(failure_threshold consecutive failures, if the ejection is allowed)--> open
open --(its ejection time elapsed)--> half-open --(success_threshold successes)--> closed
half-open --(a failure)--> open again. While half-open, one trial request at a time is let
through. Outcomes are recorded when a request has ended (stream included), not when its headers
arrive.

As Envoy's outlier detection (its `consecutive_5xx`, `base_ejection_time`, `max_ejection_time`,
`max_ejection_percent` and `failure_percentage_threshold`):

- The ejection time grows with repeated ejections: `open_s` times the number of times the
  breaker opened in a row, at most `max_open_s`; the count drops by one for each `open_s` it
  then stays closed. A worker that keeps failing a share of its requests is ejected again and
  again for longer, and so gets less of the traffic the more it fails.
- An ejection may be refused by `guard` (the registry's: it would take more than
  `breaker.max_ejected_share` of the worker's pool, or of a model's pairs, out of routing at
  once), unless the breaker's recent outcomes (its last `WINDOW`, at least twice
  `failure_threshold` of them) are at least `eject_failure_share` failures: a worker failing a fifth of its requests is kept serving the
  other four fifths instead of its whole pool being shed, while one that fails (nearly) all of
  them is ejected whatever the pool. (Envoy ejects at least one host and then, when fewer than
  half are healthy, routes to all of them anyway, its panic threshold; the gateway has no such
  mode: it answers 503, so it does not eject the last worker of a pool for a partial failure.)
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable

WINDOW = 20  # recent outcomes the failure share is taken over
_MASK = (1 << WINDOW) - 1


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


# Enum members as module constants on the request path: on Python 3.11 a class attribute of an
# Enum goes through EnumType.__getattr__'s slot hook, unspecialised (~70 ns a look-up here),
# a global does not (~7 ns); ~35 such look-ups per request (docs/benchmarks.md)
_CLOSED = BreakerState.CLOSED
_OPEN = BreakerState.OPEN
_HALF_OPEN = BreakerState.HALF_OPEN


def allow_always() -> bool:
    """The default `guard`: every ejection is allowed."""
    return True


class CircuitBreaker:
    __slots__ = (
        "_clock",
        "_closed_at",
        "_ejections",
        "_failures",
        "_open_for",
        "_open_s",
        "_opened_at",
        "_outcomes",
        "_recent",
        "_successes",
        "_trial",
        "eject_failure_share",
        "failure_threshold",
        "guard",
        "max_open_s",
        "state",
        "success_threshold",
    )

    def __init__(
        self,
        failure_threshold: int = 5,
        success_threshold: int = 2,
        open_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        *,
        max_open_s: float = 300.0,
        eject_failure_share: float = 0.85,
        guard: Callable[[], bool] = allow_always,
    ) -> None:
        self._configure(
            failure_threshold, success_threshold, open_s, max_open_s, eject_failure_share, guard, clock
        )
        self.state = _CLOSED
        self._failures = 0  # consecutive
        self._successes = 0  # in half-open
        self._opened_at = 0.0
        self._open_for = open_s  # this ejection's time
        self._ejections = 0  # in a row (decays while closed)
        self._closed_at = 0.0
        self._trial = False
        self._recent = 0  # the last WINDOW outcomes, a bit each (1: a failure), newest lowest
        self._outcomes = 0  # how many of those bits are outcomes (up to WINDOW)

    def _configure(
        self,
        failure_threshold: int,
        success_threshold: int,
        open_s: float,
        max_open_s: float,
        eject_failure_share: float,
        guard: Callable[[], bool],
        clock: Callable[[], float],
    ) -> None:
        """The settings, apart from the state (a `SharedBreaker` keeps that in its table)."""
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self._open_s = open_s
        self.max_open_s = max(open_s, max_open_s)
        self.eject_failure_share = eject_failure_share
        # may this breaker open now? (the registry's: its pool's ejected share); asked only when
        # the recent failure share is below eject_failure_share
        self.guard = guard
        self._clock = clock

    def allows(self) -> bool:
        """May a request be sent now? (Pure apart from the open → half-open transition.)"""
        if self.state is _CLOSED:
            return True
        if self.state is _OPEN:
            if self._clock() - self._opened_at < self._open_for:
                return False
            self.state = _HALF_OPEN
            self._successes = 0
            self._trial = False
        return not self._trial

    @property
    def admits(self) -> bool:
        """Would a request be let through now, as far as known without the clock: closed, or
        half-open with no trial in flight. Pure (the open -> half-open move is `allows()`'s)."""
        return self.state is _CLOSED or (self.state is _HALF_OPEN and not self._trial)

    @property
    def ejection_s(self) -> float:
        """How long the current (or last) ejection lasts."""
        return self._open_for

    @property
    def failure_share(self) -> float:
        """The share of failures among the recent outcomes (0.0 with none yet)."""
        return (self._recent & _MASK).bit_count() / self._outcomes if self._outcomes else 0.0

    def on_dispatch(self) -> bool:
        """A request goes to the worker. True if it is the half-open trial (no other request is
        let through until it has ended)."""
        if self.state is _HALF_OPEN:
            self._trial = True
            return True
        return False

    def record(self, ok: bool | None) -> bool:
        """Record one outcome; True when the state changed. None: the request ended without a
        verdict on this worker (another leg failed first): nothing is counted, and a half-open
        trial slot is freed for the next request."""
        before = self.state
        if ok and before is _CLOSED and not self._recent and self._outcomes == WINDOW:
            # a success that changes nothing (a full window of successes, so no failures in a
            # row either): the usual outcome, in a few steps (as SharedBreaker.record's)
            return False
        if ok is None:
            if self.state is _HALF_OPEN:
                self._trial = False
            return False
        self._recent = ((self._recent << 1) | (not ok)) & _MASK
        if self._outcomes < WINDOW:
            self._outcomes += 1
        if ok:
            self._failures = 0
            if self.state is _HALF_OPEN:
                self._trial = False
                self._successes += 1
                if self._successes >= self.success_threshold:
                    self.state = _CLOSED
                    self._closed_at = self._clock()
        else:
            self._failures += 1
            half_open = self.state is _HALF_OPEN
            if half_open or self._failures >= self.failure_threshold:
                if self._failing() or self.guard():
                    self._trip()  # (a failed half-open trial: ejected again, for longer)
                else:
                    # kept in service, its pool would lose too much: counted afresh
                    self._failures = 0
                    if half_open:
                        self.state = _CLOSED
                        self._trial = False
                        self._closed_at = self._clock()
        return self.state is not before

    def _failing(self) -> bool:
        """Are (nearly) all recent outcomes failures, over enough of them (twice the threshold,
        at most WINDOW) that a partly failing worker's unlucky run is not taken for it?"""
        n = self._outcomes
        if n < min(WINDOW, 2 * self.failure_threshold):
            return False
        return (self._recent & _MASK).bit_count() >= self.eject_failure_share * n

    def _trip(self) -> None:
        now = self._clock()
        if self.state is _CLOSED and self._ejections:
            # one ejection forgiven per open_s spent closed since the last one
            self._ejections = max(0, self._ejections - int((now - self._closed_at) / self._open_s))
        self._ejections += 1
        self._open_for = min(self.max_open_s, self._open_s * self._ejections)
        self.state = _OPEN
        self._opened_at = now
        self._trial = False
        self._successes = 0
        self._failures = 0

    def force_open(self) -> None:
        self._trip()
