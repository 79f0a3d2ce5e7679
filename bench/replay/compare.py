"""The replay report's paired comparison: each target against the first, over the repeats.

On a small machine a target's TTFT p90 moves by a few hundredths of a second from one repeat to
the next and by ~0.05 s from one run to the next (docs/benchmarks.md, "Wave 17 after the
merges"), so a ratio of medians says little about whether two targets differ. The targets take
turns within a repeat, so a target's repeat i ran beside the first target's repeat i, under the
same conditions: the repeats pair up. For each target after the first this table gives the ratio
of its mean to the first target's (goodput, TTFT mean, TTFT p90: the issue's figures) and the
hit rate's difference in points, each with a 90 % interval from a bootstrap over the paired
repeats (2,000 resamples of the pairs, seeded, so a report renders the same every time). An
interval that holds 1x (or 0 points) says the run could not tell the two apart.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.replay.report import Report, RunResult

RESAMPLES = 2000
LEVEL = 0.9
MIN_PAIRS = 3  # fewer paired repeats: no interval worth printing

Get = Callable[["RunResult"], float]
METRICS: tuple[tuple[str, Get, bool], ...] = (  # (name, value, as a ratio; else points of difference)
    ("goodput", lambda r: r.summary.goodput_rps, True),
    ("TTFT mean", lambda r: r.summary.ttft_s["mean"], True),
    ("TTFT p90", lambda r: r.summary.ttft_s["p90"], True),
    ("cache hit", lambda r: r.hit_rate, False),
)

Pair = tuple["RunResult", "RunResult"]


def pairs(base: Sequence[RunResult], other: Sequence[RunResult]) -> list[Pair]:
    """(the first target's run, the other's) for every repeat both ran."""
    by_repeat = {r.repeat: r for r in base}
    return [(by_repeat[r.repeat], r) for r in other if r.repeat in by_repeat]


def statistic(ps: Sequence[Pair], get: Get, ratio: bool) -> float:
    """The other's mean over the first's (`ratio`), or their difference in points."""
    a = math.fsum(get(x) for x, _ in ps) / len(ps)
    b = math.fsum(get(y) for _, y in ps) / len(ps)
    if not ratio:
        return (b - a) * 100.0
    return b / a if a > 0.0 else math.nan


def interval(ps: Sequence[Pair], get: Get, ratio: bool, rng: random.Random) -> tuple[float, float]:
    """A `LEVEL` bootstrap interval of `statistic` over resamples of the pairs."""
    n = len(ps)
    vals = sorted(statistic([ps[rng.randrange(n)] for _ in range(n)], get, ratio) for _ in range(RESAMPLES))
    vals = [v for v in vals if not math.isnan(v)]
    if not vals:
        return math.nan, math.nan
    lo = int((1.0 - LEVEL) / 2.0 * len(vals))
    hi = max(lo, int((1.0 + LEVEL) / 2.0 * len(vals)) - 1)
    return vals[lo], vals[hi]


def _cell(value: float, lo: float, hi: float, ratio: bool) -> str:
    if math.isnan(value):
        return "-"
    if ratio:
        return f"{value:.2f}x ({lo:.2f} to {hi:.2f})"
    return f"{value:+.1f} ({lo:+.1f} to {hi:+.1f})"


def order(rep: Report, load: str | None = None) -> list[str]:
    """The targets in the command's order (at `load`: those that ran there), the first being every
    comparison's reference. The runs alone do not give it at a second load: the order rotates by
    repeat and by load (main.py), so the second load's first run is the second target's. A report
    that did not keep `targets` (before 2026-12-06) gives it by first appearance over all the
    runs, the first load's first repeat being in the command's order."""
    given = list(rep.targets) or list(dict.fromkeys(r.target for r in rep.runs))
    given += [r.target for r in rep.runs if r.target not in given]
    if load is None:
        return given
    ran = {r.target for r in rep.runs if r.load == load}
    return [t for t in given if t in ran]


def table(rep: Report, load: str) -> list[str]:
    """The comparison's markdown rows at `load` (none with one target or too few pairs)."""
    runs = [r for r in rep.runs if r.load == load]
    targets = order(rep, load)
    if len(targets) < 2:
        return []
    base = [r for r in runs if r.target == targets[0]]
    rows = []
    for target in targets[1:]:
        ps = pairs(base, [r for r in runs if r.target == target])
        if len(ps) < MIN_PAIRS:
            continue
        rng = random.Random(f"{load}/{target}")
        cells = []
        for _, get, ratio in METRICS:
            lo, hi = interval(ps, get, ratio, rng)
            cells.append(_cell(statistic(ps, get, ratio), lo, hi, ratio))
        rows.append(f"| {target} | {len(ps)} | " + " | ".join(cells) + " |")
    if not rows:
        return []
    head = "| target | repeats | " + " | ".join(
        f"{name} x" if ratio else f"{name}, points" for name, _, ratio in METRICS
    )
    return [head + " |", "|---" * (len(METRICS) + 2) + "|", *rows]
