"""Planning order, fallbacks and the built-ins: table-driven, pure, no event loop."""

from __future__ import annotations

import random

import pytest

from common.workers import WorkerState
from policies import least_load, power_of_two, round_robin
from policies import random as random_policy
from policies.base import (
    Completed,
    Failed,
    NoCandidates,
    NonCachedTokensDecider,
    Policy,
    Profile,
    Routed,
    pair_id,
    plan_worker_ids,
    routed_event,
    run_profile,
)
from policies.least_load import LoadScorer, LoadWeights, MaxScorePicker, load_of
from policies.pd import PDPolicy
from policies.snapshot import Colocated, Disaggregated, Reject, RequestView
from policies.testing import (
    PlanCase,
    assert_plans,
    check_plan,
    make_request,
    make_snapshot,
    make_worker,
    run_conformance,
)

SP = make_worker("sp", "prefill", "sglang", bootstrap_port=8998)
SD = make_worker("sd", "decode", "sglang")
VP = make_worker("vp", "prefill", "vllm")
VD = make_worker("vd", "decode", "vllm")
CO = make_worker("co", "colocated", "openai")
REQ = make_request()


def all_builtins() -> list[Policy]:
    return [
        round_robin.make_policy(),
        random_policy.make_policy(rng=random.Random(1)),
        least_load.make_policy(),
        power_of_two.make_policy(rng=random.Random(2)),
    ]


ORDER_CASES = [
    PlanCase("sglang pair", REQ, make_snapshot(SP, SD), kind="disaggregated", workers=("sp", "sd")),
    PlanCase("vllm pair", REQ, make_snapshot(VP, VD), kind="disaggregated", workers=("vp", "vd")),
    PlanCase("only colocated", REQ, make_snapshot(CO), kind="colocated", workers=("co",)),
    PlanCase("pair preferred over colocated", REQ, make_snapshot(CO, SP, SD), workers=("sp", "sd")),
    PlanCase("engines never mix", REQ, make_snapshot(SP, VD), kind="colocated", workers=("vd",)),
    PlanCase("sglang decode alone cannot serve", REQ, make_snapshot(VP, SD), kind="reject", status=503),
    PlanCase("unknown model", make_request(model="x"), make_snapshot(SP, SD), kind="reject", status=404),
    PlanCase(
        "known but unusable",
        REQ,
        make_snapshot(make_worker("c", healthy=False), make_worker("d", draining=True)),
        kind="reject",
        status=503,
    ),
    PlanCase(
        "unprobed worker serves any model",
        make_request(model="x"),
        make_snapshot(make_worker("c", model=None)),
        workers=("c",),
    ),
    PlanCase(
        "other model's pool ignored",
        REQ,
        make_snapshot(make_worker("p2", "prefill", model="n"), make_worker("d2", "decode", model="n"), CO),
        workers=("co",),
    ),
    PlanCase(
        "excluded pair -> other pair",
        REQ,
        make_snapshot(SP, SD, VP, VD),
        exclude=frozenset({"sp|sd"}),
        workers=("vp", "vd"),
    ),
    PlanCase(
        "excluded pairs -> colocated",
        REQ,
        make_snapshot(SP, SD, CO),
        exclude=frozenset({"sp|sd"}),
        workers=("co",),
    ),
    PlanCase(
        "excluded pair -> vllm decode alone",
        REQ,
        make_snapshot(VP, VD),
        exclude=frozenset({"vp|vd"}),
        kind="colocated",
        workers=("vd",),
    ),
    PlanCase(
        "excluded sglang pair, nothing else",
        REQ,
        make_snapshot(SP, SD),
        exclude=frozenset({"sp|sd"}),
        kind="reject",
        status=503,
    ),
    PlanCase(
        "excluded worker id", REQ, make_snapshot(SP, SD, CO), exclude=frozenset({"sd"}), workers=("co",)
    ),
    PlanCase("excluded colocated", REQ, make_snapshot(CO), exclude=frozenset({"co"}), status=503),
    PlanCase("same-engine prefill for the decode", REQ, make_snapshot(VP, SD, SP), workers=("sp", "sd")),
]


@pytest.mark.parametrize("policy", all_builtins(), ids=lambda p: p.name)
def test_planning_order(policy: Policy) -> None:
    assert_plans(policy, ORDER_CASES)


def _decider_policy(min_tokens: int) -> PDPolicy:
    return PDPolicy(
        "rr",
        decode=round_robin.round_robin_profile(),
        prefill=round_robin.round_robin_profile(),
        colocated=round_robin.round_robin_profile(),
        decider=NonCachedTokensDecider(min_tokens),
    )


