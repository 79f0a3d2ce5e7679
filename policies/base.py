"""The policy contract: a whole-plan `Policy`, the events it observes, and the llm-d style roles.

A `Policy` turns `(RequestView, ClusterSnapshot)` into a `Plan` (`Colocated`, `Disaggregated` or
`Reject`). `plan()` only reads; every state change (round-robin cursors, caches) happens in
`observe(event)`, which the orchestrator calls with `Routed`, `Completed` and `Failed` events.

Inside a policy the choice of one worker from a pool is split into the roles of llm-d's
scheduler: `Filter`s narrow the candidates, weighted `Scorer`s score them in [0, 1], a `Picker`
chooses. `Profile` bundles them and `run_profile()` runs them; the P/D policy in
`policies.pd` uses one profile per role (decode, prefill, colocated) and a `Decider` for the
"is prefill elsewhere worth it" question.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import msgspec

from common.outcomes import LegRecord, Timings
from policies.snapshot import (
    ClusterSnapshot,
    Colocated,
    Disaggregated,
    Plan,
    Reject,
    RequestView,
    Role,
    WorkerState,
)

if TYPE_CHECKING:
    from policies.prompt_key import PromptKey


def pair_id(prefill_id: str, decode_id: str) -> str:
    """The id of a (prefill, decode) pair as it appears in `exclude` sets: ``"prefill_id|decode_id"``."""
    return f"{prefill_id}|{decode_id}"


# ---- events --------------------------------------------------------------------------------


class Routed(msgspec.Struct, frozen=True, tag="routed"):
    """A plan was accepted and is about to run. `worker_ids[i]` had role `roles[i]`.

    Disaggregated plans list (prefill, decode); colocated plans list the one worker.
    """

    request_id: str
    model: str
    worker_ids: tuple[str, ...]
    roles: tuple[Role, ...]
    prompt_tokens: int = 0
    max_tokens: int = 0
    prompt_key: PromptKey | None = None  # the request's `RequestView.prompt_key`
    workers: tuple[WorkerState, ...] = ()  # the plan's worker states, in `worker_ids` order
    reason: str = ""  # the plan's reason (`Colocated.reason`, `Disaggregated.reason`)
    stream: bool = False

    @property
    def disaggregated(self) -> bool:
        return len(self.worker_ids) == 2


class Completed(msgspec.Struct, frozen=True, tag="completed"):
    """The request finished successfully on these workers. `legs`: each engine leg's outcome in
    the attempt that served it (`common.outcomes.LegRecord`).

    `cached_tokens`: the prompt tokens the engine that prefilled it found in its prefix cache,
    as it reported them (SGLang `meta_info.cached_tokens`, OpenAI
    `usage.prompt_tokens_details.cached_tokens`); None where it reported nothing. The
    cache-aware policy compares it with its prediction (accuracy, capacity correction).

    `ttft_s`: from the request's arrival to its first token: a stream's first content from
    the engine (not its response head, which goes out before any work is done), a whole
    answer's first byte (its last).

    `timings`: when the serving attempt's phases ended (`common.outcomes.Timings`: the prefill's
    answer, the first token, the last byte), what the P/D decider learns its cost model from."""

    request_id: str
    worker_ids: tuple[str, ...]
    ttft_s: float | None = None
    output_tokens: int = 0
    cached_tokens: int | None = None
    legs: tuple[LegRecord, ...] = ()
    timings: Timings | None = None


class Failed(msgspec.Struct, frozen=True, tag="failed"):
    """An attempt failed. `phase` is where: "connect", "prefill", "handoff", "decode", "guard";
    "cancelled" when the client left or a deadline cut the request, "refused" when the gateway
    refused it after planning: every `Routed` is followed by one `Completed` or `Failed`.
    `legs`: each engine leg's outcome in that attempt, so far (`common.outcomes.LegRecord`)."""

    request_id: str
    worker_ids: tuple[str, ...]
    phase: str
    legs: tuple[LegRecord, ...] = ()


class WorkerGone(msgspec.Struct, frozen=True, tag="worker_gone"):
    """A worker left the cluster, or came back with an empty cache (an engine restart): state
    kept about it (cache indexes, queues) is stale."""

    worker_id: str
    reason: str = "removed"  # "removed" | "restarted"


