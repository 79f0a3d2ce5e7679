"""Which requests broke each SLO miss of a replay, and whether the router predicted it.

`python -m bench.replay.attribution OUT_DIR --target LABEL [--repeat N]` joins a replay's
`results.json` records with the gateway's debug log (`OUT_DIR/logs/LABEL-*.log`, written with
`--log-level debug` in the target's command) by the replay client's `x-request-id:
replay-<row>`: each request's worker (`request.done`) and, for `cache_aware`, its decision
record (`route.decision`: every candidate's predicted prefill seconds, SLO misses and, with a
TPOT SLO, the decodes `DecodeSlo` weighed there with their predicted budgets and stalls).

For every answer past its TPOT SLO, the requests routed to its worker whose first token came
inside its decode window (a prefill-first engine holds every decode while it prefills: these
are what stalled it), and for every answer past its TTFT SLO those whose first token came between
its send and its own first token (prefills run ahead of it). For each such breaker: routed
before or after the missed request, its decision's predicted misses on the chosen worker and
the fewest of any candidate, and whether that decision listed the missed decode as broken.
A TTFT miss is put down to its own decision (`ttft_category`): predicted over its limit (chosen
knowingly), or predicted within it and wrong (a prefix ahead predicted cached, or the queue).

A TPOT miss is put down to its decisive breaker (the one at which the measured prefill seconds
routed after it pass the stall its SLO allowed): predicted (that decision listed it broken),
load-bound (no candidate was predicted clean) or unpredicted (the chosen worker was predicted
to break nothing). For an unpredicted one, the term of `DecodeSlo`'s model that was off
(`wrong_term`): a breaker's cached tokens (predicted, the engine computed them), the budget
(`best(w)` above the calibrated unloaded TPOT), the prefill seconds, or else the decode steps.
Over the misses, the model's terms against what happened: best(w) against the calibrated
unloaded TPOT at the decode's length, the predicted budget and stall against the benchmark's
budget and the measured excess (decode time past the unloaded TPOT). Per decision, the
decodes predicted broken against those whose TPOT was missed.
A failed or warm-up request is left out. A log per run of the target: with several repeats,
`--repeat` picks one (the logs in the order their gateways started)."""

from __future__ import annotations

import argparse
import bisect
import json
import math
import re
import statistics
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec

from bench.replay.report import Report
from bench.replay.stats import Calibration, Record, Slo, meets

PREFIX = "replay-"
EPS_S = 0.002  # a first token this close after a decode's last still stalled it (read in bursts)


class Breaker(msgspec.Struct, kw_only=True):
    """A request whose prefill ran on the missed request's worker inside the window it missed."""

    row: int
    input_length: int
    after: bool  # routed after the missed request (sent later)
    ttft_s: float  # its measured time to first token
    service_s: float  # its first token less the later of its send and the worker's previous first token
    cached: int  # prompt tokens the engine reported cached (-1: not reported)
    predicted_cached: int  # the chosen candidate's prediction (-1: no record)
    predicted_ttft_s: float  # the chosen candidate's (nan: no record)
    predicted_prefill_s: float  # its own prefill there, predicted (nan: no record)
    chosen_misses: int  # predicted SLO misses on the chosen worker (-1: no record)
    fewest_misses: int  # the fewest of any candidate (-1: no record)
    listed: bool  # the missed decode was among those the decision weighed on that worker
    predicted_break: bool  # ... and predicted broken by this prefill
    budget_s: float  # the missed decode's predicted budget at this decision (nan: not listed)
    stall_s: float  # its predicted stall so far at this decision (nan: not listed)
    tokens: int  # its expected output tokens at this decision (0: not listed)


class Miss(msgspec.Struct, kw_only=True):
    row: int
    kind: str  # "tpot" or "ttft"
    worker: str
    input_length: int
    tokens: int  # output tokens received
    ttft_s: float
    ttft_limit_s: float
    tpot_s: float
    tpot_limit_s: float  # the benchmark's: x times the calibrated unloaded TPOT at its length
    unloaded_tpot_s: float  # the calibrated unloaded TPOT at its length
    best_s: float  # the policy's unloaded TPOT of its worker, best(w), at its own decision (nan: none)
    excess_s: float  # decode time past (tokens - 1) x the unloaded TPOT
    category: str
    term: str  # unpredicted TPOT misses: the model's term that was off (`wrong_term`); else ""
    breakers: list[Breaker]


