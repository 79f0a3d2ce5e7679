"""`queue_wait = "shared"` (policies/pool_pressure.py `shared_wait`): the busy-pool externality
reads the wait of the workers later arrivals share, not the mean over a pool one backed-up worker
inflates. Tables over an injected clock; the knob is new, so every case fails on the code before
it."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from policies.base import Completed, routed_event
from policies.build import cache_aware_settings
from policies.cache_aware import CacheAwareSelector, CacheAwareSettings, CacheState
from policies.config import parse_policy
from policies.pool_pressure import shared_wait
from policies.snapshot import Colocated
from policies.testing import ManualClock as Clock
from policies.testing import make_token_request, make_worker


@pytest.mark.parametrize(
    ("waits", "rho", "expect"),
    [
        ([], 0.5, 0.0),
        ([2.0], 0.5, 2.0),  # one worker: its wait
        ([1.0, 1.0, 1.0, 1.0], 0.5, 1.0),  # level: the mean
        ([1.0, 1.0, 2.0, 3.0], 0.6, 1.75),  # the busiest rejoins the rest before they drain: the mean
        ([0.0, 0.0, 0.0, 5.8], 0.5, 0.0),  # one backed up beside idle ones: they stay idle, it is left out
        ([0.5, 0.6, 0.7, 5.8], 0.6, 0.6),  # beside a shared 0.6 s: left out, the rest kept
        ([0.2, 0.1, 5.0, 0.3], 0.3, 0.2),  # in any order
        ([0.1, 0.1, 4.0, 6.0], 0.3, 0.1),  # two backed up: both left out, the busiest first
        ([0.0, 0.0, 0.0, 5.8], 0.9, 1.45),  # three cannot carry the load (rho_s > 1): they fill up to it
        ([0.0, 0.0, 0.0, 5.8], 0.0, 0.0),  # nothing arriving
    ],
)
def test_shared_wait(waits: list[float], rho: float, expect: float) -> None:
    assert shared_wait(waits, rho) == pytest.approx(expect)
    assert min(waits, default=0.0) <= shared_wait(waits, rho) <= sum(waits) / max(1, len(waits)) + 1e-12


# ---- the choice -----------------------------------------------------------------------------------

PREFIX = list(range(1000, 1800))  # 800 tokens: what worker b holds
ASK = PREFIX + [9] * 200  # 1000 tokens: b computes 200 of them, the others all 1000


@dataclass(frozen=True)
class Case:
    name: str
    queued: dict[str, int]  # prefill tokens queued on each worker (1,000 tokens/s each)
    shared: bool  # queue_wait = "shared"
    priced: bool  # a busy-pool price at all (K > 0)
    best: str


# b holds the prefix (predicted TTFT 0.2 s + its queue); 30 one-token requests arrived at a
# (the arrivals, ~3 a second over the window); c is a's twin without them
BACKED_UP = {"b": 1500, "d": 8000}  # d has 8 s queued, a and c next to nothing
ALL_BUSY = {"a": 1000, "b": 2000, "c": 1000, "d": 1000}  # every worker has about a second queued
CASES = [
    # W = the mean (2.4 s, d's 8 s in it): recomputing the prefix on c is priced ~2.6 s, b kept
    Case("mean, one worker backed up: the holder behind 1.5 s", BACKED_UP, False, True, "b"),
    # W = the wait the arrivals share (a and c: ~0): no price, c's 1.0 s beats b's 1.7 s
    Case("shared, one worker backed up: the idle worker", BACKED_UP, True, False, "c"),
    # every worker queued: the arrivals wait too, the price keeps the holder either way
    Case("mean, every worker queued: the holder", ALL_BUSY, False, True, "b"),
    Case("shared, every worker queued: the holder", ALL_BUSY, True, True, "b"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_backed_up_worker_does_not_price_the_pool(case: Case) -> None:
    clock = Clock()
    settings = CacheAwareSettings(
        prefill_rate=1000.0, crossover_tokens=0.0, inflight_factor=0.0, shared_wait=case.shared
    )
    st = CacheState(settings, clock=clock)
    workers = {w: make_worker(w) for w in "abcd"}
    clock.t = 60.0  # b computed the prefix long ago (a prompt is cached once its prefill ends)
    st.observe(routed_event(make_token_request("prefix", PREFIX), Colocated(workers["b"])))
    st.observe(Completed("prefix", ("b",), cached_tokens=0))
    clock.t = 100.0
    for i, (w, n) in enumerate(case.queued.items()):
        st.observe(
            routed_event(
                make_token_request(w, list(range(10_000 * (i + 1), 10_000 * (i + 1) + n))),
                Colocated(workers[w]),
            )
        )
    for i in range(30):
        st.observe(routed_event(make_token_request(f"small{i}", [7000 + i]), Colocated(workers["a"])))
    cands = list(workers.values())
    chosen, record = CacheAwareSelector("x", st, rng=random.Random(0)).decide(
        make_token_request("ask", ASK), cands
    )
    assert record is not None
    by = {e.worker: e for e in record.candidates}
    assert by["c"].ttft_s < by["b"].ttft_s  # the request's own TTFT favours c in every case
    assert by["c"].externality_s >= by["b"].externality_s  # c recomputes the prefix: priced higher
    assert (by["c"].externality_s > by["b"].externality_s > 0.0) is case.priced
    assert chosen.id == case.best
    assert (
        CacheAwareSelector("x", st, rng=random.Random(0)).select(make_token_request("ask", ASK), cands).id
        == case.best
    )


@pytest.mark.parametrize(
    ("raw", "shared"), [({}, False), ({"queue_wait": "mean"}, False), ({"queue_wait": "shared"}, True)]
)
def test_config_knob(raw: dict[str, object], shared: bool) -> None:
    assert cache_aware_settings(parse_policy({"type": "cache_aware", **raw})).shared_wait is shared


def test_config_refuses_an_unknown_wait() -> None:
    with pytest.raises(Exception, match="queue_wait"):
        parse_policy({"type": "cache_aware", "queue_wait": "median"})
