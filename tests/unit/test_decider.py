"""The cost-model decider (policies/decider.py, policies/cost_model.py): its predictions, its
verdicts table-driven, what it learns from outcomes, and the simple deciders."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import pytest

from common.outcomes import LegOutcome, LegRecord, Timings
from policies.base import Completed, Failed, NoCacheEstimate, Routed, routed_event
from policies.build import build_policy
from policies.config import DeciderCfg, LeastLoadCfg
from policies.cost_model import RERUN_REASON, CostModel, CostPriors, prefill_work
from policies.decider import CostModelDecider, CostSettings, PairChoice, Verdict, compatible
from policies.snapshot import Colocated, Disaggregated, RequestView, WorkerState
from policies.testing import ManualClock, make_request, make_snapshot, make_worker

PRIORS = CostPriors()
A, B = PRIORS.prefill_overhead_s, 1.0 / PRIORS.prefill_rate
HA, HB = PRIORS.transfer_overhead_s, PRIORS.transfer_s_per_token
X = PRIORS.crossover_tokens


@dataclass
class Cached:
    """A `CacheEstimator` that knows what each worker holds (what the cache-aware index says)."""

    tokens: dict[str, int] = field(default_factory=dict)

    def cached_tokens(self, req: RequestView, worker: WorkerState) -> int:
        return self.tokens.get(worker.id, 0)


P1 = make_worker("p1", "prefill")
P2 = make_worker("p2", "prefill")
D1 = make_worker("d1", "decode")
C1 = make_worker("c1", "colocated")
VD1 = make_worker("vd1", "decode", "vllm")  # a vLLM decode: prefills alone when asked
VP1 = make_worker("vp1", "prefill", "vllm")


def choice(
    decode: WorkerState = D1,
    prefills: tuple[WorkerState, ...] = (P1,),
    colocated: tuple[WorkerState, ...] = (C1,),
) -> PairChoice:
    return PairChoice(decode=decode, decodes=(decode,), partners={decode.id: prefills}, colocated=colocated)


def pd_event(rid: str, prompt: int, p: WorkerState = P1, d: WorkerState = D1, max_tokens: int = 16):
    req = make_request(prompt_tokens=prompt, max_tokens=max_tokens, request_id=rid, stream=True)
    return routed_event(req, Disaggregated(p, d))


def local_event(rid: str, prompt: int, w: WorkerState = C1, max_tokens: int = 16):
    req = make_request(prompt_tokens=prompt, max_tokens=max_tokens, request_id=rid, stream=True)
    return routed_event(req, Colocated(w))


def decider(clock: ManualClock | None = None, **kw: object) -> CostModelDecider:
    return CostModelDecider(CostSettings(**kw), clock=clock or ManualClock(1000.0))  # type: ignore[arg-type]


# -- predictions ----------------------------------------------------------------------------------


def test_prefill_work_counts_attention_over_the_context() -> None:
    assert prefill_work(0, 500, X) == 0.0
    assert prefill_work(1000, 0, 0.0) == 1000.0  # no crossover: tokens alone
    assert prefill_work(1000, 0, X) == pytest.approx(1000 * (1 + 500 / X))
    # the same new tokens after a long cached context cost more (they attend to all of it)
    assert prefill_work(1000, 30_000, X) > 1.9 * prefill_work(1000, 0, X)


def test_an_idle_pair_is_predicted_from_the_priors() -> None:
    v = decider().decide(make_request(prompt_tokens=20_000), choice(), NoCacheEstimate())
    assert v is not None
    pd = next(o for o in v.options if o.kind == "pd")
    own = A + B * prefill_work(20_000, 0, X)
    assert pd.queue_s == 0.0
    assert pd.prefill_s == pytest.approx(own)
    assert pd.transfer_s == pytest.approx(HA + HB * 20_000)
    assert pd.ttft_s == pytest.approx(own + HA + HB * 20_000)
    col = next(o for o in v.options if o.kind == "colocated")
    assert col.ttft_s == pytest.approx(own) and col.transfer_s == 0.0
    assert col.cost == pytest.approx(own * 1.2)  # local_penalty 0.2


def _busy(d: CostModelDecider, seconds: float, worker: WorkerState = P1) -> None:
    """Book about `seconds` of prefill on `worker` (long prompts routed to it just now)."""
    i = 0
    per = A + B * prefill_work(30_000, 0, X)
    while seconds > 0:
        d.observe(
            pd_event(f"busy{i}", 30_000, p=worker)
            if worker.role.value == "prefill"
            else local_event(f"busy{i}", 30_000, worker)
        )
        seconds -= per
        i += 1


@dataclass
class Case:
    name: str
    prompt: int
    kind: str  # the verdict: "pd", "colocated", "local"
    cached: dict[str, int] = field(default_factory=dict)
    busy_prefill_s: float = 0.0
    decode: WorkerState = D1
    prefills: tuple[WorkerState, ...] = (P1,)
    colocated: tuple[WorkerState, ...] = (C1,)
    reason: str | None = None
    prefill: str | None = None


CASES = [
    Case("short, uncached, idle: colocated", 100, "colocated", reason="feasible"),
    Case("long, uncached, idle: P/D", 20_000, "pd", prefill="p1", reason="best_effort"),
    Case("medium, idle: P/D", 3_000, "pd", reason="feasible"),
    Case("long, mostly cached where colocated: colocated", 20_000, "colocated", cached={"c1": 19_800}),
    Case("long, mostly cached on the prefill: P/D", 20_000, "pd", cached={"p1": 19_800, "c1": 0}),
    Case("medium, busy prefill: colocated", 3_000, "colocated", busy_prefill_s=6.0, reason="feasible"),
    Case(
        "medium, busy prefill, no colocated, SGLang decode: P/D",
        3_000,
        "pd",
        busy_prefill_s=6.0,
        colocated=(),
    ),
    Case(
        "medium, busy prefill, vLLM decode: it prefills itself",
        3_000,
        "local",
        busy_prefill_s=6.0,
        decode=VD1,
        prefills=(VP1,),
        colocated=(),
    ),
    Case(
        "short, vLLM decode, idle: it prefills itself",
        100,
        "local",
        decode=VD1,
        prefills=(VP1,),
        colocated=(),
    ),
    Case(
        "busy prefill p1, idle p2: P/D via p2",
        3_000,
        "pd",
        busy_prefill_s=6.0,
        prefills=(P1, P2),
        prefill="p2",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_verdicts(case: Case) -> None:
    d = decider()
    if case.busy_prefill_s:
        _busy(d, case.busy_prefill_s, VP1 if case.decode is VD1 else P1)
    v = d.decide(
        make_request(prompt_tokens=case.prompt),
        choice(case.decode, case.prefills, case.colocated),
        Cached(case.cached),
    )
    assert v is not None
    assert v.kind == case.kind, [(o.kind, o.prefill, round(o.ttft_s, 3), round(o.cost, 3)) for o in v.options]
    if case.reason is not None:
        assert v.reason == case.reason
    if case.prefill is not None:
        assert v.choice.prefill == case.prefill


def test_a_busy_prefill_queue_is_predicted() -> None:
    d = decider()
    _busy(d, 4.0)
    v = d.decide(make_request(prompt_tokens=3000), choice(), NoCacheEstimate())
    assert v is not None
    pd = next(o for o in v.options if o.kind == "pd")
    assert 4.0 <= pd.queue_s <= 4.0 + A + B * prefill_work(30_000, 0, X)
    d.model.clock.t += 100.0  # type: ignore[attr-defined]  # it drains one second per second
    v = d.decide(make_request(prompt_tokens=3000), choice(), NoCacheEstimate())
    assert v is not None and next(o for o in v.options if o.kind == "pd").queue_s == 0.0


def test_the_engines_queue_puts_a_floor_under_the_predicted_one() -> None:
    """Work other gateway replicas sent shows only in the engine's own waiting count."""
    busy = make_worker("p1", "prefill", waiting=50)
    v = decider().decide(make_request(prompt_tokens=3000), choice(prefills=(busy,)), NoCacheEstimate())
    assert v is not None and next(o for o in v.options if o.kind == "pd").queue_s > 1.0


