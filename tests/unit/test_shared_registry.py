"""Several gateway processes' registries on one shared table (`serve --workers N`).

Each "process" here is a `SharedRegistry` on its own view of one `SharedTable` (the same memory
and lock, its own row): what the forked processes do, stepped by hand so that every
interleaving the tests need happens for certain. `tests/integration/test_multiprocess.py` runs
the real processes.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
import traceback
from collections.abc import Callable

import pytest

from gateway.breaker import BreakerState
from gateway.config import BreakerConfig
from gateway.multiprocess.registry import FOREIGN_REFRESH_S, SharedRegistry
from gateway.multiprocess.table import SharedTable
from gateway.registry import Registry, Worker
from policies.snapshot import Engine, Role

_ROLES = {"p": Role.PREFILL, "d": Role.DECODE, "c": Role.COLOCATED}


def _worker(wid: str) -> Worker:
    w = Worker(
        wid, f"http://127.0.0.1:{9000 + sum(map(ord, wid)) % 900}", _ROLES[wid[0]], Engine.SGLANG, model="m"
    )
    w.healthy = True
    return w


def _group(
    n: int,
    ids: tuple[str, ...] = ("c0",),
    cap: int = 0,
    threshold: int = 2,
    open_s: float = 30.0,
    *,
    share: float = 0.5,
    max_open_s: float = 300.0,
) -> list[SharedRegistry]:
    table = SharedTable(n, slots=256)
    regs = []
    settings = BreakerConfig(
        failure_threshold=threshold,
        success_threshold=1,
        open_s=open_s,
        max_open_s=max_open_s,
        max_ejected_share=share,
    )
    for i in range(n):
        reg = SharedRegistry(table.as_process(i), settings, inflight_cap=cap)
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
    # (alone in its pool: max_ejected_share 1.0 lets a failure eject it)
    a, b = _group(2, ids=("c0",), threshold=1, share=1.0)
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


# -- outlier ejection across processes (gateway/breaker.py's rules on the shared breaker) ---------


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _on_clock(regs: list[SharedRegistry], clock: Clock) -> None:
    """Every worker breaker of every "process" reads `clock` (one clock, as CLOCK_MONOTONIC is
    for the real processes)."""
    for reg in regs:
        for w in reg.workers():
            w.breaker._clock = clock


def _fail_partly(reg: Registry, w: Worker, rounds: int = 1) -> None:
    """Two failures in a row every five outcomes (40 %): the consecutive-failure threshold (2)
    is reached, the failure share (85 %) never."""
    for _ in range(rounds):
        for ok in (True, True, True, False, False):
            reg.record(w, ok)


def _trial(reg: SharedRegistry, wid: str, ok: bool) -> None:
    """The half-open trial request, from this process: planned (the snapshot moves the breaker
    from open to half-open once its time is over), sent, answered."""
    snap = reg.snapshot().get(wid)
    assert snap is not None and snap.usable, "the ejection should be over"
    w = reg.get(wid)
    reg.acquire(w, 1)
    reg.release(w, 1)
    reg.record(w, ok)


def test_ejections_grow_and_are_forgiven_whichever_process_trips_them() -> None:
    """As tests/unit/test_breaker.py's first test, with each step taken by another process:
    the ejections in a row, and the time closed that forgives them, are the gateway's."""
    a, b = _group(2, ids=("c0", "c1"), threshold=2, open_s=10.0, max_open_s=45.0)
    clock = Clock()
    _on_clock([a, b], clock)
    a.record(a.get("c0"), False)
    b.record(b.get("c0"), False)  # one failure in each: the threshold, one of two workers out
    seen = [(a.get("c0").breaker.ejection_s, b.get("c0").breaker.ejection_s)]
    for reg in (b, a, b, a):  # each failed trial: ejected again, for longer, seen by both
        clock.t += reg.get("c0").breaker.ejection_s
        _trial(reg, "c0", False)
        assert not a.snapshot().get("c0").usable  # type: ignore[union-attr]
        assert not b.snapshot().get("c0").usable  # type: ignore[union-attr]
        seen.append((a.get("c0").breaker.ejection_s, b.get("c0").breaker.ejection_s))
    assert seen == [(10.0, 10.0), (20.0, 20.0), (30.0, 30.0), (40.0, 40.0), (45.0, 45.0)]
    clock.t += 45.0
    _trial(b, "c0", True)
    assert a.get("c0").breaker.state is BreakerState.CLOSED
    clock.t += 20.0  # closed for two open_s: two of the five ejections in a row forgiven
    a.record(a.get("c0"), False)
    b.record(b.get("c0"), False)
    assert a.get("c0").breaker.state is BreakerState.OPEN
    assert a.get("c0").breaker.ejection_s == b.get("c0").breaker.ejection_s == 40.0  # 10 x (5 - 2 + 1)


