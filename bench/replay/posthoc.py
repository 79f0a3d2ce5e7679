"""Judging a stored replay at other SLOs, after the fact (`python -m bench.replay.report DIR
--slo-ttft 3x --slo-tpot 3x`, or `--slo-sweep 3x,4x,5x,8x`).

A run's `results.json` keeps every request's record (send, first and last token, status, tokens)
and the calibration pass's unloaded TTFT and TPOT, which is all `stats.summarize` needs: the
goodput and attainment of the same requests under other SLOs come out exactly as if the run had
been told them, for every target that does not read the SLOs itself. A policy that does (a
gateway configuration with `ttft_slo_x`, `tpot_slo_x`, `ttft_slo_s` or `tpot_slo_s`: the cache
policy's SLO rank, the decider) routed for the run's SLOs, not for these, so a post-hoc figure is
what that routing would score against other SLOs, not what routing for them would score; the
re-rendered report says so and names the targets whose configuration file sets one.
"""

from __future__ import annotations

import math
import random
import re
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from bench.replay import compare
from bench.replay.stats import Calibration, Slo, summarize

if TYPE_CHECKING:
    from bench.replay.report import Report, RunResult

SLO_KNOB = re.compile(r"\b((?:ttft|tpot)_slo_[xs])\s*=\s*([0-9.eE+-]+)")


def calibration(rep: Report) -> Calibration | None:
    """The run's calibration as a `Calibration` (results.json decodes it as a plain mapping)."""
    calib = rep.calibration
    if calib is None or isinstance(calib, Calibration):
        return calib
    return msgspec.convert(calib, Calibration)


def rejudge(rep: Report, ttft_slo: Slo, tpot_slo: Slo) -> Report:
    """`rep` with every run's summary computed again from its records against these SLOs, and
    the SLOs the run was made with kept in `run_slo_ttft` / `run_slo_tpot` (the first ones, when
    `rep` was itself re-judged). ValueError when the run kept no calibration and an SLO is
    relative, or a run kept no records."""
    calib = calibration(rep)
    if calib is None and (ttft_slo.relative or tpot_slo.relative):
        raise ValueError("the run kept no calibration, so it can be judged only at absolute SLOs ('2s')")
    runs = []
    for r in rep.runs:
        if r.summary.requests and not r.records:
            raise ValueError(f"{r.target} ({r.load}, repeat {r.repeat + 1}) kept no per-request records")
        runs.append(msgspec.structs.replace(r, summary=summarize(r.records, ttft_slo, tpot_slo, calib)))
    return msgspec.structs.replace(
        rep,
        runs=runs,
        slo_ttft=str(ttft_slo),
        slo_tpot=str(tpot_slo),
        run_slo_ttft=rep.run_slo_ttft or rep.slo_ttft,
        run_slo_tpot=rep.run_slo_tpot or rep.slo_tpot,
    )


def is_rejudged(rep: Report) -> bool:
    return bool(rep.run_slo_ttft or rep.run_slo_tpot) and (
        (rep.run_slo_ttft, rep.run_slo_tpot) != (rep.slo_ttft, rep.slo_tpot)
    )


def slo_knobs(argv: Sequence[str]) -> list[str]:
    """The SLO settings (`tpot_slo_x = 5.0`, ...) set to a non-zero value in the `--config` file
    a target's command names, as the file reads now (empty when it names none or is gone)."""
    path = None
    for i, a in enumerate(argv):
        if a == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        elif a.startswith("--config="):
            path = a.partition("=")[2]
    if path is None:
        return []
    try:
        text = Path(path).read_text()
    except OSError:
        return []
    found = []
    for name, value in SLO_KNOB.findall(text):
        try:
            if float(value) != 0.0:
                found.append(f"{name} = {value}")
        except ValueError:
            continue
    return list(dict.fromkeys(found))


def told(rep: Report) -> str:
    """Which targets were told the SLOs: a sentence, ending with a full stop."""
    knobs: dict[str, list[str]] = {}
    for r in rep.runs:
        if r.target not in knobs:
            knobs[r.target] = slo_knobs(r.argv)
    named = [f"`{t}` ({', '.join(k)})" for t, k in knobs.items() if k]
    return (
        f"A policy told the SLOs (`ttft_slo_x`, `tpot_slo_x`, `ttft_slo_s`, `tpot_slo_s` in its "
        f"configuration) was told the run's SLOs (TTFT {rep.run_slo_ttft or rep.slo_ttft}, TPOT "
        f"{rep.run_slo_tpot or rep.slo_tpot}), not these"
        + (
            ": " + ", ".join(named) + " (their configuration files as they read now)."
            if named
            else "; no target's configuration file sets one as it reads now."
        )
    )


def note(rep: Report) -> list[str]:
    """The re-judged report's warning, as markdown lines (none when `rep` is as the run made it)."""
    if not is_rejudged(rep):
        return []
    return [
        f"**Judged after the run (post hoc)** at TTFT {rep.slo_ttft}, TPOT {rep.slo_tpot}, from the "
        f"stored records and calibration; the run was made at TTFT {rep.run_slo_ttft}, TPOT "
        f"{rep.run_slo_tpot}. " + told(rep),
        "",
    ]


