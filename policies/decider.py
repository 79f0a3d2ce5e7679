"""Deciders: is prefill elsewhere worth it for this request, given its decode worker?

Four built-ins (`[decider] type`, policies/config.py `DeciderCfg`):

- `always`: disaggregate whenever a P/D pair serves the model;
- `never`: serve it where it decodes (a colocated worker, or a decode worker that prefills
  itself: `WorkerState.decode_alone`), disaggregating only where neither exists;
- `threshold`: llm-d's prefix-based P/D decider, on the tokens *not* cached on the chosen decode
  worker: `prompt - cached >= min_prefill_tokens` (`policies.base.NonCachedTokensDecider`);
- `cost_model` (`CostModelDecider`): predicts each alternative's time to first token and the
  slowdown it puts on the decodes running where it prefills, and chooses under TTFT and TPOT
  SLOs (below). It also chooses the P/D pair itself, jointly (pair scoring).

What each worker offers is read from `WorkerState`, never from its engine's name: a decode
worker with `decode_alone` (vLLM's NIXL `kv_both` servers) can prefill a request itself; one
without (an SGLang `--disaggregation-mode decode` server) cannot, so there the alternative to
P/D is a colocated worker.

## The cost model's verdict

After the decode worker is chosen (`d0`, the decode policy's pick), for a request of `P` prompt
tokens with `cached(w)` of them predicted on worker `w` (the cache-aware index where the policy
keeps one, else none), in seconds (policies/cost_model.py has the terms and how each is learned):

    work(w)        = prefill_work(P - cached(w), cached(w))            token-equivalents
    prefill(w)     = a(w) + b(w) * work(w)                              learned per worker
    P/D via (p, d) : ttft = queue(p) + prefill(p) + handoff(p, d, P - cached(d))
                     cost = ttft + pair_failure(p, d) * ttft_slo
                     tpot = base(d) + min(queue(d) - ttft, tokens * chunk(d)) / tokens
                            (the local prefills queued on d that still run once its KV is there)
    local on d     : ttft = queue(d) + prefill(d)           (d has decode_alone)
                     each decode i routed to d whose window this prefill overlaps:
                     tpot_i = base(d) + (stalls_i + added_i) / tokens_i
                     itl = base(d) + b(d) * min(work(d), chunk_tokens)   (the steps while it prefills)
    colocated c    : the same as local, on c
                     cost = ttft * (1 + local_penalty)

where `queue(w)` is the prefill seconds queued on w, `stalls_i` the local prefill seconds
predicted to run inside decode i's window so far, `added_i` the part of this prefill that would
(it runs over [now + queue(d), now + queue(d) + prefill(d)); decode i's window opens at its
predicted first token, and a chunked prefill holds it at most `chunk(d)`, one step, per token it
has left), and `tokens_i` its expected output tokens. A P/D request still waiting for its KV
(queued on the prefill pool) is not slowed by a local prefill that ends before it arrives.
SLOs per request:

    ttft_slo = ttft_slo_s + ttft_slo_x * unloaded      (unloaded: the best option without queues)
    tpot_slo = tpot_slo_s + tpot_slo_x * base_floor(w)  (base_floor: w's best recent time per token)

A local or colocated option is **allowed** only while the decodes it overlaps there stay within
the TPOT SLO (no more than `tpot_risk` of those running predicted over); a P/D option only while
its own predicted tpot does (else the P/D options are weighed all the same when none is). Then:

1. the best P/D pair's ttft <= `roomy` * ttft_slo: **P/D** (the prefill pool has room; the
   decodes are left alone) — reason `roomy` (off by default: `roomy = 0`);
2. else among the best pair and the allowed options, those within the TTFT SLO: the lowest
   cost — `feasible`;
3. else (none meets it) the lowest cost all the same — `best_effort`;
4. no P/D pair, and every local or colocated option over the TPOT gate: the one that puts the
   fewest running decodes over the TPOT SLO — `only`.

So on an idle cluster a short prompt is served where it decodes (the handoff's fixed cost is
more than `local_penalty` of its tiny prefill) and a long one is disaggregated (its prefill
would stall the decodes there for longer than its KV takes to move); when the prefill pool's
queue grows, local prefills take the requests whose TTFT it would break, while the decodes
running there stay within their TPOT SLO.

**Joint pair scoring.** The pairs considered are every compatible prefill of `d0` and of up to
`pair_candidates - 1` other decodes with at most `pair_slack` more requests in flight than `d0`
(a pair is compatible when the engines match, the block sizes match where both are known, and
the `pd-group` labels match where both have one; pairs in `exclude`, open pair breakers included,
are out). Each pair's handoff is learned on its own and its recent failures are priced in, so a
slow or flaky link loses to a healthy one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import msgspec

from policies.base import CacheEstimator, PolicyEvent, PolicyMetric
from policies.cost_model import CostModel, CostPriors, prefill_work
from policies.snapshot import RequestView, WorkerState

PAIR_GROUP_LABEL = "pd-group"


@dataclass(frozen=True, slots=True)
class AlwaysDecider:
    """Disaggregate whenever a P/D pair serves the model."""

    def should_disaggregate(self, req: RequestView, decode: WorkerState, cached_tokens: int) -> bool:
        return True


@dataclass(frozen=True, slots=True)
class NeverDecider:
    """Serve where it decodes: a colocated worker, or a decode that prefills itself."""

    def should_disaggregate(self, req: RequestView, decode: WorkerState, cached_tokens: int) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class CostSettings:
    """The cost-model decider's knobs (`policies.config.DeciderCfg` documents each)."""

    ttft_slo_s: float = 2.0
    ttft_slo_x: float = 0.0
    tpot_slo_s: float = 0.1
    tpot_slo_x: float = 0.0
    roomy: float = 0.0
    local_penalty: float = 0.2
    tpot_risk: float = 0.0
    joint: bool = True
    pair_candidates: int = 4
    pair_slack: int = 2
    max_candidates: int = 16
    priors: CostPriors = field(default_factory=CostPriors)


