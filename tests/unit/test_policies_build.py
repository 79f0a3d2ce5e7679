"""Policy config decoding, `build_policy`, and plugins (entry points faked by an injected loader)."""

from __future__ import annotations

from collections.abc import Sequence
from importlib.metadata import EntryPoint

import msgspec
import pytest

from common.workers import WorkerState
from policies import plugins
from policies.base import PolicyEvent
from policies.build import PolicyBuildError, build_policy
from policies.config import (
    DeciderCfg,
    LeastLoadCfg,
    PluginCfg,
    PolicyCfg,
    PowerOfTwoCfg,
    RandomCfg,
    RoundRobinCfg,
    parse_policy,
)
from policies.pd import PDPolicy
from policies.plugins import PluginError, PolicyFactory
from policies.snapshot import ClusterSnapshot, Colocated, Plan, Reject, RequestView
from policies.testing import make_request, make_snapshot, make_worker, run_conformance


@pytest.mark.parametrize(
    ("raw", "expect"),
    [
        ("round_robin", RoundRobinCfg()),
        ("random", RandomCfg()),
        ({"type": "random", "seed": 3}, RandomCfg(seed=3)),
        ("least_load", LeastLoadCfg()),
        ({"type": "least_load", "waiting_weight": 4.0}, LeastLoadCfg(waiting_weight=4.0)),
        ({"type": "power_of_two", "seed": 1}, PowerOfTwoCfg(seed=1)),
        ("plugin:mine", PluginCfg(name="mine")),
        ({"type": "plugin", "name": "mine", "options": {"k": 1}}, PluginCfg(name="mine", options={"k": 1})),
    ],
)
def test_parse_policy(raw: str | dict[str, object], expect: PolicyCfg) -> None:
    assert parse_policy(raw) == expect


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("roundrobin", "Invalid value 'roundrobin' - at `$.type`"),
        ({"type": "least_load", "waiting_weigt": 1}, "unknown field `waiting_weigt`"),
        ({"type": "least_load", "waiting_weight": -1}, "waiting_weight must be a finite number >= 0, got -1"),
        # nan passed `< 0` and made every load nan (least_load then always took the first worker)
        ({"type": "least_load", "waiting_weight": float("nan")}, "waiting_weight must be a finite number"),
        ({"type": "power_of_two", "running_weight": float("inf")}, "running_weight must be a finite number"),
        ({"type": "plugin"}, "missing required field `name`"),
    ],
)
def test_parse_policy_errors(raw: str | dict[str, object], message: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=message.replace("$", r"\$").replace("`", ".")):
        parse_policy(raw)


def test_decider_cfg_validates() -> None:
    with pytest.raises(msgspec.ValidationError, match="min_prefill_tokens"):
        msgspec.convert({"min_prefill_tokens": -1}, DeciderCfg)


@pytest.mark.parametrize("raw", ["round_robin", "random", "least_load", "power_of_two"])
def test_build_each_builtin_conforms(raw: str) -> None:
    policy = build_policy(parse_policy(raw))
    assert policy.name == raw
    run_conformance(policy, n=200, seed=5)


def test_build_role_overrides_and_decider() -> None:
    policy = build_policy(
        RoundRobinCfg(),
        prefill=LeastLoadCfg(),
        decode=PowerOfTwoCfg(seed=1),
        decider=DeciderCfg(min_prefill_tokens=500),
    )
    assert isinstance(policy, PDPolicy)
    assert policy.name == "round_robin(prefill=least_load,decode=power_of_two)"
    snap = make_snapshot(
        make_worker("p", "prefill"), make_worker("d", "decode"), make_worker("c", "colocated")
    )
    short = policy.plan(make_request(prompt_tokens=10), snap)
    assert isinstance(short, Colocated) and short.worker.id == "c"
    assert not isinstance(policy.plan(make_request(prompt_tokens=600), snap), Colocated)
    run_conformance(policy, n=200)


def test_seeded_build_is_reproducible() -> None:
    snap = make_snapshot(*(make_worker(f"w{i}") for i in range(8)))
    req = make_request()

    def picks() -> list[Plan]:
        p = build_policy(RandomCfg(seed=42))
        return [p.plan(req, snap) for _ in range(10)]

    assert picks() == picks()


# ---- plugins ---------------------------------------------------------------------------------


