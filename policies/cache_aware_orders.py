"""The sorted lists `cache_aware`'s exact large-pool search reads (policies/cache_pool_order.py),
kept across decisions.

The lists are kept per layout of candidates (the pool as the policy is handed it: same length,
same worker ids at the same positions) and brought up to date before each decision: the
candidates whose `WorkerState` changed since the last one (found by comparing the kept states
with the new ones 64 at a time, then 8 at a time, which Python does in C, identity first: a
change among 1,000 workers costs a few slice comparisons), and the workers whose queue or rate
changed (`PrefillQueues.changes`), each moved in the lists by bisection; then the workers whose
queue emptied since are moved from the busy lists to the idle one. A layout not seen before (or
a change log reset) is sorted whole: O(N log N), once per layout.
`tests/unit/test_cache_catch_up.py` compares the kept lists with a rebuild after random changes.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import OrderedDict

from policies.prefill_cost import PrefillQueues
from policies.snapshot import WorkerState


def _remove(lst: list[tuple[float, int]], item: tuple[float, int]) -> None:
    i = bisect_left(lst, item)
    if i < len(lst) and lst[i] == item:
        del lst[i]
    else:  # not where its key says (cannot happen while keys are not NaN): find it anyway
        lst.remove(item)


CHUNK = 64  # a layout's states are compared with the next pool's this many at a time


def _chunks(cands: list[WorkerState]) -> list[list[WorkerState]]:
    return [cands[lo : lo + CHUNK] for lo in range(0, len(cands), CHUNK)]


def _diff(chunks: list[list[WorkerState]], new: list[WorkerState]) -> list[int]:
    """The positions where `new` differs from the states kept in `chunks` (list equality, in C:
    identity first, then the structs' fields), a chunk at a time."""
    out: list[int] = []
    lo = 0
    for chunk in chunks:
        hi = lo + len(chunk)
        if chunk != new[lo:hi]:
            for s in range(0, hi - lo, 8):  # then eight at a time, then one by one
                at = lo + s
                if chunk[s : s + 8] != new[at : at + 8]:
                    for k, a in enumerate(chunk[s : s + 8], at):
                        b = new[k]
                        if a is not b and a != b:
                            out.append(k)
        lo = hi
    return out


class PoolOrder:
    """One layout's workers in the three sorted lists (see the module docstring)."""

    __slots__ = (
        "a_key",
        "b_key",
        "busy",
        "by_b_busy",
        "by_b_idle",
        "by_b_unmeasured",
        "by_drain",
        "epoch",
        "factor",
        "ids",
        "log_at",
        "n",
        "now",
        "pos_of",
        "seen",
    )

    def __init__(self, cands: list[WorkerState], queues: PrefillQueues, factor: float, now: float) -> None:
        self.factor = factor
        self.now = now
        self.n = len(cands)
        self.seen = _chunks(cands)  # the states the lists were made from
        self.ids = [w.id for w in cands]
        self.pos_of = {wid: i for i, wid in enumerate(self.ids)}
        self.epoch = queues.changes_epoch
        self.log_at = len(queues.changes)
        n = len(cands)
        self.a_key: list[float | None] = [None] * n
        self.b_key: list[float] = [0.0] * n
        self.busy: list[bool] = [False] * n
        by_drain: list[tuple[float, int]] = []
        by_busy: list[tuple[float, int]] = []
        by_idle: list[tuple[float, int]] = []
        by_u: list[tuple[float, int]] = []
        for i, w in enumerate(cands):
            a, b = self._keys(w, queues)
            self.a_key[i] = a
            self.b_key[i] = b
            if a is None:
                by_u.append((b, i))
            elif a > now:
                self.busy[i] = True
                by_drain.append((a, i))
                by_busy.append((b, i))
            else:
                by_idle.append((b, i))
        by_drain.sort()
        by_busy.sort()
        by_idle.sort()
        by_u.sort()
        self.by_drain = by_drain  # measured, queue not empty at `now`: by when it empties
        self.by_b_busy = by_busy  # the same workers by `b`
        self.by_b_idle = by_idle  # measured, queue empty at `now`: by `b`
        self.by_b_unmeasured = by_u  # not measured: by `1 + f x inflight`

    def _keys(self, w: WorkerState, queues: PrefillQueues) -> tuple[float | None, float]:
        weight = 1.0 + self.factor * w.inflight
        got = queues.drains_at(w.id)
        if got is None:
            return None, weight
        rate, drains = got
        return drains, weight / rate

    def _update(self, i: int, w: WorkerState, queues: PrefillQueues) -> None:
        a, b = self._keys(w, queues)
        old_a, old_b = self.a_key[i], self.b_key[i]
        if a == old_a and b == old_b:
            return
        if old_a is None:
            _remove(self.by_b_unmeasured, (old_b, i))
        elif self.busy[i]:
            _remove(self.by_drain, (old_a, i))
            _remove(self.by_b_busy, (old_b, i))
        else:
            _remove(self.by_b_idle, (old_b, i))
        busy = False
        if a is None:
            insort(self.by_b_unmeasured, (b, i))
        elif a > self.now:
            busy = True
            insort(self.by_drain, (a, i))
            insort(self.by_b_busy, (b, i))
        else:
            insort(self.by_b_idle, (b, i))
        self.a_key[i] = a
        self.b_key[i] = b
        self.busy[i] = busy

    def sync(self, cands: list[WorkerState], queues: PrefillQueues, now: float) -> bool:
        """Bring the lists up to date with `cands`, the queues and `now`; False: not this layout
        (or the queues' change log was reset), build a new one."""
        seen = self.seen
        if len(cands) != self.n or queues.changes_epoch != self.epoch:
            return False
        if now > self.now:
            self.now = now
        ids = self.ids
        for i in _diff(seen, cands):
            w = cands[i]
            if w.id != ids[i]:
                return False
            seen[i // CHUNK][i % CHUNK] = w
            self._update(i, w, queues)
        log = queues.changes
        if len(log) > self.log_at:
            pos_of = self.pos_of
            for wid in set(log[self.log_at :]):
                at = pos_of.get(wid)
                if at is not None:
                    self._update(at, seen[at // CHUNK][at % CHUNK], queues)
            self.log_at = len(log)
        # queues emptied since: busy -> idle (a clock that went back leaves them idle: the idle
        # list's bound, own prefill alone, holds whatever the queue)
        by_drain = self.by_drain
        if by_drain and by_drain[0][0] <= now:
            k = bisect_left(by_drain, (now, self.n))
            b_key = self.b_key
            busy = self.busy
            for _, i in by_drain[:k]:
                _remove(self.by_b_busy, (b_key[i], i))
                insort(self.by_b_idle, (b_key[i], i))
                busy[i] = False
            del by_drain[:k]
        return True


class PoolOrders:
    """The `PoolOrder` of each layout a selector is handed (up to `layouts`, least recently used
    dropped), keyed by length and the first and last worker ids, checked whole by `sync`."""

    __slots__ = ("_orders", "factor", "layouts")

    def __init__(self, factor: float, layouts: int = 8) -> None:
        self.factor = factor
        self.layouts = layouts
        self._orders: OrderedDict[tuple[int, str, str], PoolOrder] = OrderedDict()

    def get(self, cands: list[WorkerState], queues: PrefillQueues, now: float) -> PoolOrder:
        shape = (len(cands), cands[0].id, cands[-1].id)
        orders = self._orders
        order = orders.get(shape)
        if order is None or not order.sync(cands, queues, now):
            order = orders[shape] = PoolOrder(cands, queues, self.factor, now)
            if len(orders) > self.layouts:
                orders.popitem(last=False)
        orders.move_to_end(shape)
        return order


__all__ = ["CHUNK", "PoolOrder", "PoolOrders"]