def test_a_slow_pair_loses_to_a_fast_one() -> None:
    clock = ManualClock(1000.0)
    d = decider(clock)
    for i in range(60):  # p1 -> d1 hands off slowly (50 ms per 1k tokens), p2 -> d1 fast
        for p, per_token in ((P1, 5e-5), (P2, 1e-6)):
            rid = f"{p.id}-{i}"
            d.observe(pd_event(rid, 4000, p=p))
            t = Timings(end_s=1.0, prefill_s=0.3, first_token_s=0.3 + 0.005 + per_token * 4000)
            d.observe(Completed(rid, (p.id, "d1"), timings=t))
            clock.t += 60.0
    v = d.decide(make_request(prompt_tokens=4000), choice(prefills=(P1, P2), colocated=()), NoCacheEstimate())
    assert v is not None and v.choice.prefill == "p2"
    slow = next(o for o in v.options if o.prefill == "p1")
    assert slow.transfer_s == pytest.approx(0.005 + 5e-5 * 4000, rel=0.05)


def test_a_flaky_pair_is_priced_out() -> None:
    d = decider()
    for i in range(10):
        d.observe(pd_event(f"f{i}", 4000, p=P1))
        legs = (LegRecord("p1", "prefill", LegOutcome.DONE), LegRecord("d1", "decode", LegOutcome.FAILED))
        d.observe(Failed(f"f{i}", ("p1", "d1"), "handoff", legs=legs))
    assert d.model.pair_failure("p1", "d1") > 0.5
    d.model.clock.t += 1000.0  # type: ignore[attr-defined]  # its queue drained
    v = d.decide(make_request(prompt_tokens=4000), choice(prefills=(P1, P2), colocated=()), NoCacheEstimate())
    assert v is not None and v.choice.prefill == "p2"


