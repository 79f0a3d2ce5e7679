"""`PDPolicy`: the planning order every built-in policy shares (decode first, then the decider).

For the request's model, with `exclude` applied (worker ids and ``"prefill|decode"`` pair ids):

1. No worker serves the model at all (usable or not) -> `Reject(..., 404)`.
2. P/D: the decode candidates are the usable decode workers that have at least one usable
   **compatible** prefill worker (`policies.decider.compatible`: the same engine, block size
   and `pd-group` label) whose pair is not excluded. The decode selector picks one, then:
   - a `PlanDecider` (the cost model) is handed the alternatives (the pairs of that decode and
     of a few others as lightly loaded, the decode prefilling itself where it can, the
     colocated pool) and its `Verdict` is the plan: `Disaggregated(prefill, decode)` or
     `Colocated(worker)`;
   - a plain `Decider` is asked whether to disaggregate (with the `CacheEstimator`'s guess of
     what is already cached on that decode worker): yes -> the prefill selector picks among
     its compatible prefill workers -> `Disaggregated`; no -> a colocated worker if there is
     one, else a decode worker that answers alone (`decode_alone`: vLLM's) prefills itself
     (`Colocated(decode)`), else (an SGLang decode cannot prefill alone) disaggregate anyway.
3. No pair possible (no P/D pool, or every pair excluded): a colocated worker; else a usable
   decode worker that answers alone (`Colocated(decode)`); else `Reject(..., 503)`.

The role selectors (`RoleSelector`: usually a `Profile`) own the choice within a pool; this
class owns only the order. `plan()` changes nothing but a cache that never changes a plan (the
split of the pool by role, kept per `ClusterSnapshot.layout`); `observe()` forwards events to
the selectors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from operator import itemgetter
from types import MappingProxyType
from typing import Any

from policies.base import (
    CacheEstimator,
    Decider,
    MetricSource,
    Needs,
    NoCacheEstimate,
    NoCandidates,
    NonCachedTokensDecider,
    PolicyEvent,
    PolicyMetric,
    Profile,
    RoleSelector,
    needs_of,
    observers_by_event,
    pair_id,
)
from policies.decider import PairChoice, PlanDecider, RerunPlacer, Verdict, compatible
from policies.snapshot import (
    ClusterSnapshot,
    Colocated,
    Disaggregated,
    Layout,
    Plan,
    Reject,
    RequestView,
    Role,
    WorkerState,
)


class PDPolicy:
    """A `Policy` built from three role selectors and a decider (see the module docstring)."""

    def __init__(
        self,
        name: str,
        *,
        decode: RoleSelector,
        prefill: RoleSelector,
        colocated: RoleSelector,
        decider: Decider | PlanDecider | None = None,
        cache: CacheEstimator | None = None,
    ) -> None:
        self.name = name
        self.decode = decode
        self.prefill = prefill
        self.colocated = colocated
        self.decider: Decider | PlanDecider = decider if decider is not None else NonCachedTokensDecider()
        self.cache: CacheEstimator = cache if cache is not None else NoCacheEstimate()
        self._plan_decider = self.decider if isinstance(self.decider, PlanDecider) else None
        # the split of the pool by role for the last layout seen (`ClusterSnapshot.layout`), per
        # model: a cache that never changes a plan (positions into a snapshot of that layout)
        self._layout: Layout | None = None
        self._splits: dict[str, _Split] = {}
        # every stateful part of the distinct selectors, found once: observe() runs twice per
        # request and would otherwise walk selector -> profile -> parts each time; a plan
        # decider first (it books a request's work before the cache-aware index records it)
        observers: list[Callable[[PolicyEvent], None]] = []
        if self._plan_decider is not None:
            observers.append(self._plan_decider.observe)
        seen: list[RoleSelector] = []
        for sel in (decode, prefill, colocated):
            if any(sel is s for s in seen):
                continue
            seen.append(sel)
            for f in sel._observers if isinstance(sel, Profile) else (sel.observe,):
                # a part the roles' profiles share (policies.build's one round-robin picker) is
                # told once (bound methods are equal for the same object and function)
                if f not in observers:
                    observers.append(f)
        self._observers = tuple(observers)
        # what the request path must provide for the selectors and the decider's cache estimate
        # (a prompt key, cached tokens)
        self.needs: Needs = needs_of(decode) | needs_of(prefill) | needs_of(colocated) | needs_of(self.cache)
        self._by_event = observers_by_event(observers)
        # the event types some part observes (`policies.base.wants`: the orchestrator builds no
        # `Completed` per request for a policy none of whose parts observes it, as round robin)
        self.observes: tuple[type, ...] = tuple(k for k, fs in self._by_event.items() if fs)
        # the default decider with the default estimate always disaggregates: not asked
        self._always_pd = (
            isinstance(self.decider, NonCachedTokensDecider)
            and self.decider.min_prefill_tokens <= 0
            and isinstance(self.cache, NoCacheEstimate)
        )

    def __repr__(self) -> str:
        return f"PDPolicy(name={self.name!r})"

    def plan(self, req: RequestView, snap: ClusterSnapshot, exclude: frozenset[str] = frozenset()) -> Plan:
        return self._plan(req, snap, exclude, None)

    def explain(
        self, req: RequestView, snap: ClusterSnapshot, exclude: frozenset[str] = frozenset()
    ) -> tuple[Plan, Verdict | None]:
        """The plan, and the cost-model decider's verdict when it made one (every option it
        weighed, with its predictions). Pure, like `plan`."""
        out: list[Verdict] = []
        plan = self._plan(req, snap, exclude, out)
        return plan, (out[0] if out else None)

    def _plan(
        self,
        req: RequestView,
        snap: ClusterSnapshot,
        exclude: frozenset[str],
        verdicts: list[Verdict] | None,
    ) -> Plan:
        model = req.model
        layout = snap.layout
        if layout is not None and not exclude:
            # the split kept for this layout: the current states taken by position
            if layout is not self._layout:
                self._layout = layout
                self._splits = {}
            split = self._splits.get(model)
            if split is None:
                split = self._splits[model] = _Split(snap.workers, model)
            if not split.known:
                return Reject(f"unknown model {model!r}: no worker serves it", 404)
            ws = snap.workers
            colocated = split.colocated(ws)
            # no P/D pair in this layout (a colocated pool): nothing more to take
            decodes = split.decodes(ws) if split.pairs or split.alone else ()
            partners: _PartnersOf = _Partners(split, ws) if split.pairs else _NO_PARTNERS
            pairable = split.pairable(ws) if split.pairs else ()
        else:
            known, decodes, prefills, colocated = _split(snap.workers, model, exclude)
            if not known:
                return Reject(f"unknown model {model!r}: no worker serves it", 404)
            partners = {d.id: _pair_prefills(d, prefills, exclude) for d in decodes}
            pairable = [d for d in decodes if partners[d.id]]
        while pairable:
            decode = _select(self.decode, req, pairable)
            if decode is None:
                break
            if self._plan_decider is not None:
                planned = self._decide(req, decode, pairable, partners, colocated, verdicts)
                if planned is not None:
                    return planned
            elif not self._always_pd and not self.decider.should_disaggregate(  # type: ignore[union-attr]
                req, decode, self.cache.cached_tokens(req, decode)
            ):
                worker = _select(self.colocated, req, colocated)
                if worker is not None:
                    return Colocated(worker, reason="decider: colocated")
                if decode.decode_alone:
                    return Colocated(decode, reason="decider: decode self-prefill")
            prefill = _select(self.prefill, req, partners[decode.id])
            if prefill is not None:
                return Disaggregated(prefill, decode)
            # the prefill selector's filters refused every prefill for this decode: try another
            pairable = [d for d in pairable if d.id != decode.id]

        worker = _select(self.colocated, req, colocated)
        if worker is not None:
            return Colocated(worker, reason="no P/D pair")
        worker = _select(self.decode, req, [d for d in decodes if d.decode_alone])
        if worker is not None:
            return Colocated(worker, reason="decode self-prefill")
        return Reject(f"no usable worker for model {model!r}", 503)

    def _decide(
        self,
        req: RequestView,
        decode: WorkerState,
        pairable: Sequence[WorkerState],
        partners: Mapping[str, Sequence[WorkerState]],
        colocated: Sequence[WorkerState],
        verdicts: list[Verdict] | None,
    ) -> Plan | None:
        """The plan decider's verdict as a plan (None: it had nothing to say)."""
        decider = self._plan_decider
        assert decider is not None
        settings = getattr(decider, "settings", None)
        joint = getattr(settings, "joint", True)
        decodes = [decode]
        if joint:
            slack = decode.inflight + getattr(settings, "pair_slack", 2)
            room = getattr(settings, "pair_candidates", 4) - 1
            others = sorted(
                (d for d in pairable if d.id != decode.id and d.inflight <= slack),
                key=lambda d: (d.inflight, d.load.waiting),
            )
            decodes += others[: max(0, room)]
        preferred = _select(self.prefill, req, partners[decode.id])
        verdict = decider.decide(
            req,
            PairChoice(
                decode=decode,
                decodes=tuple(decodes),
                partners={d.id: partners[d.id] for d in decodes},
                colocated=tuple(colocated),
                preferred_prefill=preferred,
            ),
            self.cache,
        )
        if verdict is None:
            return None
        if verdicts is not None:
            verdicts.append(verdict)
        o = verdict.choice
        reason = f"cost:{o.kind}:{verdict.reason}"
        by_id = {w.id: w for w in (*decodes, *colocated)}
        if o.kind == "pd":
            d = by_id[o.worker]
            p = next(w for w in partners[d.id] if w.id == o.prefill)
            return Disaggregated(p, d, reason=reason)
        return Colocated(by_id[o.worker], reason=reason)

    def place_rerun(
        self, req: RequestView, candidates: Sequence[WorkerState], cache: CacheEstimator | None = None
    ) -> WorkerState | None:
        """Where a verification re-run goes (`policies.decider.RerunPlacer`): the plan decider's
        choice where it weighs re-runs (the cost model), else no preference."""
        d = self._plan_decider
        if isinstance(d, RerunPlacer):
            return d.place_rerun(req, candidates, self.cache if cache is None else cache)
        return None

    def observe_rerun(self, event: PolicyEvent) -> None:
        """A verification re-run's events, for the plan decider alone: it books the re-run as a
        local prefill on its worker (the selectors' state is about requests, not re-runs)."""
        d = self._plan_decider
        if isinstance(d, RerunPlacer):
            d.observe_rerun(event)

    def observe(self, event: PolicyEvent) -> None:
        """Forward to each distinct selector's stateful parts once (roles may share one)."""
        for observe in self._by_event.get(type(event), self._observers):
            observe(event)

    def metrics(self) -> Iterator[PolicyMetric]:
        """What the decider and the selectors export (`MetricSource`)."""
        seen: list[object] = []
        for part in (self.decider, self.cache, self.decode, self.prefill, self.colocated):
            if any(part is x for x in seen):
                continue
            seen.append(part)
            if isinstance(part, MetricSource):
                yield from part.metrics()


