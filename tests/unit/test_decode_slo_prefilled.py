"""`slo_cache = "prefilled"` (policies/decode_slo.py): the SLO term counts as cached only what the
engine will have when it schedules the prompt, not a prefix that a prefill still running on the
worker is writing (a chunked engine matches the next prompt beside the holder's last chunk, before
the holder's blocks are registered). A turn sent right behind its predecessor then stalls the
decodes there for its whole prompt; "routed" (the default) predicts a few milliseconds."""

from __future__ import annotations

import pytest

from common.outcomes import Timings
from policies.base import Completed, routed_event
from policies.build import cache_aware_settings
from policies.cache_aware import CacheAwareSelector, CacheAwareSettings, CacheState
from policies.config import CacheAwareCfg, parse_policy
from policies.decode_slo import SloSettings, shared_blocks
from policies.snapshot import Colocated, WorkerState
from policies.testing import ManualClock as Clock
from policies.testing import make_token_request as request
from policies.testing import make_worker

DOC = list(range(10_000, 20_000))  # 10,000 tokens: 1 s of prefill at the prior 10,000 tokens/s


def scenario(prefilled: bool) -> tuple[Clock, CacheState, CacheAwareSelector, list[WorkerState]]:
    """Turn 1 of a conversation routed to `a` at t = 100 (its prefill predicted to end at 101),
    then a short request whose 10-token answer decodes on `a` behind it."""
    clock = Clock()
    slo = SloSettings(tpot_slo_x=5.0, prefilled=prefilled)
    st = CacheState(CacheAwareSettings(crossover_tokens=0.0, slo=slo), clock=clock)
    sel = CacheAwareSelector("colocated", st)
    a, b = make_worker("a", engine="sglang"), make_worker("b", engine="sglang")
    st.observe(routed_event(request("turn1", [*DOC, 1]), Colocated(a)))
    clock.t += 0.05
    st.observe(routed_event(request("short", [7, 7, 7], 10), Colocated(a)))
    clock.t += 0.05
    return clock, st, sel, [a, b]


@pytest.mark.parametrize(
    ("prefilled", "seconds", "misses", "chosen"),
    [
        # the index holds turn 1's prompt on a: 3 new tokens, nothing broken, the cache wins
        (False, 0.0003, 0, "a"),
        # turn 1 is still prefilling there: turn 2 computes all 10,003 tokens (1 s), past the
        # short answer's budget of 9 x 4 x 0.02 s: a breaks it, b does not
        (True, 1.0003, 1, "b"),
    ],
)
def test_a_prefix_still_prefilling_is_not_cached_for_the_slo_term(
    prefilled: bool, seconds: float, misses: int, chosen: str
) -> None:
    _, st, sel, workers = scenario(prefilled)
    turn2 = request("turn2", [*DOC, 1, 2, 3])
    est = {e.worker: e for e in st.estimates(turn2, workers)}
    assert est["a"].prefill_s == pytest.approx(seconds, rel=1e-3)
    assert est["a"].cached_tokens == 10_000  # the cost's view is the index's either way
    assert est["a"].slo_misses == misses
    held = {d.request_id: d for d in est["a"].decodes}  # turn 1 decodes there too (16 tokens)
    assert held["short"].broken is bool(misses) and not held["turn1"].broken
    assert held["short"].budget_s == pytest.approx(9 * 4 * 0.02)
    assert sel.select(turn2, workers).id == chosen
    assert sel.decide(turn2, workers)[0].id == chosen


def test_cached_again_once_the_prefill_has_ended() -> None:
    clock, st, sel, workers = scenario(True)
    turn2 = request("turn2", [*DOC, 1, 2, 3])
    clock.t = 101.2  # past turn 1's predicted end (100 + 1.0001 s)
    assert {e.worker: e.slo_misses for e in st.estimates(turn2, workers)} == {"a": 0, "b": 0}
    assert sel.select(turn2, workers).id == "a"  # the misses tie: the cache decides
    _, st2, sel2, workers2 = scenario(True)
    st2.observe(Completed("turn1", ("a",), cached_tokens=0))  # its answer came: prefill ended
    assert st2.estimates(turn2, workers2)[0].slo_misses == 0
    assert sel2.select(turn2, workers2).id == "a"


def test_an_unrelated_prompt_keeps_its_own_cache() -> None:
    _, st, _, workers = scenario(True)
    other = request("other", [5, *DOC])  # shares nothing with turn 1
    assert st.estimates(other, workers)[0].prefill_s == pytest.approx(1.0001, rel=1e-3)


def test_shared_blocks() -> None:
    assert shared_blocks((1, 2, 3), (1, 2, 4, 5)) == 2
    assert shared_blocks((1, 2, 3), (1, 2, 3)) == 3
    assert shared_blocks((9,), (1, 2)) == 0
    assert shared_blocks((), (1,)) == 0


def test_config_knob() -> None:
    cfg = parse_policy({"type": "cache_aware", "tpot_slo_x": 5.0, "slo_cache": "prefilled"})
    assert isinstance(cfg, CacheAwareCfg)
    assert cache_aware_settings(cfg).slo.prefilled
    assert not cache_aware_settings(parse_policy({"type": "cache_aware", "tpot_slo_x": 5.0})).slo.prefilled


def stream(st: CacheState, rid: str, wid: str, per_token: float) -> None:
    """A 21-token stream on `wid` taking `per_token` seconds a token after its first."""
    st.observe(routed_event(request(rid, [1, 2, 3], 21), Colocated(make_worker(wid, engine="sglang"))))
    t = Timings(0.01 + 20 * per_token, first_token_s=0.01, chunks=21, output_tokens=21)
    st.observe(Completed(rid, (wid,), timings=t))


@pytest.mark.parametrize(("pool_best", "b_best"), [(False, 0.006), (True, 0.002)])
def test_slo_best_pool(pool_best: bool, b_best: float) -> None:
    """`slo_best = "pool"`: a worker with under 10 streams of its own takes the least of the
    pool's (once it has 10), not the median of its own first streams, run under load."""
    st = CacheState(CacheAwareSettings(slo=SloSettings(tpot_slo_x=5.0, pool_best=pool_best)), clock=Clock())
    for i in range(10):
        stream(st, f"a{i}", "a", 0.002)
    for i in range(3):
        stream(st, f"b{i}", "b", 0.006)
    assert st.slo is not None
    assert st.slo.best("a") == pytest.approx(0.002)
    assert st.slo.best("b") == pytest.approx(b_best)
    assert (
        cache_aware_settings(
            parse_policy({"type": "cache_aware", "tpot_slo_x": 5.0, "slo_best": "pool"})
        ).slo.pool_best
        is True
    )


@pytest.mark.parametrize("seconds", [0.0, 0.05, 0.2, 0.5, 1.0, 5.0])
def test_a_records_held_decodes_break_as_the_slo_term_counts(seconds: float) -> None:
    """`DecodeSlo.held` (the decision record's decodes) restates `broken`'s prefill-first loop
    without its hot-path cost: the decodes it marks broken are the ones `broken` counts."""
    clock, st, _, (a, _) = scenario(False)
    for i, out in enumerate((2, 5, 40, 200)):  # answers with budgets on both sides of the stalls
        st.observe(routed_event(request(f"d{i}", [9, i], out), Colocated(a)))
        clock.t += 0.02
    assert st.slo is not None
    held = st.slo.held(a, seconds)
    assert len(held) == 6  # turn 1, the short answer and the four above
    assert sum(h.broken for h in held) == st.slo.broken(a, clock.t, seconds)
