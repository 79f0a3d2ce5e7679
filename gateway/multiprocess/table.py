"""The state the gateway's processes share: one anonymous shared-memory region and one lock.

`pd-gateway serve --workers N` forks N processes after this table is made, so each maps the same
pages (no file, nothing to clean up). It holds, for each *slot* (one per worker, one per
(prefill, decode) pair that has carried a request):

- a circuit breaker's state (`SharedBreaker`), its outlier-ejection fields included (ejections
  in a row, when it last closed, the recent outcomes): one breaker per worker and per pair for
  the whole gateway, as with one process;
- per process, the worker's booked in-flight requests and their tokens: each process writes only
  its own row, so counting a request is two stores, no lock; readers add the rows up.

Anything that must be decided against every process at once (booking a worker's last slot under
`limits.max_inflight_per_worker`, a breaker's outcome or transition with the ejected share of its
pool, a slot's allocation) happens under the table's lock, a process-shared POSIX semaphore
(`multiprocessing`'s), held for a few microseconds at a time and never across an `await`.
`generation` is bumped (under the lock) by each change another process must see in its snapshots
(a breaker's transition); `pair_generation` by each pair slot made or freed and each pair
breaker's transition.

Slots are found by the 16-byte BLAKE2b digest of their key (open addressing, linear probing,
tombstones). A slot lives while some process holds it (`members`, one bit per process) and is
zeroed when it is made again: a worker removed from every process and added back starts with a
closed breaker, as with one process.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import mmap
import multiprocessing
import os
from collections.abc import Iterator
from typing import Any

from gateway.logging import get_logger

log = get_logger("pd_gateway.multiprocess")

MAX_PROCESSES = 62  # `members` is one int64 bit per process
DEFAULT_SLOTS = 8192

_MAGIC = 0x70646777_0002  # "pdgw", layout 2

# header cells
_H_MAGIC, _H_PROCS, _H_SLOTS, _H_GEN, _H_PAIR_GEN, _H_OWNER = range(6)
_HEADER = 8
# per slot: digest (2 cells), kind, members, then a breaker's fields (gateway/breaker.py): state,
# consecutive failures, half-open successes, trial, opened_at (float), ejections in a row,
# closed_at (float), this ejection's time (float; 0: never ejected), the recent outcomes (a bit
# each) and how many of those bits are outcomes
_S_DIGEST, _S_KIND, _S_MEMBERS = 0, 2, 3
_S_STATE, _S_FAILURES, _S_SUCCESSES, _S_TRIAL, _S_OPENED = 4, 5, 6, 7, 8
_S_EJECTIONS, _S_CLOSED_AT, _S_OPEN_FOR, _S_RECENT, _S_OUTCOMES = 9, 10, 11, 12, 13
SLOT_CELLS = 14
# per process row, per slot: booked requests, their tokens
ROW_CELLS = 2

EMPTY, WORKER, PAIR, TOMBSTONE = 0, 1, 2, 3

LOCK_TIMEOUT_S = 1.0  # a holder that takes longer is dead or stopped: go on without the lock


class TableFull(RuntimeError):
    """No free slot left for another worker or pair."""


class _Held:
    """One `with table.locked():` block. A class rather than a generator context manager: the
    request path takes the lock once per outcome recorded (gateway/multiprocess/breaker.py), and
    this costs a third of a generator's enter and exit."""

    __slots__ = ("_got", "_table")

    def __init__(self, table: SharedTable) -> None:
        self._table = table
        self._got = False

    def __enter__(self) -> None:
        t = self._table
        self._got = t._lock.acquire(True, LOCK_TIMEOUT_S)
        if self._got:
            t.i[_H_OWNER] = t._own_pid
        else:
            log.error("shared_table.lock_timeout", owner=t.i[_H_OWNER], timeout_s=LOCK_TIMEOUT_S)

    def __exit__(self, *exc: object) -> None:
        if self._got:
            t = self._table
            t.i[_H_OWNER] = 0
            t._lock.release()


def digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode("utf-8"), digest_size=16).digest()


