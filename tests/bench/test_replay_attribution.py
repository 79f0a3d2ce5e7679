"""The SLO-miss attribution (bench/replay/attribution.py) on a small synthetic replay: which
requests broke each miss, whether the breaker's decision predicted it, the per-decision
confusion, and the join of the gateway's log lines by `x-request-id: replay-<row>`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec
import pytest

from bench.replay import attribution
from bench.replay.stats import Calibration, Record, Slo
from tests.bench.support import report_of, run_result

CALIB = Calibration(lengths=[100, 10_000], ttft_s=[0.1, 0.1], tpot_s=[0.01, 0.01])  # flat: 0.1 s, 10 ms
X5 = Slo(5, True)  # TTFT limit 0.5 s, TPOT limit 50 ms


def rec(row: int, sent: float, ttft: float, out: int, decode: float, *, cached: int = 0) -> Record:
    first = sent + ttft
    return Record(
        index=row,
        input_length=1000,
        output_length=out,
        sent=sent,
        first_token=first,
        last_token=first + decode,
        done=first + decode,
        status=200,
        completion_tokens=out,
        cached_tokens=cached,
    )


def decision(
    row: int, chosen: str, cands: dict[str, int], decodes: list[dict] | None = None, cached: int = 10
) -> dict:
    """A `route.decision` log record: each candidate's predicted misses; the chosen one's decodes."""
    return {
        "event": "route.decision",
        "request_id": f"replay-{row}",
        "chosen": chosen,
        "candidates": [
            {
                "worker": w,
                "slo_misses": n,
                "ttft_s": 0.3,
                "prefill_s": 0.25,
                "cached_tokens": cached,
                "tpot_best_s": 0.01,
                "decodes": decodes if w == chosen and decodes else [],
            }
            for w, n in cands.items()
        ],
    }


def held(row: int, broken: bool) -> dict:
    return {"request_id": f"replay-{row}", "tokens": 5, "budget_s": 0.16, "stall_s": 0.0, "broken": broken}


RECORDS = [
    rec(0, 0.0, 0.1, 5, 0.5),  # on A: 125 ms a token, TPOT missed; row 1's prefill came inside
    rec(1, 0.2, 0.2, 30, 0.29),  # on A: first token at 0.4, inside row 0's decode window
    rec(2, 1.0, 0.1, 5, 0.5),  # on B: TPOT missed; row 3's prefill came inside
    rec(3, 1.2, 0.2, 30, 0.29),  # on B
    rec(4, 1.25, 0.9, 30, 0.29),  # on B: TTFT missed (0.9 s), row 3's first token came before
    rec(5, 3.0, 0.1, 5, 0.02),  # on A: within both
]
WHERE = {0: "A", 1: "A", 2: "B", 3: "B", 4: "B", 5: "A"}
DECISIONS = {
    1: decision(1, "A", {"A": 0, "B": 0}, [held(0, False)]),  # predicted clean: wrong
    3: decision(3, "B", {"A": 1, "B": 1}, [held(2, True)]),  # every candidate broke one
    4: decision(4, "B", {"A": 0, "B": 0}),
}


def test_each_miss_with_its_breakers_and_the_verdict() -> None:
    att = attribution.attribute(RECORDS, DECISIONS, WHERE, CALIB, X5, X5)
    got = {(m.row, m.kind): m for m in att.misses}
    assert set(got) == {(0, "tpot"), (2, "tpot"), (4, "ttft")}
    m0 = got[(0, "tpot")]
    assert [b.row for b in m0.breakers] == [1]
    b = m0.breakers[0]
    assert b.after and b.listed and not b.predicted_break
    assert (b.chosen_misses, b.fewest_misses) == (0, 0)
    assert m0.category == "unpredicted (chosen predicted clean)"
    assert m0.term == "decode steps"  # cached, budget and prefill seconds as predicted
    assert b.budget_s == pytest.approx(0.16)
    assert b.service_s == pytest.approx(0.2)  # nothing before it on A: from its send
    assert m0.excess_s == pytest.approx(0.5 - 4 * 0.01)
    assert math.isnan(m0.best_s)  # row 0 has no decision record
    m2 = got[(2, "tpot")]
    assert m2.category == "predicted (no clean candidate)" and m2.term == ""
    assert m2.breakers[0].predicted_break
    m4 = got[(4, "ttft")]
    assert [b.row for b in m4.breakers] == [3]
    assert m4.category == "predicted within, the queue or the rate off"  # 0.3 s predicted, 0.9 took
    assert att.joined == 6 and att.records == 6


def test_the_load_bound_case_and_the_confusion() -> None:
    unlisted = dict(DECISIONS)
    unlisted[3] = decision(
        3, "B", {"A": 1, "B": 1}, [held(2, False)]
    )  # fewest 1, chosen 1, not listed broken
    att = attribution.attribute(RECORDS, unlisted, WHERE, CALIB, X5, X5)
    assert {m.row: m.category for m in att.misses if m.kind == "tpot"} == {
        0: "unpredicted (chosen predicted clean)",
        2: "load-bound (no clean candidate)",
    }
    c = attribution.attribute(RECORDS, DECISIONS, WHERE, CALIB, X5, X5).confusion
    assert (c.predicted_missed, c.predicted_met, c.unpredicted_missed, c.unpredicted_met) == (1, 0, 1, 0)
    md = attribution.markdown(att)
    assert "TPOT misses: 2" in md and "| 0 | tpot | 5 |" in md


@pytest.mark.parametrize(
    ("change", "term"),
    [
        # predicted 900 of its 1,000 tokens cached (0.1 s of prefill); the engine had 0 (0.2 s)
        ({"cached": 900, "prefill_s": 0.1}, "cached"),
        ({"cached": 900}, "decode steps"),  # the same, but its 0.2 s predicted: the term saw it
        ({"budget_s": 0.5}, "budget"),  # predicted 0.5 s of budget where the SLO allowed 0.16
        ({"prefill_s": 0.1}, "prefill seconds"),  # predicted 0.1 s; it took 0.2
    ],
)
def test_the_term_that_was_off(change: dict[str, float], term: str) -> None:
    h = held(0, False)
    h["budget_s"] = change.get("budget_s", 0.16)
    d = decision(1, "A", {"A": 0, "B": 0}, [h], cached=int(change.get("cached", 10)))
    d["candidates"][0]["prefill_s"] = change.get("prefill_s", 0.25)
    att = attribution.attribute(RECORDS, {**DECISIONS, 1: d}, WHERE, CALIB, X5, X5)
    assert next(m for m in att.misses if m.row == 0).term == term
    assert f"{term}: 1" in attribution.markdown(att)


@pytest.mark.parametrize(
    ("own", "ahead_cached", "category"),
    [
        # row 4's own decision: each candidate's predicted TTFT (its limit 0.5 s; it took 0.9)
        ({"A": 0.3, "B": 0.3}, 10, "predicted within, the queue or the rate off"),
        # row 3, ahead of it on B, was predicted 900 of its 1,000 tokens cached; the engine had 0
        ({"A": 0.3, "B": 0.3}, 900, "predicted within, a prefill ahead computed its predicted cache"),
        ({"A": 0.3, "B": 0.7}, 10, "predicted over the limit, a candidate within"),
        ({"A": 0.6, "B": 0.7}, 10, "predicted over the limit, none within"),
        (None, 10, "prefills ahead of it"),  # no decision record
    ],
)
def test_a_ttft_miss_by_its_own_decision(
    own: dict[str, float] | None, ahead_cached: int, category: str
) -> None:
    decisions = {**DECISIONS, 3: decision(3, "B", {"A": 1, "B": 1}, [held(2, True)], cached=ahead_cached)}
    if own is None:
        del decisions[4]
    else:
        d = decisions[4] = decision(4, "B", {"A": 0, "B": 0})
        for c in d["candidates"]:
            c["ttft_s"] = own[c["worker"]]
    att = attribution.attribute(RECORDS, decisions, WHERE, CALIB, X5, X5)
    assert next(m for m in att.misses if m.kind == "ttft").category == category
    assert f"TTFT misses: 1 ({category}: 1)" in attribution.markdown(att)


def test_read_log_joins_by_replay_row() -> None:
    lines = [
        json.dumps(DECISIONS[1]),
        json.dumps({"event": "request.done", "request_id": "replay-1", "decode": "A"}),
        json.dumps({"event": "request.done", "request_id": "gw-1-2", "decode": "B"}),  # warm-up
        "not json replay-9",
    ]
    decisions, where = attribution.read_log(lines)
    assert where == {1: "A"}
    assert set(decisions) == {1}


def test_main_on_an_out_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rep = report_of([run_result("ca", 1, RECORDS, CALIB, rate=3.0)], CALIB)
    (tmp_path / "results.json").write_bytes(msgspec.json.encode(rep))
    (tmp_path / "logs").mkdir()
    log = [json.dumps({"event": "gateway.started", "timestamp": "2026-12-05T00:00:00Z"})]
    log += [json.dumps(d) for d in DECISIONS.values()]
    log += [
        json.dumps({"event": "request.done", "request_id": f"replay-{r}", "decode": w})
        for r, w in WHERE.items()
    ]
    (tmp_path / "logs" / "ca-abc12345.log").write_text("\n".join(log) + "\n")
    other = tmp_path / "logs" / "ca-fix-abc12345.log"  # another target's, whose label starts "ca-"
    other.write_text(json.dumps({"event": "gateway.started", "timestamp": "2026-12-04T23:59:59Z"}) + "\n")
    assert attribution.main([str(tmp_path), "--target", "ca"]) == 0
    out = capsys.readouterr().out
    assert "TPOT misses: 2" in out and "TTFT misses: 1" in out
    assert attribution.main([str(tmp_path), "--target", "ca", "--repeat", "2"]) == 2
