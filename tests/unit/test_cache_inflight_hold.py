"""`inflight_hold`: a colocated turn routed to the worker where a prefill that writes its prefix is
still running is held until that prefill's predicted end (policies/inflight.py). An engine
matches a waiting prompt as it schedules its first chunk, in the step of the running prefill's
last chunk, before that prefill's blocks are registered: sent at once, the turn computes the
prefix again. Table-driven on `CacheState` with an injected clock; no event loop."""

from __future__ import annotations

import dataclasses

import pytest

from policies.base import Completed, Failed, WorkerGone, routed_event
from policies.build import cache_aware_settings
from policies.cache_aware import CacheState
from policies.config import CacheAwareCfg, parse_policy
from policies.prompt_key import PromptKey
from policies.snapshot import Colocated, Disaggregated, RequestView, Role, RouteKind
from policies.testing import ManualClock as Clock
from policies.testing import make_worker

A = list(range(1000, 1800))  # 800 tokens (50 blocks of 16): the predecessor's prompt
TURN = A + list(range(9000, 9160))  # its next turn: A and 160 tokens more


def req(ids: list[int], rid: str) -> RequestView:
    return RequestView(
        rid, "m", RouteKind.COMPLETIONS, len(ids), 16, prompt_key=PromptKey.from_token_ids(ids)
    )


def state(hold: float, clock: Clock) -> CacheState:
    cfg = parse_policy({"type": "cache_aware", "inflight_hold": hold})
    assert isinstance(cfg, CacheAwareCfg)
    # 1,000 tokens a second, attention not counted: A's prefill on an idle worker takes 0.8 s
    settings = dataclasses.replace(cache_aware_settings(cfg), prefill_rate=1000.0, crossover_tokens=0.0)
    return CacheState(settings, clock=clock)


# A is routed to `a` at 0 s (predicted to end at 0.8 s); then the turn. `between`: what happens
# to A first; `to`: where the turn goes; `at`: when.
@pytest.mark.parametrize(
    ("hold", "between", "to", "at", "turn", "expected"),
    [
        (2.0, None, "a", 0.2, TURN, 0.6),  # held until A's predicted end
        (2.0, None, "a", 0.0, TURN, 0.8),  # right behind it: A's whole prefill
        (0.0, None, "a", 0.2, TURN, 0.0),  # off
        (0.5, None, "a", 0.2, TURN, 0.0),  # a longer wait than the limit: sent at once
        (2.0, None, "b", 0.2, TURN, 0.0),  # another worker: nothing running there writes it
        (2.0, None, "a", 0.9, TURN, 0.0),  # A predicted done: the engine holds the prefix
        (2.0, "completed", "a", 0.2, TURN, 0.0),  # A's answer came: its prefill ended
        (2.0, "failed", "a", 0.2, TURN, 0.0),  # A failed: nothing to wait for
        (2.0, "gone", "a", 0.2, TURN, 0.0),  # the worker restarted
        (2.0, None, "a", 0.2, A[:496] + [7] * 304, 0.0),  # shares 31 blocks (496 tokens) < 512
        (2.0, None, "a", 0.2, A[:512] + [7] * 304, 0.6),  # shares 32 blocks: waited for
    ],
)
def test_a_turn_waits_for_the_prefill_that_writes_its_prefix(
    hold: float, between: str | None, to: str, at: float, turn: list[int], expected: float
) -> None:
    clock = Clock(0.0)
    s = state(hold, clock)
    a, b = make_worker("a"), make_worker("b")
    s.observe(routed_event(req(A, "ra"), Colocated(a)))
    if between == "completed":
        s.observe(Completed("ra", ("a",), cached_tokens=0))
    elif between == "failed":
        s.observe(Failed("ra", ("a",), "prefill"))
    elif between == "gone":
        s.observe(WorkerGone("a"))
    clock.t = at
    s.observe(routed_event(req(turn, "rt"), Colocated(a if to == "a" else b)))
    got = 0.0 if s.inflight is None else s.inflight.hold_s("rt")
    assert got == pytest.approx(expected)
    assert s.inflight is None or s.inflight.hold_s("rt") == 0.0  # taken once
    assert s.inflight is None or s.inflight.hold_s("ra") == 0.0  # the first of its prefix: never held


