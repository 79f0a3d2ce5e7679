"""`cache_aware`'s choice in a large pool, exactly as scoring every worker would make it, without
scoring every worker.

The cost of a worker `w` (policies/cache_aware.py) for a request whose uncached prefill work on
`w` is `U(c)` (it depends only on the prompt tokens `c` that `w` is predicted to hold) is

    cost(w) = max(T(w) - now, 0, waiting(w) x mean / rate(w)) + U(c) x (1 + f x inflight(w)) / rate(w)

where `T(w)` is when `w`'s fluid prefill queue empties at its rate. Whatever `waiting(w)` is,

    cost(w) >= max(T(w) - now, 0) + U(c) x b(w),   b(w) = (1 + f x inflight(w)) / rate(w)

so with the workers kept in two sorted lists, by `T` and by `b`, Fagin's threshold algorithm finds
every worker that can be the cheapest: read both lists in step; after `k` steps no worker not yet
read can cost less than `max(T_k - now, 0) + U x b_k`; stop once that bound is above the cheapest
cost read so far. A worker not yet measured has no `T` of its own (its rate is the measured
workers' mean, which moves with every measurement): its bound is `U x (1 + f x inflight) /
prior`, from a third list sorted by `1 + f x inflight`.

The workers the prompt's prefix match names fall into groups of equal `c` (the index's levels):
a small group is scored worker by worker; a large one (a system prompt most workers hold) and the
workers holding nothing are each searched with the lists, restricted to their members. So a
decision reads the workers that hold the prompt (when few), the cheapest few of the rest and
those whose bounds tie with them, not the pool.

Everything the search finds is scored by the same arithmetic as the whole-pool loop
(`CacheAwareSelector._choose`): the cheapest cost, the ties within `1e-12` of it, fewest in
flight among them, then a draw among those in pool order, so a generator seeded alike draws the
same worker. The bounds stop with a margin (`1e-9` relative, 1 ns absolute) that covers their
rounding. Where the shortcut could differ, the caller scores the whole pool: the balance rule
could fire (the chosen worker has more than `balance_abs_threshold` in flight: the rule needs
the pool's least loaded), a slot breaks the index's prefix invariant, or the precise index names
more than `named_limit` workers.

The lists are kept across decisions and brought up to date with what changed since the last
one (policies/cache_aware_orders.py), not rebuilt.
"""

from __future__ import annotations

import random as _random
from collections.abc import Mapping

from policies.cache_aware_orders import PoolOrder, PoolOrders
from policies.cache_state import CacheState
from policies.prefix_source import Lookup
from policies.snapshot import RequestView, WorkerState

_INF = float("inf")
DIRECT_GROUP = 256  # a prefix group of at most this many workers is scored by bounds, member by member