def test_the_tpot_gate_keeps_prefills_off_a_worker_whose_decodes_would_slow_too_much() -> None:
    d = decider(tpot_slo_s=0.05)
    # twenty answers decoding on c1: a 4 s prefill beside them adds 4 s / 64 tokens each
    for i in range(20):
        d.observe(local_event(f"r{i}", 10, max_tokens=64))
    v = d.decide(make_request(prompt_tokens=30_000), choice(), NoCacheEstimate())
    assert v is not None
    col = next(o for o in v.options if o.kind == "colocated")
    assert not col.allowed and col.tpot_over == 20 and col.running == 20
    assert v.kind == "pd"
    # without running decodes the same request may go there (it is the cheaper with a queue)
    d2 = decider(tpot_slo_s=0.05)
    _busy(d2, 30.0)
    v2 = d2.decide(make_request(prompt_tokens=30_000), choice(), NoCacheEstimate())
    assert v2 is not None and v2.kind == "colocated"


def test_roomy_keeps_requests_disaggregated_while_the_prefill_pool_has_room() -> None:
    v = decider(roomy=0.5).decide(make_request(prompt_tokens=100), choice(), NoCacheEstimate())
    assert v is not None and (v.kind, v.reason) == ("pd", "roomy")


def test_compatible_pairs_need_the_same_engine_block_size_and_group() -> None:
    assert compatible(P1, D1) and not compatible(VP1, D1)
    assert not compatible(
        make_worker("p", "prefill", "vllm", labels=[("pd-group", "a")]),
        make_worker("d", "decode", "vllm", labels=[("pd-group", "b")]),
    )
    assert compatible(
        make_worker("p", "prefill", "vllm", labels=[("pd-group", "a")]), make_worker("d", "decode", "vllm")
    )


# -- the policy: the verdict is the plan ------------------------------------------------------------


def test_the_pd_policy_plans_what_the_cost_model_decides() -> None:
    policy = build_policy(LeastLoadCfg(), decider=DeciderCfg(type="cost_model"))
    snap = make_snapshot(P1, D1, C1)
    short = policy.plan(make_request(prompt_tokens=100), snap)
    long = policy.plan(make_request(prompt_tokens=20_000), snap)
    assert isinstance(short, Colocated) and short.worker.id == "c1"
    assert short.reason == "cost:colocated:feasible"
    assert isinstance(long, Disaggregated) and (long.prefill.id, long.decode.id) == ("p1", "d1")
    plan, verdict = policy.explain(make_request(prompt_tokens=20_000), snap)  # type: ignore[attr-defined]
    assert plan == long and isinstance(verdict, Verdict)


