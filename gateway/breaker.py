"""Circuit breakers, one per worker and one per (prefill, decode) pair.

closed --(failure_threshold consecutive failures)--> open --(open_s elapsed)--> half-open
half-open --(success_threshold successes)--> closed; half-open --(a failure)--> open.
While half-open, one trial request at a time is let through. Outcomes are recorded when a
request has ended (stream included), not when its headers arrive.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    __slots__ = (
        "_clock",
        "_failures",
        "_open_s",
        "_opened_at",
        "_successes",
        "_trial",
        "failure_threshold",
        "state",
        "success_threshold",
    )

    def __init__(
        self,
        failure_threshold: int = 5,
        success_threshold: int = 2,
        open_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self._open_s = open_s
        self._clock = clock
        self.state = BreakerState.CLOSED
        self._failures = 0
        self._successes = 0
        self._opened_at = 0.0
        self._trial = False

    def allows(self) -> bool:
        """May a request be sent now? (Pure apart from the open → half-open transition.)"""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            if self._clock() - self._opened_at < self._open_s:
                return False
            self.state = BreakerState.HALF_OPEN
            self._successes = 0
            self._trial = False
        return not self._trial

    @property
    def admits(self) -> bool:
        """Would a request be let through now, as far as known without the clock: closed, or
        half-open with no trial in flight. Pure (the open -> half-open move is `allows()`'s)."""
        return self.state is BreakerState.CLOSED or (self.state is BreakerState.HALF_OPEN and not self._trial)

    def on_dispatch(self) -> bool:
        """A request goes to the worker. True if it is the half-open trial (no other request is
        let through until it has ended)."""
        if self.state is BreakerState.HALF_OPEN:
            self._trial = True
            return True
        return False

    def record(self, ok: bool | None) -> bool:
        """Record one outcome; True when the state changed. None: the request ended without a
        verdict on this worker (another leg failed first): nothing is counted, and a half-open
        trial slot is freed for the next request."""
        before = self.state
        if ok is None:
            if self.state is BreakerState.HALF_OPEN:
                self._trial = False
            return False
        if ok:
            self._failures = 0
            if self.state is BreakerState.HALF_OPEN:
                self._trial = False
                self._successes += 1
                if self._successes >= self.success_threshold:
                    self.state = BreakerState.CLOSED
        else:
            self._failures += 1
            if self.state is BreakerState.HALF_OPEN or self._failures >= self.failure_threshold:
                self._trip()
        return self.state is not before

    def _trip(self) -> None:
        self.state = BreakerState.OPEN
        self._opened_at = self._clock()
        self._trial = False
        self._successes = 0

    def force_open(self) -> None:
        self._trip()