class Search:
    """One decision's search (module docstring). `choose()` is the worker, or None where the
    caller must score the whole pool."""

    __slots__ = (
        "attention",
        "backlog_rate",
        "best",
        "cands",
        "done",
        "factor",
        "lim",
        "limit",
        "now",
        "order",
        "prompt",
        "queues",
        "rows",
        "saturation",
        "threshold",
    )

    def __init__(
        self, state: CacheState, req: RequestView, cands: list[WorkerState], order: PoolOrder, now: float
    ) -> None:
        s = state.settings
        self.cands = cands
        self.order = order
        self.queues = state.queues
        self.backlog_rate = state.queues.backlog_rate
        self.now = now
        prompt = req.prompt_tokens if req.prompt_tokens > 0 else 1
        self.prompt = prompt
        self.limit = prompt - 1
        self.threshold = s.cache_threshold * prompt
        self.factor = s.inflight_factor
        self.attention = s.crossover_tokens
        self.saturation = s.saturation_wait_s
        # (cost, in flight, position, saturated) of each worker scored
        self.rows: list[tuple[float, int, int, bool]] = []
        self.done: set[int] = set()
        self.best = _INF  # the cheapest cost of a worker not saturated
        self.lim = _INF  # no worker whose bound is above this can tie with `best`

    def work(self, cached: int) -> float:
        """The request's own prefill work with `cached` tokens held (`_choose`'s arithmetic)."""
        if cached > self.limit:
            cached = self.limit
        credit = cached if cached > self.threshold else 0
        new: float = self.prompt - credit
        if self.attention > 0.0:
            new *= 1.0 + (credit + 0.5 * new) / self.attention
        return new

    def visit(self, i: int, new: float) -> None:
        """Score the candidate at position `i` whose own prefill work is `new` (`_choose`'s
        arithmetic)."""
        self.done.add(i)
        w = self.cands[i]
        inflight = w.inflight
        backlog, rate = self.backlog_rate(w.id, self.now, w.load.waiting)
        wait = backlog / rate
        cost = wait + new / rate * (1.0 + self.factor * inflight)
        if wait > self.saturation:
            self.rows.append((cost, inflight, i, True))
            return
        self.rows.append((cost, inflight, i, False))
        if cost < self.best:
            self.best = cost
            self.lim = cost * (1.0 + 1e-9) + 1e-9

    def floor(self, new: float) -> float:
        """No worker costs less than this for a request whose own prefill work is `new` (the
        first bound of each sorted list: where it is above `lim`, no worker of any group of
        that work can be chosen, nor tie)."""
        order = self.order
        out = _INF
        if order.by_b_unmeasured:
            out = new / self.queues.prior * order.by_b_unmeasured[0][0]
        if order.by_b_idle:
            got = new * order.by_b_idle[0][0]
            if got < out:
                out = got
        if order.by_drain:
            a = order.by_drain[0][0] - self.now
            got = (a if a > 0.0 else 0.0) + new * order.by_b_busy[0][0]
            if got < out:
                out = got
        return out

    def visit_some(self, found: list[int], new: float) -> None:
        """Of the candidates at positions `found` (whose own prefill work is `new`), those whose
        lower bound is not above `lim`, cheapest bound first."""
        order = self.order
        a_key = order.a_key
        b_key = order.b_key
        now = self.now
        prior = self.queues.prior
        per_b = new / prior
        queued = self.queues.queued
        ids = order.ids
        bounds = []
        for i in found:
            a = a_key[i]
            if a is None:  # not measured: its queue at the prior rate, and its own prefill
                q = queued(ids[i])
                wait = 0.0 if q is None else q[0] / prior - (now - q[1])
                bounds.append(((wait if wait > 0.0 else 0.0) + per_b * b_key[i], i))
            else:
                bounds.append(((a - now if a > now else 0.0) + new * b_key[i], i))
        bounds.sort()
        done = self.done
        for bound, i in bounds:
            if bound > self.lim:
                break
            if i not in done:
                self.visit(i, new)

    def scan(
        self, new: float, slot_of: Mapping[str, int] | None = None, mask: int = 0, inside: bool = True
    ) -> None:
        """Every candidate that can cost at most `lim`: all of them without `slot_of`, else those
        whose slot is in `mask` (`inside`) or not (the membership test inlined: this loop may
        pass over many workers that are not members)."""
        order = self.order
        done = self.done
        visit = self.visit
        ids = order.ids
        get = None if slot_of is None else slot_of.get
        per_b = new / self.queues.prior
        prior = self.queues.prior
        queued = self.queues.queued
        now = self.now
        for b, i in order.by_b_unmeasured:
            own = per_b * b
            if own > self.lim:
                break
            if i in done:
                continue
            if get is not None:
                slot = get(ids[i])
                if (slot is not None and (mask >> slot) & 1 == 1) is not inside:
                    continue
            q = queued(ids[i])  # (sorted by own prefill alone: its queue, if any, may rule it out)
            if q is not None and q[0] / prior - (now - q[1]) + own > self.lim:
                continue
            visit(i, new)
        for b, i in order.by_b_idle:
            if new * b > self.lim:
                break
            if i in done:
                continue
            if get is not None:
                slot = get(ids[i])
                if (slot is not None and (mask >> slot) & 1 == 1) is not inside:
                    continue
            visit(i, new)
        by_drain = order.by_drain
        by_b = order.by_b_busy
        for k in range(len(by_drain)):
            a, i = by_drain[k]
            b, j = by_b[k]
            for at in (i, j):
                if at in done:
                    continue
                if get is not None:
                    slot = get(ids[at])
                    if (slot is not None and (mask >> slot) & 1 == 1) is not inside:
                        continue
                visit(at, new)
            if (a - now if a > now else 0.0) + new * b > self.lim:
                break

    def choose(self, rng: _random.Random, abs_threshold: int) -> WorkerState | None:
        rows = [r for r in self.rows if not r[3]] or self.rows
        if not rows:
            return None
        best = min(r[0] for r in rows)
        top = best * (1.0 + 1e-12)
        ties = [r for r in rows if r[0] <= top]
        fewest = min(r[1] for r in ties)
        if fewest > abs_threshold:
            return None  # the balance rule may fire: it needs the least loaded of the pool
        if len(ties) > 1:
            ties = [r for r in ties if r[1] == fewest]
            if len(ties) > 1:
                ties.sort(key=lambda r: r[2])  # pool order, as the whole-pool loop has them
                return self.cands[rng.choice(ties)[2]]
        return self.cands[ties[0][2]]