class Option(msgspec.Struct, frozen=True, gc=False):
    """One alternative as the decider predicted it (a row of a `Verdict`)."""

    kind: str  # "pd", "local" (a decode prefilling itself), "colocated"
    worker: str  # where it decodes
    prefill: str | None  # P/D: the prefill worker
    ttft_s: float  # predicted time to first token
    queue_s: float  # of which waiting for the prefills queued ahead
    prefill_s: float  # of which its own prefill
    transfer_s: float  # of which the handoff (P/D)
    cached_tokens: int  # predicted cached where it prefills
    itl_s: float  # local/colocated: the time per step of the decodes running there while it prefills
    # local/colocated: the worst predicted time per token of a decode it slows there; P/D: its own
    tpot_s: float
    # local/colocated: decodes it slows predicted over the TPOT SLO; P/D: 1 when its own would be
    tpot_over: int
    running: int  # local/colocated: decodes running there
    allowed: bool  # within the TPOT gate
    cost: float


class Verdict(msgspec.Struct, frozen=True, gc=False):
    """What the decider chose and why: every option it weighed, the SLOs it weighed them by."""

    choice: Option
    options: tuple[Option, ...]
    ttft_slo_s: float
    reason: str  # "roomy", "feasible", "best_effort", "only"

    @property
    def kind(self) -> str:
        return self.choice.kind


class PairChoice(msgspec.Struct, frozen=True, gc=False):
    """The P/D policy's input to a `PlanDecider`: the decode its policy chose, the other decodes
    a pair may use, each decode's pairable prefills, the colocated pool."""

    decode: WorkerState
    decodes: tuple[WorkerState, ...]  # d0 first
    partners: Mapping[str, Sequence[WorkerState]]  # decode id -> its compatible prefills
    colocated: tuple[WorkerState, ...]
    preferred_prefill: WorkerState | None = None  # the prefill policy's pick for d0 (wins ties)


