"""cache_aware: prompt keys, the scorer, filter and pickers (tables), the selectors and the state
they share (observe: routed, completed, failed, gone). Pure: no event loop, an injected clock."""

from __future__ import annotations

import random
from dataclasses import dataclass

import msgspec
import pytest

from common.outcomes import Timings
from policies.base import Completed, Failed, Routed, WorkerGone, routed_event
from policies.build import build_policy
from policies.cache_aware import (
    BalanceGatePicker,
    CacheAwareSelector,
    CacheAwareSettings,
    CacheState,
    LoadSelector,
    PredictedTTFTScorer,
    RandomTiePicker,
    SaturationFilter,
)
from policies.config import CacheAwareCfg, DeciderCfg, parse_policy
from policies.decode_slo import SloSettings
from policies.estimators import prefill_work
from policies.prefill_cost import PrefillQueues, RateSettings
from policies.prompt_key import PromptKey, render_chat
from policies.snapshot import Colocated, Disaggregated, RequestView, RouteKind, WorkerState
from policies.testing import ManualClock as Clock
from policies.testing import make_snapshot, make_worker, run_conformance
from policies.turn_keep import TurnKeep


def req(ids: list[int] | None, rid: str = "r", model: str = "m", text: str | None = None) -> RequestView:
    key = PromptKey.from_token_ids(ids) if ids is not None else (PromptKey.from_text(text) if text else None)
    n = len(ids) if ids is not None else (len(text) // 4 + 1 if text else 100)
    return RequestView(rid, model, RouteKind.COMPLETIONS, n, 16, prompt_key=key)


def state(clock: Clock | None = None, **kw: object) -> CacheState:
    return CacheState(CacheAwareSettings(**kw), clock=clock or Clock())  # type: ignore[arg-type]


def route(st: CacheState, r: RequestView, w: WorkerState) -> None:
    st.observe(routed_event(r, Colocated(w)))


PREFIX = list(range(1000, 1800))  # 800 tokens = 50 blocks of 16


def stream(first_token_s: float, end_s: float = 5.0) -> Timings:
    """A colocated stream's timings: its first token `first_token_s` after it was routed."""
    return Timings(end_s, first_token_s=first_token_s, chunks=10)


# ---- prompt keys ---------------------------------------------------------------------------------


def test_chat_turns_share_a_prefix() -> None:
    turn1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    turn2 = [*turn1, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    a, b = render_chat(turn1), render_chat(turn2)
    assert a is not None and b is not None and b.startswith(a) and len(b) > len(a)


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ([{"role": "user", "content": "hi"}], [{"role": "system", "content": "hi"}]),  # roles differ
        (  # the same text, two images
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:a"}}]}],
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:b"}}]}],
        ),
        (
            [{"role": "user", "content": "ab"}, {"role": "user", "content": "c"}],
            [{"role": "user", "content": "abc"}],
        ),
    ],
)
def test_different_conversations_render_differently(one: list[dict], other: list[dict]) -> None:
    assert render_chat(one) != render_chat(other)


def test_chat_text_parts_render_like_a_string() -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert render_chat(parts) == render_chat([{"role": "user", "content": "ab"}])


def test_malformed_chat_has_no_key() -> None:
    assert PromptKey.from_chat({"role": "user"}) is None  # type: ignore[arg-type]
    assert PromptKey.from_chat(["not a message"]) is None
    assert PromptKey.from_token_ids([1, 2**70]) is None


def test_token_ids_and_text_never_share_keys() -> None:
    ids = PromptKey.from_token_ids([72, 105] * 64)
    text = PromptKey.from_text("Hi" * 64)
    assert ids is not None
    assert not set(ids.approx_chain(16)) & set(text.approx_chain(16))


def test_chains_share_exactly_the_common_blocks() -> None:
    a = PromptKey.from_token_ids(PREFIX + [1] * 40)
    b = PromptKey.from_token_ids(PREFIX + [2] * 40)
    assert a is not None and b is not None
    ca, cb = a.approx_chain(16), b.approx_chain(16)
    assert ca[:50] == cb[:50] and ca[50] != cb[50] and len(ca) == 52
    assert a.approx_chain(16) is ca  # remembered


