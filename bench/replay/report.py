"""Writing a replay's results: JSON (everything, records included), a Markdown table (median
and min-max over repeats) and PNG plots (goodput vs rate, TTFT CDF, per-worker load)."""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from bench.replay import compare, misses, posthoc
from bench.replay.cluster import Counters
from bench.replay.reference import SimResult
from bench.replay.stats import Record, Slo, Summary


class WorkerLoad(msgspec.Struct):
    role: str
    counters: Counters


class RunResult(msgspec.Struct, kw_only=True):
    target: str
    kind: str
    load: str  # "rate 1.5" or "concurrency 8"
    rate: float | None
    concurrency: int | None
    repeat: int
    position: int  # its place in this repeat's order
    summary: Summary
    hit_rate: float
    load_spread: float  # max / mean prefill tokens computed over the prefill-capable workers
    workers: dict[str, WorkerLoad]
    frontend_cpu_s: float
    cluster_cpu_s: float
    client_cpu_s: float
    partial: bool
    argv: list[str]
    records: list[Record]


class Failure(msgspec.Struct):
    """A run that did not happen: its target would not start or never answered."""

    target: str
    load: str
    repeat: int
    error: str


class Report(msgspec.Struct, kw_only=True):
    command: str
    started: str
    conditions: dict[str, Any]
    cluster: str
    input: str
    rows: int
    slo_ttft: str
    slo_tpot: str
    calibration: Any
    reachable: dict[str, list[SimResult]]  # load label -> simulated policies
    runs: list[RunResult]
    failures: list[Failure] = []
    partial: bool = False
    targets: list[str] = []  # the command's order, the first the comparisons' reference (compare.order)
    # the SLOs the run was made with, when this report judges it at others after the fact
    # (bench/replay/posthoc.py; empty: slo_ttft / slo_tpot are the run's own)
    run_slo_ttft: str = ""
    run_slo_tpot: str = ""


def _fmt(values: Sequence[float], f: Callable[[float], str]) -> str:
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return "-"
    med = statistics.median(vals)
    if len(vals) == 1 or min(vals) == max(vals):
        return f(med)
    return f"{f(med)} ({f(min(vals))}-{f(max(vals))})"


def _s(v: float) -> str:
    return f"{v:.2f}"


def _ms(v: float) -> str:
    return f"{v * 1000:.0f}"


def _pct(v: float) -> str:
    return f"{v * 100:.0f}%"


def _pct1(v: float) -> str:
    return f"{v * 100:.1f}%"


def loads_in_order(runs: Sequence[RunResult]) -> list[str]:
    return list(dict.fromkeys(r.load for r in runs))


COLUMNS: list[tuple[str, Callable[[RunResult], float], Callable[[float], str]]] = [
    ("goodput req/s", lambda r: r.summary.goodput_rps, _s),
    ("SLO met", lambda r: r.summary.slo_attainment, _pct),
    ("TTFT p50 s", lambda r: r.summary.ttft_s["p50"], _s),
    ("TTFT p90 s", lambda r: r.summary.ttft_s["p90"], _s),
    ("TTFT p99 s", lambda r: r.summary.ttft_s["p99"], _s),
    ("TPOT p50 ms", lambda r: r.summary.tpot_s["p50"], _ms),
    ("TPOT p99 ms", lambda r: r.summary.tpot_s["p99"], _ms),
    ("e2e p50 s", lambda r: r.summary.e2e_s["p50"], _s),
    ("req/s", lambda r: r.summary.throughput_rps, _s),
    ("cache hit", lambda r: r.hit_rate, _pct1),
    ("load max/mean", lambda r: r.load_spread, _s),
    ("errors", lambda r: float(r.summary.errors + r.summary.unfinished), lambda v: f"{v:.0f}"),
    ("front-end CPU s", lambda r: r.frontend_cpu_s, lambda v: f"{v:.1f}"),
    ("send lag p99 ms", lambda r: r.summary.send_lag_s["p99"], _ms),
]


