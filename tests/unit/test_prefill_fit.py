"""`prefill_fit = "line"`: a worker's prefill rate as the slope of a fitted line, a prefill's
fixed cost as its intercept (policies/prefill_cost.py), against the single-rate average."""

from __future__ import annotations

import itertools

import pytest

from gateway.config import load_config
from policies.base import routed_event
from policies.build import cache_aware_settings
from policies.cache_state import CacheAwareSettings, CacheState
from policies.config import parse_policy
from policies.decode_slo import SloSettings
from policies.prefill_cost import CLIP, CLIP_AFTER, PrefillQueues, RateSettings
from policies.snapshot import Colocated
from policies.testing import ManualClock as Clock
from policies.testing import make_token_request as _request
from policies.testing import make_worker

RATE = 125_000.0  # work per second (the emulated H100's unloaded rate, docs/benchmarks.md)
FIXED = 0.004  # seconds a prefill takes besides its work


def feed(q: PrefillQueues, works: list[float], *, rate: float = RATE, fixed: float = FIXED) -> None:
    for w in works:
        q.learn("w", w, fixed + w / rate)


MIXED = [300.0, 2_000.0, 60_000.0, 5_000.0, 20_000.0, 900.0] * 10


@pytest.mark.parametrize(
    ("works", "fit", "rate_within", "overhead"),
    [
        # a fixed cost and a mix of sizes: the line recovers both; the average reads the fixed
        # cost as slowness (the smaller the prefills, the slower it thinks the worker)
        (MIXED, True, (0.99 * RATE, 1.01 * RATE), (0.9 * FIXED, 1.1 * FIXED)),
        (MIXED, False, (0.5 * RATE, 0.95 * RATE), (0.0, 0.0)),
        # small prefills only (above the average's 256-token floor): the average is far off
        ([300.0, 600.0, 1_200.0] * 20, True, (0.95 * RATE, 1.05 * RATE), (0.9 * FIXED, 1.1 * FIXED)),
        ([300.0, 600.0, 1_200.0] * 20, False, (0.1 * RATE, 0.6 * RATE), (0.0, 0.0)),
    ],
)
def test_the_line_separates_a_fixed_cost_from_the_rate(
    works: list[float], fit: bool, rate_within: tuple[float, float], overhead: tuple[float, float]
) -> None:
    q = PrefillQueues(RateSettings(default_rate=10_000.0, fit=fit))
    feed(q, works)
    assert rate_within[0] <= q.rate("w") <= rate_within[1]
    assert overhead[0] <= q.overhead("w") <= overhead[1]
    assert q.overhead("other") == 0.0  # not fitted


@pytest.mark.parametrize(
    ("outlier_seconds", "fit", "rate_within"),
    [
        # a backlog predicted but already drained: 15k work measured in 26 ms (the x3 replay's
        # 590k work/s sample); the line moves a bounded step, the average jumps by ~80 %
        (0.026, True, (0.9 * RATE, 1.25 * RATE)),
        (0.026, False, (1.6 * RATE, 100 * RATE)),
        # a backlog not predicted: 15k work measured in 2 s
        (2.0, True, (0.75 * RATE, 1.1 * RATE)),
        (2.0, False, (0.1 * RATE, 0.85 * RATE)),
    ],
)
def test_one_wild_sample_moves_the_line_a_bounded_step(
    outlier_seconds: float, fit: bool, rate_within: tuple[float, float]
) -> None:
    q = PrefillQueues(RateSettings(default_rate=10_000.0, fit=fit))
    feed(q, [w for w in MIXED if w >= 2_000.0], fixed=0.0)  # the average's fair case: no fixed cost
    assert q.rate("w") == pytest.approx(RATE, rel=0.01)
    q.learn("w", 15_000.0, outlier_seconds)
    assert rate_within[0] <= q.rate("w") <= rate_within[1]


@pytest.mark.parametrize(("new_rate", "after", "within"), [(40_000.0, 60, 0.1), (400_000.0, 100, 0.1)])
def test_a_worker_whose_speed_changes_is_followed_through_the_clip(
    new_rate: float, after: int, within: float
) -> None:
    q = PrefillQueues(RateSettings(default_rate=10_000.0, fit=True))
    feed(q, MIXED)
    feed(q, (MIXED * 2)[:after], rate=new_rate)  # 3.2x slower or faster: clipped at first
    assert q.rate("w") == pytest.approx(new_rate, rel=within)


def test_a_faster_sample_is_clipped_only_once_the_line_has_enough() -> None:
    assert CLIP > 1.0 and CLIP_AFTER >= 1
    q = PrefillQueues(RateSettings(default_rate=10_000.0, fit=True))
    q.learn("w", 10_000.0, 1.0)  # the first sample starts the line: 10k work/s
    assert q.rate("w") == pytest.approx(10_000.0)
    for _ in range(CLIP_AFTER - 1):  # not clipped yet: a young line follows faster samples at once
        q.learn("w", 50_000.0, 50_000.0 / RATE)
    assert q.rate("w") > 5 * 10_000.0


@pytest.mark.parametrize("seconds", [0.7, 3.0, 30.0])
def test_a_slower_sample_is_clipped_from_the_second(seconds: float) -> None:
    q = PrefillQueues(RateSettings(default_rate=10_000.0, fit=True))
    q.learn("w", 1_000.0, 0.004 + 1_000.0 / RATE)
    q.learn("w", 1_000.0, seconds)  # 0.012 s predicted: counts as 0.024 s
    assert q.rate("w") == pytest.approx(RATE / 2, rel=0.35)


