"""A kit for policy authors: build snapshots and requests, assert on plans, run a conformance check.

Example (a plugin's own test file)::

    from policies.testing import PlanCase, assert_plans, make_request, make_snapshot, make_worker
    from policies.testing import run_conformance
    from my_pkg.policy import factory

    def test_my_policy_plans() -> None:
        snap = make_snapshot(
            make_worker("p1", "prefill"), make_worker("d1", "decode"), make_worker("c1", "colocated")
        )
        assert_plans(factory({}), [
            PlanCase("pd", make_request(), snap, kind="disaggregated", workers=("p1", "d1")),
            PlanCase("pair excluded", make_request(), snap, exclude=frozenset({"p1|d1"}),
                     kind="colocated", workers=("c1",)),
            PlanCase("unknown model", make_request(model="other"), snap, kind="reject", status=404),
        ])

    def test_my_policy_conforms() -> None:
        run_conformance(factory({}), n=500, seed=1)   # random snapshots, every plan valid

`check_plan` lists every broken invariant of one plan (usable, not excluded, serves the model,
roles and engines of a pair, vLLM-only decode self-prefill, 404 vs 503, no needless reject).
"""

from __future__ import annotations

import json
import random as _random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from common.outcomes import Timings
from policies.base import Completed, Policy, Scorer, pair_id, plan_worker_ids, routed_event
from policies.prompt_key import PromptKey
from policies.snapshot import (
    ClusterSnapshot,
    Colocated,
    Disaggregated,
    Engine,
    Plan,
    Reject,
    RequestView,
    Role,
    RouteKind,
    WorkerLoad,
    WorkerState,
)

PlanKind = Literal["colocated", "disaggregated", "reject"]

# what the built-in adapters declare (adapters/*.py `decode_alone`, `decodes_beside_prefill`):
# policies cannot import them
_DECODE_ALONE = {Engine.SGLANG: False, Engine.VLLM: True, Engine.OPENAI: True}
_BESIDE_PREFILL = {Engine.SGLANG: False, Engine.VLLM: True, Engine.OPENAI: False}


def make_worker(
    id: str,
    role: Role | str = Role.COLOCATED,
    engine: Engine | str = Engine.SGLANG,
    model: str | None = "m",
    *,
    healthy: bool = True,
    draining: bool = False,
    inflight: int = 0,
    inflight_tokens: int = 0,
    waiting: int = 0,
    running: int = 0,
    weight: float = 1.0,
    bootstrap_port: int | None = None,
    context_length: int | None = None,
    max_input_len: int | None = None,
    labels: Iterable[tuple[str, str]] = (),
    decode_alone: bool | None = None,
) -> WorkerState:
    """A worker with sensible defaults; the URL is derived from the id. `decode_alone`: as the
    built-in adapters declare it for the engine (vLLM's and an OpenAI server's decode answer
    alone, SGLang's does not) unless given."""
    engine = Engine(engine)
    return WorkerState(
        id=id,
        url=f"http://{id}.test:8000",
        role=Role(role),
        engine=engine,
        model=model,
        healthy=healthy,
        draining=draining,
        context_length=context_length,
        max_input_len=max_input_len,
        bootstrap_port=bootstrap_port,
        weight=weight,
        labels=tuple(labels),
        decode_alone=_DECODE_ALONE[engine] if decode_alone is None else decode_alone,
        decodes_beside_prefill=_BESIDE_PREFILL[engine],
        inflight=inflight,
        inflight_tokens=inflight_tokens,
        load=WorkerLoad(running=running, waiting=waiting),
    )


class ManualClock:
    """A clock a test moves by hand (`clock.t += 1.5`): pass it where a policy takes `clock`."""

    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make_snapshot(*workers: WorkerState, version: int = 1) -> ClusterSnapshot:
    return ClusterSnapshot(version=version, workers=tuple(workers))


def make_request(
    model: str = "m",
    prompt_tokens: int = 100,
    max_tokens: int = 16,
    *,
    request_id: str = "req-1",
    route: RouteKind = RouteKind.CHAT,
    stream: bool = False,
    prefix_hashes: tuple[int, ...] = (),
    session_key: str | None = None,
) -> RequestView:
    return RequestView(
        request_id=request_id,
        model=model,
        route=route,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        stream=stream,
        prefix_hashes=prefix_hashes,
        session_key=session_key,
    )


