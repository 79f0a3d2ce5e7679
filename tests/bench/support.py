"""Builders the replay-report tests share: a run of records and a report of runs, every field a
test does not care about left empty."""

from __future__ import annotations

from bench.replay.report import Report, RunResult
from bench.replay.stats import Calibration, Record, Slo, summarize


def run_result(
    target: str, repeat: int, records: list[Record], calibration: Calibration, *, rate: float = 1.0
) -> RunResult:
    """`records` as one repeat of `target` at `rate`, summarized against 5x SLOs."""
    return RunResult(
        target=target,
        kind="gateway",
        load=f"rate x{rate:g}",
        rate=rate,
        concurrency=None,
        repeat=repeat,
        position=0,
        summary=summarize(records, Slo(5, True), Slo(5, True), calibration),
        hit_rate=0.0,
        load_spread=1.0,
        workers={},
        frontend_cpu_s=0.0,
        cluster_cpu_s=0.0,
        client_cpu_s=0.0,
        partial=False,
        argv=[],
        records=records,
    )


def report_of(runs: list[RunResult], calibration: Calibration | None, rows: int = 6) -> Report:
    """A report of `runs` with 5x SLOs and `calibration`."""
    return Report(
        command="",
        started="",
        conditions={},
        cluster="",
        input="",
        rows=rows,
        slo_ttft="5x",
        slo_tpot="5x",
        calibration=calibration,
        reachable={},
        runs=runs,
    )
