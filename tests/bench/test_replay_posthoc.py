"""A stored replay judged again at other SLOs (bench/replay/posthoc.py, `python -m
bench.replay.report DIR --slo-ttft 3x --slo-tpot 3x` and `--slo-sweep`): the same records give
the goodput and attainment the run would have had at those SLOs, the report says plainly that it
was judged after the run and that a policy told the SLOs was told the run's, the run's own folder
is never rewritten, and every report states the goodput ceiling (the offered rate, and the
highest ratio to the first target it allows)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from bench.replay import posthoc, report
from bench.replay.report import RunResult
from bench.replay.stats import Calibration, Record, Slo
from tests.bench.support import report_of, run_result

CALIB = Calibration(lengths=[100, 1000], ttft_s=[0.1, 0.1], tpot_s=[0.01, 0.01])


def rec(i: int, ttft: float, tpot: float = 0.01) -> Record:
    """Request `i`, due and sent at 1 + i seconds (a record sent at 0 was never sent), five tokens."""
    t0 = 1.0 + i
    first = t0 + ttft
    return Record(
        index=i,
        input_length=500,
        output_length=5,
        scheduled=t0,
        sent=t0,
        first_token=first,
        last_token=first + 4 * tpot,
        done=first + 4 * tpot,
        status=200,
        completion_tokens=5,
    )


# TTFT 2x, 4x, 4x, 7x the unloaded 0.1 s; TPOT 1x except the last (4x)
RECORDS = [rec(0, 0.2), rec(1, 0.4), rec(2, 0.4), rec(3, 0.7, tpot=0.04)]


def runs(
    target: str, records: list[Record], repeats: int = 3, argv: list[str] | None = None
) -> list[RunResult]:
    out = []
    for k in range(repeats):
        r = run_result(target, k, records, CALIB)
        out.append(msgspec.structs.replace(r, argv=argv or []))
    return out


def test_rejudging_counts_the_same_records_against_the_new_slos() -> None:
    rep = report_of(runs("a", RECORDS, 1), CALIB)
    assert rep.runs[0].summary.slo_attainment == pytest.approx(0.75)  # at 5x: the 7x TTFT misses
    at3 = posthoc.rejudge(rep, Slo.parse("3x"), Slo.parse("3x"))
    s = at3.runs[0].summary
    assert (s.ttft_attainment, s.tpot_attainment, s.slo_attainment) == (0.25, 0.75, 0.25)
    assert s.goodput_rps == pytest.approx(1 / s.duration_s)
    at8 = posthoc.rejudge(at3, Slo.parse("8x"), Slo.parse("8x"))
    assert at8.runs[0].summary.slo_attainment == 1.0
    # the run's own SLOs are kept, through a second re-judging too; the stored report is untouched
    assert (at8.slo_ttft, at8.run_slo_ttft, at8.run_slo_tpot) == ("8x", "5x", "5x")
    assert rep.runs[0].summary.slo_attainment == pytest.approx(0.75) and rep.run_slo_ttft == ""


def test_a_relative_slo_needs_the_stored_calibration() -> None:
    rep = report_of(runs("a", RECORDS, 1), None)
    with pytest.raises(ValueError, match="no calibration"):
        posthoc.rejudge(rep, Slo.parse("3x"), Slo.parse("3x"))
    absolute = posthoc.rejudge(rep, Slo.parse("0.5s"), Slo.parse("100ms"))
    assert absolute.runs[0].summary.ttft_attainment == 0.75


def test_the_rejudged_report_says_so_and_names_the_targets_told_the_slos(tmp_path: Path) -> None:
    told = tmp_path / "told.toml"
    told.write_text('policy = { type = "cache_aware", tpot_slo_x = 5.0, ttft_slo_x = 0.0 }\n')
    blind = tmp_path / "blind.toml"
    blind.write_text('policy = { type = "cache_aware" }\n')
    rep = report_of(
        [*runs("router", RECORDS, 1), *runs("mine", RECORDS, 1, ["serve", "--config", str(told)])], CALIB
    )
    assert "post hoc" not in report.markdown(rep)
    text = report.markdown(posthoc.rejudge(rep, Slo.parse("3x"), Slo.parse("3x")))
    assert "**Judged after the run (post hoc)** at TTFT 3x, TPOT 3x" in text
    assert "the run was made at TTFT 5x, TPOT 5x" in text
    assert "was told the run's SLOs (TTFT 5x, TPOT 5x), not these: `mine` (tpot_slo_x = 5.0)" in text
    other = report_of(runs("mine", RECORDS, 1, [f"--config={blind}"]), CALIB)
    text = report.markdown(posthoc.rejudge(other, Slo.parse("3x"), Slo.parse("5x")))
    assert "no target's configuration file sets one" in text


def test_every_report_states_the_goodput_ceiling() -> None:
    # 4 requests due over 3 s; the first target meets both SLOs for 3 of them at 5x
    rep = report_of([*runs("router", RECORDS), *runs("mine", RECORDS)], CALIB)
    duration = rep.runs[0].summary.duration_s
    assert duration == pytest.approx(3.0 + 0.7 + 0.16)
    text = report.markdown(rep)
    assert "4 requests due over the trace's span offer 1.33 req/s" in text
    assert f"no target exceeds {4 / duration:.2f} req/s, **1.333x router's mean goodput**" in text
    assert "met both SLOs for 75.0% of its requests" in text


def test_the_sweep_gives_each_slo_its_ratio_ceiling_and_attainment() -> None:
    better = [rec(0, 0.2), rec(1, 0.4), rec(2, 0.25), rec(3, 0.7, tpot=0.04)]  # (the same duration)
    rep = report_of([*runs("router", RECORDS), *runs("mine", better)], CALIB)
    rows = posthoc.sweep_table(rep, "rate x1", posthoc.sweep_slos("3x,5x,8x/2x"))
    assert len(rows) == 2 + 3 * 2
    by = {tuple(c.strip() for c in row.split("|")[1:3]): row for row in rows[2:]}
    # at 3x the router meets both SLOs for 1 request of 4, mine for 2: 2.00x, the ceiling 4.00x
    assert "| 2.00x (2.00 to 2.00) | 4.00x | 50.0% | 50.0% | 75.0% |" in by[("3x / 3x", "mine")]
    assert "| 1.00x | 4.00x | 25.0% | 25.0% | 75.0% |" in by[("3x / 3x", "router")]
    # at 5x both meet 3 of 4 (0.7 s is 7x): level, and the ceiling 1.33x
    assert "| 1.00x (1.00 to 1.00) | 1.33x | 75.0% |" in by[("5x / 5x (the run's)", "mine")]
    assert "| 75.0% | 100.0% | 75.0% |" in by[("8x / 2x", "router")]
    assert posthoc.sweep_slos("3x, 4x/5x") == [(Slo(3, True), Slo(3, True)), (Slo(4, True), Slo(5, True))]


def test_the_command_judges_a_stored_run_without_rewriting_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, out = tmp_path / "run", tmp_path / "at3"
    report.write(report_of([*runs("router", RECORDS), *runs("mine", RECORDS)], CALIB), run_dir, plots=False)
    stored = (run_dir / "results.json").read_bytes(), (run_dir / "report.md").read_bytes()
    argv = [str(run_dir), "--slo-ttft", "3x", "--slo-tpot", "3x", "--slo-sweep", "3x,5x", "--out", str(out)]
    assert report.main(argv) == 0
    printed = capsys.readouterr().out
    assert "**Judged after the run (post hoc)** at TTFT 3x, TPOT 3x" in printed
    assert "| 5x / 5x (the run's) | mine |" in printed
    assert ((run_dir / "results.json").read_bytes(), (run_dir / "report.md").read_bytes()) == stored
    again = msgspec.json.decode((out / "results.json").read_bytes(), type=report.Report)
    assert (again.slo_ttft, again.run_slo_ttft) == ("3x", "5x")
    assert "post hoc" in (out / "report.md").read_text()
    assert report.main([str(run_dir), "--slo-ttft", "3x", "--out", str(run_dir)]) == 2
