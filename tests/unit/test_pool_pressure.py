"""The price of prefill work in a busy pool (policies/pool_pressure.py) and what it changes in
cache_aware's choice (tables). Pure: an injected clock."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest

from policies.base import Completed, routed_event
from policies.cache_aware import CacheAwareSelector, CacheAwareSettings, CacheState
from policies.config import CacheAwareCfg
from policies.pool_pressure import RHO_MAX, DecayedRate, externality_per_work
from policies.prompt_key import PromptKey
from policies.snapshot import Colocated, RequestView, RouteKind
from policies.testing import ManualClock as Clock
from policies.testing import make_worker


@pytest.mark.parametrize(
    ("arrivals", "work", "wait", "pool_rate", "expect"),
    [
        (10.0, 1000.0, 0.0, 4000.0, 0.0),  # no queue anywhere: free
        (0.0, 0.0, 2.0, 4000.0, 0.0),  # nothing arrives: nobody to delay
        (10.0, 1000.0, 1.0, 0.0, 0.0),  # no rate known: no price
        (10.0, 0.0, 1.0, 4000.0, 10.0 * 1.0 / 4000.0),  # rho 0: lam W / R
        (10.0, 2000.0, 1.0, 4000.0, 10.0 * 1.0 / (0.5 * 4000.0)),  # rho 0.5: twice
        (10.0, 8000.0, 1.0, 4000.0, 10.0 * 1.0 / ((1 - RHO_MAX) * 4000.0)),  # overloaded: capped
        (5.0, 2000.0, 2.0, 4000.0, 5.0 * 2.0 / (0.5 * 4000.0)),  # same lam x W, same price
    ],
)
def test_externality_per_work(
    arrivals: float, work: float, wait: float, pool_rate: float, expect: float
) -> None:
    assert externality_per_work(arrivals, work, wait, pool_rate) == pytest.approx(expect)


@pytest.mark.parametrize(
    ("gap_s", "events", "read_after_s", "expect_per_s"),
    [
        (0.1, 300, 0.0, 10.0),  # steady 10/s for 3 windows
        (0.1, 30, 0.0, sum(math.exp(-i / 100) for i in range(30)) / 5.0),  # 3 s: over half a window
        (0.1, 300, 10.0, 10.0 * math.exp(-1.0)),  # a window of silence: e^-1 of it
        (1.0, 1, 0.0, 1 / 5.0),  # one event: a lone burst, not a rate
    ],
)
def test_decayed_rate(gap_s: float, events: int, read_after_s: float, expect_per_s: float) -> None:
    r = DecayedRate(10.0)
    for i in range(events):
        r.add(2.0, i * gap_s)
    count, amount = r.rates((events - 1) * gap_s + read_after_s)
    assert count == pytest.approx(expect_per_s, rel=0.06)
    assert amount == pytest.approx(2.0 * count)
    assert DecayedRate(10.0).rates(5.0) == (0.0, 0.0)


def test_bad_window_is_refused() -> None:
    with pytest.raises(ValueError, match="window_s"):
        DecayedRate(0.0)
    with pytest.raises(ValueError, match="queue_externality"):
        CacheAwareCfg(queue_externality=-1.0)
    with pytest.raises(ValueError, match="pressure_window_s"):
        CacheAwareCfg(pressure_window_s=0.0)


# ---- the choice -----------------------------------------------------------------------------------

PREFIX = list(range(1000, 1800))  # 800 tokens: what worker b holds
ASK = PREFIX + [9] * 200  # 1000 tokens: b computes 200 of them, a all 1000


def req(ids: list[int], rid: str = "ask") -> RequestView:
    return RequestView(
        rid, "m", RouteKind.COMPLETIONS, len(ids), 16, prompt_key=PromptKey.from_token_ids(ids)
    )


@dataclass(frozen=True)
class Case:
    name: str
    others: int  # small requests routed to a within the last second besides b's two (arrivals)
    externality: float  # queue_externality
    best: str


# b holds the prefix behind 1.5 s of queue (a 1,500-token filler); a is
# idle. Predicted TTFT: a 1.0 s, b 1.7 s. The pool (2 x 1000 tokens/s) is busy: recomputing the
# prefix on a delays every request that arrives while the queue lasts.
CASES = [
    Case("quiet pool: the shorter TTFT (the queue outweighs the cache)", 0, 1.0, "a"),
    Case("busy pool: recomputing costs the later arrivals more than b's queue", 30, 1.0, "b"),
    Case("busy pool, queue_externality 0: the TTFT alone (the old choice)", 30, 0.0, "a"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("recorded", [False, True])
def test_a_busy_pool_keeps_a_turn_on_its_cache(case: Case, recorded: bool) -> None:
    clock = Clock()
    st = CacheState(
        CacheAwareSettings(
            prefill_rate=1000.0, crossover_tokens=0.0, inflight_factor=0.0, queue_externality=case.externality
        ),
        clock=clock,
    )
    a, b = make_worker("a"), make_worker("b")
    clock.t = 60.0  # b computed the prefix long ago (a prompt is cached once its prefill ends)
    st.observe(routed_event(req(PREFIX, "prefix"), Colocated(b)))
    st.observe(Completed("prefix", ("b",), cached_tokens=0))
    clock.t = 100.0
    st.observe(routed_event(req(list(range(5000, 6500)), "filler"), Colocated(b)))
    for i in range(case.others):
        st.observe(routed_event(req([7000 + i], f"small{i}"), Colocated(a)))
    sel = CacheAwareSelector("x", st, rng=random.Random(0))
    if recorded:
        chosen, record = sel.decide(req(ASK), [a, b])
        assert record is not None
        by = {e.worker: e for e in record.candidates}
        assert by["a"].ttft_s < by["b"].ttft_s  # the request's own TTFT favours a in every case
        # a would recompute the prefix: its price is the higher one wherever there is a price
        assert (by["a"].externality_s > by["b"].externality_s) == (case.externality > 0)
    else:
        chosen = sel.select(req(ASK), [a, b])
    assert chosen.id == case.best