class Confusion(msgspec.Struct):
    """Over every (decision, decode weighed on the chosen worker) pair whose prefill came
    inside that decode's window."""

    predicted_missed: int = 0  # predicted broken, and its TPOT was missed
    predicted_met: int = 0  # predicted broken, met all the same
    unpredicted_missed: int = 0  # not predicted broken, missed
    unpredicted_met: int = 0


class Attribution(msgspec.Struct):
    misses: list[Miss]
    confusion: Confusion
    joined: int  # records with a worker from the log
    records: int


def read_log(lines: Iterable[str]) -> tuple[dict[int, dict], dict[int, str]]:
    """(decision record, worker) per replay row from a gateway's JSON log lines (the last
    attempt's where a request was retried)."""
    decisions: dict[int, dict] = {}
    where: dict[int, str] = {}
    for line in lines:
        if PREFIX not in line:
            continue
        try:
            j = json.loads(line)
        except ValueError:
            continue
        rid = j.get("request_id", "")
        if not isinstance(rid, str) or not rid.startswith(PREFIX) or not rid[len(PREFIX) :].isdigit():
            continue
        row = int(rid[len(PREFIX) :])
        if j.get("event") == "route.decision":
            decisions[row] = j
        elif j.get("event") == "request.done" and j.get("decode"):
            where[row] = j["decode"]
    return decisions, where


def _chosen(dec: dict | None) -> dict | None:
    if dec is None:
        return None
    for c in dec.get("candidates", ()):
        if c.get("worker") == dec.get("chosen"):
            return c
    return None


def _breaker(y: Record, x: Record, dec: dict | None, prev_first: float) -> Breaker:
    c = _chosen(dec)
    held = None
    if c is not None:
        for h in c.get("decodes", ()):
            if h.get("request_id") == f"{PREFIX}{x.index}":
                held = h
    fewest = min((e.get("slo_misses", 0) for e in dec["candidates"]), default=-1) if dec else -1
    nan = math.nan
    return Breaker(
        row=y.index,
        input_length=y.input_length,
        after=y.sent >= x.sent,
        ttft_s=y.ttft,
        service_s=y.first_token - max(y.sent, prev_first),
        cached=y.cached_tokens,
        predicted_cached=c.get("cached_tokens", -1) if c else -1,
        predicted_ttft_s=c["ttft_s"] if c else nan,
        predicted_prefill_s=c.get("prefill_s", nan) if c else nan,
        chosen_misses=c.get("slo_misses", 0) if c else -1,
        fewest_misses=fewest,
        listed=held is not None,
        predicted_break=bool(held and held.get("broken")),
        budget_s=held["budget_s"] if held else nan,
        stall_s=held["stall_s"] if held else nan,
        tokens=held["tokens"] if held else 0,
    )


def decisive(breakers: Sequence[Breaker], budget: float) -> Breaker | None:
    """The breaker routed after the missed decode at which the measured prefill seconds of those
    routed after it (each one's service) first pass the stall its SLO allowed, `budget`; the
    last routed after it if they never do (its own decode steps were slower too); None if
    none was routed after it."""
    after = [b for b in breakers if b.after]
    total = 0.0
    for b in after:
        total += b.service_s
        if total > budget:
            return b
    return after[-1] if after else None


def _category(kind: str, breakers: Sequence[Breaker], budget: float, own: dict | None, limit: float) -> str:
    """Why a miss was not avoided: the decision of its decisive breaker (TPOT), its own (TTFT)."""
    if kind == "ttft":
        return ttft_category(own, limit, breakers)
    if not breakers:
        return "no breaker on its worker"
    b = decisive(breakers, budget)
    if b is None:
        return "only prefills routed before it"
    if b.chosen_misses < 0:
        return "no decision record"
    if b.predicted_break:
        return (
            "predicted (no clean candidate)" if b.fewest_misses > 0 else "predicted, a clean one passed over"
        )
    if b.fewest_misses > 0 and b.chosen_misses == b.fewest_misses:
        return "load-bound (no clean candidate)"
    if b.chosen_misses == 0:
        return "unpredicted (chosen predicted clean)"
    return "chosen not the fewest"