def make_token_request(request_id: str, token_ids: list[int], max_tokens: int = 16) -> RequestView:
    """A completions request keyed on its token ids (what a cache-aware policy's index reads)."""
    return RequestView(
        request_id,
        "m",
        RouteKind.COMPLETIONS,
        len(token_ids),
        max_tokens,
        prompt_key=PromptKey.from_token_ids(token_ids),
    )


# ---- invariants --------------------------------------------------------------------------------


def _valid_worker(
    w: WorkerState, req: RequestView, snap: ClusterSnapshot, exclude: frozenset[str]
) -> list[str]:
    errors = []
    current = snap.get(w.id)
    if current is None:
        errors.append(f"worker {w.id!r} is not in the snapshot")
    elif current != w:
        errors.append(f"worker {w.id!r} differs from its snapshot entry")
    if not w.usable:
        errors.append(f"worker {w.id!r} is not usable (healthy={w.healthy}, draining={w.draining})")
    if w.id in exclude:
        errors.append(f"worker {w.id!r} is excluded")
    if not w.serves(req.model):
        errors.append(f"worker {w.id!r} serves {w.model!r}, not {req.model!r}")
    return errors


def possible_routes(req: RequestView, snap: ClusterSnapshot, exclude: frozenset[str] = frozenset()) -> int:
    """How many valid plans exist (pairs + colocated workers + decode workers that answer alone)."""
    prefills = snap.pool(Role.PREFILL, req.model, exclude)
    decodes = snap.pool(Role.DECODE, req.model, exclude)
    pairs = sum(
        1 for d in decodes for p in prefills if p.engine is d.engine and pair_id(p.id, d.id) not in exclude
    )
    alone = sum(1 for d in decodes if d.decode_alone)
    return pairs + alone + len(snap.pool(Role.COLOCATED, req.model, exclude))


def check_plan(
    plan: Plan,
    req: RequestView,
    snap: ClusterSnapshot,
    exclude: frozenset[str] = frozenset(),
    *,
    allow_reject: bool = False,
) -> list[str]:
    """Every invariant `plan` breaks (empty when valid). `allow_reject` permits shedding by choice."""
    errors: list[str] = []
    match plan:
        case Disaggregated(prefill=p, decode=d):
            errors += _valid_worker(p, req, snap, exclude)
            errors += _valid_worker(d, req, snap, exclude)
            if p.role is not Role.PREFILL:
                errors.append(f"prefill worker {p.id!r} has role {p.role}")
            if d.role is not Role.DECODE:
                errors.append(f"decode worker {d.id!r} has role {d.role}")
            if p.engine is not d.engine:
                errors.append(f"pair {p.id!r}/{d.id!r} mixes engines {p.engine} and {d.engine}")
            if pair_id(p.id, d.id) in exclude:
                errors.append(f"pair {pair_id(p.id, d.id)!r} is excluded")
        case Colocated(worker=w):
            errors += _valid_worker(w, req, snap, exclude)
            if w.role is Role.PREFILL:
                errors.append(f"prefill worker {w.id!r} cannot serve a request alone")
            if w.role is Role.DECODE and not w.decode_alone:
                errors.append(f"{w.engine} decode worker {w.id!r} cannot prefill by itself")
        case Reject(status=status):
            known = any(w.serves(req.model) for w in snap.workers)
            if not known and status != 404:
                errors.append(f"unknown model {req.model!r} must be rejected with 404, got {status}")
            if known and status == 404:
                errors.append(f"model {req.model!r} is served; 404 is wrong")
            if known and not allow_reject and possible_routes(req, snap, exclude):
                errors.append(f"rejected ({plan.reason}) although a valid route exists")
        case _:
            errors.append(f"not a plan: {plan!r}")
    return errors


def assert_valid_plan(
    plan: Plan,
    req: RequestView,
    snap: ClusterSnapshot,
    exclude: frozenset[str] = frozenset(),
    *,
    allow_reject: bool = False,
) -> None:
    errors = check_plan(plan, req, snap, exclude, allow_reject=allow_reject)
    if errors:
        raise AssertionError(f"invalid plan {plan!r}:\n  " + "\n  ".join(errors))


@dataclass(frozen=True)
class PlanCase:
    """One row of a plan table. `workers`: expected ids, prefill first; `status`: for rejects."""

    name: str
    req: RequestView
    snap: ClusterSnapshot
    exclude: frozenset[str] = frozenset()
    kind: PlanKind | None = None
    workers: tuple[str, ...] | None = None
    status: int | None = None