def test_pair_scoring_weighs_other_decodes_too() -> None:
    """The decode policy picks d1 (least loaded), but its only prefill is queued deep while
    d2's pair is idle: joint scoring takes p2 -> d2; `joint = false` keeps d1."""
    p1, p2 = (
        make_worker("p1", "prefill", labels=[("pd-group", "a")]),
        make_worker("p2", "prefill", labels=[("pd-group", "b")]),
    )
    d1 = make_worker("d1", "decode", labels=[("pd-group", "a")])
    d2 = make_worker("d2", "decode", labels=[("pd-group", "b")], inflight=1)
    snap = make_snapshot(p1, p2, d1, d2)
    for joint, want in ((True, ("p2", "d2")), (False, ("p1", "d1"))):
        policy = build_policy(LeastLoadCfg(), decider=DeciderCfg(type="cost_model", joint=joint))
        for i in range(5):
            policy.observe(pd_event(f"b{i}", 30_000, p=p1, d=d1))
        plan = policy.plan(make_request(prompt_tokens=3000), snap)
        assert isinstance(plan, Disaggregated) and (plan.prefill.id, plan.decode.id) == want


@pytest.mark.parametrize(
    ("cfg", "short", "long"),
    [
        (DeciderCfg(type="always"), "disaggregated", "disaggregated"),
        (DeciderCfg(type="never"), "colocated", "colocated"),
        (DeciderCfg(type="threshold", min_prefill_tokens=1000), "colocated", "disaggregated"),
    ],
)
def test_the_simple_deciders(cfg: DeciderCfg, short: str, long: str) -> None:
    policy = build_policy(LeastLoadCfg(), decider=cfg)
    snap = make_snapshot(P1, D1, C1)
    for prompt, want in ((100, short), (20_000, long)):
        plan = policy.plan(make_request(prompt_tokens=prompt), snap)
        assert ("disaggregated" if isinstance(plan, Disaggregated) else "colocated") == want


def test_bad_settings_are_refused() -> None:
    for bad in ({"forget": 1.5}, {"prefill_rate": 0.0}, {"ttft_slo_s": -1.0}, {"tpot_risk": 2.0}):
        with pytest.raises(ValueError):
            DeciderCfg(type="cost_model", **bad)  # type: ignore[arg-type]


# -- learning -------------------------------------------------------------------------------------


def test_the_prefill_rate_converges_on_the_workers_own() -> None:
    """Synthetic outcomes of a worker that prefills at 0.05 s + work / 20,000 per second."""
    clock = ManualClock(1000.0)
    m = CostModel(CostPriors(), clock=clock)
    for i in range(200):
        n = 500 + (i * 997) % 16_000
        m.observe(pd_event(f"r{i}", n))
        took = 0.05 + prefill_work(n, 0, X) / 20_000
        m.observe(Completed(f"r{i}", ("p1", "d1"), timings=Timings(end_s=took + 1, prefill_s=took)))
        clock.t += 120.0  # its queue drained before the next
    a, b = m.prefill_fit("p1")
    assert a == pytest.approx(0.05, rel=0.05) and 1 / b == pytest.approx(20_000, rel=0.02)
    # a worker without outcomes of its own takes its peers' fit
    assert m.prefill_fit("p9", ("p1",)) == pytest.approx((a, b))
    names = {x.name for x in m.metrics()}
    assert "pdgw_decider_prefill_rate_tokens_per_second" in names


def test_the_handoff_cost_and_time_per_token_converge() -> None:
    clock = ManualClock(1000.0)
    m = CostModel(CostPriors(), clock=clock)
    for i in range(200):
        n = 1000 + (i * 1733) % 20_000
        m.observe(pd_event(f"r{i}", n, max_tokens=64))
        handoff = 0.004 + 2e-6 * n
        first = 0.2 + handoff
        t = Timings(end_s=first + 63 * 0.03, prefill_s=0.2, first_token_s=first, chunks=64, output_tokens=64)
        m.observe(Completed(f"r{i}", ("p1", "d1"), output_tokens=64, timings=t))
        clock.t += 120.0
    a, b = m.handoff_fit("p1", "d1")
    assert a == pytest.approx(0.004, rel=0.05) and b == pytest.approx(2e-6, rel=0.02)
    assert m.tpot("d1")[0] == pytest.approx(0.03, rel=0.01)


def test_a_local_prefill_learns_from_its_first_token() -> None:
    clock = ManualClock(1000.0)
    m = CostModel(CostPriors(), clock=clock)
    for i in range(100):
        n = 200 + (i * 389) % 8000
        m.observe(local_event(f"r{i}", n))
        took = 0.01 + prefill_work(n, 0, X) / 5000
        m.observe(
            Completed(f"r{i}", ("c1",), timings=Timings(end_s=took + 0.3, first_token_s=took, chunks=16))
        )
        clock.t += 120.0
    a, b = m.prefill_fit("c1")
    assert a == pytest.approx(0.01, abs=0.002) and 1 / b == pytest.approx(5000, rel=0.02)