@runtime_checkable
class RerunPlacer(Protocol):
    """A policy that places the verification re-runs (docs/guards.md, "Verified before
    delivery") and books them: a re-run is a whole prefill of the prompt plus a few tokens on
    the worker it lands on, which stalls the decodes running there like a local prefill."""

    def place_rerun(
        self, req: RequestView, candidates: Sequence[WorkerState], cache: CacheEstimator
    ) -> WorkerState | None:
        """Which of `candidates` (never empty) runs the re-run of `req`; None: no preference. Pure."""
        ...

    def observe_rerun(self, event: PolicyEvent) -> None:
        """A re-run's `Routed` (reason `RERUN_REASON`, request id `<request>-verify`), then its
        `Completed` or `Failed`: exactly one, whatever way it ends."""
        ...


@runtime_checkable
class PlanDecider(Protocol):
    """A decider that weighs whole alternatives (the P/D pair included) and says which."""

    def decide(self, req: RequestView, choice: PairChoice, cache: CacheEstimator) -> Verdict | None:
        """None: nothing to choose from. Pure."""
        ...

    def observe(self, event: PolicyEvent) -> None: ...


def compatible(p: WorkerState, d: WorkerState) -> bool:
    """Can prefill `p` hand its KV to decode `d`? The same engine (the protocol), the same KV block
    size where both report one, the same `pd-group` label where both have one."""
    if p.engine is not d.engine:
        return False
    if p.block_size is not None and d.block_size is not None and p.block_size != d.block_size:
        return False
    pg, dg = _label(p, PAIR_GROUP_LABEL), _label(d, PAIR_GROUP_LABEL)
    return pg is None or dg is None or pg == dg


def _label(w: WorkerState, key: str) -> str | None:
    for k, v in w.labels:
        if k == key:
            return v
    return None


