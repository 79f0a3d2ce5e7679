"""`bench.python_cost` drives the real gateway over in-memory transports; its figures are only
worth something while every answer it gets is right, so each engine and mode runs a few
requests here (the rig raises on a wrong answer or a stuck request)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import uvloop

from bench.python_cost import measure


@pytest.mark.parametrize("target", ["gateway", "bare-pd"])
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("mode", ["nonstream", "stream64"])
def test_python_cost_rig_serves_every_request(target: str, engine: str, mode: str) -> None:
    r = uvloop.run(measure(engine, mode, n=50, repeats=1, target=target))
    assert r["requests"] == 50 and len(r["us_per_request"]) == 1 and r["us_per_request"][0] > 0


@pytest.mark.parametrize("target", ["gateway", "bare-pd"])
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_python_cost_rig_streams_event_by_event(target: str, engine: str) -> None:
    r = uvloop.run(measure(engine, "stream64", n=50, repeats=1, target=target, apart=True))
    assert r["requests"] == 50 and r["us_per_request"][0] > 0


@pytest.mark.parametrize("mode", ["nonstream", "stream64"])
def test_bytecode_counts_are_steady_and_grow_with_the_work(mode: str) -> None:
    """The count is what `bench.perf_report` compares: the same to well under 1 % between two
    runs, and more for the gateway than for `bare-pd` (so it counts the gateway's code)."""
    runs = [
        uvloop.run(measure("sglang", mode, n=60, repeats=1, warmup=30, count="bytecodes")) for _ in range(2)
    ]
    a, b = (r["us_per_request"][0] for r in runs)
    assert a > 1000 and abs(a - b) / a < 0.005
    bare = uvloop.run(
        measure("sglang", mode, n=60, repeats=1, warmup=30, count="bytecodes", target="bare-pd")
    )
    assert 0 < bare["us_per_request"][0] < a / 2


def test_the_call_count_counts_the_gateways_frames_the_same_every_run() -> None:
    """`--count calls`: Python frames entered per request, the same between two runs, more for
    the gateway than for `bare-pd`, and listed per function with `top`."""
    runs = [
        uvloop.run(
            measure("sglang", "nonstream", n=40, repeats=1, warmup=20, count="calls", top=3, client="openai")
        )
        for _ in range(2)
    ]
    a, b = (r["us_per_request"][0] for r in runs)
    assert a > 100 and a == b
    assert len(runs[0]["functions"]) == 3 and "on_header" in runs[0]["functions"][0][0]
    bare = uvloop.run(
        measure("sglang", "nonstream", n=40, repeats=1, warmup=20, count="calls", target="bare-pd")
    )
    assert 0 < bare["us_per_request"][0] < a / 2


def test_the_perf_report_compares_a_revision_with_the_working_tree() -> None:
    root = Path(__file__).resolve().parents[2]
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: no revision to compare against")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.perf_report",
            "--cases",
            "sglang nonstream",
            "-n",
            "40",
            "--warmup",
            "20",
        ],
        cwd=root,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    line = next(x for x in out.splitlines() if x.startswith("sglang nonstream"))
    before, after = (float(v) for v in line.split()[2:4])
    assert before > 1000 and after > 1000, out
