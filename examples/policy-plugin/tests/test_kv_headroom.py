"""The example plugin's own tests, written with the pd-gateway policy kit (policies/testing.py)."""

from __future__ import annotations

import msgspec
import pytest
from pdgw_kv_headroom.policy import KvHeadroomScorer, factory

from policies.build import build_policy
from policies.config import PluginCfg
from policies.plugins import available_plugins
from policies.snapshot import WorkerLoad
from policies.testing import (
    PlanCase,
    ReplayRow,
    assert_plans,
    assert_ranking,
    assert_verdict,
    make_request,
    make_snapshot,
    make_worker,
    replay,
    run_conformance,
)


def w(id: str, role: str, kv: float, inflight: int = 0):  # type: ignore[no-untyped-def]
    return msgspec.structs.replace(make_worker(id, role, inflight=inflight), load=WorkerLoad(kv_usage=kv))


def test_the_scorer_prefers_free_kv_cache() -> None:
    assert_ranking(
        KvHeadroomScorer(), make_request(), [w("a", "decode", 0.9), w("b", "decode", 0.2)], ["b", "a"]
    )


def test_plans() -> None:
    snap = make_snapshot(
        w("p1", "prefill", 0.1), w("p2", "prefill", 0.8), w("d1", "decode", 0.7), w("d2", "decode", 0.3)
    )
    assert_plans(
        factory({}),
        [
            PlanCase("the freest pair", make_request(), snap, kind="disaggregated", workers=("p1", "d2")),
            PlanCase(
                "its pair excluded", make_request(), snap, exclude=frozenset({"p1|d2"}), workers=("p2", "d2")
            ),
            PlanCase("unknown model", make_request(model="other"), snap, kind="reject", status=404),
        ],
        observe=False,
    )


def test_load_outweighs_headroom_when_weighted_so() -> None:
    snap = make_snapshot(w("c1", "colocated", 0.1, inflight=30), w("c2", "colocated", 0.5))
    assert_plans(
        factory({"kv_weight": 0.1}), [PlanCase("busy", make_request(), snap, workers=("c2",))], observe=False
    )


def test_conforms() -> None:
    run_conformance(factory({}), n=300, seed=3)


def test_bad_options_are_refused() -> None:
    with pytest.raises(msgspec.ValidationError):
        factory({"kv_wieght": 2.0})


def test_with_the_cost_model_decider() -> None:
    policy = factory({"decider": {"type": "cost_model"}})
    snap = make_snapshot(w("p1", "prefill", 0.1), w("d1", "decode", 0.1), w("c1", "colocated", 0.1))
    assert_verdict(policy, make_request(prompt_tokens=50), snap, kind="colocated")
    assert_verdict(policy, make_request(prompt_tokens=20_000), snap, kind="pd")
    summary = replay(policy, snap, [ReplayRow(50), ReplayRow(20_000), ReplayRow(60), ReplayRow(30_000)])
    assert summary.plans == {"colocated": 2, "disaggregated": 2}


def test_the_gateway_loads_it_by_name() -> None:
    assert "kv-headroom" in available_plugins()
    policy = build_policy(PluginCfg(name="kv-headroom", options={"kv_weight": 2.0}))
    assert policy.name == "kv-headroom"