def test_a_prefill_faster_than_predicted_leaves_no_phantom_queue() -> None:
    """The priors predict 2.6 s for a 20k-token prefill; it took 0.8 s. Once its outcome is in,
    the next request finds no queue (and learns its own prefill in full)."""
    clock = ManualClock(1000.0)
    m = CostModel(CostPriors(), clock=clock)
    m.observe(pd_event("r1", 20_000))
    assert m.queue_s(P1, clock.t) > 2.0
    clock.t += 1.0
    m.observe(Completed("r1", ("p1", "d1"), timings=Timings(end_s=1.0, prefill_s=0.8)))
    assert m.queue_s(P1, clock.t) == 0.0
    m.observe(pd_event("r2", 20_000))
    clock.t += 0.9
    m.observe(Completed("r2", ("p1", "d1"), timings=Timings(end_s=0.9, prefill_s=0.8)))
    assert m.prefill_samples("p1") == 2
    assert m.tracked() == 0


# -- stalls: which running decodes a local prefill slows ------------------------------------------

VD2 = make_worker("vd2", "decode", "vllm")


@dataclass
class StallCase:
    name: str
    pd_waiting: int  # P/D requests routed to vd1 whose prefills are queued behind ~9 s on vp1
    decoding: int  # requests decoding on vd1 now (short prompts it prefilled itself)
    kind: str  # the verdict for a 3,000-token prompt
    tpot_over: int  # running decodes the local option is predicted to push over the TPOT SLO


STALL_CASES = [
    # their KV arrives long after a 0.3 s local prefill is over: it slows none of them
    StallCase("P/D requests still queued on the prefill pool: prefill locally", 2, 0, "local", 0),
    # the same prefill runs beside decodes that are running: 0.3 s over 7 tokens breaks them
    StallCase("decodes running there: P/D", 2, 2, "pd", 2),
]


@pytest.mark.parametrize("case", STALL_CASES, ids=[c.name for c in STALL_CASES])
def test_a_local_prefill_is_gated_only_by_the_decodes_it_overlaps(case: StallCase) -> None:
    d = decider(tpot_slo_s=0.05)
    for i in range(case.pd_waiting):  # 4.4 s of prefill each on vp1
        d.observe(pd_event(f"pd{i}", 30_000, p=VP1, d=VD1, max_tokens=8))
    for i in range(case.decoding):
        d.observe(local_event(f"loc{i}", 10, VD1, max_tokens=8))
    v = d.decide(make_request(prompt_tokens=3000), choice(VD1, (VP1,), ()), NoCacheEstimate())
    assert v is not None
    local = next(o for o in v.options if o.kind == "local")
    assert local.running == case.pd_waiting + case.decoding
    assert local.tpot_over == case.tpot_over
    assert v.kind == case.kind, [(o.kind, round(o.ttft_s, 3), o.allowed) for o in v.options]


def test_a_decode_near_its_end_is_stalled_at_most_a_chunk_per_token_left() -> None:
    """Chunked prefill: the decode makes a token in each step, so a 4.4 s prefill that reaches a
    decode with 3 tokens to go holds it for 3 chunks, not 4.4 s."""
    clock = ManualClock(1000.0)
    m = CostModel(CostPriors(chunk_tokens=512), clock=clock)
    m.observe(local_event("r1", 10, VD1, max_tokens=64))  # 63 tokens at 20 ms: 1.26 s
    clock.t += 0.02 + 60 * 0.02  # its first token, then 60 more
    a, b = m.prefill_fit("vd1")
    chunk = m.chunk_s(VD1, a, b)
    [(stall, added, out)] = m.stalls(VD1, clock.t, 4.4, chunk)
    assert stall == 0.0 and out == 64
    assert added == pytest.approx(3 * chunk, rel=0.05)
    # one that has just started decoding is held for all of it
    m.observe(local_event("r2", 10, VD1, max_tokens=64))
    clock.t += 0.03
    added2 = max(x for _, x, _ in m.stalls(VD1, clock.t, 4.4, chunk))
    assert added2 == pytest.approx(4.4)


