"""The replay report's table of where the SLO misses are (bench/replay/misses.py): TTFT and TPOT
misses counted by the answer length the row asks for, failures missing both, warm-up left out,
the mean per repeat; and the report carries it under each load's table."""

from __future__ import annotations

from bench.replay import misses, report
from bench.replay.stats import Calibration, Record, Slo
from tests.bench.support import report_of, run_result

CALIB = Calibration(lengths=[100, 1000], ttft_s=[0.1, 0.1], tpot_s=[0.01, 0.01])  # flat: 0.1 s, 10 ms


def rec(out: int, ttft: float, decode: float, *, status: int = 200, warmup: bool = False) -> Record:
    """A request of `out` answer tokens, first token `ttft` s after it was sent, its last
    `decode` s after that."""
    return Record(
        index=0,
        input_length=500,
        output_length=out,
        sent=10.0,
        first_token=10.0 + ttft,
        last_token=10.0 + ttft + decode,
        done=10.0 + ttft + decode,
        status=status,
        completion_tokens=out,
        warmup=warmup,
    )


RECORDS = [
    rec(3, 0.2, 0.02),  # 2-3: within both (TTFT 0.2 <= 0.5, TPOT 10 ms <= 50 ms)
    rec(3, 0.6, 0.02),  # 2-3: TTFT missed
    rec(3, 0.2, 0.2),  # 2-3: TPOT missed (100 ms per token)
    rec(10, 0.2, 0.09),  # 9-20: within
    rec(10, 0.2, 0.6, status=500),  # 9-20: failed, misses both
    rec(200, 0.9, 15.0),  # > 100: both missed (75 ms per token)
    rec(5, 9.0, 9.0, warmup=True),  # left out
]


def test_counts_by_answer_length() -> None:
    got = misses.counts(RECORDS, Slo(5, True), Slo(5, True), CALIB)
    labels = [misses.bucket_label(lo, hi) for lo, hi in misses.BUCKETS]
    assert dict(zip(labels, got, strict=True)) == {
        "1": (0, 0, 0),
        "2-3": (3, 1, 1),
        "4-8": (0, 0, 0),
        "9-20": (2, 1, 1),
        "21-100": (0, 0, 0),
        "> 100": (1, 1, 1),
    }


def test_the_report_carries_the_table_with_means_per_repeat() -> None:
    rep = report_of([run_result("a", 0, RECORDS, CALIB), run_result("a", 1, RECORDS[:3], CALIB)], CALIB)
    text = report.markdown(rep)
    assert "Where the SLO misses are" in text
    row = next(line for line in text.splitlines() if line.startswith("| a | 0.0 / 0.0 of 0"))
    # 2-3: (1 + 1) / 2 TTFT, (1 + 1) / 2 TPOT of (3 + 3) / 2; 9-20: 1 of 2 in the first repeat only
    assert row.split(" | ")[2] == "1.0 / 1.0 of 3"
    assert row.split(" | ")[4] == "0.5 / 0.5 of 1"
    # a relative SLO without a calibration is not judged: no table
    bare = report_of(rep.runs, None)
    assert "Where the SLO misses are" not in report.markdown(bare)