class CostModelDecider:
    """The `cost_model` decider (module docstring). Owns its `CostModel`, fed by `observe`."""

    observes: tuple[type, ...] | None = None  # every event

    def __init__(
        self,
        settings: CostSettings | None = None,
        *,
        clock: Callable[[], float] | None = None,
        cached: Callable[..., int] | None = None,
    ) -> None:
        self.settings = settings or CostSettings()
        model = CostModel(self.settings.priors)
        if clock is not None:
            model.clock = clock
        model.cached = cached
        self.model = model

    # -- the verdict (pure) -------------------------------------------------------------------

    def decide(self, req: RequestView, choice: PairChoice, cache: CacheEstimator) -> Verdict | None:
        s = self.settings
        m = self.model
        now = m.clock()
        prompt = max(1, req.prompt_tokens)
        memo: dict[str, int] = {}

        def cached_on(w: WorkerState) -> int:
            got = memo.get(w.id)
            if got is None:
                got = memo[w.id] = min(prompt - 1, max(0, cache.cached_tokens(req, w)))
            return got

        peers = tuple(p.id for ps in choice.partners.values() for p in ps)
        options = self._pairs(req, choice, cached_on, peers, now)
        # where it decodes, prefilling itself
        for d in choice.decodes:
            if d.decode_alone:
                options.append(self._local("local", d, prompt, cached_on(d), peers, now))
        for w in _bounded(choice.colocated, s.max_candidates):
            options.append(self._local("colocated", w, prompt, cached_on(w), peers, now))
        return self._price(options, choice)

    def _pairs(
        self,
        req: RequestView,
        choice: PairChoice,
        cached_on: Callable[[WorkerState], int],
        peers: tuple[str, ...],
        now: float,
    ) -> list[Option]:
        """Every P/D pair's option (module docstring)."""
        s = self.settings
        m = self.model
        prompt = max(1, req.prompt_tokens)
        crossover = s.priors.crossover_tokens
        out = m.output_tokens(req.max_tokens) if req.max_tokens > 0 else 1
        options: list[Option] = []
        for d in choice.decodes:
            d_cached = cached_on(d)
            step = 0.0
            chunk = 0.0
            dq = m.queue_s(d, now)
            if dq > 0:  # its first token waits for the step in progress (a prefill chunk)
                a_d, b_d = m.prefill_fit(d.id, peers)
                chunk = m.chunk_s(d, a_d, b_d)
                step = min(dq, chunk)
            base, floor = m.tpot(d.id)
            tpot_slo = s.tpot_slo_s + s.tpot_slo_x * floor
            for p in _bounded(choice.partners.get(d.id, ()), s.max_candidates):
                c = cached_on(p)
                a, b = m.prefill_fit(p.id, peers)
                own = a + b * prefill_work(prompt - c, c, crossover)
                queue = m.queue_s(p, now)
                ha, hb = m.handoff_fit(p.id, d.id)
                transfer = ha + hb * (prompt - d_cached) + step
                ttft = queue + own + transfer
                # the local prefills queued on d that still run once its KV is there slow it
                tpot = base
                if dq > ttft and out > 1:
                    tpot += min(dq - ttft, (out - 1) * chunk) / (out - 1)
                over = int(tpot > tpot_slo)
                options.append(
                    Option(
                        kind="pd",
                        worker=d.id,
                        prefill=p.id,
                        ttft_s=ttft,
                        queue_s=queue,
                        prefill_s=own,
                        transfer_s=transfer,
                        cached_tokens=c,
                        itl_s=0.0,
                        tpot_s=tpot,
                        tpot_over=over,
                        running=0,
                        allowed=not over,
                        cost=ttft,  # the pair's failures are priced once the SLO is known
                    )
                )
        return options

    def _price(self, options: list[Option], choice: PairChoice) -> Verdict | None:
        """The verdict among `options`: each priced against the request's TTFT SLO (a pair's
        failure rate at the SLO, a local prefill's penalty), then `_choose`."""
        s = self.settings
        m = self.model
        if not options:
            return None
        unloaded = min(o.prefill_s + o.transfer_s for o in options)
        slo = s.ttft_slo_s + s.ttft_slo_x * unloaded
        if slo <= 0:
            slo = float("inf")
        penalty = 1.0 + s.local_penalty
        fail_price = slo if slo != float("inf") else 10.0 * unloaded
        priced = []
        for o in options:
            if o.kind == "pd":
                fail = m.pair_failure(o.prefill or "", o.worker)
                o = msgspec.structs.replace(o, cost=o.ttft_s + fail * fail_price)
            else:
                o = msgspec.structs.replace(o, cost=o.ttft_s * penalty)
            priced.append(o)
        return _choose(priced, choice, slo, s.roomy)

    def _local(
        self, kind: str, w: WorkerState, prompt: int, cached: int, peers: tuple[str, ...], now: float
    ) -> Option:
        """A worker prefilling the request beside its own running decodes."""
        s = self.settings
        m = self.model
        a, b = m.prefill_fit(w.id, peers)
        work = prefill_work(prompt - cached, cached, s.priors.crossover_tokens)
        own = a + b * work
        queue = m.queue_s(w, now)
        base, floor = m.tpot(w.id)
        tpot_slo = s.tpot_slo_s + s.tpot_slo_x * floor
        running = m.stalls(w, now + queue, own, m.chunk_s(w, a, b))
        worst = 0.0
        over = 0
        for stall, added, tokens in running:
            if added <= 0.0:  # this prefill runs before its decode starts or after it ends
                continue
            t = base + (stall + added) / max(1, tokens - 1)
            if t > worst:
                worst = t
            if t > tpot_slo:
                over += 1
        allowed = over <= s.tpot_risk * len(running)
        return Option(
            kind=kind,
            worker=w.id,
            prefill=None,
            ttft_s=queue + own,
            queue_s=queue,
            prefill_s=own,
            transfer_s=0.0,
            cached_tokens=cached,
            itl_s=base + b * min(work, float(s.priors.chunk_tokens)),
            tpot_s=worst,
            tpot_over=over,
            running=len(running),
            allowed=allowed,
            cost=queue + own,
        )

    # -- verification re-runs ------------------------------------------------------------------

    def place_rerun(
        self, req: RequestView, candidates: Sequence[WorkerState], cache: CacheEstimator
    ) -> WorkerState | None:
        """The candidate where a re-run of `req` (its whole prompt, `req.max_tokens` tokens),
        weighed as a local prefill there from the end of its queue, puts the fewest running
        decodes over the TPOT SLO, then slows the fewest, then answers first (a verified answer's
        end waits for it). Pure."""
        if not candidates:
            return None
        s = self.settings
        m = self.model
        now = m.clock()
        prompt = max(1, req.prompt_tokens)
        peers = tuple(w.id for w in candidates)
        best: WorkerState | None = None
        best_key = (0, 0, 0.0)
        for w in candidates:
            cached = min(prompt - 1, max(0, cache.cached_tokens(req, w)))
            a, b = m.prefill_fit(w.id, peers)
            own = a + b * prefill_work(prompt - cached, cached, s.priors.crossover_tokens)
            queue = m.queue_s(w, now)
            base, floor = m.tpot(w.id)
            tpot_slo = s.tpot_slo_s + s.tpot_slo_x * floor
            over = slowed = 0
            for stall, added, tokens in m.stalls(w, now + queue, own, m.chunk_s(w, a, b)):
                if added <= 0.0:
                    continue
                slowed += 1
                if base + (stall + added) / max(1, tokens - 1) > tpot_slo:
                    over += 1
            k = (over, slowed, queue + own)
            if best is None or k < best_key:
                best, best_key = w, k
        return best

    def observe_rerun(self, event: PolicyEvent) -> None:
        """A re-run booked as a local prefill on its worker, settled at its end (`RerunPlacer`)."""
        self.model.observe(event)

    # -- learning -------------------------------------------------------------------------------

    def observe(self, event: PolicyEvent) -> None:
        self.model.observe(event)

    def metrics(self) -> list[PolicyMetric]:
        return list(self.model.metrics())