def test_ids_that_look_alike_share_nothing_beyond_their_blocks() -> None:
    # "session-1" vs "session-12" (vllm-router RFC #219): keys come from content blocks only
    one = PromptKey.from_text("session-1" + "x" * 200)
    two = PromptKey.from_text("session-12" + "x" * 200)
    assert one.approx_chain(64)[0] != two.approx_chain(64)[0]


# ---- prefill queues ------------------------------------------------------------------------------


def test_backlog_drains_at_the_rate_and_is_floored_by_engine_waiting() -> None:
    q = PrefillQueues(RateSettings(default_rate=1000.0))
    q.add("w", 3000, now=0.0)
    assert q.backlog("w", 1.0) == pytest.approx(2000)
    assert q.backlog("w", 5.0) == 0.0
    assert q.backlog("w", 5.0, waiting=2) == pytest.approx(2 * q._mean_uncached)
    assert q.ttft("w", 500, 1.0) == pytest.approx(2.5)


@pytest.mark.parametrize(
    ("work", "seconds", "expect"),
    [(10_000, 2.0, 5000.0), (100, 2.0, 1000.0), (10_000, 0.0, 1000.0), (10**9, 1e-6, 10_000_000.0)],
)
def test_rate_is_learned_from_outcomes(work: float, seconds: float, expect: float) -> None:
    q = PrefillQueues(RateSettings(default_rate=1000.0))
    q.learn("w", work, seconds)
    assert q.rate("w") == pytest.approx(expect)


def test_an_unmeasured_worker_prefills_at_the_measured_ones_mean() -> None:
    q = PrefillQueues(RateSettings(default_rate=1000.0))
    assert q.rate("new") == 1000.0  # nothing measured: the default
    q.learn("a", 40_000, 1.0)
    q.learn("b", 20_000, 1.0)
    assert q.rate("new") == pytest.approx(30_000.0)
    assert q.backlog_rate("new", 0.0)[1] == pytest.approx(30_000.0)
    q.forget("a")
    assert q.rate("new") == pytest.approx(20_000.0)
    q.forget("b")
    assert q.rate("new") == 1000.0


@pytest.mark.parametrize(
    ("uncached", "cached", "attention", "work"),
    [
        (1000, 0, 0.0, 1000.0),  # off: plain tokens
        (1000, 0, 1000.0, 1500.0),  # its own causal context: half of it on average
        (1000, 3000, 1000.0, 4500.0),  # a cached prefix is read by every new token
        (191_000, 0, 30_500.0, 191_000 * (1 + 95_500 / 30_500)),  # the trace's longest: ~4x
        (0, 5000, 1000.0, 0.0),  # nothing to compute
    ],
)
def test_prefill_work_counts_attention(uncached: int, cached: int, attention: float, work: float) -> None:
    assert prefill_work(uncached, cached, attention) == pytest.approx(work)


def test_a_long_prompt_queues_longer_than_its_tokens_say() -> None:
    """One 40k-token prompt ahead of a short request takes as long as several times its tokens
    of short prompts: the worker behind it looks busier than the one behind 40k short tokens."""
    clock = Clock()
    st = state(clock, prefill_rate=10_000.0, crossover_tokens=8000.0, inflight_factor=0.0)
    a, b = make_worker("a"), make_worker("b")
    route(st, req(list(range(40_000)), "long"), a)
    for i in range(10):
        route(st, req([i] * 4000, f"s{i}"), b)
    est = {e.worker: e for e in st.estimates(req([7] * 100), [a, b])}
    assert est["a"].backlog_tokens == pytest.approx(40_000 * (1 + 20_000 / 8000))
    assert est["b"].backlog_tokens == pytest.approx(10 * 4000 * (1 + 2000 / 8000))
    assert est["a"].ttft_s > 2 * est["b"].ttft_s


@dataclass
class LearnCase:
    name: str
    timings: Timings | None
    ttft_s: float | None
    cached: int | None  # reported
    rate: float  # learned (default 1000 where nothing is learned)