def test_the_hold_is_the_queue_wait_the_cost_predicted() -> None:
    """The turn is priced on its holder at the queue ahead (A's remaining prefill) plus its own
    160 uncached tokens; held, that is what it waits: the choice is made on the real wait."""
    clock = Clock(0.0)
    s = state(2.0, clock)
    a = make_worker("a")
    s.observe(routed_event(req(A, "ra"), Colocated(a)))
    clock.t = 0.2
    (est,) = s.estimates(req(TURN, "rt"), [a])
    assert est.cached_tokens == 800
    s.observe(routed_event(req(TURN, "rt"), Colocated(a)))
    assert s.inflight is not None
    hold = s.inflight.hold_s("rt")
    assert hold == pytest.approx(est.ttft_s - 160 / 1000.0)
    assert (s.inflight.held, s.inflight.held_s) == (1, pytest.approx(hold))


def test_a_turn_waits_for_what_its_predecessor_writes_not_what_it_found() -> None:
    """A prefill that found the prefix cached itself writes only its suffix: a turn sharing only
    that prefix is not held behind it (the engine holds the prefix already)."""
    clock = Clock(0.0)
    s = state(2.0, clock)
    a = make_worker("a")
    s.observe(routed_event(req(A, "ra"), Colocated(a)))
    s.observe(Completed("ra", ("a",), cached_tokens=0))
    clock.t = 1.0
    s.observe(routed_event(req(A + [5] * 800, "rb"), Colocated(a)))  # finds A, writes 800 more
    clock.t = 1.1
    s.observe(routed_event(req(A + [6] * 100, "rc"), Colocated(a)))  # shares A only: not held
    s.observe(routed_event(req(A + [5] * 800 + [6] * 16, "rd"), Colocated(a)))  # shares rb's tail
    assert s.inflight is not None
    assert s.inflight.hold_s("rc") == 0.0
    assert s.inflight.hold_s("rd") > 0.0


# After a turn held until 0.8 s (A's predicted end), at `at` a request not sharing A is routed
# to `to`: to the same worker it is held until just after the turn is sent (the engine queues in
# arrival order; the cost put it behind the turn); elsewhere, or once the turn is sent, not.
@pytest.mark.parametrize(
    ("to", "at", "expected"),
    [
        ("a", 0.3, 0.5 + 0.001),
        ("b", 0.3, 0.0),
        ("a", 0.85, 0.0),
    ],
)
def test_a_request_routed_during_a_hold_is_sent_after_the_held_turn(
    to: str, at: float, expected: float
) -> None:
    clock = Clock(0.0)
    s = state(2.0, clock)
    a, b = make_worker("a"), make_worker("b")
    s.observe(routed_event(req(A, "ra"), Colocated(a)))
    clock.t = 0.2
    s.observe(routed_event(req(TURN, "rt"), Colocated(a)))
    clock.t = at
    s.observe(routed_event(req(list(range(20_000, 21_000)), "rx"), Colocated(a if to == "a" else b)))
    assert s.inflight is not None
    assert s.inflight.hold_s("rt") == pytest.approx(0.6)
    assert s.inflight.hold_s("rx") == pytest.approx(expected)


def test_a_pd_prefill_is_not_held() -> None:
    """Only colocated turns are held (a P/D prefill's dispatch is not)."""
    clock = Clock(0.0)
    s = state(2.0, clock)
    p, d = make_worker("p", role=Role.PREFILL), make_worker("d", role=Role.DECODE)
    s.observe(routed_event(req(A, "ra"), Disaggregated(p, d)))
    clock.t = 0.2
    s.observe(routed_event(req(TURN, "rt"), Disaggregated(p, d)))
    assert s.inflight is not None and s.inflight.hold_s("rt") == 0.0


def test_a_negative_or_infinite_hold_is_refused() -> None:
    cfg = parse_policy({"type": "cache_aware", "inflight_hold": 0.5})
    assert isinstance(cfg, CacheAwareCfg) and cache_aware_settings(cfg).inflight_hold_s == 0.5
    for bad in (-1.0, float("inf")):
        with pytest.raises(ValueError, match="inflight_hold"):
            parse_policy({"type": "cache_aware", "inflight_hold": bad})