def test_an_sglang_worker_holds_its_decodes_for_the_whole_prefill() -> None:
    """SGLang runs a step with prefill work as a prefill step: a decode with 3 tokens to go waits
    for all of a 4.4 s prefill, not 3 chunks."""
    clock = ManualClock(1000.0)
    m = CostModel(CostPriors(chunk_tokens=512), clock=clock)
    m.observe(local_event("r1", 10, C1, max_tokens=64))
    clock.t += 0.02 + 60 * 0.02
    a, b = m.prefill_fit("c1")
    assert m.chunk_s(C1, a, b) == float("inf")
    [(_, added, _)] = m.stalls(C1, clock.t, 4.4, m.chunk_s(C1, a, b))
    assert added == pytest.approx(4.4)


def test_a_pd_decode_avoids_a_worker_whose_queued_local_prefill_would_break_its_tpot() -> None:
    """vd1 (the decode policy's pick, with the faster handoff) has 4 s of local prefill queued;
    a P/D request decoding there would be held by what is left of it once its KV arrives."""
    clock = ManualClock(1000.0)
    d = CostModelDecider(CostSettings(tpot_slo_s=0.05, priors=CostPriors(chunk_tokens=512)), clock=clock)
    for i in range(40):  # the handoff to vd2 is learned slow (0.3 s more)
        for dec, extra in ((VD1, 0.0), (VD2, 0.3)):
            rid = f"{dec.id}-{i}"
            d.observe(pd_event(rid, 4000, p=VP1, d=dec))
            t = Timings(end_s=1.0, prefill_s=0.3, first_token_s=0.3 + 0.01 + extra)
            d.observe(Completed(rid, ("vp1", dec.id), timings=t))
            clock.t += 60.0
    d.observe(local_event("long", 30_000, VD1, max_tokens=8))  # ~4 s of prefill on vd1
    both = PairChoice(decode=VD1, decodes=(VD1, VD2), partners={"vd1": (VP1,), "vd2": (VP1,)}, colocated=())
    v = d.decide(make_request(prompt_tokens=2000, max_tokens=64), both, NoCacheEstimate())
    assert v is not None
    on_vd1 = next(o for o in v.options if o.kind == "pd" and o.worker == "vd1")
    assert on_vd1.tpot_over == 1 and not on_vd1.allowed
    assert v.choice.worker == "vd2", [
        (o.kind, o.worker, round(o.ttft_s, 3), round(o.tpot_s, 3)) for o in v.options
    ]


# -- verification re-runs (issue #31: the default guards re-run 5 % of greedy P/D answers) -------


def rerun_event(rid: str, prompt: int, w: WorkerState, shadow_tokens: int = 8) -> Routed:
    """A verification re-run as the gateway books it (gateway/orchestration/shadow.py)."""
    req = make_request(prompt_tokens=prompt, max_tokens=shadow_tokens, request_id=f"{rid}-verify")
    return msgspec.structs.replace(routed_event(req, Colocated(w)), reason=RERUN_REASON)


def test_a_rerun_booked_on_a_decode_is_a_local_prefill_there() -> None:
    """A re-run is a whole prefill of its prompt on the decode it lands on. Booked, it queues
    the local prefills routed there after it, and stalls the decodes running there (what the
    TPOT gate weighs next). With the prefill pool 3 s deep, a 3,000-token prompt prefills on
    vd1; with a 20,000-token re-run booked there (~2.6 s), it goes P/D."""
    clock = ManualClock(1000.0)
    d = decider(clock, tpot_slo_s=0.05)
    _busy(d, 3.0, VP1)
    for i in range(2):
        d.observe(local_event(f"loc{i}", 10, VD1, max_tokens=40))  # 0.8 s of decode each
    clock.t += 0.1
    req = make_request(prompt_tokens=3000)
    v = d.decide(req, choice(VD1, (VP1,), ()), NoCacheEstimate())
    assert v is not None
    assert v.kind == "local", v.options
    d.place_rerun(req, (VD1,), NoCacheEstimate())  # pure: books nothing
    assert d.model.queue_s(VD1, clock.t) == 0.0
    d.observe_rerun(rerun_event("pd0", 20_000, VD1))
    assert d.model.queue_s(VD1, clock.t) > 2.0
    assert d.model.running_on("vd1") == 3 and d.model.booked_s("vd1") > 2.0
    # the running decodes are held by it for the rest of their windows
    stalls = sorted(s for s, _, out in d.model.stalls(VD1, clock.t, 0.0, 1.0) if out == 40)
    assert len(stalls) == 2 and all(s > 0.6 for s in stalls), stalls
    v = d.decide(req, choice(VD1, (VP1,), ()), NoCacheEstimate())
    assert v is not None
    assert v.kind == "pd", [(o.kind, o.ttft_s, o.tpot_over, o.allowed) for o in v.options]
    local = next(o for o in v.options if o.kind == "local")
    assert local.queue_s > 2.0
    # not a routing verdict
    assert RERUN_REASON not in d.model.verdicts


