"""`Registry` for one of several gateway processes: in-flight counts and breakers shared.

The request path calls the same methods as with one process (`full`, `acquire`, `release`,
`record`, `record_pair`, `pair_breaker`, `open_pairs`, `snapshot`), with the same signatures;
only what is behind them differs:

- **In-flight counts.** Each process books its requests in its own row of the shared table
  (`acquire`/`release`: two stores each, no lock). Snapshots show every process's requests: the
  other processes' rows are read again at most every `FOREIGN_REFRESH_S` (a policy's view of
  the other processes' load is that fresh; its own process's is exact).
- **`limits.max_inflight_per_worker`.** With one process, `full()` names the workers at their cap
  before the policy plans and the chosen workers are booked in the same step (no `await` in
  between), so no worker is ever booked beyond its cap at planning time. Here `full()` does the
  same against every process at once: under the table's lock it adds up each worker's booked
  requests and, for each worker below its cap, *reserves* one slot in this process's row. The
  policy then picks among those, and `acquire` turns the chosen worker's reservation into the
  request's booking; reservations not used are given back by the next `full()` of this process
  or at the next turn of its event loop, whichever comes first. Two processes can therefore
  never book a worker beyond its cap between them. A booking made without a fresh reservation
  (a vLLM decode, booked after its prefill, as with one process) is counted unconditionally, as
  it is with one process.
- **Breakers** are `SharedBreaker`s: one per worker and per pair for every process, with the
  outlier-ejection state (growing ejections, forgiveness, the recent failure share) in the table.
  A pair breaker made by another process is adopted when the table's pair generation moves, so
  an open pair is avoided by every process, including those that never used it.
- **`breaker.max_ejected_share`.** A breaker's guard (`Registry._may_eject`, `_may_eject_pair`)
  runs inside its locked step and counts the pool's ejected workers or pairs from the table's
  states, those of pairs this process has not adopted yet included: two processes cannot each
  eject a different member of a pool that may lose only one.

Health, engine info and load reports stay per process: each process probes and scrapes the
engines itself (docs/operations.md, "Several processes").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from common.workers import Role
from gateway.breaker import BreakerState, CircuitBreaker
from gateway.config import BreakerConfig
from gateway.logging import get_logger
from gateway.multiprocess import table as t
from gateway.multiprocess.breaker import CLOSED_CODE, SharedBreaker
from gateway.multiprocess.table import SharedTable, TableFull
from gateway.registry import Registry, Worker, new_breaker
from policies.snapshot import ClusterSnapshot

log = get_logger("pd_gateway.multiprocess")

FOREIGN_REFRESH_S = 0.001
_NOTHING_FULL: set[str] = set()


class _Cells:
    """A worker's cells in the table, for this process."""

    __slots__ = ("booked", "key", "leaving", "peers_booked", "peers_tokens", "slot", "tokens")

    def __init__(self, table: SharedTable, slot: int, key: str) -> None:
        me = table.index
        self.key = key
        self.slot = slot
        self.booked = table.row_cell(me, slot, 0)
        self.tokens = table.row_cell(me, slot, 1)
        others = [p for p in range(table.processes) if p != me]
        self.peers_booked = [table.row_cell(p, slot, 0) for p in others]
        self.peers_tokens = [table.row_cell(p, slot, 1) for p in others]
        self.leaving = False  # removed here while requests were in flight: leave when they end


def worker_key(worker_id: str) -> str:
    return f"w:{worker_id}"


def pair_key(prefill_id: str, decode_id: str) -> str:
    return f"p:{prefill_id}|{decode_id}"