def _split(
    workers: Sequence[WorkerState], model: str, exclude: frozenset[str]
) -> tuple[bool, list[WorkerState], list[WorkerState], list[WorkerState]]:
    """(some worker serves `model`, its usable decode, prefill and colocated workers less the
    excluded), in one pass (`snap.pool` each would walk the workers three times)."""
    decodes: list[WorkerState] = []
    prefills: list[WorkerState] = []
    colocated: list[WorkerState] = []
    known = False
    for w in workers:
        if w.model is not None and w.model != model:
            continue
        known = True
        if not w.healthy or w.draining or w.id in exclude:
            continue
        role = w.role
        if role is Role.DECODE:
            decodes.append(w)
        elif role is Role.PREFILL:
            prefills.append(w)
        else:
            colocated.append(w)
    return known, decodes, prefills, colocated


class _Take:
    """The workers at some positions of a snapshot's tuple: a slice where they are contiguous
    (copied in C; all of them: the tuple itself), else an `itemgetter` of them (a tuple)."""

    __slots__ = ("_get", "_n", "_slice")

    def __init__(self, positions: list[int]) -> None:
        self._slice: slice | None = None
        self._get: Callable[[Sequence[WorkerState]], Any] | None = None
        self._n = len(positions)
        if positions and positions[-1] - positions[0] == len(positions) - 1:
            self._slice = slice(positions[0], positions[-1] + 1)
        elif len(positions) > 1:
            self._get = itemgetter(*positions)
        elif positions:
            self._slice = slice(positions[0], positions[0] + 1)

    def __bool__(self) -> bool:
        return self._n > 0

    def __call__(self, workers: Sequence[WorkerState]) -> Sequence[WorkerState]:
        # a tuple as it comes, not copied again into a list: a copy of a pool of 1,000 touches
        # every worker's state (its reference count) twice, each a cache miss once the caches
        # have other work in them; a slice of the whole tuple is the tuple itself
        if self._slice is not None:
            return workers[self._slice]
        if self._get is not None:
            got: Sequence[WorkerState] = self._get(workers)
            return got
        return ()