PolicyEvent = Routed | Completed | Failed | WorkerGone


class PolicyMetric(msgspec.Struct, frozen=True):
    """One value a policy exports (what it learned, what it decided), which the gateway serves
    on /metrics: `name` a Prometheus metric name, `labels` its (label, value) pairs, `kind`
    "gauge" or "counter" (a running total)."""

    name: str
    doc: str
    labels: tuple[tuple[str, str], ...]
    value: float
    kind: str = "gauge"


@runtime_checkable
class MetricSource(Protocol):
    """A policy (or a part of one) with values to export: called at each scrape, outside the
    request path."""

    def metrics(self) -> Iterable[PolicyMetric]: ...


EVENT_TYPES: tuple[type, ...] = (Routed, Completed, Failed, WorkerGone)


def observers_by_event(
    observers: Sequence[Callable[[PolicyEvent], None]],
) -> dict[type, tuple[Callable[[PolicyEvent], None], ...]]:
    """For each event type, the observers that want it (see `Observer.observes`)."""
    out: dict[type, tuple[Callable[[PolicyEvent], None], ...]] = {}
    for kind in EVENT_TYPES:
        out[kind] = tuple(
            f
            for f in observers
            if kind in (getattr(getattr(f, "__self__", None), "observes", None) or (kind,))
        )
    return out


def wants(policy: object, kind: type) -> bool:
    """Whether `policy.observe` does anything with events of `kind`: False only where the policy
    names the event types it observes (an `observes` tuple, as `Observer` parts and
    `policies.pd.PDPolicy` do) and `kind` is not one of them. The orchestrator builds a
    `Completed` event per served request only for a policy that wants it."""
    kinds = getattr(policy, "observes", None)
    if not isinstance(kinds, tuple | frozenset | set | list):  # not a list of event types
        return True
    return kind in kinds


def plan_worker_ids(plan: Plan) -> tuple[str, ...]:
    """The worker ids a plan uses, prefill first; () for a `Reject`."""
    match plan:
        case Disaggregated():
            return (plan.prefill.id, plan.decode.id)
        case Colocated():
            return (plan.worker.id,)
        case Reject():
            return ()


def routed_event(req: RequestView, plan: Colocated | Disaggregated) -> Routed:
    """The `Routed` event the orchestrator sends for an accepted plan."""
    ids: tuple[str, ...]
    roles: tuple[Role, ...]
    if isinstance(plan, Disaggregated):
        p, d = plan.prefill, plan.decode
        ids, roles = (p.id, d.id), (p.role, d.role)
    else:
        ids, roles = (plan.worker.id,), (plan.worker.role,)
    return Routed(
        request_id=req.request_id,
        model=req.model,
        worker_ids=ids,
        roles=roles,
        prompt_tokens=req.prompt_tokens,
        max_tokens=req.max_tokens,
        prompt_key=req.prompt_key,
        workers=(plan.prefill, plan.decode) if isinstance(plan, Disaggregated) else (plan.worker,),
        reason=plan.reason,
        stream=req.stream,
    )


# ---- the whole-plan contract -----------------------------------------------------------------


@runtime_checkable
class Policy(Protocol):
    """Chooses a whole plan for one request.

    Invariants every implementation keeps (`policies.testing.check_plan` checks them):
    - `plan()` is a pure read of `snap`: no I/O, no mutation of the policy (drawing from an
      injected RNG is allowed, and so is a cache whose use never makes a plan invalid, as
      cache_aware's `PositionMemo`);
    - a returned worker is usable (`healthy and not draining`), serves `req.model`, and its id
      is not in `exclude`; a disaggregated pair has a PREFILL and a DECODE worker of the same
      engine and its pair id (`pair_id(p, d)`) is not in `exclude`;
    - `Reject(..., 404)` for a model no worker serves, `Reject(..., 503)` when none is usable.

    A policy may set `observes`, a tuple of the event types its `observe` uses (as `Observer`
    parts do): the gateway then does not build the others for it (`wants`). Without it, every
    event is sent.
    """

    name: str

    def plan(self, req: RequestView, snap: ClusterSnapshot, exclude: frozenset[str] = frozenset()) -> Plan:
        """Return a plan. `exclude` holds worker ids and pair ids that already failed for this request."""
        ...

    def observe(self, event: PolicyEvent) -> None:
        """Update internal state. The only place a policy mutates itself."""
        ...