def _bounded(ws: Sequence[WorkerState], n: int) -> Sequence[WorkerState]:
    """At most `n` workers, the least loaded (a large pool is not scored whole)."""
    if len(ws) <= n:
        return ws
    return sorted(ws, key=lambda w: (w.inflight, w.load.waiting))[:n]


def _choose(options: list[Option], choice: PairChoice, slo: float, roomy: float) -> Verdict:
    d0 = choice.decode.id
    pref = choice.preferred_prefill.id if choice.preferred_prefill is not None else None

    def key(o: Option) -> tuple[float, int, int]:
        # ties: the decode policy's pick, then the prefill policy's
        return (o.cost, o.worker != d0, o.prefill != pref)

    pds = [o for o in options if o.kind == "pd" and o.allowed] or [o for o in options if o.kind == "pd"]
    alts = [o for o in options if o.kind != "pd" and o.allowed]
    best_pd = min(pds, key=key) if pds else None
    if best_pd is not None and best_pd.ttft_s <= roomy * slo:
        return Verdict(best_pd, tuple(options), slo, "roomy")
    pool = ([best_pd] if best_pd is not None else []) + alts
    if not pool:  # only alternatives over the TPOT SLO: the one predicted to hurt least
        worst_first = min(options, key=lambda o: (o.tpot_over, o.ttft_s))
        return Verdict(worst_first, tuple(options), slo, "only")
    feasible = [o for o in pool if o.ttft_s <= slo]
    if feasible:
        return Verdict(min(feasible, key=key), tuple(options), slo, "feasible")
    return Verdict(min(pool, key=key), tuple(options), slo, "best_effort")