def plan_kind(plan: Plan) -> PlanKind:
    match plan:
        case Disaggregated():
            return "disaggregated"
        case Colocated():
            return "colocated"
        case Reject():
            return "reject"


def assert_plans(policy: Policy, cases: Sequence[PlanCase], *, observe: bool = True) -> None:
    """Plan every case (in order), check validity and the expectations; report all failures.

    With `observe`, each accepted plan is reported back as `Routed` (as the gateway does), so
    stateful policies advance between rows.
    """
    failures: list[str] = []
    for case in cases:
        plan = policy.plan(case.req, case.snap, case.exclude)
        errors = check_plan(plan, case.req, case.snap, case.exclude, allow_reject=True)
        if case.kind is not None and plan_kind(plan) != case.kind:
            errors.append(f"expected {case.kind}, got {plan_kind(plan)}")
        if case.workers is not None and plan_worker_ids(plan) != case.workers:
            errors.append(f"expected workers {case.workers}, got {plan_worker_ids(plan)}")
        if case.status is not None and (not isinstance(plan, Reject) or plan.status != case.status):
            errors.append(f"expected reject {case.status}, got {plan!r}")
        if errors:
            failures.append(f"[{case.name}] {plan!r}: " + "; ".join(errors))
        if observe and not isinstance(plan, Reject):
            policy.observe(routed_event(case.req, plan))
    if failures:
        raise AssertionError(f"{policy.name}: {len(failures)} case(s) failed:\n" + "\n".join(failures))


# ---- conformance -------------------------------------------------------------------------------


def random_snapshot(rng: _random.Random, models: Sequence[str] = ("m", "n")) -> ClusterSnapshot:
    """A small random cluster: mixed roles, engines, models, health and load."""
    workers = []
    for i in range(rng.randint(0, 8)):
        role = rng.choice(list(Role))
        engine = (
            Engine.OPENAI
            if role is Role.COLOCATED and rng.random() < 0.2
            else rng.choice([Engine.SGLANG, Engine.VLLM])
        )
        workers.append(
            make_worker(
                f"w{i}",
                role,
                engine,
                rng.choice([*models, None]),
                healthy=rng.random() < 0.8,
                draining=rng.random() < 0.1,
                inflight=rng.randint(0, 5),
                inflight_tokens=rng.randint(0, 5000),
                waiting=rng.randint(0, 5),
                running=rng.randint(0, 5),
                weight=rng.choice([0.5, 1.0, 2.0]),
            )
        )
    return make_snapshot(*workers, version=rng.randint(1, 1000))


def random_exclude(rng: _random.Random, snap: ClusterSnapshot) -> frozenset[str]:
    ids = [w.id for w in snap.workers]
    pairs = [pair_id(p, d) for p in ids for d in ids if p != d]
    picked = [i for i in ids if rng.random() < 0.15] + [p for p in pairs if rng.random() < 0.2]
    return frozenset(picked)


def run_conformance(
    policy: Policy, *, n: int = 300, seed: int = 0, allow_reject: bool = False, observe: bool = True
) -> None:
    """Plan `n` random (request, snapshot, exclude) cases; every plan must be valid.

    Built-ins pass with `allow_reject=False` (never reject while a route exists); a plugin that
    sheds load on purpose passes `allow_reject=True`.
    """
    rng = _random.Random(seed)
    for i in range(n):
        snap = random_snapshot(rng)
        exclude = random_exclude(rng, snap) if rng.random() < 0.5 else frozenset()
        req = make_request(
            rng.choice(["m", "n", "unknown"]),
            prompt_tokens=rng.randint(1, 4000),
            request_id=f"conf-{i}",
        )
        plan = policy.plan(req, snap, exclude)
        errors = check_plan(plan, req, snap, exclude, allow_reject=allow_reject)
        if errors:
            raise AssertionError(
                f"{policy.name}: case {i} (seed {seed}) invalid plan {plan!r}\n"
                f"  request: {req!r}\n  exclude: {sorted(exclude)}\n  snapshot: {snap!r}\n  "
                + "\n  ".join(errors)
            )
        if observe and not isinstance(plan, Reject):
            policy.observe(routed_event(req, plan))


# ---- scorers, verdicts, offline replay ----------------------------------------------------------


