"""Several gateway processes' registries on one shared table (`serve --workers N`).

Each "process" here is a `SharedRegistry` on its own view of one `SharedTable` (the same memory
and lock, its own row): what the forked processes do, stepped by hand so that every
interleaving the tests need happens for certain. `tests/integration/test_multiprocess.py` runs
the real processes.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from gateway.breaker import BreakerState
from gateway.multiprocess.registry import FOREIGN_REFRESH_S, SharedRegistry
from gateway.multiprocess.table import SharedTable
from gateway.registry import BreakerSettings, Registry, Worker
from policies.snapshot import Engine, Role

_ROLES = {"p": Role.PREFILL, "d": Role.DECODE, "c": Role.COLOCATED}


def _worker(wid: str) -> Worker:
    w = Worker(
        wid, f"http://127.0.0.1:{9000 + sum(map(ord, wid)) % 900}", _ROLES[wid[0]], Engine.SGLANG, model="m"
    )
    w.healthy = True
    return w


def _group(
    n: int, ids: tuple[str, ...] = ("c0",), cap: int = 0, threshold: int = 2, open_s: float = 30.0
) -> list[SharedRegistry]:
    table = SharedTable(n, slots=256)
    regs = []
    for i in range(n):
        reg = SharedRegistry(table.as_process(i), BreakerSettings(threshold, 1, open_s), inflight_cap=cap)
        for wid in ids:
            reg.add(_worker(wid))
        regs.append(reg)
    return regs


def _booked(regs: list[SharedRegistry], wid: str) -> int:
    """Requests booked on `wid` by every process (what an engine would have in flight)."""
    return sum(r.get(wid).inflight for r in regs)


def test_two_processes_never_book_a_worker_beyond_its_cap_whatever_the_interleaving() -> None:
    """A request is planned (full(): the planner's exclusions) and, if the worker is not full,
    booked (acquire()) in one step of its process, with no await between: nothing else of that
    process runs in between, but the other processes do. Here three processes' steps interleave
    at random, each plan and its booking split apart (the race a per-process count loses), and
    requests end at random."""
    cap = 3
    regs = _group(3, cap=cap)
    rng = random.Random(7)
    planned: dict[int, bool] = {}  # process -> the worker was free when it planned
    peak = 0
    for _ in range(20000):
        i = rng.randrange(3)
        reg = regs[i]
        w = reg.get("c0")
        if i in planned:  # the rest of its step: book what it planned
            if planned.pop(i):
                reg.acquire(w, 10)
        elif rng.random() < 0.6:
            planned[i] = "c0" not in reg.full()
        elif w.inflight:
            reg.release(w, 10)
        booked = _booked(regs, "c0")
        peak = max(peak, booked)
        assert booked <= cap
    assert peak == cap  # (the cap was reached: the test exercised it)


def test_per_process_registries_alone_do_book_beyond_the_cap() -> None:
    """The same two planners on registries that do not share counts (two gateways, or the
    processes before this change): each keeps its own cap, so the worker gets twice as many."""
    regs = [Registry(inflight_cap=2), Registry(inflight_cap=2)]
    for r in regs:
        r.add(_worker("c0"))
    for r in regs:
        for _ in range(2):
            assert "c0" not in r.full()
            r.acquire(r.get("c0"), 1)
    assert sum(r.get("c0").inflight for r in regs) == 4


def test_a_reservation_not_used_is_given_back_by_the_next_plan_or_loop_turn() -> None:
    a, b = _group(2, ids=("c0", "c1"), cap=1)
    assert a.full() == set()  # one slot reserved on each worker for this plan
    assert b.full() == {"c0", "c1"}  # (while a's plan holds them)
    a.acquire(a.get("c0"), 1)  # the plan chose c0: c1's reservation is not used
    assert a.full() == {"c0"}  # the next plan gives it back first (and reserves c1 again)
    a._give_back()
    assert b.full() == {"c0"}  # c1 is free for b again
    b._give_back()

    async def in_a_loop() -> set[str]:
        assert a.full() == {"c0"}  # reserves c1...
        assert b.full() == {"c0", "c1"}
        await asyncio.sleep(0)  # ...until its loop turns
        return b.full()

    assert asyncio.run(in_a_loop()) == {"c0"}


def test_snapshots_show_every_process_inflight() -> None:
    a, b = _group(2, ids=("c0",))
    a.acquire(a.get("c0"), 100)
    a.acquire(a.get("c0"), 50)
    time.sleep(FOREIGN_REFRESH_S * 2)
    s = b.snapshot().get("c0")
    assert s is not None and (s.inflight, s.inflight_tokens) == (2, 150)
    assert b.inflight_of(b.get("c0")) == (2, 150)
    assert b.get("c0").inflight == 0  # its own count (admin removal waits on it) stays its own
    a.release(a.get("c0"), 100)
    time.sleep(FOREIGN_REFRESH_S * 2)
    s = b.snapshot().get("c0")
    assert s is not None and (s.inflight, s.inflight_tokens) == (1, 50)


def test_a_worker_breaker_opened_by_one_process_is_open_in_every_process() -> None:
    a, b = _group(2, ids=("c0", "c1"), threshold=2, open_s=0.2)
    assert b.snapshot().get("c0").usable  # type: ignore[union-attr]
    a.record(a.get("c0"), False)
    b.record(b.get("c0"), False)  # one failure in each: together the threshold
    assert a.get("c0").breaker.state is BreakerState.OPEN
    assert not b.snapshot().get("c0").usable  # type: ignore[union-attr]
    assert not a.snapshot().get("c0").usable  # type: ignore[union-attr]
    time.sleep(0.25)
    # half-open after open_s, seen by the process that did not record the last failure too
    assert b.snapshot().get("c0").usable  # type: ignore[union-attr]
    b.acquire(b.get("c0"), 1)  # the one trial
    assert not a.snapshot().get("c0").usable  # type: ignore[union-attr]
    b.release(b.get("c0"), 1)
    b.record(b.get("c0"), True)
    assert a.get("c0").breaker.state is BreakerState.CLOSED
    assert a.snapshot().get("c0").usable  # type: ignore[union-attr]


def test_a_pair_opened_by_one_process_is_avoided_by_another_that_never_used_it() -> None:
    a, b = _group(2, ids=("p0", "d0", "d1"))
    pair = a.pair_breaker("p0", "d0")
    pair.force_open()
    assert a.open_pairs() == {"p0|d0"}
    assert b.open_pairs() == frozenset()  # not known there yet...
    b.snapshot()  # ...until its next plan looks at the table
    assert b.open_pairs() == {"p0|d0"}
    assert [(p, d, s) for p, d, s in b.pair_states()] == [("p0", "d0", BreakerState.OPEN)]


def test_removed_everywhere_then_added_again_starts_with_a_closed_breaker() -> None:
    a, b = _group(2, ids=("c0",), threshold=1)
    a.record(a.get("c0"), False)
    assert b.get("c0").breaker.state is BreakerState.OPEN

    async def remove_and_add() -> None:
        await a.remove("c0")
        assert b.get("c0").breaker.state is BreakerState.OPEN  # b still holds it
        await b.remove("c0")
        a.add(_worker("c0"))
        b.add(_worker("c0"))

    asyncio.run(remove_and_add())
    assert a.get("c0").breaker.state is BreakerState.CLOSED
    assert b.get("c0").breaker.state is BreakerState.CLOSED


def test_a_removal_with_requests_in_flight_keeps_counting_them_until_they_end() -> None:
    a, b = _group(2, ids=("c0",))
    w = a.get("c0")
    a.acquire(w, 5)

    async def remove() -> None:
        await a.remove("c0")
        await b.remove("c0")

    asyncio.run(remove())
    assert w.shared is not None and w.shared.leaving  # type: ignore[attr-defined]
    a.release(w, 5)  # the last one: its slot is freed now
    assert not w.shared.leaving  # type: ignore[attr-defined]
    c = SharedRegistry(a.table, inflight_cap=0)
    c.add(_worker("c0"))
    assert c.inflight_of(c.get("c0")) == (0, 0)


@pytest.mark.parametrize("n", [1, 3])
def test_the_table_refuses_a_process_index_outside_the_group(n: int) -> None:
    table = SharedTable(n, slots=16)
    with pytest.raises(ValueError):
        table.as_process(n)


def test_a_worker_added_again_while_its_removed_self_still_has_requests_keeps_its_slot() -> None:
    (a,) = _group(1, ids=("c0",))
    old = a.get("c0")
    a.acquire(old, 5)
    asyncio.run(a.remove("c0"))
    a.add(_worker("c0"))
    new = a.get("c0")
    a.acquire(new, 7)
    a.release(old, 5)  # the removed one's last request: the slot stays, the new one holds it
    assert a.table.slot_kind(new.shared.slot) == 1  # type: ignore[attr-defined]
    c = SharedRegistry(a.table.as_process(0))
    c.add(_worker("c0"))
    assert c.get("c0").shared.slot == new.shared.slot  # type: ignore[attr-defined]