# PREFIX (800 tokens) routed to an idle worker with nothing predicted cached
LEARN_CASES = [
    LearnCase("a stream: its first token", stream(0.4), 0.001, None, 2000.0),
    LearnCase("the response head (ttft_s) is not a first token", None, 0.001, None, 1000.0),
    LearnCase("a whole answer: its first byte is its end", Timings(0.2), 0.2, None, 1000.0),
    LearnCase("a P/D prefill's answer", Timings(3.0, prefill_s=0.2, first_token_s=0.5), 0.5, None, 4000.0),
    LearnCase("the reported cache shrinks the work", stream(0.1), 0.1, 400, 4000.0),
]


@pytest.mark.parametrize("case", LEARN_CASES, ids=lambda c: c.name)
def test_the_prefill_rate_is_learned_from_when_the_prefill_ended(case: LearnCase) -> None:
    clock = Clock()
    st = state(clock, prefill_rate=1000.0, crossover_tokens=0.0)
    route(st, req(PREFIX, "r1"), make_worker("a"))
    st.observe(Completed("r1", ("a",), ttft_s=case.ttft_s, cached_tokens=case.cached, timings=case.timings))
    assert st.queues.rate("a") == pytest.approx(case.rate)


# ---- scorer / filter / pickers (tables) -------------------------------------------------------------


@dataclass
class ScoreCase:
    name: str
    routed: list[tuple[list[int], str]]  # prompts routed before, and where
    ask: list[int]
    best: str
    settings: dict[str, object]
    inflight: dict[str, int] | None = None
    advance_s: float = 0.0


SCORE_CASES = [
    ScoreCase("no key history: all equal", [], PREFIX, "*", {}),
    ScoreCase(
        "idle: the cached worker",
        [(PREFIX + [5] * 16, "b")],
        PREFIX + [9] * 100,
        "b",
        {"prefill_rate": 1e6},
        advance_s=1.0,
    ),
    ScoreCase(
        "the cached worker's queue outweighs its cache",
        [(list(range(5000, 13000)), "b"), (PREFIX, "b")],
        PREFIX + [9] * 100,
        "a",
        {"prefill_rate": 1000.0},
    ),
    ScoreCase(
        "the queue has drained: the cache wins again",
        [(list(range(5000, 13000)), "b"), (PREFIX, "b")],
        PREFIX + [9] * 100,
        "b",
        {"prefill_rate": 1000.0},
        advance_s=60.0,
    ),
    ScoreCase(
        "below cache_threshold a match gives no credit",
        [(PREFIX[:160], "b")],
        PREFIX,
        "*",
        {"cache_threshold": 0.3, "prefill_rate": 1e6},
        advance_s=1.0,
    ),
    ScoreCase(
        "requests in flight weigh against the cache",
        [(PREFIX, "b")],
        PREFIX + [9] * 1000,
        "a",
        {"prefill_rate": 1e6},
        inflight={"b": 3},
        advance_s=1.0,
    ),
    ScoreCase(
        "in flight weighs on the own prefill, not on the queue ahead",
        [(PREFIX, "b"), (list(range(5000, 5500)), "b")],  # b: 0.3 s still queued after 1 s
        PREFIX + [9] * 100,  # b: 0.3 + 0.1 x 3 = 0.6 s; a: 0.9 s (0.4 x 3 = 1.2 s if the queue weighed)
        "b",
        {"prefill_rate": 1000.0, "crossover_tokens": 0.0},
        inflight={"b": 2},
        advance_s=1.0,
    ),
    ScoreCase(
        "inflight_factor 0: the predicted TTFT alone",
        [(PREFIX, "b")],
        PREFIX + [9] * 1000,
        "b",
        {"prefill_rate": 1e6, "inflight_factor": 0.0},
        inflight={"b": 3},
        advance_s=1.0,
    ),
]


@pytest.mark.parametrize("case", SCORE_CASES, ids=lambda c: c.name)
def test_predicted_ttft_scorer(case: ScoreCase) -> None:
    clock = Clock()
    st = state(clock, **case.settings)
    workers = {n: make_worker(n) for n in "ab"}
    for i, (ids, where) in enumerate(case.routed):
        route(st, req(ids, f"old{i}"), workers[where])
    clock.t += case.advance_s
    cands = [
        msgspec.structs.replace(w, inflight=(case.inflight or {}).get(w.id, 0)) for w in workers.values()
    ]
    scores = PredictedTTFTScorer(st).score(req(case.ask), cands)
    assert max(scores.values()) == 1.0
    if case.best == "*":
        assert scores["a"] == scores["b"]
    else:
        other = "a" if case.best == "b" else "b"
        assert scores[case.best] == 1.0 and scores[other] < 1.0