def ttft_category(dec: dict | None, limit: float, breakers: Sequence[Breaker]) -> str:
    """Why a TTFT miss was not avoided, by its own decision: the chosen worker predicted over
    `limit` (chosen knowingly: with another candidate predicted within it, or with none), else
    predicted within it and wrong: a prefill ahead of it computed tokens predicted cached (a
    turn sent behind its predecessor), or else the queue or the rate; without a record, whether
    prefills ran ahead of it."""
    c = _chosen(dec)
    if dec is None or c is None or "ttft_s" not in c:
        if not breakers:
            return "no breaker on its worker"
        return "prefills ahead of it" if any(not b.after for b in breakers) else "prefills routed after it"
    if c["ttft_s"] > limit:
        within = min(e.get("ttft_s", math.inf) for e in dec["candidates"]) <= limit
        return f"predicted over the limit, {'a candidate' if within else 'none'} within"
    if any(not b.after and _computed_cached(b) for b in breakers):
        return "predicted within, a prefill ahead computed its predicted cache"
    return "predicted within, the queue or the rate off"


def _computed_cached(b: Breaker) -> bool:
    """The engine computed over 5 % of the breaker's prompt that its decision predicted cached."""
    return b.cached >= 0 and b.predicted_cached - b.cached > 0.05 * b.input_length


def wrong_term(breakers: Sequence[Breaker], budget: float, unloaded: float, steps: int) -> str:
    """Which term of `DecodeSlo`'s model was off for a decode it predicted no breaker of, in
    this order: a breaker found fewer cached tokens than predicted (by over 5 % of its prompt)
    and took over 1.2x the prefill seconds predicted;
    the predicted budget was over 1.1x the benchmark's `budget` (`best(w)` above the unloaded
    TPOT); the breakers' measured prefill seconds were over 1.2x the predicted; else the decode
    steps themselves (slower than `best(w)` in a batch)."""
    after = [b for b in breakers if b.after]
    # (not where the SLO term saw through it: its prefill seconds as measured)
    if any(_computed_cached(b) and b.service_s > 1.2 * b.predicted_prefill_s for b in after):
        return "cached"
    listed = next((b for b in after if b.listed), None)
    if listed is not None and listed.budget_s > 1.1 * budget:
        return "budget"
    predicted = sum(b.predicted_prefill_s for b in after if not math.isnan(b.predicted_prefill_s))
    if sum(b.service_s for b in after) > 1.2 * predicted:
        return "prefill seconds"
    return "decode steps"


def _window(x: Record, kind: str) -> tuple[float, float]:
    """The interval a breaker's first token falls in: the decode window (TPOT), or from its
    send to its first token (TTFT)."""
    return (x.first_token, x.last_token + EPS_S) if kind == "tpot" else (x.sent, x.first_token)


def _miss(
    x: Record,
    kind: str,
    worker: str,
    peers: Sequence[Record],
    decisions: dict[int, dict],
    limits: tuple[float, float],
    unloaded: float,
) -> Miss:
    lo, hi = _window(x, kind)
    ys = sorted((y for y in peers if y.index != x.index and lo < y.first_token <= hi), key=lambda y: y.sent)
    firsts = sorted(y.first_token for y in peers)

    def prev(t: float) -> float:  # the worker's latest first token before t (0: none)
        k = bisect.bisect_left(firsts, t)
        return firsts[k - 1] if k > 0 else 0.0

    breakers = [_breaker(y, x, decisions.get(y.index), prev(y.first_token)) for y in ys]
    own = _chosen(decisions.get(x.index))
    steps = max(1, x.completion_tokens - 1)
    budget = steps * (limits[1] - unloaded)  # the stall the benchmark's TPOT SLO allowed
    return Miss(
        row=x.index,
        kind=kind,
        worker=worker,
        input_length=x.input_length,
        tokens=x.completion_tokens,
        ttft_s=x.ttft,
        ttft_limit_s=limits[0],
        tpot_s=x.tpot,
        tpot_limit_s=limits[1],
        unloaded_tpot_s=unloaded,
        best_s=own.get("tpot_best_s", math.nan) if own else math.nan,
        excess_s=(x.last_token - x.first_token) - steps * unloaded,
        category=(cat := _category(kind, breakers, budget, decisions.get(x.index), limits[0])),
        term=wrong_term(breakers, budget, unloaded, steps) if cat.startswith("unpredicted") else "",
        breakers=breakers,
    )