def _pair_class(w: WorkerState) -> tuple[object, ...]:
    """What `compatible` reads of a worker (engine, block size, labels): workers alike in these
    pair alike."""
    return (w.engine, w.block_size, w.labels)


class _Split:
    """`_split` of one layout (`ClusterSnapshot.layout`) for one model, without exclusions, as
    positions, with each decode's compatible prefills (`_pair_prefills`) by pairing class: what
    a request's plan reads of the pool in a few copies made in C, not a pass over every
    worker's fields (nor every decode times every prefill)."""

    __slots__ = ("alone", "class_of", "colocated", "decodes", "known", "pairable", "pairs", "partners")

    def __init__(self, workers: Sequence[WorkerState], model: str) -> None:
        at = {id(w): i for i, w in enumerate(workers)}
        known, decodes, prefills, colocated = _split(workers, model, frozenset())
        self.known = known
        self.decodes = _Take([at[id(w)] for w in decodes])
        self.colocated = _Take([at[id(w)] for w in colocated])
        # decode id -> its pairing class; per class, its compatible prefills' positions
        self.class_of: dict[str, int] = {}
        self.partners: list[_Take] = []
        classes: dict[tuple[object, ...], int] = {}
        pairable: list[int] = []
        for d in decodes:
            key = _pair_class(d)
            k = classes.get(key)
            if k is None:
                k = classes[key] = len(self.partners)
                self.partners.append(_Take([at[id(p)] for p in _pair_prefills(d, prefills, frozenset())]))
            self.class_of[d.id] = k
            if self.partners[k]:
                pairable.append(at[id(d)])
        self.pairable = _Take(pairable)
        self.pairs = bool(pairable)  # read per plan: an attribute, not `_Take.__bool__`
        self.alone = any(d.decode_alone for d in decodes)  # a decode that may serve alone