def test_saturation_filter_drops_saturated_workers_unless_all_are() -> None:
    clock = Clock()
    st = state(clock, prefill_rate=1000.0, saturation_wait_s=2.0)
    a, b = make_worker("a"), make_worker("b")
    route(st, req(list(range(3000))), a)  # a: 3 s queued
    f = SaturationFilter(st)
    assert [w.id for w in f.filter(req(PREFIX), [a, b])] == ["b"]
    route(st, req(list(range(5000, 8000)), "r2"), b)
    assert [w.id for w in f.filter(req(PREFIX), [a, b])] == ["a", "b"]


def test_a_saturated_cached_worker_is_not_chosen() -> None:
    clock = Clock()
    st = state(clock, prefill_rate=1000.0, saturation_wait_s=2.0)
    a, b = make_worker("a"), make_worker("b")
    route(st, req(PREFIX, "held"), b)
    st.observe(Completed("held", ("b",), cached_tokens=0))  # b holds the prefix
    route(st, req(PREFIX + list(range(2400)), "big"), b)  # and 3.2 s of queue
    sel = CacheAwareSelector("x", st, rng=random.Random(0))
    chosen, record = sel.decide(req(PREFIX + [7] * 10000), [a, b])
    assert chosen.id == "a" and record is not None
    by = {e.worker: e for e in record.candidates}
    assert by["b"].saturated and by["b"].cached_tokens >= 800 and not by["a"].saturated


def w_(name: str, inflight: int) -> WorkerState:
    return make_worker(name, inflight=inflight)


@pytest.mark.parametrize(
    ("name", "scored", "abs_t", "rel_t", "expect", "why"),
    [
        ("best score", [(w_("a", 0), 0.5), (w_("b", 0), 1.0)], 64, 1.5, "b", "min_ttft"),
        ("tie: fewer in flight", [(w_("a", 3), 1.0), (w_("b", 1), 1.0)], 64, 1.5, "b", "min_ttft"),
        ("gate fires: abs and rel", [(w_("a", 100), 1.0), (w_("b", 10), 0.2)], 64, 1.5, "b", "balance_gate"),
        ("abs only: no gate", [(w_("a", 100), 1.0), (w_("b", 70), 0.2)], 20, 1.5, "a", "min_ttft"),
        ("rel only: no gate", [(w_("a", 30), 1.0), (w_("b", 1), 0.2)], 64, 1.5, "a", "min_ttft"),
        (
            "gate prefers the better of the least loaded",
            [(w_("a", 9), 1.0), (w_("b", 0), 0.1), (w_("c", 0), 0.3)],
            4,
            1.5,
            "c",
            "balance_gate",
        ),
    ],
)
def test_balance_gate_picker(
    name: str, scored: list[tuple[WorkerState, float]], abs_t: int, rel_t: float, expect: str, why: str
) -> None:
    chosen, reason = BalanceGatePicker(abs_t, rel_t, random.Random(0)).pick_why(scored)
    assert (chosen.id, reason) == (expect, why), name


def test_ties_are_broken_at_random_not_by_position() -> None:
    picker = RandomTiePicker(random.Random(3))
    scored = [(make_worker(n), 1.0) for n in "abcd"]
    picks = {picker.pick(req(None), scored).id for _ in range(200)}
    assert picks == set("abcd")
    assert RandomTiePicker().pick(req(None), [(make_worker("a"), 0.2), (make_worker("b"), 0.9)]).id == "b"


# ---- selectors and policies ----------------------------------------------------------------------