def attribute(
    records: Sequence[Record],
    decisions: dict[int, dict],
    where: dict[int, str],
    calib: Calibration,
    ttft_slo: Slo,
    tpot_slo: Slo,
) -> Attribution:
    """Every SLO miss among `records` with its breakers, and the per-decision confusion."""
    recs = {r.index: r for r in records if r.ok and not r.warmup}
    by_worker: dict[str, list[Record]] = {}
    for r in recs.values():
        if r.index in where:
            by_worker.setdefault(where[r.index], []).append(r)
    out: list[Miss] = []
    missed_tpot: set[int] = set()
    for i in sorted(recs):
        x = recs[i]
        if i not in where:
            continue
        t_ok, p_ok = meets(x, ttft_slo, tpot_slo, calib)
        limits = (ttft_slo.limit(calib.ttft(x.input_length)), tpot_slo.limit(calib.tpot(x.input_length)))
        for kind, ok in (("tpot", p_ok), ("ttft", t_ok)):
            if not ok:
                out.append(
                    _miss(
                        x, kind, where[i], by_worker[where[i]], decisions, limits, calib.tpot(x.input_length)
                    )
                )
        if not p_ok:
            missed_tpot.add(i)
    return Attribution(
        misses=out,
        confusion=confusion(recs, decisions, missed_tpot),
        joined=sum(1 for i in recs if i in where),
        records=len(recs),
    )


def confusion(recs: dict[int, Record], decisions: dict[int, dict], missed_tpot: set[int]) -> Confusion:
    """Each decision's verdict on each decode it weighed on the chosen worker, where its prefill
    came inside that decode's window, against whether the decode's TPOT was missed."""
    c = Confusion()
    for row, dec in decisions.items():
        y, chosen = recs.get(row), _chosen(dec)
        if y is None or chosen is None:
            continue
        for h in chosen.get("decodes", ()):
            rid = h.get("request_id", "")
            r = (
                recs.get(int(rid[len(PREFIX) :]))
                if rid.startswith(PREFIX) and rid[len(PREFIX) :].isdigit()
                else None
            )
            if r is None or not (r.first_token < y.first_token <= r.last_token + EPS_S):
                continue
            missed = r.index in missed_tpot
            if h.get("broken"):
                c.predicted_missed += missed
                c.predicted_met += not missed
            else:
                c.unpredicted_missed += missed
                c.unpredicted_met += not missed
    return c


def _ms(v: float) -> str:
    return "-" if math.isnan(v) else f"{v * 1000:.1f}"


def _median(vs: Sequence[float]) -> str:
    vs = [v for v in vs if not math.isnan(v)]
    return f"{statistics.median(vs) * 1000:.1f} ms (n={len(vs)})" if vs else "-"


def terms(att: Attribution) -> list[str]:
    """The model's terms against what happened, medians over the TPOT misses whose decisive
    breaker's decision listed them (the prediction that decision made)."""
    rows = []
    for m in att.misses:
        b = decisive(m.breakers, (m.tokens - 1) * (m.tpot_limit_s - m.unloaded_tpot_s))
        if m.kind == "tpot" and b is not None and b.listed:
            rows.append((m, b))
    if not rows:
        return ["No TPOT miss was listed by its decisive breaker's decision."]
    real_budget = [(m.tokens - 1) * (m.tpot_limit_s - m.unloaded_tpot_s) for m, _ in rows]
    return [
        f"Over {len(rows)} TPOT misses listed by their decisive breaker's decision (medians):",
        "",
        f"- predicted budget {_median([b.budget_s for _, b in rows])}, the benchmark's "
        f"(tokens - 1) x (limit - unloaded TPOT) {_median(real_budget)}",
        f"- best(w) {_median([m.best_s for m, _ in rows])}, calibrated unloaded TPOT "
        f"{_median([m.unloaded_tpot_s for m, _ in rows])}",
        f"- expected tokens {statistics.median(b.tokens for _, b in rows)}, received "
        f"{statistics.median(m.tokens for m, _ in rows)}",
        f"- predicted stall before that breaker {_median([b.stall_s for _, b in rows])}, plus its "
        f"prefill {_median([b.predicted_prefill_s for _, b in rows])}; measured excess "
        f"{_median([m.excess_s for m, _ in rows])}; the breaker's measured TTFT "
        f"{_median([b.ttft_s for _, b in rows])} (predicted {_median([b.predicted_ttft_s for _, b in rows])})",
    ]


