"""cache_aware's blocking price (`block_price`, policies/turnover.py): each worker's decayed
affinity arrivals, and what the price changes in the choice (tables, both paths: `select` and
the recorded `decide`). Pure: an injected clock."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest

from policies.base import routed_event
from policies.build import build_policy, cache_aware_settings
from policies.cache_aware import CacheAwareSelector, CacheAwareSettings, CacheState
from policies.config import CacheAwareCfg, parse_policy
from policies.prompt_key import PromptKey
from policies.snapshot import Colocated, RequestView, RouteKind
from policies.testing import make_worker
from policies.turnover import Turnover


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def req(ids: list[int], rid: str = "ask") -> RequestView:
    return RequestView(
        rid, "m", RouteKind.COMPLETIONS, len(ids), 16, prompt_key=PromptKey.from_token_ids(ids)
    )


# ---- the decayed affinity arrivals -------------------------------------------------------------


def test_affinity_arrivals_decay_over_the_window_and_are_forgotten() -> None:
    t = Turnover(10.0)
    assert t.affinity_rate("a", 0.0) == 0.0
    t.add("a", 100.0, 0.0, 1.0)
    t.add("a", 100.0, 10.0, 0.5)
    t.add("b", 100.0, 10.0)  # no hit: written, not an affinity arrival
    t.add("c", 0.0, 10.0, 0.25)  # a hit that writes nothing still counts
    assert t.affinity_rate("a", 10.0) == pytest.approx((math.exp(-1.0) + 0.5) / 10.0)
    assert t.affinity_rate("a", 20.0) == pytest.approx((math.exp(-1.0) + 0.5) * math.exp(-1.0) / 10.0)
    assert "b" not in t.hits and t.tokens("b", 10.0) == pytest.approx(100.0)
    assert t.affinity_rate("c", 10.0) == pytest.approx(0.025) and "c" not in t.scaled
    t.forget("a")
    assert t.affinity_rate("a", 20.0) == 0.0 and t.tokens("a", 20.0) == 0.0


def test_affinity_arrivals_survive_a_rebase() -> None:
    t = Turnover(1.0)
    t.add("b", 1.0, 0.0, 1.0)
    for i in range(2001):  # 2,000 windows: exp(2000) would overflow without the rebase
        t.add("a", 1.0, float(i), 1.0)
    assert t.affinity_rate("a", 2000.0) == pytest.approx(1.0 / (1.0 - math.exp(-1.0)))
    assert "b" not in t.hits and max(t.hits.values()) < 1e30


# ---- the choice ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    price: float  # block_price
    best: str
    ask: tuple[int, int] = (20_000, 21_000)  # the prompt's token ids (range): cold by default
    window_s: float = 10.0  # evict_window_s (the affinity arrivals' window too)
    threshold: float = 0.0  # cache_threshold


# a holds a conversation: its first turn (ids 1000-2999) at t=100, its second (1000-3099,
# 2,000 of 2,100 tokens cached: a hit of 0.952) at t=103; b was sent an unmatched 100-token
# prompt at t=110 (0.1 s queued). At t=110, a's queue has drained; lam_aff(a) = 0.952 x
# exp(-0.7) / 10 = 0.0473/s. An unmatched 1,000-token prompt: 1.0 s on a, 1.1 s on b; the
# blocking price on a = price x 0.0473 x 1.0 x (0 + 0.5) = 0.0236 x price, on b 0.
CASES = [
    Case("off: the shorter wait (a)", 0.0, "a"),
    Case("a small price does not outweigh b's queue", 1.0, "a"),
    Case("a holds a live conversation: the cold prompt blocks fewer turns on b", 10.0, "b"),
    Case("a's turn is ten windows old: nothing expected back", 10.0, "a", window_s=0.7),
    Case("the turn was cached below cache_threshold: no affinity arrival", 10.0, "a", threshold=0.96),
    # the conversation's third turn (100 new tokens on a, 2,200 on b): barely charged on its holder
    Case("a cached turn on its holder is barely charged", 10.0, "a", ask=(1000, 3200)),
    Case("... even at a large price", 1000.0, "a", ask=(1000, 3200)),
]


def _state(case: Case, clock: Clock) -> CacheState:
    return CacheState(
        CacheAwareSettings(
            prefill_rate=1000.0,
            crossover_tokens=0.0,
            inflight_factor=0.0,
            queue_externality=0.0,
            block_price=case.price,
            evict_window_s=case.window_s,
            cache_threshold=case.threshold,
        ),
        clock=clock,
    )


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("recorded", [False, True])
def test_the_blocking_price_of_a_worker_with_live_conversations(case: Case, recorded: bool) -> None:
    clock = Clock()
    st = _state(case, clock)
    a, b = make_worker("a"), make_worker("b")
    st.observe(routed_event(req(list(range(1000, 3000)), "turn1"), Colocated(a)))
    clock.t = 103.0
    st.observe(routed_event(req(list(range(1000, 3100)), "turn2"), Colocated(a)))
    clock.t = 110.0
    st.observe(routed_event(req(list(range(9000, 9100)), "small"), Colocated(b)))
    sel = CacheAwareSelector("x", st, rng=random.Random(0))
    ask = req(list(range(*case.ask)))
    if recorded:
        chosen, record = sel.decide(ask, [a, b])
        assert record is not None
        by = {e.worker: e for e in record.candidates}
        lam = st.turnover.affinity_rate("a", 110.0)
        own = by["a"].ttft_s  # (a's queue is empty: its own prefill)
        assert by["a"].evict_s == pytest.approx(case.price * lam * own * (0.0 + 0.5 * own))
        assert by["b"].evict_s == 0.0
    else:
        chosen = sel.select(ask, [a, b])
    assert chosen.id == case.best


def test_the_price_counts_the_queue_ahead() -> None:
    """`wait + S / 2`: a cold prompt queued behind a's backlog blocks its turns longer."""
    clock = Clock()
    st = _state(Case("", 10.0, ""), clock)
    a, b = make_worker("a"), make_worker("b")
    st.observe(routed_event(req(list(range(1000, 3000)), "turn1"), Colocated(a)))
    clock.t = 103.0
    st.observe(routed_event(req(list(range(1000, 3100)), "turn2"), Colocated(a)))
    clock.t = 103.05  # a: 0.05 s of turn2 still queued
    sel = CacheAwareSelector("x", st, rng=random.Random(0))
    _, record = sel.decide(req(list(range(20_000, 21_000))), [a, b])
    assert record is not None
    e = {c.worker: c for c in record.candidates}["a"]
    wait = e.ttft_s - 1.0
    assert wait == pytest.approx(0.05)
    lam = st.turnover.affinity_rate("a", 103.05)
    assert e.evict_s == pytest.approx(10.0 * lam * 1.0 * (wait + 0.5))


# ---- the knob ----------------------------------------------------------------------------------


def test_the_knob_parses_reaches_the_state_and_is_off_by_default() -> None:
    cfg = parse_policy({"type": "cache_aware", "block_price": 4.0})
    assert isinstance(cfg, CacheAwareCfg) and cfg.block_price == 4.0
    assert CacheAwareCfg().block_price == 0.0 and CacheAwareSettings().block_price == 0.0
    build_policy(cfg)  # builds
    assert cache_aware_settings(cfg).block_price == 4.0


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"block_price": -1.0}, "block_price"),
        ({"block_price": math.nan}, "block_price"),
        ({"block_price": 1.0, "large_pool": "exact", "queue_externality": 0.0}, "block_price = 0"),
    ],
)
def test_bad_knobs_are_refused(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CacheAwareCfg(**kw)  # type: ignore[arg-type]
