"""`tail_price` / `tail_ttft_s` (policies/tail_price.py): cache_aware's cost made convex in the
request's own predicted TTFT beyond a threshold, so that a cached turn leaves a backed-up holder
for a worker predicted within it, while a short wait keeps the affinity and the SLO rule still
ranks decodes broken first. Tables over an injected clock; the knobs are new, so every case fails
on the code before them."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from policies.base import Completed, routed_event
from policies.build import cache_aware_settings
from policies.cache_aware import CacheAwareSelector, CacheAwareSettings, CacheState
from policies.config import parse_policy
from policies.decode_slo import SloSettings
from policies.snapshot import Colocated, RequestView, WorkerState
from policies.tail_price import tail_s
from policies.testing import ManualClock as Clock
from policies.testing import make_token_request, make_worker

DOC = list(range(10_000, 20_000))  # a 10,000-token document the conversation keeps sending


@dataclass(frozen=True)
class Case:
    name: str
    price: float
    threshold_s: float
    queued_tokens: int  # prefill queued on the holder `a` ahead of the turn (10,000 work/s)
    decoding_on_b: bool  # a 10-token answer decodes on b (with the TPOT SLO on, b's prefill breaks it)
    expected: str


# a holds the document; b computes the whole prompt in ~1 s but has 9 requests in flight, so the
# batch term weighs its prefill 10x: cost(b) ~ 10 s against cost(a) = a's queue (~6 s or ~2 s)
CASES = [
    Case("off: the holder, ~6 s late", 0.0, 0.5, 60_000, False, "a"),
    # beyond 0.5 s each predicted second counts twice: a 6 + 5.5 = 11.5 against b 10 + 0.5
    Case("price 1: the worker predicted within", 1.0, 0.5, 60_000, False, "b"),
    # half as dear: a 6 + 2.75 = 8.75 against b 10 + 0.25
    Case("price 0.5: still the holder", 0.5, 0.5, 60_000, False, "a"),
    # the threshold above both predictions: nothing priced
    Case("threshold 7 s: the holder", 1.0, 7.0, 60_000, False, "a"),
    # a short wait (2 s) keeps the affinity at the same price: a 2 + 1.45 against b 10.5
    Case("short wait: the holder", 1.0, 0.5, 20_000, False, "a"),
    # a steep price moves it even then (a 2 + 10 x 1.45 = 16.5 against b 10 + 10 x 0.5 = 15)
    Case("price 10, short wait: moved", 10.0, 0.5, 20_000, False, "b"),
    # the SLO rule first: b would break its decode, a none; no price moves the turn there
    Case("price 8, b decoding: the holder", 8.0, 0.5, 60_000, True, "a"),
]


def scenario(case: Case) -> tuple[CacheAwareSelector, RequestView, list[WorkerState]]:
    clock = Clock()
    settings = CacheAwareSettings(
        crossover_tokens=0.0,
        queue_externality=0.0,
        slo=SloSettings(tpot_slo_x=5.0),
        tail_price=case.price,
        tail_ttft_s=case.threshold_s,
    )
    st = CacheState(settings, clock=clock)
    sel = CacheAwareSelector("colocated", st)
    a, b = make_worker("a", engine="sglang"), make_worker("b", engine="sglang", inflight=9)
    st.observe(routed_event(make_token_request("turn1", [*DOC, 1]), Colocated(a)))
    clock.t += 5.0
    st.observe(Completed("turn1", ("a",), cached_tokens=0))
    queued = list(range(50_000, 50_000 + case.queued_tokens))
    st.observe(routed_event(make_token_request("big", queued, 1), Colocated(a)))  # a one-token answer
    if case.decoding_on_b:
        st.observe(routed_event(make_token_request("short", [7, 7, 7], 10), Colocated(b)))
    clock.t += 0.05
    return sel, make_token_request("turn2", [*DOC, 2]), [a, b]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_tail_price_moves_only_the_long_waits(case: Case) -> None:
    sel, turn2, cands = scenario(case)
    chosen, record = sel.decide(turn2, cands)
    assert record is not None
    for e in record.candidates:  # the record shows the price, and the cost includes it
        assert e.tail_s == pytest.approx(tail_s(e.ttft_s, case.price, case.threshold_s))
        assert e.tail_s == 0.0 or e.cost >= e.ttft_s + e.tail_s
    assert chosen.id == case.expected
    assert sel.select(turn2, cands).id == case.expected  # the record-free loop agrees


@pytest.mark.parametrize(
    ("ttft", "price", "threshold", "expected"),
    [
        (0.4, 2.0, 0.5, 0.0),
        (0.5, 2.0, 0.5, 0.0),
        (0.75, 2.0, 0.5, 0.5),
        (3.0, 0.0, 0.5, 0.0),
        (1.0, 1.0, 0.0, 1.0),
    ],
)
def test_tail_s(ttft: float, price: float, threshold: float, expected: float) -> None:
    assert tail_s(ttft, price, threshold) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("raw", "price", "threshold"),
    [({}, 0.0, 0.5), ({"tail_price": 2.0}, 2.0, 0.5), ({"tail_price": 1.0, "tail_ttft_s": 0.4}, 1.0, 0.4)],
)
def test_config_knobs(raw: dict[str, object], price: float, threshold: float) -> None:
    s = cache_aware_settings(parse_policy({"type": "cache_aware", **raw}))
    assert (s.tail_price, s.tail_ttft_s) == (price, threshold)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"tail_price": -1.0}, "tail_price must be a finite number >= 0"),
        ({"tail_price": float("inf")}, "tail_price must be a finite number >= 0"),
        ({"tail_ttft_s": -0.1}, "tail_ttft_s must be a finite number >= 0"),
        ({"tail_price": 1.0, "large_pool": "exact", "queue_externality": 0.0}, "needs tail_price = 0"),
    ],
)
def test_config_refuses(raw: dict[str, object], message: str) -> None:
    with pytest.raises(Exception, match=message):
        parse_policy({"type": "cache_aware", **raw})