def test_conversations_stick_and_load_spreads() -> None:
    """16 conversations over a shared system prompt on 4 workers, each request in flight 2 s:
    every conversation stays on one worker and the workers get equal shares."""
    clock = Clock()
    policy = build_policy(parse_policy({"type": "cache_aware", "seed": 1}), clock=clock)
    workers = {f"w{i}": make_worker(f"w{i}") for i in range(4)}
    homes: dict[int, set[str]] = {}
    live: list[tuple[str, str, float]] = []
    for i in range(200):
        for rid, wid, t0 in list(live):
            if clock.t - t0 > 2.0:
                live.remove((rid, wid, t0))
                workers[wid] = msgspec.structs.replace(workers[wid], inflight=workers[wid].inflight - 1)
                policy.observe(Completed(rid, (wid,), ttft_s=0.1))
        conv = i % 16
        r = req(PREFIX * 2 + [conv + 5] * 500 + [i + 100] * 50, f"r{i}")
        plan = policy.plan(r, make_snapshot(*workers.values()))
        assert isinstance(plan, Colocated)
        policy.observe(routed_event(r, plan))
        wid = plan.worker.id
        workers[wid] = msgspec.structs.replace(workers[wid], inflight=workers[wid].inflight + 1)
        live.append((r.request_id, wid, clock.t))
        homes.setdefault(conv, set()).add(wid)
        clock.t += 0.1
    assert all(len(h) == 1 for h in homes.values()), homes
    shares = [sum(1 for h in homes.values() if w in h) for w in workers]
    assert shares == [4, 4, 4, 4]


def test_pd_prefill_on_cache_decode_on_load() -> None:
    clock = Clock()
    policy = build_policy(parse_policy({"type": "cache_aware", "seed": 2}), clock=clock)
    p1, p2 = make_worker("p1", "prefill"), make_worker("p2", "prefill")
    d1, d2 = make_worker("d1", "decode", inflight=5), make_worker("d2", "decode", inflight=1)
    snap = make_snapshot(p1, p2, d1, d2)
    first = policy.plan(req(PREFIX + [1] * 50, "r1"), snap)
    assert isinstance(first, Disaggregated)
    policy.observe(routed_event(req(PREFIX + [1] * 50, "r1"), first))
    clock.t += 1.0  # its prefill is done
    for i in range(5):
        plan = policy.plan(req(PREFIX + [i] * 50, f"x{i}"), snap)
        assert isinstance(plan, Disaggregated)
        assert plan.prefill.id == first.prefill.id  # the prefill holding the prefix
        assert plan.decode.id == "d2"  # the less loaded decode, whatever its cache


def test_decider_uses_the_decode_cache() -> None:
    """With a prompt-length decider, a vLLM decode predicted to hold most of the prompt
    prefills it itself."""
    clock = Clock()
    policy = build_policy(
        parse_policy({"type": "cache_aware", "seed": 2}),
        decider=DeciderCfg(min_prefill_tokens=200),
        clock=clock,
    )
    p, d = make_worker("p", "prefill", "vllm"), make_worker("d", "decode", "vllm")
    snap = make_snapshot(p, d)
    long = req(PREFIX + [3] * 300, "a")
    assert isinstance(policy.plan(long, snap), Disaggregated)
    policy.observe(routed_event(long, Colocated(d)))  # d served it alone once: it holds it now
    policy.observe(Completed("a", ("d",), cached_tokens=0))
    again = req(PREFIX + [3] * 300 + [4] * 20, "b")
    assert policy.plan(again, snap) == Colocated(d, reason="decider: decode self-prefill")


def test_a_large_pool_is_searched_not_scored_whole() -> None:
    """Above `scan_limit` the record lists the workers the search scored (the one holding the
    prompt, then the cheapest of the rest until none can beat it), not the pool."""
    clock = Clock()
    st = state(clock, scan_limit=8, prefill_rate=1e9, exact_large_pool=True, queue_externality=0.0)
    pool = [make_worker(f"w{i}") for i in range(300)]
    route(st, req(PREFIX), pool[217])
    clock.t += 1.0
    sel = CacheAwareSelector("x", st, rng=random.Random(5))
    chosen, record = sel.decide(req(PREFIX + [1] * 16), pool)
    assert chosen.id == "w217" and record is not None
    assert 1 <= len(record.candidates) <= 3 and record.candidates[0].worker == "w217"