# (work, seconds) a worker's line was fed at the start of a x3 replay on cache_aware's defaults
# (docs/benchmarks.md, "Why the line lost on the defaults"; ~20k work/s in those units): small
# prefills, then ones queued behind work the gateway had not counted. Unclipped until its fifth
# sample, the fourth tipped the slope to its floor (the rate to the 10M work/s cap), the fifth
# to 0.5k work/s; slower samples clipped from the second, it stays within 3.2k-37k.
RUNAWAY = [
    (17.0, 0.005),
    (89.0, 0.007),
    (621.0, 0.022),
    (105.0, 0.215),
    (883.0, 2.809),
    (44.0, 2.767),
    (1_002.0, 0.504),
    (8_574.0, 1.497),
    (40_373.0, 0.339),
    (1_484.0, 0.520),
    (8_824.0, 3.066),
    (16_577.0, 0.795),
]


@pytest.mark.parametrize(
    ("samples", "rate_within"),
    [
        (RUNAWAY, (3_000.0, 50_000.0)),
        # another repeat's worker (the same rows): within a few percent of it
        ([(w, s * 0.97) for w, s in RUNAWAY], (3_000.0, 50_000.0)),
    ],
)
def test_early_samples_of_a_busy_worker_do_not_run_the_line_away(
    samples: list[tuple[float, float]], rate_within: tuple[float, float]
) -> None:
    q = PrefillQueues(RateSettings(fit=True))
    for work, seconds in samples:
        q.learn("w", work, seconds)
        assert rate_within[0] <= q.rate("w") <= rate_within[1], (work, seconds, q.rate("w"))


@pytest.mark.parametrize(("rates", "prior_after_forget"), [({"a": 50_000.0, "b": 150_000.0}, 150_000.0)])
def test_a_fitted_rate_is_the_prior_of_unmeasured_workers_and_forgotten_with_its_worker(
    rates: dict[str, float], prior_after_forget: float
) -> None:
    q = PrefillQueues(RateSettings(default_rate=1_000.0, fit=True))
    for work, (wid, rate) in itertools.product([20_000.0, 40_000.0], rates.items()):
        q.learn(wid, work, work / rate)
    assert q.rate("new") == pytest.approx(sum(rates.values()) / len(rates), rel=0.01)
    q.forget("a")
    assert q.rate("new") == pytest.approx(prior_after_forget, rel=0.01)
    assert q.overhead("a") == 0.0


@pytest.mark.parametrize(("value", "fit"), [("rate", False), ("line", True)])
def test_the_knob_reaches_the_queues(tmp_path, value: str, fit: bool) -> None:
    cfg = tmp_path / "g.toml"
    cfg.write_text(f'policy = {{ type = "cache_aware", prefill_fit = "{value}" }}\n')
    settings = cache_aware_settings(load_config(cfg).policy)
    assert CacheState(settings).queues.settings.fit is fit


# ---- queue_cache = "prefilled": the queued work of a turn sent behind its predecessor ----------


DOC = list(range(10_000, 20_000))  # 10,000 tokens: 1 s of prefill at the prior 10,000 work/s


@pytest.mark.parametrize(
    ("queue_prefilled", "gap_s", "backlog_s"),
    [
        # turn 2 sent while turn 1 (1 s) still prefills: the engine computes its whole prompt,
        # so the worker has ~2 s queued, not ~1 s and a few tokens
        (True, 0.1, 0.9 + 1.0003),
        (False, 0.1, 0.9 + 0.0003),
        # sent after turn 1's prefill was predicted to end: cached either way
        (True, 1.5, 0.0003),
        (False, 1.5, 0.0003),
    ],
)
def test_the_queue_counts_the_engines_view_of_a_turn_behind_its_predecessor(
    queue_prefilled: bool, gap_s: float, backlog_s: float
) -> None:
    clock = Clock()
    slo = SloSettings(tpot_slo_x=5.0, prefilled=True, queue_prefilled=queue_prefilled)
    st = CacheState(CacheAwareSettings(crossover_tokens=0.0, slo=slo), clock=clock)
    a = make_worker("a", engine="sglang")
    st.observe(routed_event(_request("turn1", [*DOC, 1]), Colocated(a)))
    clock.t += gap_s
    st.observe(routed_event(_request("turn2", [*DOC, 1, 2, 3]), Colocated(a)))
    assert st.queues.backlog("a", clock.t) / st.queues.rate("a") == pytest.approx(backlog_s, rel=1e-3)


@pytest.mark.parametrize(("slo_cache", "ok"), [("routed", False), ("prefilled", True)])
def test_queue_cache_prefilled_needs_the_slo_terms_engine_view(slo_cache: str, ok: bool) -> None:
    table = {"type": "cache_aware", "tpot_slo_x": 5.0, "slo_cache": slo_cache, "queue_cache": "prefilled"}
    if ok:
        assert cache_aware_settings(parse_policy(table)).slo.queue_prefilled  # type: ignore[arg-type]
    else:
        with pytest.raises(ValueError, match="queue_cache"):
            parse_policy(table)
