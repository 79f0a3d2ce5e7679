"""`ttft_slo_rank` (policies/decode_slo.py `ttft_rank`): how cache_aware told a TTFT SLO counts a
request's own predicted TTFT miss against the decodes its prefill would break. `"sum"` adds them
(one miss each); `"after_tpot"` ranks the candidates by the decodes broken first and by the own
miss only among those breaking as few. Tables over an injected clock; the knob is new, so every
case fails on the code before it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from policies.base import Completed, routed_event
from policies.build import cache_aware_settings
from policies.cache_aware import CacheAwareSelector, CacheAwareSettings, CacheState
from policies.config import parse_policy
from policies.decode_slo import SloSettings, ttft_rank
from policies.prompt_key import PromptKey
from policies.snapshot import Colocated, RequestView, RouteKind, WorkerState
from policies.testing import ManualClock as Clock
from policies.testing import make_worker

DOC = list(range(10_000, 20_000))  # a 10,000-token document the conversation keeps sending


def request(rid: str, ids: list[int], max_tokens: int = 16) -> RequestView:
    return RequestView(
        rid, "m", RouteKind.COMPLETIONS, len(ids), max_tokens, prompt_key=PromptKey.from_token_ids(ids)
    )


TPOT = SloSettings(tpot_slo_x=5.0)
SUM = SloSettings(ttft_slo_x=5.0, tpot_slo_x=5.0)
AFTER = SloSettings(ttft_slo_x=5.0, tpot_slo_x=5.0, ttft_after_tpot=True)


@dataclass(frozen=True)
class Case:
    name: str
    slo: SloSettings
    decoding_on_b: bool  # a 10-token answer decodes on b when the turn comes (b's prefill breaks it)
    b_inflight: int  # requests in flight on b (the cost weighs b's prefill by 1 + this)
    misses: dict[str, int]  # the decision record's slo_misses per candidate
    expected: str


# a holds the document behind 6 s of queued prefill (over the turn's 5 s TTFT SLO: 5 x 1 s idle)
# and decodes nothing; b computes the whole prompt in 1 s: with nothing else in flight the cost
# takes b (1 s against 6), with 9 requests in flight there a (10 s against 6)
CASES = [
    # the TPOT term alone: b would break its decode, a breaks none: a, late
    Case("tpot only, b decoding: the holder", TPOT, True, 0, {"a": 0, "b": 1}, "a"),
    # summed, a's own TTFT miss ties with b's broken decode and the cost takes b: a decode lost
    # to save a TTFT
    Case("sum, b decoding: the cost breaks b's decode", SUM, True, 0, {"a": 1, "b": 1}, "b"),
    # ranked, breaking b's decode is worse than missing its own TTFT on a
    Case("after_tpot, b decoding: the holder", AFTER, True, 0, {"a": 1, "b": 2}, "a"),
    # nothing decodes on b, busy: the TPOT term alone keeps the turn on its holder, late ...
    Case("tpot only, b idle: the holder, late", TPOT, False, 9, {"a": 0, "b": 0}, "a"),
    # ... either TTFT order sends it where it is predicted within its TTFT SLO
    Case("sum, b idle: within the TTFT SLO", SUM, False, 9, {"a": 1, "b": 0}, "b"),
    Case("after_tpot, b idle: within the TTFT SLO", AFTER, False, 9, {"a": 1, "b": 0}, "b"),
]


def scenario(
    slo: SloSettings, decoding_on_b: bool, b_inflight: int
) -> tuple[CacheAwareSelector, RequestView, list[WorkerState]]:
    clock = Clock()
    settings = CacheAwareSettings(crossover_tokens=0.0, queue_externality=0.0, slo=slo)
    st = CacheState(settings, clock=clock)
    sel = CacheAwareSelector("colocated", st)
    a, b = make_worker("a", engine="sglang"), make_worker("b", engine="sglang", inflight=b_inflight)
    st.observe(routed_event(request("turn1", [*DOC, 1]), Colocated(a)))
    clock.t += 5.0
    st.observe(Completed("turn1", ("a",), cached_tokens=0))
    # 60,000 tokens queued on a (6 s at the prior 10,000 work/s), a one-token answer (no decode)
    st.observe(routed_event(request("big", list(range(50_000, 110_000)), 1), Colocated(a)))
    if decoding_on_b:
        st.observe(routed_event(request("short", [7, 7, 7], 10), Colocated(b)))
    clock.t += 0.05
    return sel, request("turn2", [*DOC, 2]), [a, b]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_own_ttft_miss_ranks_after_broken_decodes(case: Case) -> None:
    sel, turn2, cands = scenario(case.slo, case.decoding_on_b, case.b_inflight)
    chosen, record = sel.decide(turn2, cands)
    assert record is not None
    assert {e.worker: e.slo_misses for e in record.candidates} == case.misses
    assert chosen.id == case.expected
    assert sel.select(turn2, cands).id == case.expected  # the record-free loop agrees


@pytest.mark.parametrize(
    ("a", "b"),
    [((0, 1), (1, 0)), ((0, 0), (0, 1)), ((1, 1), (2, 0)), ((2, 0), (2, 1)), ((3, 1), (4, 0))],
)
def test_ttft_rank_is_lexicographic(a: tuple[int, int], b: tuple[int, int]) -> None:
    """(broken, own) pairs in increasing order rank strictly increasing."""
    assert a < b and ttft_rank(*a) < ttft_rank(*b)


@pytest.mark.parametrize(("value", "after"), [(None, False), ("sum", False), ("after_tpot", True)])
def test_config_knob(value: str | None, after: bool) -> None:
    raw: dict[str, object] = {"type": "cache_aware", "ttft_slo_x": 5.0, "tpot_slo_x": 5.0}
    if value is not None:
        raw["ttft_slo_rank"] = value
    assert cache_aware_settings(parse_policy(raw)).slo.ttft_after_tpot is after


def test_config_refuses_other_ranks() -> None:
    with pytest.raises(Exception, match="ttft_slo_rank"):
        parse_policy({"type": "cache_aware", "ttft_slo_rank": "before_tpot"})
