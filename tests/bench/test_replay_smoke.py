"""`pd-gateway bench replay` end to end on a tiny workload (a few seconds): real emulated
workers, the real gateway, the real client; and a Ctrl-C that leaves partial results and no
process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from bench import procs
from bench.replay import main as replay_main


def test_a_tiny_replay_through_the_direct_baseline_and_the_gateway(tmp_path: Path) -> None:
    out = tmp_path / "res"
    rc = replay_main.main(
        [
            "--synthetic", "chat", "--synthetic-requests", "4", "--synthetic-rate", "8",
            "--engine", "sglang", "--colocated", "2", "--time-scale", "0.02",
            "--target", "direct", "--target", "broken=gateway --config /nonexistent/gw.toml",
            "--target", "gateway:round_robin",
            "--slo-ttft", "10", "--slo-tpot", "1", "--out", str(out), "--no-progress",
        ]
    )  # fmt: skip
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    assert [r["target"] for r in data["runs"]] == ["direct", "gateway:round_robin"]
    # a target that cannot start is reported, and the run goes on
    assert [f["target"] for f in data["failures"]] == ["broken"]
    assert "ProcessDied" in data["failures"][0]["error"]
    for run in data["runs"]:
        s = run["summary"]
        assert (s["requests"], s["completed"], s["errors"], s["unfinished"]) == (4, 4, 0, 0), s
        assert s["prompt_mismatches"] == 0 and s["prompt_unreported"] == 0
        assert s["slo_attainment"] == 1.0 and s["goodput_rps"] > 0
        # the engines' own counters, warm-up requests left out: the 4 rows and their tokens
        workers = run["workers"].values()
        assert sum(w["counters"]["requests"] for w in workers) == 4
        rows_tokens = sum(r["input_length"] for r in run["records"])
        assert sum(w["counters"]["prompt_tokens"] for w in workers) == rows_tokens
        assert 0 < run["hit_rate"] < 1  # the shared system prompt
    assert data["reachable"]["rate x1"][0]["policy"] == "ideal"
    md = (out / "report.md").read_text()
    assert "| gateway:round_robin |" in md and "reachable reuse" in md
    for png in ("goodput.png", "ttft_cdf.png", "worker_load.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_tiny_replay_on_a_mixed_cluster_with_the_cost_model_decider(tmp_path: Path) -> None:
    """A mixed cluster (colocated and a P/D pool) is calibrated through its P/D pool; the
    gateway's cost-model decider serves it (it was refused before the replay started)."""
    out = tmp_path / "res"
    rc = replay_main.main(
        [
            "--synthetic", "chat", "--synthetic-requests", "4", "--synthetic-rate", "8",
            "--synthetic-user-tokens", "3000", "--synthetic-output-tokens", "40",
            "--engine", "sglang", "--prefill", "1", "--decode", "1", "--colocated", "1",
            "--time-scale", "0.02", "--target", "cost=gateway --decider cost_model",
            "--slo-ttft", "10", "--slo-tpot", "1", "--out", str(out), "--no-progress", "--no-plots",
        ]
    )  # fmt: skip
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    s = data["runs"][0]["summary"]
    assert (s["requests"], s["completed"], s["errors"]) == (4, 4, 0), s
    # the generated prompts are sized as asked (a 1,024-token system prompt, then ~3,000 own)
    lengths = [r["input_length"] for r in data["runs"][0]["records"]]
    assert sum(lengths) / len(lengths) > 2500, lengths
    # what the decider chose is kept beside the logs: one verdict per request
    [kept] = (out / "logs").glob("*.metrics.txt")
    verdicts = [ln for ln in kept.read_text().splitlines() if ln.startswith("pdgw_decider_verdicts_total")]
    assert sum(float(ln.rsplit(" ", 1)[1]) for ln in verdicts) >= 4, verdicts


def test_a_tiny_replay_with_kv_events_and_the_precise_index(tmp_path: Path) -> None:
    """`--kv-events`: the emulators publish their KV events, a gateway with a routing tokenizer
    predicts the text prompts' cached tokens from them, and its index's health is kept beside
    the logs (live, no gaps)."""
    own = tmp_path / "precise.toml"
    own.write_text(
        'policy = { type = "cache_aware", chars_per_token = 1.0 }\n\n[tokenizer]\nkind = "emulator"\n'
    )
    out = tmp_path / "res"
    rc = replay_main.main(
        [
            "--synthetic", "chat", "--synthetic-requests", "6", "--synthetic-rate", "8",
            "--engine", "sglang", "--colocated", "2", "--time-scale", "0.02", "--kv-events",
            "--emulator-arg=--enable-cache-report",
            "--target", f"precise=gateway --config {own}", "--target", "sglang-router:cache_aware",
            "--slo-ttft", "10", "--slo-tpot", "1", "--out", str(out), "--no-progress", "--no-plots",
        ]
    )  # fmt: skip
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    assert [r["target"] for r in data["runs"]] == ["precise", "sglang-router:cache_aware"]
    for run in data["runs"]:
        assert run["summary"]["completed"] == 6 and run["summary"]["errors"] == 0
    [kept] = (out / "logs").glob("*.metrics.txt")
    lines = kept.read_text().splitlines()
    live = [ln for ln in lines if ln.startswith("pdgw_kv_index_usable") and 'state="live"' in ln]
    assert len(live) == 2 and all(ln.endswith(" 1.0") for ln in live), lines
    gaps = [ln for ln in lines if ln.startswith("pdgw_kv_index_gaps_total")]
    assert len(gaps) == 2 and all(ln.endswith(" 0.0") for ln in gaps), gaps
    assert any(ln.startswith("pdgw_kv_index_max_lag_seconds") for ln in lines)
    [cache] = (out / "logs").glob("precise-pdgw_cache-*.prom")
    predicted = [ln for ln in cache.read_text().splitlines() if ln.startswith("pdgw_cache_predicted_tokens")]
    assert any('source="kv_events"' in ln and not ln.endswith(" 0.0") for ln in predicted), predicted


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_stops_the_run_writes_partial_results_and_leaves_no_process(
    tmp_path: Path, presses: int
) -> None:
    """One Ctrl-C ends the run in progress and reports it; a second cancels it at once. Either
    way the results are written and every worker and router is stopped."""
    out = tmp_path / "res"
    argv = [
        sys.executable, "-m", "bench.replay.main",
        "--synthetic", "chat", "--synthetic-requests", "200", "--synthetic-rate", "4",
        "--engine", "sglang", "--colocated", "1", "--time-scale", "1",
        "--target", "direct", "--target", "gateway:round_robin",
        "--slo-ttft", "10", "--slo-tpot", "1", "--out", str(out), "--no-progress", "--no-plots",
    ]  # fmt: skip
    proc = subprocess.Popen(
        argv,
        cwd=procs.REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        for line in proc.stderr:
            if b"reachable reuse" in line or time.monotonic() > deadline:
                break
        time.sleep(4.0)  # inside the first run: workers up, requests in flight
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children, "the run started no worker"
        for _ in range(presses):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.05)
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 130
    data = json.loads((out / "results.json").read_text())
    assert data["partial"] is True
    if presses == 1:  # the run in progress ends and is reported
        assert len(data["runs"]) == 1 and data["runs"][0]["partial"] is True
        s = data["runs"][0]["summary"]
        assert 0 < s["requests"] < 200
    else:  # cancelled at once, or (if the first press already ended it) reported
        assert len(data["runs"]) <= 1
    assert "Partial" in (out / "report.md").read_text()
    time.sleep(0.5)
    assert [c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE] == []