def choose_exact(
    state: CacheState,
    orders: PoolOrders,
    req: RequestView,
    cands: list[WorkerState],
    lookups: tuple[Lookup | None, Lookup],
    rng: _random.Random,
    abs_threshold: int,
    named_limit: int = 64,
) -> tuple[WorkerState, list[WorkerState]] | None:
    """The worker scoring all of `cands` would choose, and the workers scored to find it; None
    where only scoring all of them can tell (module docstring)."""
    now = state.clock()
    order = orders.get(cands, state.queues, now)
    search = Search(state, req, cands, order, now)
    precise, approx = lookups
    ok = _by_groups(search, approx) if precise is None else _by_named(search, precise, approx, named_limit)
    chosen = search.choose(rng, abs_threshold) if ok else None
    if chosen is None:
        return None
    return chosen, [cands[r[2]] for r in search.rows]


def _by_groups(search: Search, approx: Lookup) -> bool:
    """The approximate index alone: its prefix groups, then the workers holding nothing; False
    where its groups are not exact."""
    groups = approx.groups()  # type: ignore[attr-defined]
    if groups is None:
        return False
    slot_of = approx.slot_of  # type: ignore[attr-defined]
    pos_of = search.order.pos_of
    union = 0
    for mask, tokens in groups:
        union |= mask
        new = search.work(tokens)
        if search.floor(new) > search.lim:
            continue  # none of them can be chosen (a deeper group's worker costs less)
        if mask.bit_count() <= DIRECT_GROUP:
            # the members' slots from the mask's binary digits (a find per member, in C; a
            # mask of 1,000 slots is an int of 1,000 bits, and each operation on it a new one)
            ids_of_slot = approx._ids  # type: ignore[attr-defined]
            digits = bin(mask)
            last = len(digits) - 1
            found: list[int] = []
            j = digits.find("1", 2)
            while j != -1:
                wid = ids_of_slot[last - j]
                i = None if wid is None else pos_of.get(wid)
                if i is not None:
                    found.append(i)
                j = digits.find("1", j + 1)
            search.visit_some(found, new)
        else:
            search.scan(new, slot_of, mask, inside=True)
    search.scan(search.work(0), slot_of if union else None, union, inside=False)
    return True


def _by_named(search: Search, precise: Lookup, approx: Lookup, limit: int) -> bool:
    """The precise index too: every worker either names scored as `_choose` would, then the rest
    (holding nothing); False where they name more than `limit`."""
    named: list[str] = []
    for lk in (precise, approx):
        got = lk.named(limit)  # type: ignore[attr-defined]
        if got is None:
            return False
        named += got
    pos_of = search.order.pos_of
    for wid in dict.fromkeys(named):
        i = pos_of.get(wid)
        if i is None:
            continue
        cached = precise.cached_tokens(wid)
        if cached is None:
            cached = approx.cached_tokens(wid) or 0
        search.visit(i, search.work(cached))
    search.scan(search.work(0), None)  # the named are done: the rest hold nothing
    return True


__all__ = ["DIRECT_GROUP", "PoolOrder", "PoolOrders", "choose_exact"]