def markdown(rep: Report) -> str:
    lines = [
        f"Cluster: {rep.cluster}. Input: {rep.input} ({rep.rows} rows). "
        f"SLOs: TTFT {rep.slo_ttft}, TPOT {rep.slo_tpot}"
        + (
            " (multiples of each request's unloaded figures from the calibration pass)"
            if "x" in rep.slo_ttft + rep.slo_tpot
            else ""
        )
        + ".",
        "",
        *posthoc.note(rep),
    ]
    repeats = max((r.repeat for r in rep.runs), default=0) + 1
    if repeats > 1:
        lines += [f"Each cell: median (min-max) over {repeats} repeats, each on a fresh cluster.", ""]
    for load in loads_in_order(rep.runs):
        lines.append(f"**{load}**" + _reach(rep.reachable.get(load, [])))
        lines.append("")
        lines.append("| target | " + " | ".join(c[0] for c in COLUMNS) + " |")
        lines.append("|---" * (len(COLUMNS) + 1) + "|")
        for target in compare.order(rep, load):
            runs = [r for r in rep.runs if r.load == load and r.target == target]
            if not runs:
                continue
            cells = [_fmt([get(r) for r in runs], f) for _, get, f in COLUMNS]
            lines.append(f"| {target} | " + " | ".join(cells) + " |")
        lines += ["", posthoc.ceiling_line(rep, load), ""]
        against = compare.table(rep, load)
        if against:
            lines += [
                f"Each target against {compare.order(rep, load)[0]}, "
                "paired by repeat (bench/replay/compare.py): the ratio of the means, or the hit "
                "rate's difference in points, with a 90 % bootstrap interval over the repeats",
                "",
                *against,
                "",
            ]
        where = misses.table(rep, load)
        if where:
            lines += [
                "Where the SLO misses are (bench/replay/misses.py): TTFT missed / TPOT missed of the "
                "requests, by the answer's length in tokens, each the mean per repeat",
                "",
                *where,
                "",
            ]
    mism = sum(r.summary.prompt_mismatches for r in rep.runs)
    unrep = sum(r.summary.prompt_unreported for r in rep.runs)
    lines.append(
        f"Prompt lengths: {mism} answers reported a `prompt_tokens` other than the row's length"
        + (f"; {unrep} reported none" if unrep else "")
        + "."
    )
    for f in rep.failures:
        lines += [
            "",
            f"**{f.target}** ({f.load}, repeat {f.repeat + 1}) did not run: {f.error.splitlines()[0]}",
        ]
    if rep.partial:
        lines += ["", "**Partial**: the run was stopped before it finished; the figures cover what ran."]
    return "\n".join(lines) + "\n"


def _reach(sims: Sequence[SimResult]) -> str:
    if not sims:
        return ""
    parts = [f"{s.policy.replace('_', ' ')} {_pct1(s.reuse)}" for s in sims]
    return " — reachable reuse (simulated): " + ", ".join(parts)


def write(rep: Report, out: Path, plots: bool = True) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json", out / "report.md"]
    (out / "results.json").write_bytes(msgspec.json.format(msgspec.json.encode(rep), indent=1))
    (out / "report.md").write_text(markdown(rep))
    if plots and rep.runs:
        written += plot(rep, out)
    return written