def test_large_pool_sample_narrows_to_matches_and_a_sample() -> None:
    """`large_pool = "sample"` (the default): the deepest matches plus `sample` random workers."""
    clock = Clock()
    st = state(clock, scan_limit=8, sample=2, prefill_rate=1e9)
    pool = [make_worker(f"w{i}") for i in range(300)]
    route(st, req(PREFIX), pool[217])
    clock.t += 1.0
    sel = CacheAwareSelector("x", st, rng=random.Random(5))
    chosen, record = sel.decide(req(PREFIX + [1] * 16), pool)
    assert chosen.id == "w217" and record is not None
    assert 2 <= len(record.candidates) <= 3
    exact = build_policy(parse_policy({"type": "cache_aware", "large_pool": "exact", "queue_externality": 0}))
    assert exact.colocated.state.settings.exact_large_pool  # type: ignore[attr-defined]


def test_the_exact_search_refuses_the_busy_pool_price() -> None:
    """The busy-pool price (`queue_externality`) is taken over the whole pool, which the exact
    search does not read: it could choose otherwise than scoring every worker, so the two are
    refused together with a clear error."""
    with pytest.raises(ValueError, match="queue_externality = 0"):
        parse_policy({"type": "cache_aware", "large_pool": "exact"})
    with pytest.raises(ValueError, match="queue_externality = 0"):
        CacheAwareSettings(exact_large_pool=True)


def test_load_selector_samples_large_pools() -> None:
    sel = LoadSelector("d", CacheAwareSettings(scan_limit=4, sample=3), rng=random.Random(1))
    pool = [make_worker(f"w{i}", inflight=100 - i) for i in range(100)]
    picks = {sel.select(req(None), pool).id for _ in range(50)}
    assert len(picks) > 5  # not always the global minimum: a sample of three each time
    assert sel.select(req(None), pool[:3]).id == "w2"  # small pools: the least loaded


# ---- observe ----------------------------------------------------------------------------------


def test_outcomes_feed_accuracy_rates_and_capacity() -> None:
    clock = Clock()
    st = state(clock, worker_cache_tokens=1600, prefill_rate=1000.0, crossover_tokens=0.0)
    a = make_worker("a")
    route(st, req(PREFIX, "r1"), a)
    st.observe(Completed("r1", ("a",), ttft_s=0.4, cached_tokens=0, timings=stream(0.4)))
    assert st.queues.rate("a") == pytest.approx(2000.0)  # 800 tokens in 0.4 s
    clock.t += 0.4  # (the 0.4 s it took: nothing is left queued, ApproxIndex.feedback `queued`)
    route(st, req(PREFIX + [1] * 32, "r2"), a)  # predicted: the 800 tokens of PREFIX
    st.observe(Completed("r2", ("a",), ttft_s=0.1, cached_tokens=96))  # the engine had evicted
    acc = st.accuracy.summary()[("a", "approx")]
    assert acc[0] == 2 and acc[2] == 800 and acc[3] == 96
    assert st.approx._scale["a"] == pytest.approx(0.9)  # the modelled capacity shrank


def test_failed_requests_leave_the_queue_and_gone_workers_are_forgotten() -> None:
    clock = Clock()
    st = state(clock, prefill_rate=1000.0, crossover_tokens=0.0)
    a = make_worker("a")
    route(st, req(PREFIX, "r1"), a)
    assert st.queues.backlog("a", clock.t) == 800
    st.observe(Failed("r1", ("a",), "prefill"))
    assert st.queues.backlog("a", clock.t) == 0
    assert st.approx.worker_entries("a") == 50
    st.observe(WorkerGone("a", "restarted"))
    assert st.approx.worker_entries("a") == 0
    assert st.cached((None, st.approx.lookup("m", req(PREFIX).prompt_key, 4)), "a")[0] == 0  # type: ignore[arg-type]


def test_stale_pending_requests_are_swept() -> None:
    clock = Clock()
    st = state(clock, eviction_interval_s=10.0)
    for i in range(5):
        route(st, req(PREFIX, f"r{i}"), make_worker("a"))
    clock.t += 11
    st.observe(Routed("late", "m", ("a",), (make_worker("a").role,), prompt_tokens=10))
    assert list(st._pending) == ["late"]


# ---- config --------------------------------------------------------------------------------------


def test_sglang_router_knobs_are_accepted() -> None:
    cfg = parse_policy(
        {
            "type": "cache_aware",
            "cache_threshold": 0.3,
            "balance_abs_threshold": 64,
            "balance_rel_threshold": 1.5,
            "eviction_interval": 120,
            "max_tree_size": 67108864,
        }
    )
    assert isinstance(cfg, CacheAwareCfg) and cfg.max_tree_size == 1 << 26


