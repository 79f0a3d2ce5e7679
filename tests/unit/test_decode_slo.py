"""cache_aware told the SLOs (policies/decode_slo.py): on colocated SGLang workers a prefill holds
every decode running on its worker, so the choice is the fewest predicted SLO misses (the
decodes pushed over their TPOT SLO, this request's TTFT), then the lowest cost. Tables over an
injected clock; each case needs the SLO fields, which the code before them did not have."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from common.outcomes import Timings
from policies.base import Completed, routed_event
from policies.build import build_policy, cache_aware_settings
from policies.cache_aware import CacheAwareSelector, CacheAwareSettings, CacheState
from policies.config import CacheAwareCfg, parse_policy
from policies.decode_slo import SloSettings
from policies.prompt_key import PromptKey
from policies.snapshot import Colocated, RequestView, RouteKind, WorkerState
from policies.testing import ManualClock as Clock
from policies.testing import make_worker

DOC = list(range(10_000, 20_000))  # a 10,000-token document a conversation keeps sending


def request(rid: str, ids: list[int], max_tokens: int = 16) -> RequestView:
    key = PromptKey.from_token_ids(ids)
    return RequestView(rid, "m", RouteKind.COMPLETIONS, len(ids), max_tokens, prompt_key=key)


@dataclass(frozen=True)
class Case:
    name: str
    slo: SloSettings
    decoding_on: tuple[str, ...]  # workers where a short answer is decoding when the turn comes
    decode_tokens: int  # that answer's max_tokens
    expected: str


OFF = SloSettings()
TPOT = SloSettings(tpot_slo_x=5.0)
BOTH = SloSettings(ttft_slo_x=5.0, tpot_slo_x=5.0)

CASES = [
    # without SLOs the holder of the document wins, whatever it is decoding (the old choice)
    Case("off: cache holder", OFF, ("a",), 10, "a"),
    # its 10,000 uncached tokens (1 s) would hold a's 10-token answer: 0.02 + 1 / 9 s per token
    # against 5 x 0.02; b computes the whole prompt (2 s) and stalls nothing
    Case("tpot: away from a short decode", TPOT, ("a",), 10, "b"),
    Case("tpot+ttft: away from a short decode", BOTH, ("a",), 10, "b"),
    # a long answer absorbs the second: 0.02 + 1 / 199 s per token, within its SLO
    Case("tpot: a long decode keeps it home", TPOT, ("a",), 200, "a"),
    # both workers would break one decode: the misses tie, the cost (the cache) decides
    Case("tpot: both decoding, cache decides", TPOT, ("a", "b"), 10, "a"),
    Case("tpot: the idle holder", TPOT, ("b",), 10, "a"),
]


def scenario(
    slo: SloSettings, decoding_on: tuple[str, ...], decode_tokens: int
) -> tuple[CacheState, CacheAwareSelector, RequestView, list[WorkerState]]:
    clock = Clock()
    st = CacheState(CacheAwareSettings(crossover_tokens=0.0, slo=slo), clock=clock)
    sel = CacheAwareSelector("colocated", st)
    a, b = make_worker("a", engine="sglang"), make_worker("b", engine="sglang")
    workers = {"a": a, "b": b}
    turn1 = request("turn1", [*DOC, 1])
    st.observe(routed_event(turn1, Colocated(a)))  # a prefills the document: it holds it now
    clock.t += 5.0
    st.observe(Completed("turn1", ("a",), cached_tokens=0))
    for wid in decoding_on:  # a short prompt and its answer, decoding when the turn comes
        st.observe(routed_event(request(f"short-{wid}", [7, 7, 7], decode_tokens), Colocated(workers[wid])))
    clock.t += 0.05
    turn2 = request("turn2", [*DOC, *range(30_000, 40_000)])  # the document plus 10,000 new tokens
    return st, sel, turn2, [a, b]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_fewest_misses_then_cost(case: Case) -> None:
    st, sel, turn2, cands = scenario(case.slo, case.decoding_on, case.decode_tokens)
    chosen, record = sel.decide(turn2, cands)
    assert chosen.id == case.expected
    assert sel.select(turn2, cands).id == case.expected  # the record-free loop agrees
    assert record is not None
    misses = {e.worker: e.slo_misses for e in record.candidates}
    if not case.slo.on:
        assert misses == {"a": 0, "b": 0}
        assert st.slo is None
    else:
        # a decode broken where a short answer runs and the turn's prefill would hold it
        broken = {w: int(w in case.decoding_on and case.decode_tokens < 50) for w in ("a", "b")}
        assert misses == broken


@pytest.mark.parametrize(("slo", "expected"), [(OFF, "a"), (SloSettings(ttft_slo_x=5.0), "b")])
def test_ttft_slo_counts_this_requests_own_miss(slo: SloSettings, expected: str) -> None:
    """The holder a has 6 s queued; b, busy with 9 requests, would compute the whole prompt in
    1 s, which the in-flight weight prices at 10 s: by cost a, but a's TTFT is over 5 x the
    prompt's idle prefill (5 s) and b's is not."""
    clock = Clock()
    st = CacheState(CacheAwareSettings(crossover_tokens=0.0, slo=slo), clock=clock)
    sel = CacheAwareSelector("colocated", st)
    a, b = make_worker("a", engine="sglang"), make_worker("b", engine="sglang", inflight=9)
    st.observe(routed_event(request("turn1", [*DOC, 1]), Colocated(a)))
    clock.t += 5.0
    st.observe(Completed("turn1", ("a",), cached_tokens=0))
    st.observe(routed_event(request("big", list(range(50_000, 110_000)), 1), Colocated(a)))
    turn2 = request("turn2", [*DOC, 2])
    chosen, record = sel.decide(turn2, [a, b])
    assert record is not None
    want = {"a": 1, "b": 0} if slo.on else {"a": 0, "b": 0}
    assert {e.worker: e.slo_misses for e in record.candidates} == want
    assert chosen.id == expected and sel.select(turn2, [a, b]).id == expected


def test_the_decode_window_learns_a_worker_s_time_per_token() -> None:
    """The TPOT SLO is a multiple of the worker's best time per token, learned from streams."""
    clock = Clock()
    st = CacheState(CacheAwareSettings(crossover_tokens=0.0, slo=TPOT), clock=clock)
    a = make_worker("a", engine="sglang")
    st.observe(routed_event(request("s", [1, 2, 3], 21), Colocated(a)))
    clock.t += 1.0
    # 20 steps in 0.99 s: ~0.05 s per token, so the SLO is ~0.25 s per token
    st.observe(Completed("s", ("a",), timings=Timings(1.0, first_token_s=0.01, chunks=21, output_tokens=21)))
    assert st.slo is not None
    assert st.slo.best("a") == pytest.approx(0.99 / 20)
    assert st.slo.best("b") == pytest.approx(0.99 / 20)  # a peer's, until b has its own
    # one stream whose tokens came together (read in one burst) does not make it 0
    st.observe(routed_event(request("burst", [1, 2, 4], 21), Colocated(a)))
    st.observe(
        Completed("burst", ("a",), timings=Timings(1.0, first_token_s=0.99, chunks=1, output_tokens=21))
    )
    assert st.slo.best("a") > 0.04
    # a decode routed there now is taken to need at least that per token (its window)
    st.observe(routed_event(request("t", [4, 5, 6], 21), Colocated(a)))
    assert st.slo.model.stalls(a, clock.t + 0.5, 0.1, float("inf")) == [(0.0, pytest.approx(0.1), 21)]


