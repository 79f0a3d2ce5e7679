"""The pool split `PDPolicy` keeps per `ClusterSnapshot.layout`: the registry gives a snapshot a
new layout whenever a worker is added, removed, drained, found unhealthy or changes anything
else the split or the pairing reads, and keeps it across in-flight counts and load scrapes; the
next plan after any such change sees it (the split is never stale)."""

from __future__ import annotations

import random

import msgspec
import pytest

from common.workers import Engine, Role, WorkerLoad
from gateway.registry import Registry, Worker
from policies.base import Policy
from policies.build import build_policy
from policies.config import parse_policy
from policies.snapshot import LAYOUT_FIELDS, ClusterSnapshot, Colocated, Disaggregated, Layout, same_layout
from policies.testing import make_request, make_worker


def _worker(wid: str, role: Role = Role.COLOCATED, model: str = "m") -> Worker:
    w = Worker(wid, f"http://127.0.0.1:{9000 + len(wid)}", role, Engine.SGLANG, model=model)
    w.healthy = True
    return w


def _plans(policy: Policy, reg: Registry, n: int = 20) -> set[str]:
    """The workers `n` plans choose (colocated: the worker; P/D: "prefill>decode")."""
    out: set[str] = set()
    for i in range(n):
        plan = policy.plan(make_request(request_id=f"r{i}"), reg.snapshot())
        if isinstance(plan, Colocated):
            out.add(plan.worker.id)
        elif isinstance(plan, Disaggregated):
            out.add(f"{plan.prefill.id}>{plan.decode.id}")
        else:
            out.add(f"reject {plan.status}")
    return out


def _busy(reg: Registry, w: Worker, n: int) -> None:
    for _ in range(n):
        reg.acquire(w, 100)


@pytest.mark.parametrize("field", LAYOUT_FIELDS)
def test_same_layout_is_told_by_every_layout_field_and_by_nothing_else(field: str) -> None:
    a = (make_worker("a"), make_worker("b", role=Role.PREFILL))
    moved = (a[0], msgspec.structs.replace(a[1], inflight=7, inflight_tokens=900, load=WorkerLoad(waiting=3)))
    assert same_layout(a, moved)
    other = {
        "id": "c",
        "role": Role.DECODE,
        "engine": Engine.VLLM,
        "model": "other",
        "healthy": False,
        "draining": True,
        "block_size": 64,
        "labels": (("pd-group", "x"),),
        "decode_alone": True,
    }[field]
    assert not same_layout(a, (a[0], msgspec.structs.replace(a[1], **{field: other})))
    assert not same_layout(a, a[:1]) and not same_layout(a, a[::-1])


def test_the_registry_keeps_the_layout_across_counts_and_load_only() -> None:
    reg = Registry()
    a, b = _worker("a"), _worker("b")
    reg.add(a)
    reg.add(b)
    first = reg.snapshot().layout
    assert isinstance(first, Layout)
    _busy(reg, a, 2)
    a.load = WorkerLoad(running=3, waiting=1)  # a scrape
    reg.changed()
    snap = reg.snapshot()
    assert snap.layout is first and snap.get("a").inflight == 2  # type: ignore[union-attr]
    b.draining = True
    reg.changed()
    assert reg.snapshot().layout is not first


def test_the_split_follows_workers_added_removed_drained_and_failed() -> None:
    """least_load over colocated workers: the least loaded worker is chosen; each change makes
    a worker that a stale split would leave out (or keep) the only right answer."""
    policy = build_policy(parse_policy("least_load"))
    reg = Registry()
    a, b = _worker("a"), _worker("b")
    reg.add(a)
    reg.add(b)
    _busy(reg, b, 3)
    assert _plans(policy, reg) == {"a"}
    c = _worker("c")  # added, idle: the only choice
    reg.add(c)
    _busy(reg, a, 5)
    assert _plans(policy, reg) == {"c"}
    c.draining = True  # drained: never chosen again
    reg.changed()
    assert _plans(policy, reg) == {"b"}
    b.healthy = False  # unhealthy
    reg.changed()
    assert _plans(policy, reg) == {"a"}
    b.healthy = True
    reg.changed()
    assert _plans(policy, reg) == {"b"}
    _busy(reg, b, 9)
    c.draining = False
    reg.changed()
    assert _plans(policy, reg) == {"c"}


async def test_the_split_follows_a_worker_removed_and_back_in_another_role() -> None:
    policy = build_policy(parse_policy("least_load"))
    reg = Registry()
    a, b = _worker("a"), _worker("b")
    reg.add(a)
    reg.add(b)
    _busy(reg, a, 3)
    assert _plans(policy, reg) == {"b"}
    await reg.remove("b")
    assert _plans(policy, reg) == {"a"}
    await reg.remove("a")
    reg.add(_worker("a", Role.PREFILL))  # the same ids, now a P/D pair: no colocated worker
    reg.add(_worker("b", Role.DECODE))
    assert _plans(policy, reg) == {"a>b"}
    await reg.remove("a")
    await reg.remove("b")
    reg.add(_worker("b", model="other"))  # the model moved: none serves "m"
    assert _plans(policy, reg) == {"reject 404"}


def test_a_snapshot_without_a_layout_or_with_exclusions_is_split_afresh() -> None:
    policy = build_policy(parse_policy("least_load"))
    a, b = make_worker("a"), make_worker("b", inflight=5)
    layout = Layout()
    assert policy.plan(make_request(), ClusterSnapshot(1, (a, b), layout)).worker.id == "a"  # type: ignore[union-attr]
    # the same token with other workers breaks the contract, but no token (a snapshot built
    # elsewhere) and a retry's exclusions never read the kept split
    assert policy.plan(make_request(), ClusterSnapshot(2, (b, a))).worker.id == "a"  # type: ignore[union-attr]
    plan = policy.plan(make_request(), ClusterSnapshot(3, (a, b), layout), frozenset({"a"}))
    assert plan.worker.id == "b"  # type: ignore[union-attr]