@pytest.mark.parametrize("end", ["completed", "failed"])
def test_a_rerun_booking_is_settled_at_its_end(end: str) -> None:
    clock = ManualClock(1000.0)
    d = decider(clock)
    d.observe_rerun(rerun_event("pd0", 20_000, VD1))
    assert d.model.tracked() == 1 and d.model.booked_s("vd1") > 0.0
    clock.t += 0.5
    ev = Completed("pd0-verify", ("vd1",)) if end == "completed" else Failed("pd0-verify", ("vd1",), "verify")
    d.observe_rerun(ev)
    assert d.model.tracked() == 0 and d.model.running_on("vd1") == 0 and d.model.booked_s("vd1") == 0.0
    assert d.model.queue_s(VD1, clock.t) == 0.0


def test_a_rerun_goes_where_it_puts_no_running_decode_over_its_tpot_slo() -> None:
    """vd1 runs the verified answer itself (8 tokens: a 2 s prefill beside it breaks its TPOT),
    vd2 a long answer (200 tokens: the same prefill adds 10 ms a token). The re-run goes to
    vd2, not to the verified answer's own decode."""
    clock = ManualClock(1000.0)
    d = decider(clock, tpot_slo_s=0.05)
    d.observe(local_event("long", 10, VD2, max_tokens=200))
    d.observe(pd_event("v", 20_000, p=VP1, d=VD1, max_tokens=8))
    clock.t += 2.2  # its prefill answered: its decode starts now
    req = make_request(prompt_tokens=20_000, max_tokens=8, request_id="v-verify")
    assert d.place_rerun(req, (VD1, VD2), NoCacheEstimate()) == VD2
    # with a 30,000-token local prefill queued on vd2 as well, the re-run there would come
    # after it and break the long answer too, and slow the queued one: vd1 slows one decode
    d.observe(local_event("queued", 30_000, VD2, max_tokens=8))
    assert d.place_rerun(req, (VD1, VD2), NoCacheEstimate()) == VD1


def test_a_rerun_started_with_its_prefill_goes_where_it_slows_no_decode() -> None:
    """A re-run started with the verified request's prefill (the vLLM shape) runs while the
    prefill does: it ends before that request's own decode starts on vd1, so vd1 is where it
    slows nothing; on vd2 it would slow the long answer there (within its SLO)."""
    clock = ManualClock(1000.0)
    d = decider(clock, tpot_slo_s=0.05)
    d.observe(local_event("long", 10, VD2, max_tokens=200))
    clock.t += 0.1
    _busy(d, 3.0, VP1)  # the prefill pool is 3 s deep
    d.observe(pd_event("v", 20_000, p=VP1, d=VD1, max_tokens=8))
    req = make_request(prompt_tokens=20_000, max_tokens=8, request_id="v-verify")
    assert d.place_rerun(req, (VD2, VD1), NoCacheEstimate()) == VD1


def test_the_pd_policy_places_reruns_through_its_decider_only() -> None:
    """`PDPolicy.place_rerun`: the cost-model decider's choice; other deciders have none (the
    gateway then takes the least loaded). Re-run events reach the decider alone."""
    pol = build_policy(LeastLoadCfg(), decider=DeciderCfg(type="cost_model"))
    req = make_request(prompt_tokens=20_000, max_tokens=8)
    assert pol.place_rerun(req, (VD1, VD2)) in (VD1, VD2)  # type: ignore[attr-defined]
    pol.observe_rerun(rerun_event("r", 20_000, VD1))  # type: ignore[attr-defined]
    assert pol.decider.model.running_on("vd1") == 1  # type: ignore[attr-defined]
    plain = build_policy(LeastLoadCfg(), decider=DeciderCfg(type="always"))
    assert plain.place_rerun(req, (VD1, VD2)) is None  # type: ignore[attr-defined]
    plain.observe_rerun(rerun_event("r", 20_000, VD1))  # type: ignore[attr-defined]
