"""cache_aware's eviction price (`evict_price`, policies/turnover.py): the decayed new KV sent
to each worker, and what the price changes in the choice (tables, both paths: `select` and the
recorded `decide`). Pure: an injected clock."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import msgspec
import pytest

from policies.base import Completed, routed_event
from policies.build import build_policy
from policies.cache_aware import CacheAwareSelector, CacheAwareSettings, CacheState
from policies.config import CacheAwareCfg, parse_policy
from policies.prompt_key import PromptKey
from policies.snapshot import Colocated, RequestView, RouteKind, WorkerState
from policies.testing import ManualClock as Clock
from policies.testing import make_worker
from policies.turnover import Turnover


def req(ids: list[int], rid: str = "ask") -> RequestView:
    return RequestView(
        rid, "m", RouteKind.COMPLETIONS, len(ids), 16, prompt_key=PromptKey.from_token_ids(ids)
    )


# ---- the decayed sums ------------------------------------------------------------------------


def test_turnover_decays_over_its_window() -> None:
    t = Turnover(10.0)
    assert t.tokens("a", 0.0) == 0.0 and t.factor(0.0) == 0.0
    t.add("a", 1000.0, 0.0)
    t.add("a", 500.0, 10.0)
    t.add("b", 0.0, 10.0)  # nothing written: nothing kept
    assert t.tokens("a", 10.0) == pytest.approx(1000.0 * math.exp(-1.0) + 500.0)
    assert t.tokens("a", 20.0) == pytest.approx((1000.0 * math.exp(-1.0) + 500.0) * math.exp(-1.0))
    assert "b" not in t.scaled
    t.forget("a")
    assert t.tokens("a", 20.0) == 0.0


def test_turnover_rebases_before_the_scale_overflows() -> None:
    t = Turnover(1.0)
    t.add("a", 100.0, 0.0)
    t.add("b", 100.0, 0.0)
    for i in range(1, 2001):  # 2,000 windows: exp(2000) would overflow without the rebase
        t.add("a", 100.0, float(i))
    assert t.tokens("a", 2000.0) == pytest.approx(100.0 / (1.0 - math.exp(-1.0)))
    assert "b" not in t.scaled  # decayed to nothing and dropped at a rebase
    assert max(t.scaled.values()) < 1e30


def test_bad_turnover_window_is_refused() -> None:
    with pytest.raises(ValueError, match="window_s"):
        Turnover(0.0)


# ---- the choice ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    price: float  # evict_price
    window_s: float  # evict_window_s
    pool: int | None  # each worker's KV pool in tokens (None: unknown)
    best: str
    ask: tuple[int, int] = (20_000, 21_000)  # the prompt's token ids (range)


# a was sent a 4,000-token prompt 5 s ago (its queue has drained: 4,016 new KV tokens, 2,436
# of them left after half a 10 s window); b was just sent 100 tokens (0.1 s queued). An
# unmatched 1,000-token prompt: 1.0 s on a, 1.1 s on b; the price on a: price x 1.0 s x
# written / pool.
CASES = [
    Case("off: the shorter wait (a)", 0.0, 10.0, 4000, "a"),
    Case(
        "a rewrote 0.6 of its pool in the window: its evictions cost more than b's queue",
        1.0,
        10.0,
        4000,
        "b",
    ),
    Case("a small price does not outweigh b's queue", 0.1, 10.0, 4000, "a"),
    Case("a's writes are ten windows old: its cache has settled", 1.0, 0.5, 4000, "a"),
    Case("a pool ten times as large: a rewrote 0.06 of it", 1.0, 10.0, 40_000, "a"),
    Case("pool unknown: no price", 1.0, 10.0, None, "a"),
    Case("a pool reported as 0 tokens: no price (no division)", 1.0, 10.0, 0, "a"),
    # the same prompt continued (a holds its first 4,000 tokens): a writes 500 new tokens, b
    # 4,500; the price protects the holder even where it turns over fastest
    Case("the holder writes only what it does not hold", 1.0, 10.0, 4000, "a", (1000, 5500)),
]


def _worker(wid: str, pool: int | None) -> WorkerState:
    return msgspec.structs.replace(make_worker(wid), kv_capacity_tokens=pool)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("recorded", [False, True])
def test_the_eviction_price_of_a_fast_turning_cache(case: Case, recorded: bool) -> None:
    clock = Clock()
    st = CacheState(
        CacheAwareSettings(
            prefill_rate=1000.0,
            crossover_tokens=0.0,
            inflight_factor=0.0,
            queue_externality=0.0,
            evict_price=case.price,
            evict_window_s=case.window_s,
            worker_cache_tokens=None,
        ),
        clock=clock,
    )
    a, b = _worker("a", case.pool), _worker("b", case.pool)
    st.observe(routed_event(req(list(range(1000, 5000)), "filler"), Colocated(a)))
    st.observe(Completed("filler", ("a",), cached_tokens=0))
    clock.t = 105.0
    st.observe(routed_event(req(list(range(9000, 9100)), "small"), Colocated(b)))
    sel = CacheAwareSelector("x", st, rng=random.Random(0))
    ask = req(list(range(*case.ask)))
    if recorded:
        chosen, record = sel.decide(ask, [a, b])
        assert record is not None
        by = {e.worker: e for e in record.candidates}
        priced = case.price > 0 and bool(case.pool)
        assert (by["a"].evict_s > 0 and by["b"].evict_s > 0) == priced
        assert by["a"].cost == pytest.approx(by["a"].ttft_s + by["a"].evict_s)
    else:
        chosen = sel.select(ask, [a, b])
    assert chosen.id == case.best


def test_worker_cache_tokens_stands_in_for_an_unreported_pool() -> None:
    clock = Clock()
    st = CacheState(
        CacheAwareSettings(
            prefill_rate=1000.0,
            crossover_tokens=0.0,
            inflight_factor=0.0,
            queue_externality=0.0,
            evict_price=1.0,
            worker_cache_tokens=4000,
        ),
        clock=clock,
    )
    a, b = make_worker("a"), make_worker("b")
    st.observe(routed_event(req(list(range(1000, 5000)), "filler"), Colocated(a)))
    clock.t = 105.0
    st.observe(routed_event(req(list(range(9000, 9100)), "small"), Colocated(b)))
    sel = CacheAwareSelector("x", st, rng=random.Random(0))
    assert sel.select(req(list(range(20_000, 21_000))), [a, b]).id == "b"


# ---- the knobs ---------------------------------------------------------------------------------


def test_the_knobs_parse_and_reach_the_state() -> None:
    cfg = parse_policy({"type": "cache_aware", "evict_price": 2.0, "evict_window_s": 20.0})
    assert isinstance(cfg, CacheAwareCfg) and (cfg.evict_price, cfg.evict_window_s) == (2.0, 20.0)
    assert (CacheAwareCfg().evict_price, CacheAwareCfg().evict_window_s) == (0.0, 5.0)  # off by default
    build_policy(cfg)  # builds
    from policies.build import cache_aware_settings

    s = cache_aware_settings(cfg)
    assert (s.evict_price, s.evict_window_s) == (2.0, 20.0)
    assert CacheState(s).turnover.window_s == 20.0


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"evict_price": -1.0}, "evict_price"),
        ({"evict_price": math.inf}, "evict_price"),
        ({"evict_window_s": 0.0}, "evict_window_s"),
        ({"evict_window_s": math.nan}, "evict_window_s"),
        ({"evict_price": 1.0, "large_pool": "exact", "queue_externality": 0.0}, "evict_price = 0"),
    ],
)
def test_bad_knobs_are_refused(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CacheAwareCfg(**kw)  # type: ignore[arg-type]
    if "large_pool" in kw:
        with pytest.raises(ValueError, match=match):
            CacheAwareSettings(evict_price=1.0, exact_large_pool=True, queue_externality=0.0)