@pytest.mark.parametrize(
    "bad",
    [
        {"cache_threshold": 1.5},
        {"balance_rel_threshold": 0.5},
        {"balance_abs_threshold": -1},
        {"eviction_interval": 0},
        {"max_tree_size": 0},
        {"inflight_factor": -1.0},
        {"index": "precise"},
        {"unknown_knob": 1},
    ],
)
def test_bad_knobs_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(msgspec.ValidationError):
        parse_policy({"type": "cache_aware", **bad})


@pytest.mark.parametrize("spec", ["cache_aware", {"type": "cache_aware", "scan_limit": 2, "sample": 1}])
def test_cache_aware_conforms(spec: str | dict[str, object]) -> None:
    run_conformance(build_policy(parse_policy(spec)), n=400, seed=7)


SHAPES = {
    "whole": {},
    # a large pool narrowed to its matches and a sample
    "sampled": {"scan_limit": 3, "sample": 2},
    # more prefix levels than listed: the levels are not exact, each worker's depth searched
    "searched": {"max_candidates": 1},
    # every worker with a queue saturated: often all of them (the rule over the saturated)
    "saturated": {"saturation_wait_s": 1e-9},
    # the tail price over most predictions (policies/tail_price.py): both paths add it alike
    "tail": {"tail_price": 4.0, "tail_ttft_s": 0.05},
    # the externality's wait over the workers later arrivals share (policies/pool_pressure.py)
    "shared": {"shared_wait": True},
    # the fewest predicted TPOT misses first, and a turn's far cheaper holder kept past them
    # (policies/turn_keep.py): both paths cost and credit the holder alike
    "slo": {"slo": SloSettings(tpot_slo_x=2.0)},
    "keep": {"slo": SloSettings(tpot_slo_x=2.0, keep=TurnKeep(1.0, 0.3))},
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("seed", range(20))
def test_the_fast_path_chooses_as_the_recorded_one(seed: int, shape: str) -> None:
    """`select` (one loop, no record) and `decide(record=True)` (estimates, scores, picker)
    make the same choice, ties drawn from identically seeded generators."""
    rng = random.Random(seed)
    clock = Clock()
    st = state(
        clock,
        prefill_rate=1000.0,
        **{"saturation_wait_s": rng.choice([0.5, 5.0]), "balance_abs_threshold": 2, **SHAPES[shape]},
    )
    workers = [
        make_worker(f"w{i}", inflight=rng.randrange(0, 6), waiting=rng.randrange(0, 3)) for i in range(6)
    ]
    step = rng.choice([0.05, 1.0])  # queues still full when asked, or drained
    for i in range(rng.randrange(1, 12)):
        route(
            st,
            req(PREFIX[: rng.randrange(16, 800)] + [i] * rng.randrange(0, 300), f"o{i}"),
            rng.choice(workers),
        )
        clock.t += rng.random() * step
    ask = req(PREFIX[: rng.randrange(16, 800)] + [99] * 50)
    a = CacheAwareSelector("x", st, rng=random.Random(seed))
    b = CacheAwareSelector("x", st, rng=random.Random(seed))
    chosen, record = b.decide(ask, workers)
    assert a.select(ask, workers) is chosen
    assert record is not None and record.chosen == chosen.id


def test_position_memo_finds_workers_without_a_pass_and_notices_changes() -> None:
    from policies.cache_aware import PositionMemo

    memo = PositionMemo(refresh_every=1000)
    pool = [make_worker(f"w{i}") for i in range(300)]
    assert [w.id for w in memo.find(pool, ["w7", "w250", "nope"])] == ["w7", "w250"]
    moved = pool[:5] + pool[6:] + [pool[5]]  # new layout, new last element: mapped again
    assert [w.id for w in memo.find(moved, ["w7", "w5"])] == ["w7", "w5"]
    same_shape = [pool[0], *reversed(pool[1:-1]), pool[-1]]  # same ends, moved middle: checked
    assert [w.id for w in memo.find(same_shape, ["w7"])] == ["w7"]
