"""A circuit breaker whose state lives in the shared table: one breaker per worker (and per pair)
for all the gateway's processes, outlier ejection included.

The state machine is `CircuitBreaker`'s own code (gateway/breaker.py): this class only keeps its
fields in the table's cells instead of in the object, and runs every step that changes them
under the table's lock. That covers the outlier-ejection rules as well: the ejections in a row
(each ejection lasts `open_s` times their number, at most `max_open_s`), the one forgiven per
`open_s` spent closed, and the last `WINDOW` outcomes that decide whether a worker fails
(nearly) all its requests (`eject_failure_share`) are cells of the table, so every process's
outcomes count in them, and an ejection one process makes grows the next one another makes.
The `guard` that caps a pool's ejected share (`breaker.max_ejected_share`, the registry's) runs
inside the same locked step and reads the other breakers' states from the table, so two
processes cannot each eject a different worker of a pool that may lose only one.

What the request path calls per request stays lock-free where nothing can change: `allows()` on
a closed breaker, `on_dispatch()` on a breaker that is not half-open, `record(None)` outside
half-open, `admits` and `state` (one read each), and `record(True)` on a closed breaker whose
last `WINDOW` outcomes were all successes (it would shift a zero into zeros: the steady state
of a healthy worker). Any other outcome takes the lock: it goes into the recent outcomes, which
the failure share is taken over.

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

from gateway.breaker import WINDOW, BreakerState, CircuitBreaker, allow_always
from gateway.multiprocess import table as t
from gateway.multiprocess.table import SharedTable

_STATES = (BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN)
_CODES = {s: i for i, s in enumerate(_STATES)}
CLOSED_CODE = 0
_HALF_OPEN_CODE = 2
_MASK = (1 << WINDOW) - 1  # the recent outcomes' bits, as gateway/breaker.py keeps them
_STATE, _FAILURES, _RECENT, _OUTCOMES = t.STATE, t.FAILURES, t.RECENT, t.OUTCOMES  # (per outcome)


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
        max_open_s: float = 300.0,
        eject_failure_share: float = 0.85,
        guard: Callable[[], bool] = allow_always,
    ) -> None:
        # not CircuitBreaker.__init__: it would reset the shared fields. The settings are every
        # process's own (the same configuration in each); the state is the table's.
        # (`guard` is called with the table's lock held: it must only read the table)
        self._configure(
            failure_threshold, success_threshold, open_s, max_open_s, eject_failure_share, guard, clock
        )
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

    @property
    def _ejections(self) -> int:
        return self._cells[self._base + t.EJECTIONS]

    @_ejections.setter
    def _ejections(self, value: int) -> None:
        self._cells[self._base + t.EJECTIONS] = value

    @property
    def _closed_at(self) -> float:
        return self._fcells[self._base + t.CLOSED_AT]

    @_closed_at.setter
    def _closed_at(self, value: float) -> None:
        self._fcells[self._base + t.CLOSED_AT] = value

    @property
    def _open_for(self) -> float:
        # a slot is made zeroed: never ejected yet, its first ejection lasts open_s
        return self._fcells[self._base + t.OPEN_FOR] or self._open_s

    @_open_for.setter
    def _open_for(self, value: float) -> None:
        self._fcells[self._base + t.OPEN_FOR] = value

    @property
    def _recent(self) -> int:
        return self._cells[self._base + t.RECENT]

    @_recent.setter
    def _recent(self, value: int) -> None:
        self._cells[self._base + t.RECENT] = value

    @property
    def _outcomes(self) -> int:
        return self._cells[self._base + t.OUTCOMES]

    @_outcomes.setter
    def _outcomes(self, value: int) -> None:
        self._cells[self._base + t.OUTCOMES] = value

    # -- the transitions, under the lock --------------------------------------------------------

    def _mark(self) -> tuple[int, int]:
        return self._cells[self._base + t.STATE], self._cells[self._base + t.TRIAL]

    def _bump_if(self, before: tuple[int, int]) -> None:
        if self._mark() != before:
            self._table.bump_locked(pairs=self._pair)

    def allows(self) -> bool:
        if self._cells[self._base + t.STATE] == CLOSED_CODE:
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
        i, b = self._cells, self._base
        if ok is None and i[b + _STATE] != _HALF_OPEN_CODE:
            return False
        if ok and not i[b + _RECENT] and i[b + _OUTCOMES] == WINDOW and i[b + _STATE] == CLOSED_CODE:
            # a success that changes nothing (a full window of successes, none failed since, so
            # no failures in a row either): the lock is not taken. Another process changing
            # this breaker at the same moment makes it as if this success came just before.
            return False
        with self._table.locked():
            if ok and i[b + _STATE] == CLOSED_CODE:
                # the usual outcome, CircuitBreaker.record's steps for it inlined (no transition
                # can follow): one more success in the recent outcomes, the failures in a row reset
                i[b + _RECENT] = (i[b + _RECENT] << 1) & _MASK
                if i[b + _OUTCOMES] < WINDOW:
                    i[b + _OUTCOMES] += 1
                i[b + _FAILURES] = 0
                return False
            before = self._mark()
            out = super().record(ok)
            self._bump_if(before)
        return out

    def force_open(self) -> None:
        with self._table.locked():
            before = self._mark()
            super().force_open()
            self._bump_if(before)
