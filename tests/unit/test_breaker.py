"""Outlier ejection (gateway/breaker.py, the registry's pools): ejection time growing with
repeated ejections, the ejected share of a pool capped, a (nearly) fully failing worker ejected
whatever its pool."""

from __future__ import annotations

from gateway.breaker import BreakerState, CircuitBreaker
from gateway.config import BreakerConfig
from gateway.registry import Registry, Worker
from policies.snapshot import Engine, Role


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_the_ejection_time_grows_with_repeated_ejections_and_decays_while_closed() -> None:
    clock = Clock()
    b = CircuitBreaker(2, 1, 10.0, clock, max_open_s=35.0)
    b.record(False)
    b.record(False)
    seen = [b.ejection_s]
    for _ in range(4):  # each failed half-open trial: ejected again, for longer (capped)
        clock.t += b.ejection_s
        assert b.allows() and b.state is BreakerState.HALF_OPEN
        b.on_dispatch()
        b.record(False)
        assert b.state is BreakerState.OPEN
        seen.append(b.ejection_s)
    assert seen == [10.0, 20.0, 30.0, 35.0, 35.0]
    clock.t += b.ejection_s
    assert b.allows()
    b.on_dispatch()
    b.record(True)
    assert b.state is BreakerState.CLOSED
    # closed for 20 s, two open_s: two of the five ejections in a row are forgiven
    clock.t += 20.0
    b.record(False)
    b.record(False)
    assert b.state is BreakerState.OPEN and b.ejection_s == 35.0  # min(35, 10 x (5 - 2 + 1))
    clock.t += 35.0
    b.allows()
    b.on_dispatch()
    b.record(True)
    clock.t += 1000.0  # long closed: forgiven entirely
    b.record(False)
    b.record(False)
    assert b.ejection_s == 10.0


def _pool(n: int, share: float = 0.5) -> tuple[Registry, list[Worker]]:
    reg = Registry(
        BreakerConfig(failure_threshold=2, success_threshold=1, open_s=30.0, max_ejected_share=share)
    )
    ws = []
    for i in range(n):
        w = Worker(f"c{i}", f"http://127.0.0.1:{9200 + i}", Role.COLOCATED, Engine.VLLM, model="m")
        w.healthy = True
        reg.add(w)
        ws.append(w)
    return reg, ws


def _fail_partly(reg: Registry, w: Worker, rounds: int) -> None:
    """Outcomes with two failures in a row every five (40 % failures): the consecutive-failure
    threshold (2) is reached, the failure share never."""
    for _ in range(rounds):
        for ok in (True, True, True, False, False):
            reg.record(w, ok)


def test_a_partly_failing_worker_alone_in_its_pool_is_never_ejected() -> None:
    reg, (w,) = _pool(1)
    _fail_partly(reg, w, 20)
    assert w.breaker.state is BreakerState.CLOSED and reg.snapshot().get("c0").usable  # type: ignore[union-attr]


def test_at_most_the_max_ejected_share_of_a_pool_is_out_for_partial_failures() -> None:
    reg, ws = _pool(4)
    for w in ws:
        _fail_partly(reg, w, 1)
    states = [w.breaker.state for w in ws]
    assert states.count(BreakerState.OPEN) == 2, states  # half of four
    usable = [s for s in reg.snapshot().workers if s.usable]
    assert len(usable) == 2


def test_a_fully_failing_worker_is_ejected_whatever_its_pool() -> None:
    reg, (w,) = _pool(1)
    reg.record(w, False)
    reg.record(w, False)
    assert w.breaker.state is BreakerState.CLOSED  # two outcomes: too few to tell
    reg.record(w, False)
    reg.record(w, False)  # four of four (twice the threshold): failing, not unlucky
    assert w.breaker.state is BreakerState.OPEN
    reg2, ws = _pool(4)
    for w in ws:  # every worker of a pool failing: all of them ejected
        for _ in range(4):
            reg2.record(w, False)
    assert all(w.breaker.state is BreakerState.OPEN for w in ws)


def test_a_pairs_breaker_is_capped_by_the_model_s_pairs() -> None:
    reg = Registry(BreakerConfig(failure_threshold=2, success_threshold=1, open_s=30.0))
    for wid, role in (("p", Role.PREFILL), ("d0", Role.DECODE), ("d1", Role.DECODE)):
        w = Worker(wid, f"http://{wid}:1", role, Engine.SGLANG, model="m")
        w.healthy = True
        reg.add(w)
    a, b = reg.pair_breaker("p", "d0"), reg.pair_breaker("p", "d1")
    for pair in (a, b):
        for ok in (True, True, True, False, False):
            pair.record(ok)
    assert a.state is BreakerState.OPEN and b.state is BreakerState.CLOSED  # one pair of two
