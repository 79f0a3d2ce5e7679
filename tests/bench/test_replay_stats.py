"""bench/replay stats: percentiles, SLOs (absolute and relative), goodput and attainment."""

from __future__ import annotations

import math

import pytest

from bench.replay.stats import Calibration, Record, Slo, meets, pcts, summarize


def rec(
    i: int, *, ttft: float = 0.1, tpot: float = 0.01, out: int = 11, length: int = 1000, **kw: object
) -> Record:
    sent = 100.0 + i
    r = Record(index=i, input_length=length, output_length=out, scheduled=sent, sent=sent, status=200)
    r.first_token = sent + ttft
    r.last_token = r.first_token + tpot * (out - 1)
    r.done = r.last_token + 0.001
    r.completion_tokens = out
    r.prompt_tokens = length
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_percentiles_are_nearest_rank() -> None:
    p = pcts([float(x) for x in range(1, 101)])
    assert (p["p50"], p["p90"], p["p99"], p["max"]) == (50.0, 90.0, 99.0, 100.0)
    assert p["mean"] == 50.5
    assert pcts([3.0])["p99"] == 3.0
    assert math.isnan(pcts([math.nan])["p50"])


def test_slo_parse() -> None:
    assert Slo.parse("2.5") == Slo(2.5)
    assert Slo.parse("250ms") == Slo(0.25)
    assert Slo.parse("5x") == Slo(5.0, True)
    assert Slo.parse("3s") == Slo(3.0)
    with pytest.raises(ValueError, match="bad SLO"):
        Slo.parse("fast")


def test_ttft_and_tpot_of_a_record() -> None:
    r = rec(0, ttft=0.5, tpot=0.02, out=11)
    assert r.ttft == pytest.approx(0.5)
    assert r.tpot == pytest.approx(0.02)
    assert math.isnan(rec(0, out=1).tpot)


def test_goodput_counts_only_requests_meeting_both_slos() -> None:
    records = [
        rec(0),  # meets both
        rec(1),  # meets both
        rec(2, ttft=3.0),  # TTFT missed
        rec(3, tpot=0.5),  # TPOT missed
        rec(4, out=1),  # no TPOT: meets it
        rec(5, status=503, error="HTTP 503"),  # failed: meets neither
        rec(6, done=0.0, first_token=0.0, status=0),  # unfinished
        rec(7, warmup=True, ttft=9.0),  # warm-up: not measured
    ]
    s = summarize(records, Slo(1.0), Slo(0.1), None)
    assert s.requests == 7
    assert (s.completed, s.errors, s.unfinished) == (4 + 1, 1, 1)
    assert s.slo_attainment == pytest.approx(3 / 7)
    assert s.ttft_attainment == pytest.approx(4 / 7)
    assert s.tpot_attainment == pytest.approx(4 / 7)
    start = 100.0
    end = max(r.done for r in records[:5])
    assert s.duration_s == pytest.approx(end - start)
    assert s.goodput_rps == pytest.approx(3 / (end - start))
    assert s.throughput_rps == pytest.approx(5 / (end - start))
    assert s.error_samples == ["HTTP 503"]


def test_relative_slos_use_each_requests_calibrated_figures() -> None:
    calib = Calibration(lengths=[1000, 3000], ttft_s=[0.1, 0.3], tpot_s=[0.01, 0.02])
    assert calib.ttft(2000) == pytest.approx(0.2)
    assert calib.ttft(500) == pytest.approx(0.1)  # flat beyond the ends
    assert calib.tpot(9000) == pytest.approx(0.02)
    slo_t, slo_p = Slo(2.0, True), Slo(2.0, True)
    # 2000 tokens: TTFT limit 0.4 s, TPOT limit 0.03 s
    assert meets(rec(0, length=2000, ttft=0.39, tpot=0.029), slo_t, slo_p, calib) == (True, True)
    assert meets(rec(0, length=2000, ttft=0.41, tpot=0.031), slo_t, slo_p, calib) == (False, False)
    # the same TTFT is fine for a long prompt and too slow for a short one
    assert meets(rec(0, length=3000, ttft=0.5), slo_t, slo_p, calib)[0]
    assert not meets(rec(0, length=1000, ttft=0.5), slo_t, slo_p, calib)[0]
    with pytest.raises(ValueError, match="calibration"):
        meets(rec(0), slo_t, slo_p, None)


def test_prompt_length_mismatches_are_counted() -> None:
    s = summarize([rec(0), rec(1, prompt_tokens=999), rec(2, prompt_tokens=-1)], Slo(1), Slo(1), None)
    assert (s.prompt_mismatches, s.prompt_unreported) == (1, 1)


def test_send_lag_is_sent_minus_scheduled() -> None:
    r = rec(0)
    r.scheduled, r.sent = 10.0, 10.004
    r.first_token, r.last_token, r.done = 10.1, 10.2, 10.3
    s = summarize([r], Slo(99), Slo(99), None)
    assert s.send_lag_s["max"] == pytest.approx(0.004)