def plot(rep: Report, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files: list[Path] = []
    targets = compare.order(rep)
    loads = loads_in_order(rep.runs)
    # goodput vs rate (or concurrency)
    fig, ax = plt.subplots(figsize=(7.5, 3.6), dpi=80)
    for t in targets:
        xs, med, lo, hi = [], [], [], []
        for load in loads:
            runs = [r for r in rep.runs if r.target == t and r.load == load]
            if not runs:
                continue
            vals = [r.summary.goodput_rps for r in runs]
            xs.append(runs[0].rate if runs[0].rate is not None else float(runs[0].concurrency or 0))
            m = statistics.median(vals)
            med.append(m)
            lo.append(m - min(vals))
            hi.append(max(vals) - m)
        ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, label=t)
    closed = rep.runs[0].rate is None
    ax.set_xlabel("concurrency" if closed else "rate multiplier")
    ax.set_ylabel("goodput (req/s meeting both SLOs)")
    ax.set_title(f"Goodput — {rep.cluster}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    files.append(out / "goodput.png")
    fig.savefig(files[-1])
    plt.close(fig)
    # TTFT CDF at the heaviest load, first repeat
    load = loads[-1]
    fig, ax = plt.subplots(figsize=(7.5, 3.6), dpi=80)
    for t in targets:
        runs = [r for r in rep.runs if r.target == t and r.load == load]
        if not runs:
            continue
        vals = sorted(x.ttft for x in runs[0].records if x.ok and not x.warmup)
        if vals:
            ax.plot(vals, [(i + 1) / len(vals) for i in range(len(vals))], label=t)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF — {load}, {rep.cluster}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    files.append(out / "ttft_cdf.png")
    fig.savefig(files[-1])
    plt.close(fig)
    # per-worker prefill tokens computed, heaviest load, first repeat
    fig, ax = plt.subplots(figsize=(7.5, 3.6), dpi=80)
    names: list[str] = []
    for r in rep.runs:
        if r.load == load:
            names += [n for n, w in r.workers.items() if w.role != "decode" and n not in names]
    width = 0.8 / max(1, len(targets))
    for k, t in enumerate(targets):
        runs = [r for r in rep.runs if r.target == t and r.load == load]
        if not runs:
            continue
        ys = [
            runs[0].workers[n].counters.computed_tokens / 1e6 if n in runs[0].workers else 0.0 for n in names
        ]
        ax.bar([i + k * width for i in range(len(names))], ys, width, label=t)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, fontsize=8)
    ax.set_ylabel("prefill tokens computed (M)")
    ax.set_title(f"Per-worker load — {load}, {rep.cluster}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    files.append(out / "worker_load.png")
    fig.savefig(files[-1])
    plt.close(fig)
    return files


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.replay.report",
        description="Render a replay's results again (report.md, plots) or, with other SLOs, judge its "
        "stored records after the fact (bench/replay/posthoc.py) without touching its directory.",
    )
    p.add_argument("dir", help="the run's results folder (its results.json)")
    p.add_argument(
        "--slo-ttft", default=None, help="judge at this TTFT SLO ('2', '500ms', '3x'); default the run's"
    )
    p.add_argument("--slo-tpot", default=None, help="likewise for the TPOT SLO")
    p.add_argument(
        "--slo-sweep",
        default=None,
        metavar="LIST",
        help="a table of goodput and attainment at each SLO: '3x,4x,5x,8x' (each for both) or '3x/5x,...' "
        "(TTFT/TPOT)",
    )
    p.add_argument("--out", default=None, help="with other SLOs: also write report.md and results.json here")
    return p


def main(argv: list[str]) -> int:
    """`python -m bench.replay.report DIR`: render DIR/results.json again (report.md, plots).
    With `--slo-ttft` / `--slo-tpot` the report is judged at those SLOs and printed (and written to
    `--out`, never into DIR); with `--slo-sweep` a table of SLOs is printed after it."""
    args = build_parser().parse_args(argv)
    src = Path(args.dir)
    if args.out and Path(args.out).resolve() == src.resolve():
        print("python -m bench.replay.report: --out must not be the run's own folder", file=sys.stderr)
        return 2
    rep = msgspec.json.decode((src / "results.json").read_bytes(), type=Report)
    rejudge = args.slo_ttft is not None or args.slo_tpot is not None
    try:
        sweep = posthoc.sweep_slos(args.slo_sweep) if args.slo_sweep else []
        if not rejudge and not sweep:
            for f in write(rep, src):
                print(f)
            return 0
        if rejudge:
            rep = posthoc.rejudge(
                rep, Slo.parse(args.slo_ttft or rep.slo_ttft), Slo.parse(args.slo_tpot or rep.slo_tpot)
            )
            print(markdown(rep))
        for load in loads_in_order(rep.runs) if sweep else []:
            print(
                f"**{load}**, judged after the run (post hoc) at each SLO from the stored records and "
                f"calibration. {posthoc.told(rep)}\n"
            )
            print("\n".join(posthoc.sweep_table(rep, load, sweep)) + "\n")
    except ValueError as exc:
        print(f"python -m bench.replay.report: {exc}", file=sys.stderr)
        return 2
    if args.out and rejudge:
        for f in write(rep, Path(args.out), plots=False):
            print(f, file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(sys.argv[1:]))