@pytest.mark.parametrize(
    ("table", "on"),
    [
        ("cache_aware", False),
        ({"type": "cache_aware", "tpot_slo_x": 5.0}, True),
        ({"type": "cache_aware", "ttft_slo_s": 2.0}, True),
    ],
)
def test_config_switches_it_on(table: str | dict[str, object], on: bool) -> None:
    cfg = parse_policy(table)
    assert isinstance(cfg, CacheAwareCfg)
    assert (CacheState(cache_aware_settings(cfg)).slo is not None) is on
    build_policy(cfg)  # builds


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"tpot_slo_x": -1.0}, "tpot_slo_x must be a finite number >= 0"),
        ({"ttft_slo_s": float("inf")}, "ttft_slo_s must be a finite number >= 0"),
        ({"large_pool": "exact", "queue_externality": 0.0, "tpot_slo_x": 5.0}, "does not weigh SLOs"),
    ],
)
def test_bad_slo_settings_are_refused(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CacheAwareCfg(**kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("before", "candidate", "answered", "broken"),
    [
        # an answer of 10 tokens may wait 9 x (5 - 1) x 0.02 s = 0.72 s in all on a prefill-first
        # worker; the prefills routed there after it hold it (1 s of prefill per 10,000 tokens)
        (5_000, 3_000, False, 1),  # 0.5 s + 0.3 s: pushed over by this one
        (5_000, 1_000, False, 0),  # 0.5 s + 0.1 s: still within
        (8_000, 3_000, False, 0),  # 0.8 s already: over before this one, not counted again
        (0, 8_000, False, 1),  # nothing before it: 0.8 s breaks it alone
        (5_000, 3_000, True, 0),  # its answer came: nothing left to hold
    ],
)
def test_prefill_first_decodes_wait_for_every_prefill_after_them(
    before: int, candidate: int, answered: bool, broken: int
) -> None:
    clock = Clock()
    st = CacheState(CacheAwareSettings(crossover_tokens=0.0, slo=TPOT), clock=clock)
    a = make_worker("a", engine="sglang")
    assert not a.decodes_beside_prefill
    st.observe(routed_event(request("short", [7, 7, 7], 10), Colocated(a)))
    if before:
        st.observe(routed_event(request("before", list(range(100_000, 100_000 + before)), 1), Colocated(a)))
    if answered:
        st.observe(Completed("short", ("a",)))
    clock.t += 0.01
    (est,) = st.estimates(request("new", list(range(200_000, 200_000 + candidate))), [a])
    assert est.slo_misses == broken