def test_the_pool_s_ejected_share_and_failure_share_hold_across_processes() -> None:
    """Four workers of one pool, at most half ejected for partial failures. Process a ejects
    two; process b then finds the pool at its share: its partly failing worker stays in. The
    failure share is taken over every process's outcomes: a's successes keep b's failures at a
    third, and only a worker failing (nearly) all of them is ejected beyond the share."""
    a, b = _group(2, ids=("c0", "c1", "c2", "c3"), threshold=2)
    _fail_partly(a, a.get("c0"))
    _fail_partly(a, a.get("c1"))
    assert [b.get(w).breaker.state for w in ("c0", "c1")] == [BreakerState.OPEN] * 2
    _fail_partly(b, b.get("c2"), rounds=4)
    assert b.get("c2").breaker.state is BreakerState.CLOSED  # the pool has lost its half already
    assert a.snapshot().get("c2").usable and b.snapshot().get("c2").usable  # type: ignore[union-attr]

    for _ in range(8):
        a.record(a.get("c3"), True)
    for _ in range(4):
        b.record(b.get("c3"), False)  # 4 failures of 12 outcomes, two processes'
    assert b.get("c3").breaker.state is BreakerState.CLOSED
    failures = 0
    while b.get("c3").breaker.state is BreakerState.CLOSED and failures < 20:
        (a, b)[failures % 2].record((a, b)[failures % 2].get("c3"), False)
        failures += 1
    assert a.get("c3").breaker.state is BreakerState.OPEN  # failing: ejected whatever the pool
    # at the 7th threshold of two in a row since: 18 failures of the last 20 outcomes (the first
    # at least 85 %), whichever process saw them; its 8 successes in a's window count
    assert failures == 14
    assert [s.id for s in a.snapshot().workers if s.usable] == ["c2"]


def test_a_pair_s_pool_counts_pairs_ejected_by_a_process_that_this_one_has_not_seen() -> None:
    """Process a ejects (p0, d0); process b, which never used that pair and has not planned
    since, fails (p0, d1) partly: one of the model's two pairs is out already, so it stays."""
    a, b = _group(2, ids=("p0", "d0", "d1"), threshold=2)
    pa = a.pair_breaker("p0", "d0")
    for ok in (True, True, True, False, False):
        pa.record(ok)
    assert pa.state is BreakerState.OPEN
    pb = b.pair_breaker("p0", "d1")
    assert b.open_pairs() == frozenset()  # b has not adopted (p0, d0): its guard reads the table
    for _ in range(3):
        for ok in (True, True, True, False, False):
            pb.record(ok)
    assert pb.state is BreakerState.CLOSED
    assert b.snapshot() is not None and b.open_pairs() == {"p0|d0"}


def _in_child(step: Callable[[], None]) -> int:
    """Run `step` in a forked process (the gateway's processes are forks that share the table);
    its exit status: 0 when it returned, 1 when it raised (printed)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's own coverage is not collected
        code = 1
        try:
            step()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_outlier_ejection_holds_between_two_forked_processes() -> None:
    """The table made before the fork, each process attaching its own row, as `serve --workers
    2` runs them: the child's ejection is the parent's, an ejection grows from one process to the
    other, and the pool's share counts both."""
    table = SharedTable(2, slots=64)
    settings = BreakerConfig(
        failure_threshold=2, success_threshold=1, open_s=0.05, max_open_s=10.0, max_ejected_share=0.5
    )
    parent = SharedRegistry(table, settings)
    for wid in ("c0", "c1"):
        parent.add(_worker(wid))

    def child_registry() -> SharedRegistry:
        table.attach(1)
        reg = SharedRegistry(table, settings)
        for wid in ("c0", "c1"):
            reg.add(_worker(wid))
        return reg

    def first() -> None:
        reg = child_registry()
        _fail_partly(reg, reg.get("c0"))
        assert reg.get("c0").breaker.state is BreakerState.OPEN
        _fail_partly(reg, reg.get("c1"), rounds=3)  # the other half of the pool: kept
        assert reg.get("c1").breaker.state is BreakerState.CLOSED

    assert _in_child(first) == 0
    c0, c1 = parent.get("c0").breaker, parent.get("c1").breaker
    assert c0.state is BreakerState.OPEN and c0.ejection_s == 0.05
    assert not parent.snapshot().get("c0").usable  # type: ignore[union-attr]
    _fail_partly(parent, parent.get("c1"))
    assert c1.state is BreakerState.CLOSED  # the parent counts the child's ejection too
    time.sleep(0.06)
    _trial(parent, "c0", False)
    assert c0.state is BreakerState.OPEN and c0.ejection_s == 0.1  # the second in a row

    def second() -> None:
        reg = child_registry()
        assert reg.get("c0").breaker.ejection_s == 0.1
        time.sleep(0.11)
        _trial(reg, "c0", False)
        assert reg.get("c0").breaker.ejection_s == pytest.approx(0.15)

    assert _in_child(second) == 0
    assert c0.state is BreakerState.OPEN and c0.ejection_s == pytest.approx(0.15)  # the third


def test_a_healthy_worker_s_success_skips_the_lock_and_failures_still_count_after_it() -> None:
    """A success on a closed breaker whose last WINDOW outcomes all succeeded changes nothing,
    so it does not wait for the table's lock (held here by a stalled "process"); the first
    failure after it is counted as ever, and a success from the other process then resets the
    failures in a row (it is no longer a no-op, so it takes the lock)."""
    from gateway.breaker import WINDOW

    a, b = _group(2, ids=("c0", "c1", "c2", "c3"), threshold=2)  # a pool that may lose one
    wa, wb = a.get("c0"), b.get("c0")
    for _ in range(WINDOW):
        a.record(wa, True)
    with b.table.locked():  # another process holds the lock
        t0 = time.perf_counter()
        assert wa.breaker.record(True) is False
        assert time.perf_counter() - t0 < 0.5  # the lock's timeout is 1 s
    b.record(wb, False)
    assert wa.breaker.failure_share == pytest.approx(1 / WINDOW)
    a.record(wa, True)  # resets the failures in a row: the next failure is the first again
    b.record(wb, False)
    assert wa.breaker.state is BreakerState.CLOSED
    b.record(wb, False)
    assert wa.breaker.state is BreakerState.OPEN