@pytest.mark.parametrize("seed", range(30))
def test_the_kept_split_and_pairing_are_the_fresh_ones(seed: int) -> None:
    """`_Split` (positions, pairing classes) taken from a pool equals `_split` and
    `_pair_prefills` of that pool, over random roles, models, health, engines, block sizes and
    pair groups."""
    from policies.pd import _pair_prefills, _Partners, _Split, _split

    rng = random.Random(seed)
    ws = tuple(
        msgspec.structs.replace(
            make_worker(
                f"w{i}",
                role=rng.choice([Role.PREFILL, Role.DECODE, Role.COLOCATED]),
                engine=rng.choice([Engine.SGLANG, Engine.VLLM]),
                model=rng.choice(["m", "m", "other", None]),
                healthy=rng.random() > 0.2,
                draining=rng.random() < 0.1,
                labels=rng.choice([(), (("pd-group", "a"),), (("pd-group", "b"),), (("zone", "x"),)]),
            ),
            block_size=rng.choice([None, 16, 32]),
        )
        for i in range(rng.randrange(0, 40))
    )
    for model in ("m", "other", "none"):
        known, decodes, prefills, colocated = _split(ws, model, frozenset())
        kept = _Split(ws, model)
        assert kept.known == known
        assert list(kept.decodes(ws)) == decodes and list(kept.colocated(ws)) == colocated
        partners = _Partners(kept, ws)
        fresh = {d.id: _pair_prefills(d, prefills, frozenset()) for d in decodes}
        assert {d.id: list(partners[d.id]) for d in decodes} == fresh
        assert list(kept.pairable(ws)) == [d for d in decodes if fresh[d.id]]


def test_a_pd_plan_follows_prefills_added_and_pairing_changed() -> None:
    policy = build_policy(parse_policy("least_load"))
    reg = Registry()
    p1, d = _worker("p1", Role.PREFILL), _worker("d", Role.DECODE)
    reg.add(p1)
    reg.add(d)
    _busy(reg, p1, 3)
    assert _plans(policy, reg) == {"p1>d"}
    p2 = _worker("p2", Role.PREFILL)  # added, idle: its prefill is the one chosen
    reg.add(p2)
    assert _plans(policy, reg) == {"p2>d"}
    p2.labels = (("pd-group", "x"),)  # no longer in d's group... once d has one
    d.labels = (("pd-group", "y"),)
    reg.changed()
    assert _plans(policy, reg) == {"p1>d"}


class _Handed:
    """A colocated `RoleSelector` that keeps the candidates it is handed and takes the first."""

    def __init__(self) -> None:
        self.handed: list[object] = []

    def select(self, req: object, cands: object) -> object:
        self.handed.append(cands)
        return cands[0]  # type: ignore[index]

    def observe(self, event: object) -> None:
        pass


def test_a_kept_split_hands_the_selector_the_snapshots_workers_uncopied() -> None:
    """A plan with a kept layout hands the colocated selector the snapshot's tuple itself where
    every worker is colocated, and a tuple slice of a contiguous part (not a list copied from
    it: a copy touches every worker's state, a cache miss each in a pool of 1,000)."""
    from policies.pd import PDPolicy

    sel = _Handed()
    policy = PDPolicy("t", decode=sel, prefill=sel, colocated=sel)  # type: ignore[arg-type]
    ws = tuple(make_worker(f"w{i}") for i in range(50))
    layout = Layout()
    for v in range(3):
        plan = policy.plan(make_request(), ClusterSnapshot(v, ws, layout))
        assert isinstance(plan, Colocated) and plan.worker is ws[0]
    assert len(sel.handed) == 3 and all(h is ws for h in sel.handed)
    part = (*ws, make_worker("d", role=Role.DECODE, model="other"))
    policy.plan(make_request(), ClusterSnapshot(9, part, Layout()))
    assert type(sel.handed[-1]) is tuple and sel.handed[-1] == ws


@pytest.mark.parametrize("seed", range(40))
def test_a_pool_without_pairs_plans_alike_with_a_kept_layout_and_without(seed: int) -> None:
    """Pools with no P/D pair (colocated workers, decodes that may or may not serve alone, some
    unhealthy or of another model): the plan with a kept layout (which takes no pairs then) is
    the plan of a fresh split, down to the fallbacks (a decode serving alone, a rejection)."""
    rng = random.Random(seed)
    ws = tuple(
        msgspec.structs.replace(
            make_worker(
                f"w{i}",
                role=rng.choice([Role.DECODE, Role.COLOCATED]),
                model=rng.choice(["m", "m", "other"]),
                healthy=rng.random() > 0.4,
                inflight=i,  # no ties: least_load's choice is one worker
            ),
            decode_alone=rng.random() < 0.5,
        )
        for i in range(rng.randrange(1, 8))
    )
    kept, fresh = (build_policy(parse_policy("least_load")) for _ in range(2))
    layout = Layout()
    for v in range(2):
        a = kept.plan(make_request(), ClusterSnapshot(v, ws, layout))
        b = fresh.plan(make_request(), ClusterSnapshot(v, ws))
        assert type(a) is type(b)
        if isinstance(a, Colocated):
            assert a.worker.id == b.worker.id and a.reason == b.reason  # type: ignore[union-attr]
        else:
            assert a.status == b.status  # type: ignore[union-attr]