@runtime_checkable
class RerunHost(Protocol):
    """A policy that places and books the gateway's verification re-runs (docs/guards.md,
    "Verified before delivery"); `policies.pd.PDPolicy` is one, through its plan decider."""

    def place_rerun(self, req: RequestView, candidates: Sequence[WorkerState]) -> WorkerState | None:
        """Which of `candidates` (more than one) runs the re-run of `req`; None: no preference."""
        ...

    def observe_rerun(self, event: PolicyEvent) -> None:
        """The re-run's `Routed`, then exactly one `Completed` or `Failed`."""
        ...


# ---- llm-d roles -----------------------------------------------------------------------------


class NoCandidates(Exception):
    """A profile ran out of candidates (`stage` names the filter, or "input")."""

    def __init__(self, stage: str) -> None:
        super().__init__(f"no candidates left after {stage}")
        self.stage = stage


class Filter(Protocol):
    name: str

    def filter(self, req: RequestView, cands: Sequence[WorkerState]) -> Sequence[WorkerState]:
        """Return a subset of `cands` (order kept). Pure."""
        ...


class Scorer(Protocol):
    name: str

    def score(self, req: RequestView, cands: Sequence[WorkerState]) -> Mapping[str, float]:
        """Scores keyed by `WorkerState.id`, in [0, 1] (higher is better). Pure; missing ids score 0."""
        ...


class Picker(Protocol):
    name: str

    def pick(self, req: RequestView, scored: Sequence[tuple[WorkerState, float]]) -> WorkerState:
        """Choose one of the (non-empty) scored candidates. Pure apart from an injected RNG."""
        ...


@runtime_checkable
class Observer(Protocol):
    """Implemented by filters, scorers and pickers that keep state (e.g. a round-robin cursor).

    A part may also set a class attribute `observes`, a tuple of the event types it wants
    (e.g. `(Routed,)`); it is then not called for the others (two calls saved per request for
    a part that only follows routing). Without it, every event is delivered."""

    def observe(self, event: PolicyEvent) -> None: ...


@dataclass(frozen=True, slots=True)
class Decision:
    """What `run_profile` chose and why (per-scorer scores, for logs and metrics)."""

    worker: WorkerState
    totals: Mapping[str, float]
    scores: Mapping[str, Mapping[str, float]]


@dataclass(frozen=True, slots=True)
class Profile:
    """Filters, then weighted scorers, then a picker: how one worker is chosen from one pool.

    A runtime composite holding behaviour, so a dataclass rather than a wire Struct.
    """

    name: str
    picker: Picker
    filters: tuple[Filter, ...] = ()
    scorers: tuple[tuple[Scorer, float], ...] = ()  # (scorer, weight)
    # The bound `observe` of every stateful part, found once here: `observe()` runs twice per
    # request, and a runtime-checkable Protocol `isinstance` per part costs microseconds.
    _observers: tuple[Callable[[PolicyEvent], None], ...] = field(
        init=False, repr=False, compare=False, default=()
    )

    def __post_init__(self) -> None:
        parts = (*self.filters, *(s for s, _ in self.scorers), self.picker)
        observers = tuple(part.observe for part in parts if isinstance(part, Observer))
        object.__setattr__(self, "_observers", observers)

    def select(self, req: RequestView, cands: Sequence[WorkerState]) -> WorkerState:
        """`run_profile(self, ...).worker`; raises `NoCandidates`."""
        if not self.filters and not self.scorers:
            # a bare picker (round robin, random): no totals to add up, and nothing to choose
            # between one candidate
            if len(cands) == 1:
                return cands[0]
            if not cands:
                raise NoCandidates("input")
            return self.picker.pick(req, [(w, 0.0) for w in cands])
        return run_profile(self, req, cands).worker

    def observe(self, event: PolicyEvent) -> None:
        """Forward an event to every part that keeps state."""
        for observe in self._observers:
            observe(event)


