"""Hypothesis: for any snapshot, request and exclude set, every built-in returns a valid plan."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from common.workers import Engine, Role, WorkerState
from policies import least_load, power_of_two, round_robin
from policies import random as random_policy
from policies.base import Policy, pair_id, routed_event
from policies.snapshot import ClusterSnapshot, Reject, RequestView
from policies.testing import check_plan, make_request, make_snapshot, make_worker

MODELS = st.sampled_from(["m", "n", "x"])


@st.composite
def workers(draw: st.DrawFn, i: int) -> WorkerState:
    role = draw(st.sampled_from(list(Role)))
    engines = list(Engine) if role is Role.COLOCATED else [Engine.SGLANG, Engine.VLLM]
    return make_worker(
        f"w{i}",
        role,
        draw(st.sampled_from(engines)),
        draw(st.one_of(st.none(), st.sampled_from(["m", "n"]))),
        healthy=draw(st.booleans()),
        draining=draw(st.booleans()),
        inflight=draw(st.integers(0, 50)),
        inflight_tokens=draw(st.integers(0, 100_000)),
        waiting=draw(st.integers(0, 50)),
        running=draw(st.integers(0, 50)),
        weight=draw(st.sampled_from([0.0, 0.5, 1.0, 3.0])),
    )


@st.composite
def cases(draw: st.DrawFn) -> tuple[RequestView, ClusterSnapshot, frozenset[str]]:
    n = draw(st.integers(0, 7))
    snap = make_snapshot(*(draw(workers(i)) for i in range(n)))
    ids = [w.id for w in snap.workers]
    pairs = [pair_id(p, d) for p in ids for d in ids if p != d]
    exclude = draw(st.frozensets(st.sampled_from(ids + pairs), max_size=8)) if ids else frozenset()
    req = make_request(draw(MODELS), prompt_tokens=draw(st.integers(1, 10_000)))
    return req, snap, exclude


def builtins() -> list[Policy]:
    return [
        round_robin.make_policy(),
        random_policy.make_policy(rng=random.Random(0)),
        least_load.make_policy(),
        power_of_two.make_policy(rng=random.Random(0)),
    ]


POLICIES = builtins()


@settings(max_examples=300, deadline=None)
@given(cases())
def test_any_snapshot_gives_a_valid_plan(case: tuple[RequestView, ClusterSnapshot, frozenset[str]]) -> None:
    req, snap, exclude = case
    for policy in POLICIES:
        plan = policy.plan(req, snap, exclude)
        errors = check_plan(plan, req, snap, exclude)
        assert not errors, (policy.name, plan, errors)
        if not isinstance(plan, Reject):
            policy.observe(routed_event(req, plan))
