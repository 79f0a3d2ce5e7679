"""`turn_keep_x` (policies/turn_keep.py): with a TPOT SLO, `cache_aware` ranks the fewest predicted
SLO misses first, so one decode predicted broken on a turn's cache holder sends the turn to a
worker that computes its whole prompt. With the knob, the holder of a cached turn stays among the
candidates where the cheapest worker breaking fewer costs at least `x` times as much per miss
spared; cold prompts are ranked as before. Tables over an injected clock; the knob is new, so
every case fails on the code before it (and the scenario's kept cases pick `b` there)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from policies.base import routed_event
from policies.build import cache_aware_settings
from policies.cache_aware import CacheAwareSelector, CacheAwareSettings, CacheState
from policies.config import CacheAwareCfg, parse_policy
from policies.decode_slo import SloSettings
from policies.snapshot import Colocated, RequestView, WorkerState
from policies.testing import ManualClock as Clock
from policies.testing import make_token_request, make_worker
from policies.turn_keep import TurnKeep, holder, keep_parts, kept_holder, slo_kept

DOC = list(range(10_000, 50_000))  # 40,000 tokens of a conversation, sent to `a` first
SUFFIX = list(range(60_000, 70_000))  # the next turn's 10,000 new tokens


@dataclass(frozen=True)
class Case:
    name: str
    x: float  # turn_keep_x
    share: float  # turn_keep_share
    short_on_a: int  # short answers decoding on the holder when the turn comes
    cold: bool  # the request is a new prompt, not the turn
    expected: str


# the turn (DOC + SUFFIX, 50,000 tokens) costs ~1 s on its holder `a` (the suffix, at the
# prior 10,000 work/s) and ~5 s on `b` (the whole prompt): ~5x. Each short answer decoding on
# `a` is one more miss there (1 s of prefill puts a 10-token answer past 5x its TPOT)
CASES = [
    Case("off: the fewest misses first, the whole prompt on b", 0.0, 0.5, 1, False, "b"),
    Case("x = 2: b costs 5x the holder, the turn stays", 2.0, 0.5, 1, False, "a"),
    Case("x = 4: still within", 4.0, 0.5, 1, False, "a"),
    Case("x = 6: b is not 6x as costly, it goes", 6.0, 0.5, 1, False, "b"),
    Case("two misses on a: x = 2 asks 2 x 2 = 4x, b is 5x", 2.0, 0.5, 2, False, "a"),
    Case("two misses on a: x = 3 asks 6x", 3.0, 0.5, 2, False, "b"),
    Case("the holder holds 80 % of the prompt, share 0.9: not a turn", 2.0, 0.9, 1, False, "b"),
    Case("share 0.8: a turn", 2.0, 0.8, 1, False, "a"),
    Case("a cold prompt is ranked as before", 2.0, 0.5, 1, True, "b"),
    Case("nothing decoding on a: the cost alone", 0.0, 0.5, 0, False, "a"),
    Case("nothing decoding, the knob on: the cost alone", 2.0, 0.5, 0, False, "a"),
]


def scenario(case: Case) -> tuple[CacheAwareSelector, RequestView, list[WorkerState]]:
    clock = Clock()
    slo = SloSettings(tpot_slo_x=5.0, keep=TurnKeep(case.x, case.share))
    settings = CacheAwareSettings(crossover_tokens=0.0, queue_externality=0.0, inflight_factor=0.0, slo=slo)
    st = CacheState(settings, clock=clock)
    sel = CacheAwareSelector("colocated", st)
    a, b = make_worker("a", engine="sglang"), make_worker("b", engine="sglang")
    st.observe(routed_event(make_token_request("turn1", [*DOC, 1], 1), Colocated(a)))
    clock.t += 5.0  # turn1's prefill (1 s predicted) is over; its prefix stays on a
    for i in range(case.short_on_a):
        st.observe(routed_event(make_token_request(f"short{i}", [7, 7, 7 + i], 10), Colocated(a)))
    clock.t += 0.05
    ids = list(range(100_000, 150_000)) if case.cold else [*DOC, *SUFFIX]
    return sel, make_token_request("turn2", ids), [a, b]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_far_cheaper_holder_keeps_its_turn(case: Case) -> None:
    sel, turn2, cands = scenario(case)
    chosen, record = sel.decide(turn2, cands)
    assert record is not None
    got = {e.worker: e for e in record.candidates}
    assert (got["a"].slo_misses, got["b"].slo_misses) == (case.short_on_a, 0)
    if not case.cold:
        assert got["a"].cached_tokens >= len(DOC) - 16
        assert 4.5 < got["b"].cost / got["a"].cost < 5.5
    assert chosen.id == case.expected
    assert sel.select(turn2, cands).id == case.expected  # the record-free loop agrees


def test_both_paths_keep_alike() -> None:
    """`select` (one loop) and `decide` (estimates) make the same choice over random pools where
    the holder is often dropped by the rank, and the knob keeps it in some of them."""
    kept = 0
    for seed in range(80):
        rng = random.Random(seed)
        clock = Clock()
        keep = TurnKeep(rng.choice([1.0, 2.0, 4.0]), rng.choice([0.3, 0.5, 0.9]))
        settings = CacheAwareSettings(
            queue_externality=rng.choice([0.0, 2.0]),
            inflight_factor=rng.choice([0.0, 1.0]),
            evict_price=rng.choice([0.0, 4.0]),
            slo=SloSettings(tpot_slo_x=5.0, keep=keep),
        )
        st = CacheState(settings, clock=clock)
        cands = [make_worker(w, inflight=rng.randrange(0, 4)) for w in "abcd"]
        doc = list(range(10_000, 10_000 + rng.randrange(2_000, 30_000)))
        st.observe(routed_event(make_token_request("turn1", [*doc, 1], 1), Colocated(rng.choice(cands))))
        clock.t += rng.choice([0.5, 5.0])
        for i in range(rng.randrange(0, 6)):
            ids = [7, 7, i] if rng.random() < 0.7 else list(range(i * 100_000, i * 100_000 + 3_000))
            st.observe(
                routed_event(
                    make_token_request(f"o{i}", ids, rng.choice([4, 10, 50])), Colocated(rng.choice(cands))
                )
            )
            clock.t += rng.random() * 0.2
        turn = make_token_request("turn2", [*doc, *range(70_000, 70_000 + rng.randrange(100, 8_000))])
        chosen, record = CacheAwareSelector("x", st, rng=random.Random(seed)).decide(turn, cands)
        assert CacheAwareSelector("x", st, rng=random.Random(seed)).select(turn, cands) is chosen, seed
        assert record is not None
        est = record.candidates
        fewest = min(e.slo_misses for e in est)
        kept += next(e for e in est if e.worker == chosen.id).slo_misses > fewest
    assert kept >= 5  # (the table is not vacuous: the knob acted in some pools)


@dataclass(frozen=True)
class Pure:
    name: str
    costs: list[float]
    misses: list[int]
    cached: list[int]
    x: float
    expected: int | None
    share: float = 0.5
    prompt: int = 1000


PURE = [
    Pure("off", [0.1, 1.0], [1, 0], [900, 0], 0.0, None),
    Pure("kept: 10x", [0.1, 1.0], [1, 0], [900, 0], 2.0, 0),
    Pure("exactly x: kept", [0.5, 1.0], [1, 0], [900, 0], 2.0, 0),
    Pure("under x", [0.6, 1.0], [1, 0], [900, 0], 2.0, None),
    Pure("the cheapest of the fewest counts", [0.1, 1.0, 0.15], [1, 0, 0], [900, 0, 0], 2.0, None),
    Pure("the holder among the fewest: nothing to keep", [0.1, 1.0], [0, 0], [900, 0], 2.0, None),
    Pure("two holders, one among the fewest", [0.1, 1.0, 0.2], [1, 0, 0], [900, 0, 900], 2.0, None),
    Pure("two holders, both dropped: the cheaper", [0.2, 1.0, 0.1], [1, 0, 1], [900, 0, 900], 2.0, 2),
    Pure("the deepest holds it, not the cheapest", [0.1, 1.0, 0.05], [1, 0, 1], [900, 0, 600], 2.0, 0),
    Pure("under the share", [0.1, 1.0], [1, 0], [400, 0], 2.0, None),
    Pure("at the share", [0.1, 1.0], [1, 0], [500, 0], 2.0, 0),
    Pure("nothing cached anywhere: cold", [0.1, 1.0], [1, 0], [0, 0], 2.0, None, share=0.0001),
    Pure("two extra misses: 2x per miss", [0.3, 1.0], [2, 0], [900, 0], 2.0, None),
    Pure("two extra misses: 2x per miss met", [0.25, 1.0], [2, 0], [900, 0], 2.0, 0),
    Pure("extra counted from the fewest", [0.25, 1.0, 9.0], [3, 1, 2], [900, 0, 0], 2.0, 0),
]


@pytest.mark.parametrize("case", PURE, ids=lambda c: c.name)
def test_kept_holder(case: Pure) -> None:
    keep = TurnKeep(case.x, case.share)
    assert kept_holder(keep, case.prompt, case.costs, case.misses, case.cached) == case.expected
    fewest = min(case.misses)
    mask = slo_kept(keep, case.prompt, case.costs, case.misses, case.cached)
    assert mask == [n == fewest or i == case.expected for i, n in enumerate(case.misses)]


def test_holder_ties() -> None:
    assert holder([1.0, 0.5, 0.2], [1, 0, 0], [10, 10, 5]) == 1  # fewest misses among the deepest
    assert holder([1.0, 0.5], [1, 1], [10, 10]) == 1  # then the cheaper
    assert holder([1.0, 1.0], [1, 1], [10, 10]) == 0  # then the first


def test_keep_parts_reads_no_index_when_nothing_is_dropped() -> None:
    w = make_worker("w")
    parts = [(0.0, 1.0, 10.0, 0.0, w), (0.0, 2.0, 20.0, 0.0, w)]
    # no state: a read would fail
    assert keep_parts(TurnKeep(2.0), 100, parts, [1, 1], 0.0, 0.0, None, (None, None)) == parts  # type: ignore[arg-type]
    assert keep_parts(TurnKeep(0.0), 100, parts, [1, 0], 0.0, 0.0, None, (None, None)) == parts[1:]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("raw", "keep"),
    [
        ({}, TurnKeep(0.0, 0.5)),
        ({"turn_keep_x": 0.0}, TurnKeep(0.0, 0.5)),
        ({"turn_keep_x": 2.0}, TurnKeep(2.0, 0.5)),
        ({"turn_keep_x": 1.0, "turn_keep_share": 0.8}, TurnKeep(1.0, 0.8)),
    ],
)
def test_config_knob(raw: dict[str, object], keep: TurnKeep) -> None:
    cfg = parse_policy({"type": "cache_aware", "tpot_slo_x": 5.0, **raw})
    assert isinstance(cfg, CacheAwareCfg)
    assert cache_aware_settings(cfg).slo.keep == keep


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"turn_keep_x": 0.5}, "turn_keep_x must be 0 .off. or a finite number >= 1, got 0.5"),
        ({"turn_keep_x": -1.0}, "turn_keep_x must be 0 .off. or a finite number >= 1"),
        ({"turn_keep_x": float("inf")}, "turn_keep_x must be 0 .off. or a finite number >= 1"),
        ({"turn_keep_x": float("nan")}, "turn_keep_x must be 0 .off. or a finite number >= 1"),
        ({"turn_keep_share": 0.0}, r"turn_keep_share must be in \(0, 1\], got 0.0"),
        ({"turn_keep_share": 1.5}, r"turn_keep_share must be in \(0, 1\]"),
        ({"turn_keep_share": float("nan")}, r"turn_keep_share must be in \(0, 1\]"),
    ],
)
def test_config_refuses_bad_values(raw: dict[str, object], message: str) -> None:
    with pytest.raises(Exception, match=message):
        parse_policy({"type": "cache_aware", "tpot_slo_x": 5.0, **raw})


def test_config_refuses_the_knob_without_an_slo() -> None:
    with pytest.raises(Exception, match="turn_keep_x needs an SLO"):
        parse_policy({"type": "cache_aware", "turn_keep_x": 2.0})
