"""cache_aware's cold-prompt placement (`cold_slack_s`, policies/cache_aware_cold.py): a prompt held
nowhere goes to the least turned-over worker within the slack of the cheapest (tables, both
paths: `select` and the recorded `decide`). Pure: an injected clock."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import msgspec
import pytest

from policies.base import Completed, routed_event
from policies.build import build_policy, cache_aware_settings
from policies.cache_aware import CacheAwareSelector, CacheAwareSettings, CacheState
from policies.config import CacheAwareCfg, parse_policy
from policies.prompt_key import PromptKey
from policies.snapshot import Colocated, RequestView, RouteKind, WorkerState
from policies.testing import make_worker


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def req(ids: list[int], rid: str = "ask") -> RequestView:
    return RequestView(
        rid, "m", RouteKind.COMPLETIONS, len(ids), 16, prompt_key=PromptKey.from_token_ids(ids)
    )


COLD = list(range(20_000, 21_000))  # held by no worker
HELD = list(range(1000, 5500))  # a holds its first 4,000 tokens
BARELY = list(range(1000, 1100)) + list(range(20_000, 21_000))  # a holds 100 of 1,100 tokens


@dataclass(frozen=True)
class Case:
    name: str
    slack: float  # cold_slack_s
    best: str
    ask: tuple[int, ...] = tuple(COLD)
    window_s: float = 30.0  # cold_window_s
    pools: tuple[int | None, int | None] = (4000, 4000)  # a's and b's KV pools in tokens
    threshold: float = 0.0  # cache_threshold
    cold: bool = True  # the rule applies (the record's reason)


# a was sent a 4,000-token prompt 5 s ago (its queue has drained; 4,016 new KV tokens, 3,400 of
# them left after 5 s of a 30 s window); b was just sent 100 tokens (116 new KV, 0.1 s queued).
# A 1,000-token prompt: cost 1.0 s on a, 1.1 s on b.
CASES = [
    Case("off: the cheaper (a)", 0.0, "a", cold=False),
    Case("b within the slack and turned over less", 0.2, "b"),
    Case("b outside the slack: the cheapest", 0.05, "a"),
    Case("a prompt a holds is not cold: the cost decides", 5.0, "a", tuple(HELD), cold=False),
    Case("a match under cache_threshold counts as none", 5.0, "b", tuple(BARELY), threshold=0.5),
    Case("the same match over cache_threshold 0", 5.0, "a", tuple(BARELY), cold=False),
    Case("turnover against the pool: a's pool ten times b's", 0.2, "a", pools=(40_000, 400)),
    Case("no pool known: raw tokens", 0.2, "b", pools=(None, None)),
    Case("a short window: a's writes decayed below b's", 0.2, "a", window_s=0.5),
]


def _worker(wid: str, pool: int | None) -> WorkerState:
    return msgspec.structs.replace(make_worker(wid), kv_capacity_tokens=pool)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("recorded", [False, True])
def test_cold_prompts_go_where_the_cache_turns_over_least(case: Case, recorded: bool) -> None:
    clock = Clock()
    st = CacheState(
        CacheAwareSettings(
            prefill_rate=1000.0,
            crossover_tokens=0.0,
            inflight_factor=0.0,
            queue_externality=0.0,
            cache_threshold=case.threshold,
            cold_slack_s=case.slack,
            cold_window_s=case.window_s,
        ),
        clock=clock,
    )
    a, b = _worker("a", case.pools[0]), _worker("b", case.pools[1])
    st.observe(routed_event(req(list(range(1000, 5000)), "filler"), Colocated(a)))
    st.observe(Completed("filler", ("a",), cached_tokens=0))
    clock.t = 105.0
    st.observe(routed_event(req(list(range(9000, 9100)), "small"), Colocated(b)))
    sel = CacheAwareSelector("x", st, rng=random.Random(0))
    ask = req(list(case.ask))
    if recorded:
        chosen, record = sel.decide(ask, [a, b])
        assert record is not None
        assert (record.reason == "cold_turnover") == case.cold
    else:
        chosen = sel.select(ask, [a, b])
    assert chosen.id == case.best


def test_turnover_is_counted_only_when_the_placement_is_on() -> None:
    for slack, counted in ((0.0, False), (0.1, True)):
        st = CacheState(CacheAwareSettings(cold_slack_s=slack), clock=Clock())
        st.observe(routed_event(req(list(range(100)), "r"), Colocated(make_worker("a"))))
        assert ("a" in st.cold_turnover.scaled) == counted


def test_the_knobs_parse_and_reach_the_state() -> None:
    cfg = parse_policy({"type": "cache_aware", "cold_slack_s": 0.3, "cold_window_s": 10.0})
    assert isinstance(cfg, CacheAwareCfg) and (cfg.cold_slack_s, cfg.cold_window_s) == (0.3, 10.0)
    assert CacheAwareCfg().cold_slack_s == 0.0  # off by default
    build_policy(cfg)
    s = cache_aware_settings(cfg)
    assert (s.cold_slack_s, s.cold_window_s) == (0.3, 10.0)
    assert CacheState(s).cold_turnover.window_s == 10.0


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"cold_slack_s": -0.1}, "cold_slack_s"),
        ({"cold_slack_s": math.inf}, "cold_slack_s"),
        ({"cold_window_s": 0.0}, "cold_window_s"),
        ({"cold_window_s": math.nan}, "cold_window_s"),
        ({"cold_slack_s": 0.1, "large_pool": "exact", "queue_externality": 0.0}, "cold_slack_s = 0"),
    ],
)
def test_bad_knobs_are_refused(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CacheAwareCfg(**kw)  # type: ignore[arg-type]
