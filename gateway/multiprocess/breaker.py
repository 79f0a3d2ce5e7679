"""A circuit breaker whose state lives in the shared table: one breaker per worker (and per
pair) for all the gateway's processes.

The state machine is `CircuitBreaker`'s own code: this class only keeps its fields in the
table's cells instead of in the object, and runs every step that changes them under the table's
lock. What the request path calls per request stays lock-free where nothing changes: `allows()`
on a closed breaker, `record(True)` on a closed breaker with no failures counted, `on_dispatch()`
on a breaker that is not half-open, `admits` and `state` (one read each).

Every change of state or of the half-open trial bumps the table's generation (its pair
generation too, for a pair's breaker), so that the other processes rebuild their snapshots.
Differences from one process: two processes may each let one trial through a half-open breaker
at the same moment (each reads "no trial yet" before either marks it), and a success recorded
by one process between another's failures resets the count of consecutive failures as it would
in one process with those requests interleaved.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gateway.breaker import BreakerState, CircuitBreaker
from gateway.multiprocess import table as t
from gateway.multiprocess.table import SharedTable

_STATES = (BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN)
_CODES = {s: i for i, s in enumerate(_STATES)}
_CLOSED_CODE = 0
_HALF_OPEN_CODE = 2


class SharedBreaker(CircuitBreaker):
    __slots__ = ("_base", "_cells", "_fcells", "_pair", "_table")

    def __init__(
        self,
        table: SharedTable,
        slot: int,
        failure_threshold: int = 5,
        success_threshold: int = 2,
        open_s: float = 30.0,
        *,
        pair: bool = False,
        clock: Callable[[], float] = time.monotonic,  # CLOCK_MONOTONIC: one clock for all processes
    ) -> None:
        # not CircuitBreaker.__init__: it would reset the shared fields
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self._open_s = open_s
        self._clock = clock
        self._table = table
        self._cells = table.i
        self._fcells = table.f
        self._base = table.slot_cell(slot, 0)
        self._pair = pair

    # -- the fields, in the table -------------------------------------------------------------

    @property
    def state(self) -> BreakerState:
        return _STATES[self._cells[self._base + t.STATE]]

    @state.setter
    def state(self, value: BreakerState) -> None:
        self._cells[self._base + t.STATE] = _CODES[value]

    @property
    def _failures(self) -> int:
        return self._cells[self._base + t.FAILURES]

    @_failures.setter
    def _failures(self, value: int) -> None:
        self._cells[self._base + t.FAILURES] = value

    @property
    def _successes(self) -> int:
        return self._cells[self._base + t.SUCCESSES]

    @_successes.setter
    def _successes(self, value: int) -> None:
        self._cells[self._base + t.SUCCESSES] = value

    @property
    def _trial(self) -> bool:
        return bool(self._cells[self._base + t.TRIAL])

    @_trial.setter
    def _trial(self, value: bool) -> None:
        self._cells[self._base + t.TRIAL] = 1 if value else 0

    @property
    def _opened_at(self) -> float:
        return self._fcells[self._base + t.OPENED_AT]

    @_opened_at.setter
    def _opened_at(self, value: float) -> None:
        self._fcells[self._base + t.OPENED_AT] = value

    # -- the transitions, under the lock --------------------------------------------------------

    def _mark(self) -> tuple[int, int]:
        return self._cells[self._base + t.STATE], self._cells[self._base + t.TRIAL]

    def _bump_if(self, before: tuple[int, int]) -> None:
        if self._mark() != before:
            self._table.bump_locked(pairs=self._pair)

    def allows(self) -> bool:
        if self._cells[self._base + t.STATE] == _CLOSED_CODE:
            return True
        with self._table.locked():
            before = self._mark()
            out = super().allows()
            self._bump_if(before)
        return out

    def on_dispatch(self) -> bool:
        if self._cells[self._base + t.STATE] != _HALF_OPEN_CODE:
            return False
        with self._table.locked():
            before = self._mark()
            out = super().on_dispatch()
            self._bump_if(before)
        return out

    def record(self, ok: bool | None) -> bool:
        code = self._cells[self._base + t.STATE]
        if ok is None and code != _HALF_OPEN_CODE:
            return False
        if ok and code == _CLOSED_CODE and not self._cells[self._base + t.FAILURES]:
            return False
        with self._table.locked():
            before = self._mark()
            out = super().record(ok)
            self._bump_if(before)
        return out

    def force_open(self) -> None:
        with self._table.locked():
            before = self._mark()
            super().force_open()
            self._bump_if(before)