@pytest.mark.parametrize(
    ("min_tokens", "prompt", "workers", "expect"),
    [
        (0, 1, (SP, SD, CO), ("sp", "sd")),  # default: always disaggregate
        (100, 100, (SP, SD, CO), ("sp", "sd")),  # boundary: >= disaggregates
        (100, 99, (SP, SD, CO), ("co",)),  # short prompt: colocated worker
        (100, 99, (VP, VD), ("vd",)),  # no colocated: vLLM decode prefills itself
        (100, 99, (SP, SD), ("sp", "sd")),  # SGLang decode cannot: disaggregate anyway
    ],
)
def test_decider(
    min_tokens: int, prompt: int, workers: tuple[WorkerState, ...], expect: tuple[str, ...]
) -> None:
    plan = _decider_policy(min_tokens).plan(make_request(prompt_tokens=prompt), make_snapshot(*workers))
    assert plan_worker_ids(plan) == expect


def test_decider_uses_cache_estimate() -> None:
    class HalfCached:
        def cached_tokens(self, req: RequestView, worker: WorkerState) -> int:
            return req.prompt_tokens // 2

    policy = _decider_policy(60)
    policy.cache = HalfCached()
    assert plan_worker_ids(policy.plan(make_request(prompt_tokens=100), make_snapshot(SP, SD, CO))) == ("co",)
    assert plan_worker_ids(policy.plan(make_request(prompt_tokens=120), make_snapshot(SP, SD, CO))) == (
        "sp",
        "sd",
    )


def test_round_robin_cycles_per_role_via_observe() -> None:
    snap = make_snapshot(
        make_worker("p1", "prefill"),
        make_worker("p2", "prefill"),
        make_worker("d1", "decode"),
        make_worker("d2", "decode"),
        make_worker("d3", "decode"),
    )
    policy = round_robin.make_policy()
    assert policy.plan(REQ, snap) == policy.plan(REQ, snap)  # plan() alone changes nothing
    seen = []
    for _ in range(6):
        plan = policy.plan(REQ, snap)
        assert isinstance(plan, Disaggregated)
        seen.append(plan_worker_ids(plan))
        policy.observe(routed_event(REQ, plan))
    assert seen == [("p1", "d1"), ("p2", "d2"), ("p1", "d3"), ("p2", "d1"), ("p1", "d2"), ("p2", "d3")]


def test_round_robin_ignores_other_events() -> None:
    policy = round_robin.make_policy()
    snap = make_snapshot(make_worker("a"), make_worker("b"))
    policy.observe(Completed("r", ("a",), ttft_s=0.1, output_tokens=3))
    policy.observe(Failed("r", ("a",), phase="decode"))
    assert plan_worker_ids(policy.plan(REQ, snap)) == ("a",)
    policy.observe(Routed("r", "m", ("a",), (make_worker("a").role,)))
    assert plan_worker_ids(policy.plan(REQ, snap)) == ("b",)


def test_round_robin_survives_membership_change() -> None:
    policy = round_robin.make_policy()
    policy.observe(Routed("r", "m", ("b",), (make_worker("b").role,)))
    # "b" is gone: continue after it in id order, not from an index
    assert plan_worker_ids(policy.plan(REQ, make_snapshot(make_worker("a"), make_worker("c")))) == ("c",)


@pytest.mark.parametrize(
    ("loads", "expect"),
    [
        ({"a": dict(inflight=3), "b": dict(inflight=1)}, "b"),
        ({"a": dict(waiting=1), "b": dict(running=3)}, "b"),  # waiting weighs 2, running 0.5
        ({"a": dict(inflight_tokens=5000), "b": dict(inflight=2)}, "b"),
        ({"a": dict(), "b": dict()}, "a"),  # tie: first in snapshot order
        ({"a": dict(inflight=2, weight=4.0), "b": dict(inflight=1)}, "a"),  # capacity weight
    ],
)
def test_least_load_picks_lowest(loads: dict[str, dict[str, float]], expect: str) -> None:
    snap = make_snapshot(*(make_worker(wid, **kw) for wid, kw in loads.items()))  # type: ignore[arg-type]
    assert plan_worker_ids(least_load.make_policy().plan(REQ, snap)) == (expect,)


def test_least_load_weights_configurable() -> None:
    snap = make_snapshot(make_worker("a", waiting=1), make_worker("b", running=3))
    weights = LoadWeights(waiting_weight=0.1, running_weight=1.0)
    assert plan_worker_ids(least_load.make_policy(weights).plan(REQ, snap)) == ("a",)
    assert load_of(make_worker("x", inflight=2, weight=2.0), LoadWeights()) == 1.0


def test_load_scores_in_unit_range() -> None:
    cands = [make_worker(str(i), inflight=i, waiting=i * 2) for i in range(5)]
    scores = LoadScorer().score(REQ, cands)
    assert all(0.0 <= s <= 1.0 for s in scores.values())
    assert scores["0"] == 1.0 and scores["4"] == 0.0


def test_power_of_two_never_takes_the_worst_of_two() -> None:
    snap = make_snapshot(make_worker("idle"), make_worker("busy", inflight=10))
    policy = power_of_two.make_policy(rng=random.Random(0))
    for _ in range(20):
        assert plan_worker_ids(policy.plan(REQ, snap)) == ("idle",)


