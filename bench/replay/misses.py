"""Where a replay's SLO misses are: per target, the requests that missed the TTFT SLO and those
that missed the TPOT SLO, by the length of the answer the trace row asks for.

A prefill-first engine (SGLang) holds every decode on a worker while it prefills, so a short
answer (a few tokens, a few milliseconds of decoding) misses its TPOT SLO whenever one prefill
reaches its worker during its decode, while a long one absorbs a few; a short prompt misses its
TTFT SLO behind one long prefill queued ahead of it. The table says which of those a router
loses, to aim a policy change at the right requests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

from bench.replay import compare
from bench.replay.stats import Calibration, Record, Slo, meets

if TYPE_CHECKING:
    from bench.replay.report import Report, RunResult

# answer lengths (tokens the row asks for), inclusive bounds; None: no upper bound
BUCKETS: tuple[tuple[int, int | None], ...] = ((1, 1), (2, 3), (4, 8), (9, 20), (21, 100), (101, None))


def bucket_label(lo: int, hi: int | None) -> str:
    if hi is None:
        return f"> {lo - 1}"
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def counts(
    records: Sequence[Record], ttft_slo: Slo, tpot_slo: Slo, calib: Calibration | None
) -> list[tuple[int, int, int]]:
    """Per bucket of `BUCKETS`: (requests, TTFT missed, TPOT missed), warm-up left out; a failed
    request misses both (as `stats.meets` counts it)."""
    out = [[0, 0, 0] for _ in BUCKETS]
    for rec in records:
        if rec.warmup:
            continue
        for i, (lo, hi) in enumerate(BUCKETS):
            if rec.output_length >= lo and (hi is None or rec.output_length <= hi):
                t_ok, p_ok = meets(rec, ttft_slo, tpot_slo, calib)
                row = out[i]
                row[0] += 1
                row[1] += not t_ok
                row[2] += not p_ok
                break
    return [(n, t, p) for n, t, p in out]


def table(rep: Report, load: str) -> list[str]:
    """The markdown table of one load: a row per target, a cell per bucket, `TTFT missed / TPOT
    missed of requests`, each the mean per repeat. Empty when the SLOs cannot be judged (a
    relative SLO without a calibration) or nothing ran."""
    ttft_slo, tpot_slo = Slo.parse(rep.slo_ttft), Slo.parse(rep.slo_tpot)
    calib = rep.calibration
    if calib is not None and not isinstance(calib, Calibration):
        calib = msgspec.convert(calib, Calibration)
    if calib is None and (ttft_slo.relative or tpot_slo.relative):
        return []
    by_target: dict[str, list[RunResult]] = {}
    for r in rep.runs:
        if r.load == load:
            by_target.setdefault(r.target, []).append(r)
    if not by_target:
        return []
    head = [bucket_label(lo, hi) for lo, hi in BUCKETS]
    lines = [
        "| target | " + " | ".join(f"answer {h}" for h in head) + " |",
        "|---" * (len(head) + 1) + "|",
    ]
    for target in compare.order(rep, load):
        runs = by_target[target]
        sums = [[0, 0, 0] for _ in BUCKETS]
        for r in runs:
            for acc, got in zip(sums, counts(r.records, ttft_slo, tpot_slo, calib), strict=True):
                for j in range(3):
                    acc[j] += got[j]
        k = len(runs)
        cells = [f"{t / k:.1f} / {p / k:.1f} of {n / k:.0f}" for n, t, p in sums]
        lines.append(f"| {target} | " + " | ".join(cells) + " |")
    return lines