def run_profile(p: Profile, req: RequestView, cands: Sequence[WorkerState]) -> Decision:
    """Run `p` over `cands`: filters (stop when empty), weighted scorers clamped to [0, 1], picker."""
    if not cands:
        raise NoCandidates("input")
    for f in p.filters:
        cands = f.filter(req, cands)
        if not cands:
            raise NoCandidates(f.name)
    totals = {w.id: 0.0 for w in cands}
    per_scorer: dict[str, Mapping[str, float]] = {}
    for s, weight in p.scorers:
        got = s.score(req, cands)
        per_scorer[s.name] = got
        for wid in totals:
            totals[wid] += min(max(got.get(wid, 0.0), 0.0), 1.0) * weight
    chosen = p.picker.pick(req, [(w, totals[w.id]) for w in cands])
    return Decision(worker=chosen, totals=totals, scores=per_scorer)


@runtime_checkable
class RoleSelector(Protocol):
    """Chooses one worker of a pool. `Profile` implements it; a plugin policy may too, which
    lets it serve as `prefill_policy` / `decode_policy` alongside another policy."""

    @property
    def name(self) -> str: ...

    def select(self, req: RequestView, cands: Sequence[WorkerState]) -> WorkerState:
        """Choose from non-empty `cands`; raise `NoCandidates` if none fits. Pure."""
        ...

    def observe(self, event: PolicyEvent) -> None: ...


class Decider(Protocol):
    """Should this request be disaggregated, given the decode worker already chosen?"""

    def should_disaggregate(self, req: RequestView, decode: WorkerState, cached_tokens: int) -> bool:
        """`cached_tokens`: estimated prompt tokens already cached on `decode`. Pure."""
        ...


@dataclass(frozen=True, slots=True)
class Needs:
    """What a policy reads beyond what every request carries, so that the request path pays for
    it only where a policy uses it: `prompt_key` (`RequestView.prompt_key`: the prompt keyed for
    prefix matching) and `cached_tokens` (`Completed.cached_tokens`: an engine's answer read for
    the cached tokens it reports). A policy, or a role selector of one, says it with a `needs`
    attribute; `needs_of` reads it (nothing, where it has none)."""

    prompt_key: bool = False
    cached_tokens: bool = False

    def __or__(self, other: Needs) -> Needs:
        return Needs(self.prompt_key or other.prompt_key, self.cached_tokens or other.cached_tokens)


NO_NEEDS = Needs()


def needs_of(part: object) -> Needs:
    """A policy's or selector's `needs` (`Needs()` where it declares none)."""
    got = getattr(part, "needs", None)
    return got if isinstance(got, Needs) else NO_NEEDS


class CacheEstimator(Protocol):
    """Estimates how many prompt tokens a worker already holds in its prefix cache."""

    def cached_tokens(self, req: RequestView, worker: WorkerState) -> int: ...


@dataclass(frozen=True, slots=True)
class NoCacheEstimate:
    """The default estimator: nothing is assumed cached."""

    def cached_tokens(self, req: RequestView, worker: WorkerState) -> int:
        return 0


@dataclass(frozen=True, slots=True)
class NonCachedTokensDecider:
    """Disaggregate when the uncached part of the prompt is at least `min_prefill_tokens`.

    llm-d's prefix-based P/D decider: `prompt_tokens - cached_tokens >= min_prefill_tokens`.
    `min_prefill_tokens = 0` (the default) always disaggregates.
    """

    min_prefill_tokens: int = 0

    def should_disaggregate(self, req: RequestView, decode: WorkerState, cached_tokens: int) -> bool:
        return req.prompt_tokens - cached_tokens >= self.min_prefill_tokens


__all__ = [
    "NO_NEEDS",
    "CacheEstimator",
    "Completed",
    "Decider",
    "Decision",
    "Failed",
    "Filter",
    "MetricSource",
    "Needs",
    "NoCacheEstimate",
    "NoCandidates",
    "NonCachedTokensDecider",
    "Observer",
    "Picker",
    "Policy",
    "PolicyEvent",
    "PolicyMetric",
    "Profile",
    "RoleSelector",
    "Routed",
    "Scorer",
    "WorkerGone",
    "needs_of",
    "observers_by_event",
    "pair_id",
    "plan_worker_ids",
    "routed_event",
    "run_profile",
]