class SharedRegistry(Registry):
    def __init__(
        self, table: SharedTable, breaker: BreakerConfig | None = None, inflight_cap: int = 0
    ) -> None:
        super().__init__(breaker, inflight_cap)
        self.table = table
        self._i = table.i
        self._seen_gen = -1
        self._seen_pair_gen = table.pair_generation
        self._next_foreign = 0.0
        self._reserved: dict[Worker, int] = {}
        self._giveback: asyncio.Handle | None = None
        self._pair_keys: dict[bytes, tuple[str, str]] | None = None  # digest -> (prefill, decode)
        self._leaving: dict[int, _Cells] = {}  # slot -> a removed worker's cells, requests in flight

    # -- membership ---------------------------------------------------------------------------

    def add(self, worker: Worker) -> None:
        super().add(worker)
        key = worker_key(worker.id)
        try:
            with self.table.locked():
                slot, _ = self.table.join_locked(key, t.WORKER)
        except TableFull:
            del self._workers[worker.id]
            self.changed()
            self._gone(worker)
            raise
        worker.shared = _Cells(self.table, slot, key)
        old = self._leaving.pop(slot, None)
        if old is not None:  # added again while the removed one's requests run: one slot for both
            old.leaving = False
        worker.breaker = self._shared_breaker(slot, lambda: self._may_eject(worker))
        self._pair_keys = None

    async def remove(self, worker_id: str) -> Worker:
        pairs = [k for k in self._pair_breakers if worker_id in k.split("|")]
        leave = [b for k in pairs if isinstance(b := self._pair_breakers[k], SharedBreaker)]
        w = await super().remove(worker_id)
        self._reserved.pop(w, None)
        cells = w.shared
        with self.table.locked():
            for b in leave:
                self.table.leave_locked(_slot_of(b))
            if isinstance(cells, _Cells):
                if w.inflight == 0:
                    self._i[cells.booked] = 0
                    self._i[cells.tokens] = 0
                    self.table.leave_locked(cells.slot)
                else:
                    cells.leaving = True  # its requests still count; release() leaves at the last
                    self._leaving[cells.slot] = cells
        self._pair_keys = None
        return w

    # -- counting -----------------------------------------------------------------------------

    def full(self) -> set[str]:
        cap = self.inflight_cap
        if not cap:
            return _NOTHING_FULL
        if self._reserved:
            self._give_back()
        out: set[str] = set()
        i = self._i
        reserved = self._reserved
        with self.table.locked():
            for w in self._workers.values():
                c = w.shared
                assert isinstance(c, _Cells)
                booked = i[c.booked]
                for k in c.peers_booked:
                    booked += i[k]
                if booked >= cap:
                    out.add(w.id)
                else:
                    i[c.booked] = i[c.booked] + 1
                    reserved[w] = reserved.get(w, 0) + 1
        if reserved and self._giveback is None:
            try:
                self._giveback = asyncio.get_running_loop().call_soon(self._give_back)
            except RuntimeError:  # no loop (a synchronous caller): the next full() gives back
                pass
        return out

    def _give_back(self) -> None:
        """Reservations that no acquire() used (the policy chose another worker, or none)."""
        h, self._giveback = self._giveback, None
        if h is not None:
            h.cancel()
        i = self._i
        for w, n in self._reserved.items():
            c = w.shared
            assert isinstance(c, _Cells)
            i[c.booked] = i[c.booked] - n
        self._reserved.clear()

    def acquire(self, w: Worker, tokens: int) -> None:
        w.inflight += 1
        w.inflight_tokens += tokens
        c = w.shared
        if c is not None:
            i = self._i
            n = self._reserved.get(w)
            if n:  # its reservation becomes the request's booking
                if n == 1:
                    del self._reserved[w]
                else:
                    self._reserved[w] = n - 1
            else:
                i[c.booked] = i[c.booked] + 1
            i[c.tokens] = i[c.tokens] + tokens
        if self._workers.get(w.id) is not w:
            return
        if w.breaker.on_dispatch():
            self.changed()
        self._moved.add(w)

    def release(self, w: Worker, tokens: int) -> None:
        w.inflight -= 1
        w.inflight_tokens -= tokens
        c = w.shared
        if c is not None:
            i = self._i
            i[c.booked] = i[c.booked] - 1
            i[c.tokens] = i[c.tokens] - tokens
            if c.leaving and w.inflight == 0:
                c.leaving = False
                self._leaving.pop(c.slot, None)
                with self.table.locked():
                    i[c.booked] = 0
                    i[c.tokens] = 0
                    self.table.leave_locked(c.slot)
        if self._workers.get(w.id) is not w:
            return
        self._moved.add(w)

    def inflight_of(self, w: Worker) -> tuple[int, int]:
        c = w.shared
        if not isinstance(c, _Cells):
            return w.inflight, w.inflight_tokens
        i = self._i
        return (
            w.inflight + sum(i[k] for k in c.peers_booked),
            w.inflight_tokens + sum(i[k] for k in c.peers_tokens),
        )

    # -- what the other processes changed ---------------------------------------------------------

    def snapshot(self) -> ClusterSnapshot:
        table = self.table
        gen = table.generation
        if gen != self._seen_gen:
            self._seen_gen = gen
            self.changed()  # a breaker moved somewhere: rebuild from the shared states
            for w in self._workers.values():
                if w.breaker.state is BreakerState.OPEN:
                    self._open.add(w)  # (its half-open move is due by time, here too)
            pgen = table.pair_generation
            if pgen != self._seen_pair_gen:
                self._seen_pair_gen = pgen
                self._adopt_pairs()
        now = time.monotonic()
        if now >= self._next_foreign:
            self._next_foreign = now + FOREIGN_REFRESH_S
            i = self._i
            moved = self._moved
            for w in self._workers.values():
                c = w.shared
                if c is None:
                    continue
                n = 0
                for k in c.peers_booked:
                    n += i[k]
                tok = 0
                for k in c.peers_tokens:
                    tok += i[k]
                if n != w.foreign_inflight or tok != w.foreign_tokens:
                    w.foreign_inflight = n
                    w.foreign_tokens = tok
                    moved.add(w)
        return super().snapshot()

    def pair_breaker(self, prefill_id: str, decode_id: str) -> CircuitBreaker:
        key = f"{prefill_id}|{decode_id}"
        b = self._pair_breakers.get(key)
        if b is not None:
            return b
        if prefill_id not in self._workers or decode_id not in self._workers:
            return new_breaker(self._breaker)  # the pair's worker was removed: its own, not kept
        try:
            with self.table.locked():
                slot, _ = self.table.join_locked(pair_key(prefill_id, decode_id), t.PAIR)
        except TableFull:
            log.warning("shared_table.full", pair=key, slots=self.table.slots)
            # this process's alone
            b = new_breaker(self._breaker, guard=lambda: self._may_eject_pair(prefill_id, decode_id))
        else:
            b = self._shared_pair(slot, prefill_id, decode_id)
        self._pair_breakers[key] = b
        return b

    def _shared_breaker(self, slot: int, guard: Callable[[], bool], *, pair: bool = False) -> SharedBreaker:
        """A breaker on `slot`'s cells, with the outlier-ejection settings; `guard` (the
        registry's pool rule, `Registry._may_eject`) runs under the table's lock."""
        s = self._breaker
        return SharedBreaker(
            self.table,
            slot,
            s.failure_threshold,
            s.success_threshold,
            s.open_s,
            pair=pair,
            max_open_s=s.max_open_s,
            eject_failure_share=s.eject_failure_share,
            guard=guard,
        )

    def _shared_pair(self, slot: int, prefill_id: str, decode_id: str) -> SharedBreaker:
        return self._shared_breaker(slot, lambda: self._may_eject_pair(prefill_id, decode_id), pair=True)

    def _pair_ejected(self, prefill_id: str, decode_id: str) -> bool:
        """A pair's breaker out of routing, in any process: one this process has not adopted
        yet (another process made it since this one's last snapshot) is read from the table.
        Asked by a pair breaker's guard, under the table's lock."""
        b = self._pair_breakers.get(f"{prefill_id}|{decode_id}")
        if b is not None:
            return b.state is not BreakerState.CLOSED
        slot = self.table.find_locked(pair_key(prefill_id, decode_id))
        return slot is not None and self._i[self.table.slot_cell(slot, t.STATE)] != CLOSED_CODE

    def _adopt_pairs(self) -> None:
        """Pairs another process made a breaker for (one carried a request there): this process
        keeps them too, so an open one is avoided here without a request of its own failing."""
        keys = self._pair_keys
        if keys is None:
            prefills = [w.id for w in self._workers.values() if w.role is Role.PREFILL]
            decodes = [w.id for w in self._workers.values() if w.role is Role.DECODE]
            keys = self._pair_keys = {t.digest(pair_key(p, d)): (p, d) for p in prefills for d in decodes}
        found = [(slot, keys[d]) for slot, d in self.table.used_slots(t.PAIR) if d in keys]
        new = [(slot, p, d) for slot, (p, d) in found if f"{p}|{d}" not in self._pair_breakers]
        if not new:
            return
        with self.table.locked():
            for _, p, d in new:
                try:
                    slot, _ = self.table.join_locked(pair_key(p, d), t.PAIR)
                except TableFull:
                    continue
                self._pair_breakers[f"{p}|{d}"] = self._shared_pair(slot, p, d)
        self.changed()

    async def close(self) -> None:
        if self._reserved:
            self._give_back()
        await super().close()


def _slot_of(b: SharedBreaker) -> int:
    return (b._base - b._table.slot_cell(0, 0)) // t.SLOT_CELLS
