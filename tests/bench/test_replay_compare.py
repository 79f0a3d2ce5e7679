"""The replay report's paired comparison (bench/replay/compare.py): each target against the first,
the ratio of the means (not the mean of the ratios) or the hit rate's difference in points, a
bootstrap interval over the repeats paired by repeat that holds the truth and excludes 1x only
when the repeats say so, and no table with too few pairs."""

from __future__ import annotations

import random

import msgspec
import pytest

from bench.replay import compare, report
from bench.replay.report import RunResult
from bench.replay.stats import Calibration, Record
from tests.bench.support import report_of, run_result

CALIB = Calibration(lengths=[100, 1000], ttft_s=[0.1, 0.1], tpot_s=[0.01, 0.01])
REC = Record(
    index=0,
    input_length=500,
    output_length=4,
    sent=1.0,
    first_token=1.1,
    last_token=1.2,
    done=1.2,
    status=200,
    completion_tokens=4,
)


def run(target: str, repeat: int, goodput: float, p90: float, hit: float) -> RunResult:
    r = run_result(target, repeat, [REC], CALIB)
    ttft = dict(r.summary.ttft_s, p90=p90, mean=p90 / 2)
    summary = msgspec.structs.replace(r.summary, goodput_rps=goodput, ttft_s=ttft)
    return msgspec.structs.replace(r, summary=summary, hit_rate=hit)


def runs_of(target: str, goodputs: list[float], p90s: list[float], hits: list[float]) -> list[RunResult]:
    return [run(target, i, g, p, h) for i, (g, p, h) in enumerate(zip(goodputs, p90s, hits, strict=True))]


def test_the_ratio_is_of_the_means_and_the_hit_a_difference_in_points() -> None:
    a = runs_of("a", [10.0, 20.0], [1.0, 1.0], [0.50, 0.40])
    b = runs_of("b", [12.0, 18.0], [0.5, 1.0], [0.48, 0.41])
    ps = compare.pairs(a, b)
    goodput, _, p90, hit = compare.METRICS
    assert compare.statistic(ps, goodput[1], True) == pytest.approx(30.0 / 30.0)  # (not (1.2 + 0.9) / 2)
    assert compare.statistic(ps, p90[1], True) == pytest.approx(0.75)
    assert compare.statistic(ps, hit[1], False) == pytest.approx(-0.5)


def test_pairs_follow_the_repeat_not_the_order() -> None:
    a = runs_of("a", [10.0, 20.0, 30.0], [1.0] * 3, [0.5] * 3)
    b = list(reversed(runs_of("b", [11.0, 22.0, 33.0], [1.0] * 3, [0.5] * 3)))[:2]  # repeats 2, 1
    ps = compare.pairs(a, b)
    assert [(x.repeat, y.repeat) for x, y in ps] == [(2, 2), (1, 1)]
    assert compare.statistic(ps, compare.METRICS[0][1], True) == pytest.approx(1.1)


@pytest.mark.parametrize(
    ("lift", "holds_one"),
    [(1.10, False), (1.00, True)],
)
def test_the_interval_excludes_one_only_when_the_repeats_differ(lift: float, holds_one: bool) -> None:
    rng = random.Random(7)
    base = [10.0 + rng.uniform(-0.3, 0.3) for _ in range(8)]
    other = [g * lift + 0.3 * (-1) ** i for i, g in enumerate(base)]  # (noise summing to 0)
    ps = compare.pairs(runs_of("a", base, [1.0] * 8, [0.5] * 8), runs_of("b", other, [1.0] * 8, [0.5] * 8))
    lo, hi = compare.interval(ps, compare.METRICS[0][1], True, random.Random(0))
    value = compare.statistic(ps, compare.METRICS[0][1], True)
    assert value == pytest.approx(lift) and lo <= value <= hi
    assert (lo <= 1.0 <= hi) is holds_one


def test_the_report_carries_the_table_under_each_load() -> None:
    a = runs_of("router", [10.0, 10.5, 9.5], [0.8, 0.9, 0.85], [0.51, 0.50, 0.52])
    b = runs_of("mine", [12.0, 12.5, 11.5], [0.6, 0.6, 0.62], [0.49, 0.50, 0.50])
    text = report.markdown(report_of([*a, *b], CALIB))
    assert "Each target against router, paired by repeat" in text
    row = next(line for line in text.splitlines() if line.startswith("| mine | 3 | "))
    assert row.startswith("| mine | 3 | 1.20x (")
    assert "| -1.3 (" in row


def test_no_table_with_one_target_or_too_few_pairs() -> None:
    a = runs_of("a", [10.0, 11.0], [1.0, 1.0], [0.5, 0.5])
    b = runs_of("b", [12.0, 13.0], [1.0, 1.0], [0.5, 0.5])
    assert compare.table(report_of(a, CALIB), "rate x1") == []
    assert compare.table(report_of([*a, *b], CALIB), "rate x1") == []
    assert "paired by repeat" not in report.markdown(report_of([*a, *b], CALIB))


def at(rate: float, target: str, goodputs: list[float]) -> list[RunResult]:
    return [
        msgspec.structs.replace(r, load=f"rate x{rate:g}", rate=rate)
        for r in runs_of(target, goodputs, [1.0] * len(goodputs), [0.5] * len(goodputs))
    ]


def test_the_reference_is_the_commands_first_target_at_every_load() -> None:
    # main.py rotates the order by repeat and by load: at the second load, repeat 0 runs b first
    x1 = [*at(1, "a", [10.0] * 3), *at(1, "b", [12.0] * 3)]
    x2 = [*at(2, "b", [9.0] * 3), *at(2, "a", [10.0] * 3)]
    rep = report_of([*x1, *x2], CALIB)  # kept no `targets`: the first load's first repeat tells
    assert compare.order(rep, "rate x2") == ["a", "b"]
    assert compare.table(rep, "rate x2")[2].startswith("| b | 3 | 0.90x (")
    assert report.markdown(rep).count("Each target against a,") == 2
    alone = msgspec.structs.replace(report_of(x2, CALIB), targets=["a", "b"])  # as main.py keeps it
    assert compare.table(alone, "rate x2")[2].startswith("| b | 3 | 0.90x (")
