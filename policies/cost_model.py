"""The P/D decider's cost model: what it predicts from, learned online from outcomes.

Everything is in seconds, per worker and per (prefill, decode) pair, from the events the
request path sends (`Routed`, then `Completed` with `common.outcomes.Timings`, or `Failed`):

- **Prefill work** of `n` uncached tokens after `c` cached ones, in token-equivalents:
  `work(n, c) = n * (1 + (c + n/2) / crossover)` (the dense matmuls, plus attention over the
  causal context; vllm-router's `smetric` prefill cost, `new + new * (len - new/2) / crossover`).
  `crossover` is where attention costs as much as the dense part, `2 * params / (4 * layers *
  hidden)`: about 30,600 tokens for Llama-3-8B, 53,900 for Llama-3-70B; 0 counts tokens alone.
- **Prefill time** per worker: `a + b * work` (`LinearFit`: a fixed overhead, seconds per unit of
  work), learned from each P/D prefill's answer (`Timings.prefill_s`) and from each stream a
  worker prefilled itself (its first token), with the work queued ahead of it counted in.
- **Handoff time** per pair: `a + b * tokens` for the KV of `tokens` prompt tokens (the transfer,
  the decode's queue and first step), learned from `Timings.handoff_s` of each P/D stream.
- **Time per output token** per worker that decodes (`base`), learned from streams, with the
  stalls this model put on the request (below) taken out.
- **Queues**: every routed prefill adds `a + b * work` seconds to its worker's queue, which
  drains one second per second (no "prefill finished" event needed: Dynamo's decaying active
  prefill tokens); the engine's own count of waiting requests puts a floor under it (work other
  gateway replicas sent).
- **Stalls**: a worker that decodes and prefills (a vLLM decode prefilling a request itself, a
  colocated worker) runs its prefill chunks in the steps of its running decodes, which wait for
  them: a second of prefill that runs while a request decodes there is a second added to that
  decode. Per worker the model keeps the requests routed to decode there, each with its
  predicted decode window (from its predicted first token -- a P/D request's prefill queue,
  prefill and handoff; a local one's queue and prefill -- for its expected output tokens) and
  the prefill seconds predicted to overlap it so far (`stall`); a local prefill booked there
  runs from the end of the worker's queue for its own time, and adds to each decode the part
  inside that decode's window -- on vLLM at most one prefill chunk's time per token the decode
  has left (its scheduler runs the running decodes in every step and fills the rest of the
  token budget with prefill chunks: vLLM v1/core/sched/scheduler.py `schedule`), on SGLang all
  of it (a step with prefill work decodes nothing: SGLang managers/scheduler.py
  `get_next_batch_to_run`, mixed chunks off by default). So a P/D request still queued on its
  prefill worker is not slowed by local prefills that end before its KV arrives. A decode's
  predicted time per token is `base + stall / tokens`.
- **Pair reliability**: the share of recent handoffs on each pair that failed.

Priors (`CostPriors`) hold until outcomes arrive; a worker without outcomes of its own takes the
mean of its peers' fits that have some (the same hardware, likely). Reads (`prefill_fit`,
`queue_s`, `handoff_fit`, ...) are pure; `observe` is the only mutation.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from common.outcomes import LegOutcome
from policies.base import Completed, Failed, PolicyEvent, PolicyMetric, Routed, WorkerGone
from policies.cost_requests import Decoder, Pending, overlap
from policies.estimators import PRIOR_WEIGHT, Ewma, LinearFit, prefill_work
from policies.pending import expire
from policies.snapshot import Role, WorkerState

# the `Routed.reason` of a verification re-run booked on the worker it runs on (a local prefill
# of its prompt: `policies.decider.RerunPlacer`); not a routing verdict
RERUN_REASON = "verify"


@dataclass(frozen=True, slots=True)
class CostPriors:
    """What the model assumes before any outcome (`policies.config.DeciderCfg` documents each)."""

    prefill_rate: float = 10_000.0  # tokens/s
    prefill_overhead_s: float = 0.02
    transfer_s_per_token: float = 5e-6  # 128 KiB/token (Llama-3-8B) at ~25 GB/s
    transfer_overhead_s: float = 0.01
    tpot_s: float = 0.02
    crossover_tokens: float = 32_768.0
    chunk_tokens: int = (
        8192  # prefill tokens per engine step (vLLM max_num_batched_tokens, SGLang chunked_prefill_size)
    )
    forget: float = 0.05
    max_tracked: int = 100_000  # requests in flight the model keeps (the oldest go first)
    horizon_s: float = 600.0  # a request whose outcome never came is forgotten after this


@dataclass
class CostModel:
    """The learned state (module docstring). One per policy; `observe` is fed every event."""

    priors: CostPriors = field(default_factory=CostPriors)
    clock: Callable[[], float] = time.monotonic
    # cached prompt tokens a worker holds, as the routing saw it (the cache-aware index), for
    # the work booked at `Routed`
    cached: Callable[[Routed, str], int] | None = None
    # the least time per output token a decode on a worker is taken to need (its window's
    # length), where the owner measures it otherwise (policies/decode_slo.py); None: no bound
    min_step: Callable[[str], float] | None = None
    _prefill: dict[str, LinearFit] = field(default_factory=dict)
    _handoff: dict[tuple[str, str], LinearFit] = field(default_factory=dict)
    _tpot: dict[str, Ewma] = field(default_factory=dict)
    _queue: dict[str, tuple[float, float]] = field(default_factory=dict)  # worker -> (seconds, as of)
    _open: dict[str, float] = field(default_factory=dict)  # worker -> booked seconds not yet settled
    _decoders: dict[str, Decoder] = field(default_factory=dict)
    _pair_fail: dict[tuple[str, str], float] = field(default_factory=dict)
    _pending: OrderedDict[str, Pending] = field(default_factory=OrderedDict)
    _mean_request_s: float = 0.1
    _fill: Ewma = field(default_factory=lambda: Ewma(1.0, 0.05))  # output tokens / max_tokens
    verdicts: dict[str, int] = field(default_factory=dict)  # plan reason -> requests routed so
    reruns: dict[str, int] = field(default_factory=dict)  # worker -> verification re-runs booked there
    _last_sweep: float = 0.0

    # -- reads --------------------------------------------------------------------------------

    def _new_prefill_fit(self) -> LinearFit:
        p = self.priors
        return LinearFit(
            p.prefill_overhead_s,
            1.0 / p.prefill_rate,
            8192.0,
            prior_weight=PRIOR_WEIGHT,
            forget=p.forget,
            b_min=1e-9,
            b_max=1.0,
        )

    def prefill_fit(self, worker_id: str, peers: tuple[str, ...] = ()) -> tuple[float, float]:
        """(overhead s, seconds per unit of work) of a worker's prefill; without outcomes of its
        own, the mean of its `peers`' that have some, else the priors."""
        fit = self._prefill.get(worker_id)
        if fit is not None and fit.samples:
            return fit.coefficients()
        learned = [f.coefficients() for w in peers if (f := self._prefill.get(w)) is not None and f.samples]
        if learned:
            return (sum(a for a, _ in learned) / len(learned), sum(b for _, b in learned) / len(learned))
        p = self.priors
        return p.prefill_overhead_s, 1.0 / p.prefill_rate

    def prefill_samples(self, worker_id: str) -> int:
        fit = self._prefill.get(worker_id)
        return 0 if fit is None else fit.samples

    def handoff_fit(self, prefill_id: str, decode_id: str) -> tuple[float, float]:
        """(overhead s, seconds per token of KV) of the pair's handoff; without outcomes, the mean
        of the pairs that have some, else the priors."""
        fit = self._handoff.get((prefill_id, decode_id))
        if fit is not None and fit.samples:
            return fit.coefficients()
        learned = [f.coefficients() for f in self._handoff.values() if f.samples]
        if learned:
            return (sum(a for a, _ in learned) / len(learned), sum(b for _, b in learned) / len(learned))
        p = self.priors
        return p.transfer_overhead_s, p.transfer_s_per_token

    def tpot(self, worker_id: str) -> tuple[float, float]:
        """(mean, floor) of a worker's time per output token without the stalls of prefills."""
        e = self._tpot.get(worker_id)
        if e is None or not e.samples:
            learned = [x for x in self._tpot.values() if x.samples]
            if learned:
                return sum(x.mean for x in learned) / len(learned), min(x.floor for x in learned)
            return self.priors.tpot_s, self.priors.tpot_s
        return e.mean, e.floor

    def queue_s(self, w: WorkerState, now: float) -> float:
        """Prefill seconds queued on the worker at `now` (module docstring)."""
        fluid = self._ahead(w.id, now)
        floor = w.load.waiting * self._mean_request_s
        return fluid if fluid > floor else floor

    def _ahead(self, worker_id: str, now: float) -> float:
        """The booked seconds left on a worker: draining one second per second, and never more
        than what was booked for the requests whose prefill is not known to be done (a prefill
        faster than predicted leaves no phantom queue behind)."""
        q = self._queue.get(worker_id)
        if q is None:
            return 0.0
        fluid = q[0] - (now - q[1])
        if fluid <= 0.0:
            return 0.0
        open_s = self._open.get(worker_id, 0.0)
        return fluid if fluid < open_s else open_s

    def pair_failure(self, prefill_id: str, decode_id: str) -> float:
        """The share of recent handoffs on the pair that failed (0 without any)."""
        return self._pair_fail.get((prefill_id, decode_id), 0.0)

    def output_tokens(self, max_tokens: int) -> int:
        """The output tokens a request of this budget is expected to generate."""
        return max(1, round(max_tokens * min(1.0, max(0.05, self._fill.mean))))

    def stalls(
        self, w: WorkerState, start: float, seconds: float, chunk_s: float, running_at: float = 0.0
    ) -> list[tuple[float, float, int]]:
        """For a prefill of `seconds` that would run on the worker from `start` in steps of at
        most `chunk_s`: (predicted stall so far, what this prefill adds, output tokens) of each
        request routed to decode there. `running_at` (now): each of them is known to run until
        then at least (its outcome has not come), however early its window was predicted to end."""
        d = self._decoders.get(w.id)
        if d is None:
            return []
        end = start + seconds
        return [(r.stall, overlap(start, end, r, chunk_s, running_at), r.out) for r in d.running.values()]

    def chunk_s(self, w: WorkerState, a: float, b: float) -> float:
        """The longest a prefill on `w` (whose fit is (a, b)) holds a decode there per token:
        one full chunk (a step) where the engine decodes in every step (vLLM), else without
        bound (module docstring)."""
        if not w.decodes_beside_prefill:
            return math.inf
        return a + b * self.priors.chunk_tokens

    # -- observe ------------------------------------------------------------------------------

    def observe(self, event: PolicyEvent) -> None:
        match event:
            case Routed():
                self._routed(event)
            case Completed():
                self._completed(event)
            case Failed():
                self._failed(event)
            case WorkerGone():
                self._gone(event.worker_id)
        now = self.clock()
        if now - self._last_sweep >= 10.0:
            self._sweep(now)

    def _book(self, worker_id: str, seconds: float, now: float) -> float:
        """Add prefill seconds to a worker's queue; returns what was queued ahead."""
        ahead = self._ahead(worker_id, now)
        self._queue[worker_id] = (ahead + seconds, now)
        self._open[worker_id] = self._open.get(worker_id, 0.0) + seconds
        self._mean_request_s += 0.05 * (seconds - self._mean_request_s)
        return ahead

    def _routed(self, ev: Routed) -> None:
        now = self.clock()
        if ev.reason != RERUN_REASON:
            self.verdicts[ev.reason or "-"] = self.verdicts.get(ev.reason or "-", 0) + 1
        elif ev.worker_ids:
            self.reruns[ev.worker_ids[0]] = self.reruns.get(ev.worker_ids[0], 0) + 1
        if len(self.verdicts) > 64:  # reasons are the policy's own strings; bounded all the same
            self.verdicts.pop(next(iter(self.verdicts)))
        p = Pending()
        p.at = now
        prompt = max(1, ev.prompt_tokens)
        pre = ev.worker_ids[0]
        p.prefill = pre
        p.decode = ev.worker_ids[-1]
        cached = 0 if self.cached is None else min(prompt - 1, max(0, self.cached(ev, pre)))
        p.work = prefill_work(prompt - cached, cached, self.priors.crossover_tokens)
        peers = tuple(w.id for w in ev.workers if w.id != pre)
        a, b = self.prefill_fit(pre, peers)
        seconds = a + b * p.work
        p.queued_s = self._book(pre, seconds, now)
        p.booked = seconds
        p.max_tokens = ev.max_tokens
        p.out = self.output_tokens(ev.max_tokens) if ev.max_tokens > 0 else 1
        decoder = self._decoders.get(p.decode)
        if decoder is None:
            decoder = self._decoders[p.decode] = Decoder()
        p.step = self.tpot(p.decode)[0]
        if self.min_step is not None:
            least = self.min_step(p.decode)
            if least > p.step:
                p.step = least
        p.dur = max(0, p.out - 1) * p.step
        if ev.disaggregated:
            p.kind = "pd"
            d_cached = 0 if self.cached is None else min(prompt - 1, max(0, self.cached(ev, p.decode)))
            p.transfer_tokens = prompt - d_cached
            ha, hb = self.handoff_fit(pre, p.decode)
            p.start = now + p.queued_s + seconds + ha + hb * p.transfer_tokens
            # the local prefills queued on its decode worker that run on after its KV arrives
            p.stall = max(0.0, now + self._ahead(p.decode, now) - p.start)
        else:
            p.kind = "local"
            # its prefill runs beside the decodes there: each is slowed by the part inside its
            # window; its own decode starts after it
            begin = now + p.queued_s
            chunk = self.chunk_s(ev.workers[0], a, b) if ev.workers else math.inf
            for r in decoder.running.values():
                r.stall += overlap(begin, begin + seconds, r, chunk)
            p.start = begin + seconds
        decoder.running[ev.request_id] = p
        pending = self._pending
        old = pending.pop(ev.request_id, None)  # (a moved decode: routed again)
        if old is not None:
            self._drop(ev.request_id, old)
            if old.decode == p.decode:
                decoder.running[ev.request_id] = p
        pending[ev.request_id] = p
        if len(pending) > self.priors.max_tracked:
            rid, gone = pending.popitem(last=False)
            self._drop(rid, gone)

    def _drop(self, rid: str, p: Pending) -> None:
        """A request's outcome came (or it is forgotten): off its decoder, its booking settled."""
        d = self._decoders.get(p.decode)
        if d is not None:
            d.running.pop(rid, None)
        if p.booked:
            left = self._open.get(p.prefill, 0.0) - p.booked
            if left > 1e-9:
                self._open[p.prefill] = left
            else:
                self._open.pop(p.prefill, None)
            p.booked = 0.0

    def _completed(self, ev: Completed) -> None:
        p = self._pending.pop(ev.request_id, None)
        if p is None:
            return
        self._drop(ev.request_id, p)
        t = ev.timings
        if p.kind == "pd" and len(ev.worker_ids) == 2:
            self._pair_outcome(p.prefill, p.decode, ok=True)
        if t is None:
            return
        if p.kind == "pd":
            if t.prefill_s is not None:  # the prefill's answer: its queue, then its work
                self._learn_prefill(p.prefill, p, t.prefill_s)
            handoff = t.handoff_s
            if handoff is not None:
                fit = self._handoff.get((p.prefill, p.decode))
                if fit is None:
                    pr = self.priors
                    fit = self._handoff[(p.prefill, p.decode)] = LinearFit(
                        pr.transfer_overhead_s,
                        pr.transfer_s_per_token,
                        8192.0,
                        prior_weight=PRIOR_WEIGHT,
                        forget=pr.forget,
                        b_min=1e-12,
                        b_max=1e-2,
                    )
                fit.add(float(p.transfer_tokens), handoff)
        elif t.first_token_s is not None:  # a stream prefilled where it decodes
            self._learn_prefill(p.prefill, p, t.first_token_s)
        counted = t.output_tokens if t.output_tokens is not None else (ev.output_tokens or None)
        if counted is not None and p.max_tokens > 0:
            self._fill.add(min(1.0, counted / p.max_tokens))
        # a stream's reads stand in for its tokens where nothing counted them (fewer when events
        # came together: a time per token on the high side)
        self._learn_tpot(p, t.decode_s, counted if counted is not None else t.chunks)

    def _learn_prefill(self, worker_id: str, p: Pending, seconds: float) -> None:
        """The request's prefill ended `seconds` after it was routed, behind `queued_s` of
        predicted work: its own took the rest."""
        own = seconds - p.queued_s
        if own <= 0 or p.work <= 0:
            return
        fit = self._prefill.get(worker_id)
        if fit is None:
            fit = self._prefill[worker_id] = self._new_prefill_fit()
        fit.add(p.work, own)

    def _learn_tpot(self, p: Pending, decode_s: float | None, tokens: int | None) -> None:
        if decode_s is None or tokens is None or tokens < 2:
            return
        steps = tokens - 1
        base = max(0.0, decode_s - p.stall) / steps
        e = self._tpot.get(p.decode)
        if e is None:
            e = self._tpot[p.decode] = Ewma(self.priors.tpot_s)
        e.add(base)

    def _failed(self, ev: Failed) -> None:
        p = self._pending.pop(ev.request_id, None)
        if p is None:
            return
        self._drop(ev.request_id, p)
        # its prefill will not run, or ran for nothing: not queued any more (what ran is lost
        # either way; the queue only over-counts until it drains)
        q = self._queue.get(p.prefill)
        if q is not None:
            now = self.clock()
            a, b = self.prefill_fit(p.prefill)
            left = max(0.0, q[0] - (now - q[1]) - (a + b * p.work))
            self._queue[p.prefill] = (left, now)
        if p.kind == "pd" and ev.phase not in ("cancelled", "refused"):
            pair_failed = (
                any(leg.outcome in (LegOutcome.SPARED, LegOutcome.FAILED) for leg in ev.legs) or not ev.legs
            )
            self._pair_outcome(p.prefill, p.decode, ok=not pair_failed)

    def _pair_outcome(self, prefill_id: str, decode_id: str, *, ok: bool) -> None:
        key = (prefill_id, decode_id)
        old = self._pair_fail.get(key, 0.0)
        new = old + 0.1 * ((0.0 if ok else 1.0) - old)
        if new < 1e-4 and ok:
            self._pair_fail.pop(key, None)
        else:
            self._pair_fail[key] = new

    def _gone(self, worker_id: str) -> None:
        """A worker left or restarted: its queue and decodes are gone; its speed is kept (the
        same hardware, likely)."""
        self._queue.pop(worker_id, None)
        d = self._decoders.get(worker_id)
        if d is not None:
            for rid in list(d.running):
                p = self._pending.pop(rid, None)
                if p is not None:
                    self._drop(rid, p)
            del self._decoders[worker_id]
        self._open.pop(worker_id, None)
        for key in [k for k in self._pair_fail if worker_id in k]:
            del self._pair_fail[key]

    def _sweep(self, now: float) -> None:
        """Forget requests whose outcome never came (`priors.horizon_s`), and idle decoders."""
        self._last_sweep = now
        for rid, p in expire(self._pending, now - self.priors.horizon_s):
            self._drop(rid, p)

    # -- accounting, for tests and the admin view ---------------------------------------------

    def tracked(self) -> int:
        """Requests in flight the model keeps (each `Routed` until its `Completed`/`Failed`)."""
        return len(self._pending)

    def booked_s(self, worker_id: str) -> float:
        """Prefill seconds booked on the worker for requests whose outcome has not come."""
        return self._open.get(worker_id, 0.0)

    def running_on(self, worker_id: str) -> int:
        d = self._decoders.get(worker_id)
        return 0 if d is None else len(d.running)

    def metrics(self) -> Iterator[PolicyMetric]:
        for wid, fit in self._prefill.items():
            a, b = fit.coefficients()
            lv: tuple[tuple[str, str], ...] = (("worker", wid),)
            yield PolicyMetric(
                "pdgw_decider_prefill_rate_tokens_per_second",
                "Learned prefill speed per worker (token-equivalents of work per second)",
                lv,
                1.0 / b,
            )
            yield PolicyMetric(
                "pdgw_decider_prefill_overhead_seconds", "Learned fixed prefill time per worker", lv, a
            )
            yield PolicyMetric(
                "pdgw_decider_prefill_samples", "Outcomes the prefill fit learned from", lv, fit.samples
            )
        for (p, d), fit in self._handoff.items():
            a, b = fit.coefficients()
            lv = (("prefill", p), ("decode", d))
            yield PolicyMetric(
                "pdgw_decider_transfer_seconds_per_token",
                "Learned handoff time per prompt token of KV per (prefill, decode) pair",
                lv,
                b,
            )
            yield PolicyMetric(
                "pdgw_decider_transfer_overhead_seconds",
                "Learned fixed handoff time per (prefill, decode) pair",
                lv,
                a,
            )
        for wid, e in self._tpot.items():
            lv = (("worker", wid),)
            yield PolicyMetric(
                "pdgw_decider_tpot_seconds",
                "Learned time per output token per worker, prefill stalls taken out",
                lv,
                e.mean,
            )
        for (p, d), share in self._pair_fail.items():
            yield PolicyMetric(
                "pdgw_decider_pair_failure_share",
                "Recent share of failed handoffs per (prefill, decode) pair",
                (("prefill", p), ("decode", d)),
                share,
            )
        yield from self._counters()

    def _counters(self) -> Iterator[PolicyMetric]:
        """The running totals: re-runs booked per worker, requests per verdict."""
        for wid, n in self.reruns.items():
            yield PolicyMetric(
                "pdgw_decider_reruns",
                "Verification re-runs booked as a local prefill on the worker they ran on",
                (("worker", wid),),
                float(n),
                kind="counter",
            )
        for reason, n in self.verdicts.items():
            yield PolicyMetric(
                "pdgw_decider_verdicts",
                "Requests routed by the decider's verdict",
                (("reason", reason),),
                float(n),
                kind="counter",
            )


def decoding_role(w: WorkerState) -> bool:
    """Does this worker run decodes (a decode or a colocated worker)?"""
    return w.role is not Role.PREFILL