def scores(scorer: Scorer, req: RequestView, *workers: WorkerState) -> dict[str, float]:
    """`scorer`'s scores of `workers` (id -> score; a missing id scores 0), each checked to be a
    number in [0, 1] as the `Scorer` protocol asks."""
    got = scorer.score(req, workers)
    out = {w.id: float(got.get(w.id, 0.0)) for w in workers}
    bad = {k: v for k, v in out.items() if not 0.0 <= v <= 1.0}
    if bad:
        raise AssertionError(f"{scorer.name}: scores outside [0, 1]: {bad}")
    return out


def assert_ranking(
    scorer: Scorer, req: RequestView, workers: Sequence[WorkerState], best_first: Sequence[str]
) -> None:
    """`scorer` ranks `workers` in the order `best_first` (strictly: no ties among them)."""
    got = scores(scorer, req, *workers)
    order = sorted(got, key=lambda k: -got[k])
    ranked = [k for k in order if k in best_first]
    if ranked != list(best_first) or len({got[k] for k in best_first}) != len(best_first):
        raise AssertionError(f"{scorer.name}: expected {list(best_first)} best first, got scores {got}")


def assert_verdict(
    policy: Policy, req: RequestView, snap: ClusterSnapshot, *, kind: str, reason: str | None = None
) -> object:
    """The cost-model decider's verdict (a P/D policy with `[decider] type = "cost_model"`):
    its chosen option's `kind` ("pd", "local", "colocated") and, when given, the rule that chose it
    (`reason`: "roomy", "feasible", "best_effort", "only"). Returns the `Verdict` (every option
    weighed, with its predictions) for further checks."""
    explain = getattr(policy, "explain", None)
    if explain is None:
        raise AssertionError(f"{policy.name}: no explain(): not a P/D policy")
    plan, verdict = explain(req, snap)
    if verdict is None:
        raise AssertionError(f"{policy.name}: no verdict (not a cost-model decider?), plan {plan!r}")
    if verdict.kind != kind or (reason is not None and verdict.reason != reason):
        rows = [(o.kind, o.worker, o.prefill, round(o.ttft_s, 4), round(o.cost, 4)) for o in verdict.options]
        raise AssertionError(f"expected {kind}/{reason or '*'}, got {verdict.kind}/{verdict.reason}: {rows}")
    return verdict


@dataclass(frozen=True)
class ReplayRow:
    """One request of an offline replay: its sizes, its session, and how long it ran (seconds,
    reported to the policy as its outcome)."""

    prompt_tokens: int
    max_tokens: int = 16
    session_key: str | None = None
    seconds: float = 0.1


@dataclass
class ReplaySummary:
    plans: Counter[str] = field(default_factory=Counter)  # plan kind -> requests
    workers: Counter[str] = field(default_factory=Counter)  # worker id -> requests it served a part of
    reasons: Counter[str] = field(default_factory=Counter)  # plan reason -> requests


def trace_rows(path: str | Path, limit: int = 100) -> list[ReplayRow]:
    """The first `limit` rows of a Mooncake-style JSONL trace (`input_length`, `output_length`,
    optional `session_id`)."""
    rows: list[ReplayRow] = []
    with open(path) as f:
        for line in f:
            if len(rows) >= limit:
                break
            if not line.strip():
                continue
            r = json.loads(line)
            sid = r.get("session_id")
            rows.append(
                ReplayRow(
                    int(r["input_length"]), int(r.get("output_length", 16)), None if sid is None else str(sid)
                )
            )
    return rows


def replay(
    policy: Policy, snap: ClusterSnapshot, rows: Iterable[ReplayRow], *, model: str = "m"
) -> ReplaySummary:
    """Route a small trace through `policy` offline, as the gateway would: each row is planned
    against `snap`, told to the policy as `Routed`, then as `Completed` after its `seconds`.
    No engine runs: what it shows is where each request goes (plan kinds, workers, reasons)."""
    out = ReplaySummary()
    for i, row in enumerate(rows):
        req = make_request(
            model, row.prompt_tokens, row.max_tokens, request_id=f"replay-{i}", session_key=row.session_key
        )
        plan = policy.plan(req, snap)
        assert_valid_plan(plan, req, snap, allow_reject=True)
        out.plans[plan_kind(plan)] += 1
        out.reasons[plan.reason] += 1
        if isinstance(plan, Reject):
            continue
        ids = plan_worker_ids(plan)
        out.workers.update(ids)
        policy.observe(routed_event(req, plan))
        policy.observe(
            Completed(req.request_id, ids, output_tokens=row.max_tokens, timings=Timings(end_s=row.seconds))
        )
    return out
