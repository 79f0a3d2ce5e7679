"""`policies.explain`: a plan's decision record names the worker the policy chose, with the
reason the selector itself gives (`CacheAwareSelector.decide`), for colocated and P/D plans;
no record where the prefilling role is not cache-aware."""

from __future__ import annotations

import pytest

from policies.base import routed_event
from policies.build import build_policy
from policies.config import CacheAwareCfg, LeastLoadCfg
from policies.explain import explain
from policies.prompt_key import PromptKey
from policies.snapshot import Colocated, Disaggregated, RequestView, Role, RouteKind, WorkerState
from policies.testing import make_snapshot, make_worker

PREFIX = list(range(1000, 1800))  # 800 tokens


def req(ids: list[int], rid: str) -> RequestView:
    return RequestView(
        rid, "m", RouteKind.COMPLETIONS, len(ids), 16, prompt_key=PromptKey.from_token_ids(ids)
    )


@pytest.mark.parametrize(
    ("name", "inflight", "cfg", "b_busy", "expect", "reason"),
    [
        ("the cached worker wins", {"a": 0, "b": 0}, CacheAwareCfg(seed=1), False, "a", "min_ttft"),
        # a holds the prefix but has many more requests in flight: the balance rule
        (
            "balance gate",
            {"a": 40, "b": 0},
            CacheAwareCfg(seed=1, inflight_factor=0.0, balance_abs_threshold=8),
            False,
            "b",
            "balance_gate",
        ),
        # a is still prefilling the prefix: saturated, b is not
        (
            "a saturated",
            {"a": 0, "b": 0},
            CacheAwareCfg(seed=1, saturation_wait_s=1e-6),
            False,
            "b",
            "min_ttft",
        ),
        # b was sent a longer prompt: both saturated, the cheaper one
        (
            "all saturated",
            {"a": 0, "b": 0},
            CacheAwareCfg(seed=1, saturation_wait_s=1e-6),
            True,
            "a",
            "all_saturated",
        ),
    ],
)
def test_a_colocated_record_matches_the_choice(
    name: str, inflight: dict[str, int], cfg: CacheAwareCfg, b_busy: bool, expect: str, reason: str
) -> None:
    now = [100.0]
    policy = build_policy(cfg, clock=lambda: now[0])
    warm = make_snapshot(make_worker("a"), make_worker("b"))
    policy.observe(routed_event(req(PREFIX, "r0"), Colocated(warm.workers[0])))  # a: the prefix
    if b_busy:
        policy.observe(routed_event(req(list(range(3000)), "rb"), Colocated(warm.workers[1])))
    elif "saturated" not in name:
        now[0] += 60.0  # the queued prefills are done
    snap = make_snapshot(*(make_worker(w, inflight=n) for w, n in inflight.items()))
    r = req(PREFIX + [5] * 40, "r1")
    plan = policy.plan(r, snap)
    assert isinstance(plan, Colocated) and plan.worker.id == expect
    rec = explain(policy, r, snap, plan)
    assert rec is not None
    assert rec.chosen == expect and rec.reason == reason
    rows = {e.worker: e for e in rec.candidates}
    assert rows["a"].cached_tokens == 800 and rows["b"].cached_tokens == 0
    assert rec.keyed == "tokens" and rec.role == "cache_aware/colocated"


def test_a_pd_record_covers_the_prefill_pool_of_the_decodes_engine() -> None:
    now = [100.0]
    policy = build_policy(CacheAwareCfg(seed=1), clock=lambda: now[0])
    workers: list[WorkerState] = [
        make_worker("p1", Role.PREFILL),
        make_worker("p2", Role.PREFILL),
        make_worker("pv", Role.PREFILL, engine="vllm"),
        make_worker("d", Role.DECODE),
    ]
    snap = make_snapshot(*workers)
    policy.observe(routed_event(req(PREFIX, "r0"), Disaggregated(workers[1], workers[3])))
    now[0] += 60.0
    r = req(PREFIX + [9] * 20, "r1")
    plan = policy.plan(r, snap)
    assert isinstance(plan, Disaggregated) and plan.prefill.id == "p2"
    rec = explain(policy, r, snap, plan)
    assert rec is not None and rec.chosen == "p2" and rec.reason == "min_ttft"
    assert {e.worker for e in rec.candidates} == {"p1", "p2"}  # not the vLLM prefill
    assert rec.role == "cache_aware/prefill"


def test_no_record_without_a_cache_aware_role() -> None:
    policy = build_policy(LeastLoadCfg())
    snap = make_snapshot(make_worker("a"), make_worker("b"))
    r = req(PREFIX, "r1")
    plan = policy.plan(r, snap)
    assert isinstance(plan, Colocated)
    assert explain(policy, r, snap, plan) is None