def ceiling(runs: Sequence[RunResult]) -> tuple[float, float, float]:
    """(offered req/s, goodput ceiling req/s, mean run duration s) over `runs`: the requests over
    the span of their due times (what the trace offers), and the requests over the run's
    duration (goodput's denominator: first request sent to last answered), which bounds goodput:
    it is the goodput of a run in which every request met both SLOs."""
    offered, top, dur = [], [], []
    for r in runs:
        due = [x.scheduled for x in r.records if not x.warmup and x.sent]
        n = r.summary.requests
        if len(due) > 1 and max(due) > min(due):
            offered.append(n / (max(due) - min(due)))
        if r.summary.duration_s > 0.0:
            top.append(n / r.summary.duration_s)
            dur.append(r.summary.duration_s)
    mean = statistics.fmean
    return (
        mean(offered) if offered else math.nan,
        mean(top) if top else math.nan,
        mean(dur) if dur else math.nan,
    )


def ceiling_line(rep: Report, load: str) -> str:
    """One sentence: the offered rate, the goodput ceiling, and the highest ratio to the first
    target's goodput that it allows (empty when nothing ran at `load`)."""
    runs = [r for r in rep.runs if r.load == load]
    if not runs:
        return ""
    first = compare.order(rep, load)[0]
    offered, top, dur = ceiling(runs)
    base = [r for r in runs if r.target == first]
    good = statistics.fmean(r.summary.goodput_rps for r in base)
    met = statistics.fmean(r.summary.slo_attainment for r in base)
    n = statistics.fmean(r.summary.requests for r in runs)
    ratio = f"{top / good:.3f}x" if good > 0.0 else "unbounded"
    return (
        f"Goodput ceiling: {n:.0f} requests due over the trace's span offer {offered:.2f} req/s; goodput "
        f"counts the requests meeting both SLOs per second of a run ({dur:.2f} s on average, first "
        f"sent to last answered), so no target exceeds {top:.2f} req/s, **{ratio} {first}'s mean goodput** "
        f"of {good:.2f} req/s (it met both SLOs for {met:.1%} of its requests)."
    )


def sweep_slos(text: str) -> list[tuple[Slo, Slo]]:
    """'3x,4x,5x/8x' -> [(3x, 3x), (4x, 4x), (5x, 8x)]: an item is one SLO for both TTFT and
    TPOT, or TTFT/TPOT."""
    out = []
    for item in text.split(","):
        if not item.strip():
            continue
        a, _, b = item.partition("/")
        out.append((Slo.parse(a), Slo.parse(b or a)))
    if not out:
        raise ValueError(f"no SLOs in {text!r}")
    return out


def sweep_table(rep: Report, load: str, slos: Sequence[tuple[Slo, Slo]]) -> list[str]:
    """Markdown rows: per SLO pair and target, the mean goodput, its ratio to the first target's
    (paired, with the 90 % interval of compare.py), the target's goodput ceiling (`ceiling` over
    its runs) over the first target's goodput (for the first itself: 1 / its attainment), and the
    share of requests within both SLOs, the TTFT SLO and the TPOT SLO (means over the repeats)."""
    lines = [
        "| TTFT / TPOT SLO | target | goodput req/s | x first (90 % interval) | ceiling x | both met | "
        "TTFT met | TPOT met |",
        "|---" * 8 + "|",
    ]
    made = (rep.run_slo_ttft or rep.slo_ttft, rep.run_slo_tpot or rep.slo_tpot)
    for ttft_slo, tpot_slo in slos:
        judged = rejudge(rep, ttft_slo, tpot_slo)
        runs = [r for r in judged.runs if r.load == load]
        targets = compare.order(judged, load)
        if not targets:
            return []
        base = [r for r in runs if r.target == targets[0]]
        base_good = statistics.fmean(r.summary.goodput_rps for r in base)
        label = f"{ttft_slo} / {tpot_slo}" + (
            " (the run's)" if (str(ttft_slo), str(tpot_slo)) == made else ""
        )
        for t in targets:
            mine = [r for r in runs if r.target == t]
            s = [r.summary for r in mine]
            _, top, _ = ceiling(mine)
            cells = [
                f"{statistics.fmean(x.goodput_rps for x in s):.2f}",
                _ratio_cell(base, mine, load, t) if t != targets[0] else "1.00x",
                f"{top / base_good:.2f}x" if base_good > 0.0 else "-",
                f"{statistics.fmean(x.slo_attainment for x in s):.1%}",
                f"{statistics.fmean(x.ttft_attainment for x in s):.1%}",
                f"{statistics.fmean(x.tpot_attainment for x in s):.1%}",
            ]
            lines.append(f"| {label} | {t} | " + " | ".join(cells) + " |")
    return lines


def _ratio_cell(base: Sequence[RunResult], mine: Sequence[RunResult], load: str, target: str) -> str:
    ps = compare.pairs(base, mine)
    _, get, ratio = compare.METRICS[0]
    value = compare.statistic(ps, get, ratio) if ps else math.nan
    if len(ps) < compare.MIN_PAIRS or math.isnan(value):
        return "-" if math.isnan(value) else f"{value:.2f}x"
    # seeded as compare.table seeds its first metric (goodput): at the run's SLOs the two agree
    lo, hi = compare.interval(ps, get, ratio, random.Random(f"{load}/{target}"))
    return f"{value:.2f}x ({lo:.2f} to {hi:.2f})"