class FirstColocated:
    """A tiny plugin policy: the first usable colocated worker; also a RoleSelector."""

    def __init__(self, options: dict[str, object]) -> None:
        self.name = f"first-colocated{options.get('suffix', '')}"
        self.events: list[PolicyEvent] = []

    def plan(self, req: RequestView, snap: ClusterSnapshot, exclude: frozenset[str] = frozenset()) -> Plan:
        from policies.snapshot import Role

        if not any(w.serves(req.model) for w in snap.workers):
            return Reject("unknown model", 404)
        pool = snap.pool(Role.COLOCATED, req.model, exclude)
        return Colocated(pool[0]) if pool else Reject("none", 503)

    def select(self, req: RequestView, cands: Sequence[WorkerState]) -> WorkerState:
        return cands[-1]

    def observe(self, event: PolicyEvent) -> None:
        self.events.append(event)


class PlanOnly:
    name = "plan-only"

    def plan(self, req: RequestView, snap: ClusterSnapshot, exclude: frozenset[str] = frozenset()) -> Plan:
        return Reject("never", 503)

    def observe(self, event: PolicyEvent) -> None:
        pass


class Strict(PlanOnly):
    """A factory that checks its options as the docs advise (msgspec.convert, unknown fields
    forbidden)."""

    class Options(msgspec.Struct, forbid_unknown_fields=True):
        knob: int = 1

    def __init__(self, options: dict[str, object]) -> None:
        self.options = msgspec.convert(options, Strict.Options)


def loader(name: str) -> PolicyFactory:
    table: dict[str, PolicyFactory] = {
        "first": FirstColocated,
        "plan-only": lambda options: PlanOnly(),
        "not-a-policy": lambda options: object(),  # type: ignore[dict-item,return-value]
        "strict": Strict,
    }
    if name not in table:
        raise PluginError(f"unknown policy plugin {name!r}")
    return table[name]


def test_plugin_alone_owns_the_plan() -> None:
    policy = build_policy(PluginCfg(name="first", options={"suffix": "-x"}), loader=loader)
    assert isinstance(policy, FirstColocated) and policy.name == "first-colocated-x"
    run_conformance(policy, n=200, allow_reject=True)


def test_plugin_as_role_selector() -> None:
    policy = build_policy(RoundRobinCfg(), decode=PluginCfg(name="first"), loader=loader)
    snap = make_snapshot(
        make_worker("p", "prefill"), make_worker("d1", "decode"), make_worker("d2", "decode")
    )
    plan = policy.plan(make_request(), snap)
    assert not isinstance(plan, Reject) and plan.decode.id == "d2"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("cfg", "decode", "message"),
    [
        (PluginCfg(name="nope"), None, "unknown policy plugin 'nope'"),
        (PluginCfg(name="not-a-policy"), None, "not a Policy"),
        (RoundRobinCfg(), PluginCfg(name="plan-only"), "cannot be combined"),
        # a factory's own exception (here a typo in an option) was a traceback out of `serve`
        (
            PluginCfg(name="strict", options={"knbo": 2}),
            None,
            r"policy plugin 'strict' refused its options: ValidationError: Object contains unknown field `knbo`",
        ),
    ],
)
def test_plugin_errors(cfg: PolicyCfg, decode: PolicyCfg | None, message: str) -> None:
    with pytest.raises(PolicyBuildError, match=message):
        build_policy(cfg, decode=decode, loader=loader)


def test_entry_point_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    ep = EntryPoint(name="first", value=f"{__name__}:FirstColocated", group=plugins.ENTRY_POINT_GROUP)
    monkeypatch.setattr(plugins, "available_plugins", lambda: {"first": ep})
    policy = build_policy(PluginCfg(name="first"))
    assert isinstance(policy, FirstColocated)
    with pytest.raises(PolicyBuildError, match=r"unknown policy plugin 'zzz'.*first"):
        build_policy(PluginCfg(name="zzz"))


def test_a_round_robin_policy_tells_its_one_picker_each_routed_event_once() -> None:
    """The roles' round-robin profiles share one picker (cursors per role): a `Routed` event is
    one call to it, not one per role, and each role still turns in its own order."""
    from policies.base import Routed, plan_worker_ids, routed_event

    policy = build_policy(RoundRobinCfg())
    assert isinstance(policy, PDPolicy)
    assert len(policy._by_event[Routed]) == 1
    snap = make_snapshot(
        make_worker("p1", "prefill"),
        make_worker("p2", "prefill"),
        make_worker("d1", "decode"),
        make_worker("d2", "decode"),
        make_worker("d3", "decode"),
    )
    req = make_request()
    got = []
    for _ in range(6):
        plan = policy.plan(req, snap)
        assert not isinstance(plan, Reject | Colocated)
        got.append(plan_worker_ids(plan))
        policy.observe(routed_event(req, plan))
    assert [p for p, _ in got] == ["p1", "p2", "p1", "p2", "p1", "p2"]
    assert [d for _, d in got] == ["d1", "d2", "d3", "d1", "d2", "d3"]