def test_power_of_two_spreads_over_equal_workers() -> None:
    snap = make_snapshot(*(make_worker(f"w{i}") for i in range(4)))
    policy = power_of_two.make_policy(rng=random.Random(0))
    assert len({plan_worker_ids(policy.plan(REQ, snap)) for _ in range(50)}) > 1


def test_random_is_reproducible_with_seed_and_honours_weight() -> None:
    snap = make_snapshot(make_worker("a", weight=0.0), make_worker("b"), make_worker("c"))
    picks = [plan_worker_ids(random_policy.make_policy(seed=7).plan(REQ, snap)) for _ in range(3)]
    assert len(set(picks)) == 1
    policy = random_policy.make_policy(rng=random.Random(3))
    got = {plan_worker_ids(policy.plan(REQ, snap))[0] for _ in range(100)}
    assert got == {"b", "c"}


def test_run_profile_filters_scores_and_picks() -> None:
    class NotB:
        name = "not-b"

        def filter(self, req: RequestView, cands: object) -> list[WorkerState]:
            return [w for w in cands if w.id != "b"]  # type: ignore[attr-defined]

    class Wild:
        name = "wild"

        def score(self, req: RequestView, cands: object) -> dict[str, float]:
            return {"a": 7.0, "c": -3.0}  # clamped to [0, 1]

    profile = Profile("t", picker=MaxScorePicker(), filters=(NotB(),), scorers=((Wild(), 2.0),))
    cands = [make_worker("a"), make_worker("b"), make_worker("c")]
    d = run_profile(profile, REQ, cands)
    assert d.worker.id == "a" and d.totals == {"a": 2.0, "c": 0.0} and d.scores["wild"]["a"] == 7.0
    with pytest.raises(NoCandidates) as e:
        run_profile(profile, REQ, [make_worker("b")])
    assert e.value.stage == "not-b"


def test_selector_refusing_all_prefills_for_a_decode_tries_the_next() -> None:
    class OnlyP2:
        name = "only-p2"

        def filter(self, req: RequestView, cands: object) -> list[WorkerState]:
            return [w for w in cands if w.id == "p2"]  # type: ignore[attr-defined]

    policy = PDPolicy(
        "t",
        decode=round_robin.round_robin_profile(),
        prefill=Profile("p", picker=MaxScorePicker(), filters=(OnlyP2(),)),
        colocated=round_robin.round_robin_profile(),
    )
    snap = make_snapshot(
        make_worker("p1", "prefill", "sglang"),
        make_worker("d1", "decode", "sglang"),
        make_worker("p2", "prefill", "vllm"),
        make_worker("d2", "decode", "vllm"),
    )
    assert plan_worker_ids(policy.plan(REQ, snap)) == ("p2", "d2")


def test_check_plan_reports_violations() -> None:
    bad = Disaggregated(VP, SD)
    errors = check_plan(bad, REQ, make_snapshot(VP, SD), frozenset({"vp"}))
    assert any("mixes engines" in e for e in errors) and any("excluded" in e for e in errors)
    assert check_plan(Colocated(SD), REQ, make_snapshot(SD))  # sglang decode alone
    assert check_plan(Reject("x", 503), make_request(model="zz"), make_snapshot(SD))  # should be 404
    assert check_plan(Reject("x", 503), REQ, make_snapshot(CO))  # needless reject
    assert not check_plan(Reject("x", 503), REQ, make_snapshot(CO), allow_reject=True)
    assert pair_id("a", "b") == "a|b"


@pytest.mark.parametrize("policy", all_builtins(), ids=lambda p: p.name)
def test_conformance(policy: Policy) -> None:
    run_conformance(policy, n=400, seed=11)


def test_policy_protocol_is_satisfied() -> None:
    for policy in all_builtins():
        assert isinstance(policy, Policy)


def test_a_round_robin_picker_made_for_a_role_records_only_that_role() -> None:
    # each role's picker of a built policy keeps its own role's cursor; the others' workers of a
    # `Routed` event are recorded by their own pickers (one store per picker per request)
    p1, p2, d1 = make_worker("p1", "prefill"), make_worker("p2", "prefill"), make_worker("d1", "decode")
    event = Routed("r", "m", ("p1", "d1"), (p1.role, d1.role))
    own, shared = round_robin.RoundRobinPicker(d1.role), round_robin.RoundRobinPicker()
    own.observe(event)
    shared.observe(event)
    prefills = [(p1, 0.0), (p2, 0.0)]
    assert shared.pick(REQ, prefills).id == "p2"  # it followed the prefill too
    assert own.pick(REQ, prefills).id == "p1"  # no prefill cursor: the first
    assert own.pick(REQ, [(d1, 0.0), (make_worker("d2", "decode"), 0.0)]).id == "d2"
