"""`pd-gateway bench cache-decision` runs end to end at a small size (the figures themselves are
docs/policies.md's, measured at full size)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.cache_decision import main


def test_the_micro_benchmark_runs(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    argv = ["--workers", "8,80", "--blocks", "3000", "--decisions", "30", "--precise", "--no-memory"]
    assert main([*argv, "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [p["workers"] for p in r["pools"]] == [8, 80]
    for p in r["pools"]:
        assert p["approx_entries"] >= 3000 and p["precise_entries"] >= 3000
        assert 0 < p["approx"]["p50_us"] <= p["approx"]["p99_us"]
        assert 0 < p["approx_unswitched"]["p50_us"] <= p["approx_unswitched"]["p99_us"]
        assert 0 <= p["switched"] <= 30
    assert set(r["engine_hash_us_per_block"]) == {"vllm", "sglang", "emulator"}


def test_the_whole_plan_and_the_diagnosis_run(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    argv = ["--workers", "80", "--blocks", "3000", "--decisions", "30", "--no-memory", "--plan", "--diagnose"]
    assert main([*argv, "--json", str(out)]) == 0
    (p,) = json.loads(out.read_text())["pools"]
    for name in ("plan_layout", "plan_no_layout", "approx_again", "approx_evict_2mb", "approx_evict_16mb"):
        assert 0 < p[name]["p50_us"] <= p[name]["p99_us"], name
    for name in ("code", "code_plan_layout", "code_plan_no_layout"):
        instructions, functions = p[name]
        assert 100 < instructions and 5 < functions < instructions, name
    # the whole plan runs the selector and more
    assert p["code_plan_layout"][0] > p["code"][0] and p["code_plan_layout"][1] > p["code"][1]


def test_the_code_footprint_counts_each_instruction_once() -> None:
    from bench.code_footprint import footprint

    def loop(n: int) -> int:
        total = 0
        for i in range(n):
            total += i
        return total

    once, fns, got = footprint(loop, 1)
    assert fns == 1 and got == 0
    assert footprint(loop, 1000)[:2] == (once, fns)  # a loop repeated is the same code
    more, fns, _ = footprint(lambda: (loop(1), abs(-1)))
    assert more > once and fns == 2  # the lambda's code too