def markdown(att: Attribution) -> str:
    """The report: counts per category, the terms, the confusion, a row per miss."""
    lines = [f"Joined {att.joined} of {att.records} requests to a worker.", ""]
    for kind in ("tpot", "ttft"):
        ms = [m for m in att.misses if m.kind == kind]
        cats: dict[str, int] = {}
        for m in ms:
            cats[m.category] = cats.get(m.category, 0) + 1
        lines.append(
            f"{kind.upper()} misses: {len(ms)} ("
            + ", ".join(f"{k}: {v}" for k, v in sorted(cats.items()))
            + ")"
        )
    wrong: dict[str, int] = {}
    for m in att.misses:
        if m.term:
            wrong[m.term] = wrong.get(m.term, 0) + 1
    terms_off = ", ".join(f"{k}: {v}" for k, v in sorted(wrong.items())) or "none"
    lines.append(f"Unpredicted TPOT misses by the model's term that was off: {terms_off}")
    c = att.confusion
    lines += [
        "",
        "Per decision, the decodes it weighed on the chosen worker whose window its prefill hit: "
        f"predicted broken {c.predicted_missed + c.predicted_met} ({c.predicted_missed} missed, "
        f"{c.predicted_met} met); not predicted {c.unpredicted_missed + c.unpredicted_met} "
        f"({c.unpredicted_missed} missed, {c.unpredicted_met} met).",
        "",
        *terms(att),
        "",
        "| row | miss | tokens | prompt | worker | term off | TTFT / limit ms | TPOT / limit ms | best(w) / unloaded ms "
        "| excess ms | breakers: row prompt cached/predicted, after, predicted prefill/TTFT ms, measured "
        "service/TTFT ms, misses chosen/fewest, budget/stall ms | category |",
        "|---" * 12 + "|",
    ]
    for m in att.misses:
        bs = "; ".join(
            f"{b.row} {b.input_length} {b.cached}/{b.predicted_cached} {'after' if b.after else 'before'} "
            f"{_ms(b.predicted_prefill_s)}/{_ms(b.predicted_ttft_s)}, {_ms(b.service_s)}/{_ms(b.ttft_s)}, "
            f"{b.chosen_misses}/{b.fewest_misses}, "
            + (
                f"{_ms(b.budget_s)}/{_ms(b.stall_s)}{' broken' if b.predicted_break else ''}"
                if b.listed
                else "unlisted"
            )
            for b in m.breakers
        )
        lines.append(
            f"| {m.row} | {m.kind} | {m.tokens} | {m.input_length} | {m.worker.rsplit(':', 1)[-1]} | {m.term or '-'} "
            f"| {_ms(m.ttft_s)} / {_ms(m.ttft_limit_s)} | {_ms(m.tpot_s)} / {_ms(m.tpot_limit_s)} "
            f"| {_ms(m.best_s)} / {_ms(m.unloaded_tpot_s)} | {_ms(m.excess_s)} | {bs} | {m.category} |"
        )
    return "\n".join(lines) + "\n"


def _logs(out: Path, label: str) -> list[Path]:
    """The target's gateway logs, in the order their gateways started."""

    def started(p: Path) -> str:
        with p.open() as f:
            for line in f:
                if '"timestamp"' in line:
                    try:
                        return str(json.loads(line).get("timestamp", ""))
                    except ValueError:
                        continue
        return ""

    # `label-XXXXXXXX.log` (bench/procs.py: mkstemp's 8 characters), not another target's
    # whose label starts with this one's
    own = re.compile(re.escape(label) + r"-[a-z0-9_]{8}\.log")
    return sorted((p for p in (out / "logs").glob(f"{label}-*.log") if own.fullmatch(p.name)), key=started)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.replay.attribution", description=__doc__.split("\n")[0]
    )
    ap.add_argument("out", type=Path, help="a `bench replay --out` directory")
    ap.add_argument("--target", required=True, help="the target's label (its gateway at --log-level debug)")
    ap.add_argument("--repeat", type=int, default=1, help="which run of the target (1-based; default 1)")
    ap.add_argument("--json", action="store_true", help="the attribution as JSON instead of markdown")
    a = ap.parse_args(argv)
    rep = msgspec.json.decode((a.out / "results.json").read_bytes(), type=Report)
    if rep.calibration is None:
        print("no calibration in results.json: relative SLOs cannot be judged", file=sys.stderr)
        return 2
    calib = msgspec.convert(rep.calibration, Calibration)
    runs = sorted((r for r in rep.runs if r.target == a.target), key=lambda r: (r.load, r.repeat))
    logs = _logs(a.out, a.target)
    if not runs or len(logs) < a.repeat or len(runs) < a.repeat:
        print(f"{a.target}: {len(runs)} runs, {len(logs)} logs; no repeat {a.repeat}", file=sys.stderr)
        return 2
    with logs[a.repeat - 1].open() as f:
        decisions, where = read_log(f)
    att = attribute(
        runs[a.repeat - 1].records, decisions, where, calib, Slo.parse(rep.slo_ttft), Slo.parse(rep.slo_tpot)
    )
    sys.stdout.write(msgspec.json.encode(att).decode() + "\n" if a.json else markdown(att))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