_PartnersOf = Mapping[str, Sequence[WorkerState]]  # decode id -> its compatible prefills
_NO_PARTNERS: _PartnersOf = MappingProxyType({})


class _Partners(Mapping[str, Sequence[WorkerState]]):
    """Decode id -> its compatible prefills' current states, taken when first asked for (a plan
    asks for a few decodes', not every one's)."""

    __slots__ = ("_lists", "_split", "_ws")

    def __init__(self, split: _Split, workers: Sequence[WorkerState]) -> None:
        self._split = split
        self._ws = workers
        self._lists: dict[int, Sequence[WorkerState]] = {}

    def __getitem__(self, decode_id: str) -> Sequence[WorkerState]:
        k = self._split.class_of[decode_id]
        got = self._lists.get(k)
        if got is None:
            got = self._lists[k] = self._split.partners[k](self._ws)
        return got

    def __iter__(self) -> Iterator[str]:
        return iter(self._split.class_of)

    def __len__(self) -> int:
        return len(self._split.class_of)


def _pair_prefills(
    decode: WorkerState, prefills: Sequence[WorkerState], exclude: frozenset[str]
) -> list[WorkerState]:
    """Prefill workers that can pair with `decode`: compatible, pair not excluded."""
    if not exclude:
        return [p for p in prefills if compatible(p, decode)]
    return [p for p in prefills if compatible(p, decode) and pair_id(p.id, decode.id) not in exclude]


def _select(selector: RoleSelector, req: RequestView, cands: Sequence[WorkerState]) -> WorkerState | None:
    if not cands:
        return None
    try:
        return selector.select(req, cands)
    except NoCandidates:
        return None