class SharedTable:
    """See the module docstring. Made once, before the processes are forked; each process then
    calls `attach(index)` with its own index."""

    def __init__(self, processes: int, slots: int = DEFAULT_SLOTS) -> None:
        if not 1 <= processes <= MAX_PROCESSES:
            raise ValueError(f"processes must be in 1..{MAX_PROCESSES}, got {processes}")
        self.processes = processes
        self.slots = slots
        self._slot_base = _HEADER + processes  # control ports after the header
        self._row_base = self._slot_base + slots * SLOT_CELLS
        cells = self._row_base + processes * slots * ROW_CELLS
        self._mem = mmap.mmap(-1, cells * 8)  # MAP_SHARED | MAP_ANONYMOUS: shared with children
        self.i = memoryview(self._mem).cast("q")
        self.f = memoryview(self._mem).cast("d")
        self._lock: Any = multiprocessing.get_context("fork").Lock()
        self.i[_H_MAGIC] = _MAGIC
        self.i[_H_PROCS] = processes
        self.i[_H_SLOTS] = slots
        self.index = 0  # this process's row (attach() sets it)
        self._own_pid = os.getpid()

    def attach(self, index: int) -> None:
        """This process is the `index`-th of the group (after the fork)."""
        if not 0 <= index < self.processes:
            raise ValueError(f"process index {index} out of 0..{self.processes - 1}")
        self.index = index
        self._own_pid = os.getpid()

    def as_process(self, index: int) -> SharedTable:
        """The same table (memory and lock) as process `index` sees it: for several "processes"
        in one (tests, benchmarks)."""
        other = copy.copy(self)
        other.attach(index)
        return other

    # -- the lock -----------------------------------------------------------------------------

    def locked(self) -> _Held:
        """Hold the table's lock for a `with` block. A holder that keeps it past LOCK_TIMEOUT_S
        (a process stopped or killed while holding it, which the supervisor also clears) is not
        waited for longer: the operation goes on without it, logged."""
        return _Held(self)

    def clear_lock_of(self, pid: int) -> bool:
        """The supervisor's part when process `pid` died: if it held the lock, release it."""
        if pid and self.i[_H_OWNER] == pid:
            self.i[_H_OWNER] = 0
            with contextlib.suppress(ValueError):
                self._lock.release()
            return True
        return False

    # -- generations --------------------------------------------------------------------------

    @property
    def generation(self) -> int:
        return self.i[_H_GEN]

    @property
    def pair_generation(self) -> int:
        return self.i[_H_PAIR_GEN]

    def bump_locked(self, pairs: bool = False) -> None:
        """Another process must look again (call with the lock held)."""
        self.i[_H_GEN] += 1
        if pairs:
            self.i[_H_PAIR_GEN] += 1

    # -- control ports ------------------------------------------------------------------------

    def set_control_port(self, port: int) -> None:
        self.i[_HEADER + self.index] = port

    def control_port(self, index: int) -> int:
        return self.i[_HEADER + index]

    # -- slots --------------------------------------------------------------------------------

    def slot_cell(self, slot: int, field: int) -> int:
        """Index (into `i` / `f`) of one of a slot's cells."""
        return self._slot_base + slot * SLOT_CELLS + field

    def row_cell(self, process: int, slot: int, field: int) -> int:
        """Index of process `process`'s cell `field` (0: booked, 1: tokens) for `slot`."""
        return self._row_base + (process * self.slots + slot) * ROW_CELLS + field

    def _probe(self, d: bytes) -> Iterator[int]:
        start = int.from_bytes(d[:8], "little") % self.slots
        for k in range(self.slots):
            yield (start + k) % self.slots

    def _matches(self, slot: int, d: bytes) -> bool:
        b = self._slot_base + slot * SLOT_CELLS
        return self.i[b] == int.from_bytes(d[:8], "little", signed=True) and self.i[b + 1] == int.from_bytes(
            d[8:], "little", signed=True
        )

    def find_locked(self, key: str) -> int | None:
        """The slot of `key`, if some process holds it (lock held)."""
        d = digest(key)
        for s in self._probe(d):
            kind = self.i[self.slot_cell(s, _S_KIND)]
            if kind == EMPTY:
                return None
            if kind != TOMBSTONE and self._matches(s, d):
                return s
        return None

    def join_locked(self, key: str, kind: int) -> tuple[int, bool]:
        """This process holds `key`'s slot from now on: (slot, made). A slot no process held is
        made (zeroed) first. Raises TableFull. Lock held."""
        d = digest(key)
        free: int | None = None
        for s in self._probe(d):
            k = self.i[self.slot_cell(s, _S_KIND)]
            if k == EMPTY:
                if free is None:
                    free = s
                break
            if k == TOMBSTONE:
                if free is None:
                    free = s
                continue
            if self._matches(s, d):
                self.i[self.slot_cell(s, _S_MEMBERS)] |= 1 << self.index
                return s, False
        if free is None:
            raise TableFull(f"no free slot in the shared table ({self.slots}) for {key!r}")
        b = self._slot_base + free * SLOT_CELLS
        for c in range(SLOT_CELLS):
            self.i[b + c] = 0
        for p in range(self.processes):
            for c in range(ROW_CELLS):
                self.i[self.row_cell(p, free, c)] = 0
        self.i[b] = int.from_bytes(d[:8], "little", signed=True)
        self.i[b + 1] = int.from_bytes(d[8:], "little", signed=True)
        self.i[b + _S_KIND] = kind
        self.i[b + _S_MEMBERS] = 1 << self.index
        if kind == PAIR:
            self.bump_locked(pairs=True)
        return free, True

    def leave_locked(self, slot: int) -> None:
        """This process no longer holds `slot`; the last one out frees it. Lock held."""
        m = self.slot_cell(slot, _S_MEMBERS)
        self.i[m] &= ~(1 << self.index)
        if self.i[m] == 0:
            kind = self.i[self.slot_cell(slot, _S_KIND)]
            self.i[self.slot_cell(slot, _S_KIND)] = TOMBSTONE
            if kind == PAIR:
                self.bump_locked(pairs=True)

    def used_slots(self, kind: int) -> Iterator[tuple[int, bytes]]:
        """(slot, digest) of every slot of `kind` some process holds (read without the lock)."""
        for s in range(self.slots):
            b = self._slot_base + s * SLOT_CELLS
            if self.i[b + _S_KIND] == kind:
                yield (
                    s,
                    self.i[b].to_bytes(8, "little", signed=True)
                    + self.i[b + 1].to_bytes(8, "little", signed=True),
                )

    def slot_kind(self, slot: int) -> int:
        return self.i[self.slot_cell(slot, _S_KIND)]


# breaker cell offsets, for SharedBreaker
STATE, FAILURES, SUCCESSES, TRIAL, OPENED_AT = _S_STATE, _S_FAILURES, _S_SUCCESSES, _S_TRIAL, _S_OPENED
EJECTIONS, CLOSED_AT, OPEN_FOR = _S_EJECTIONS, _S_CLOSED_AT, _S_OPEN_FOR
RECENT, OUTCOMES = _S_RECENT, _S_OUTCOMES
