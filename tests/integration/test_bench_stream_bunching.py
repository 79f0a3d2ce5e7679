"""`python -m bench.stream_bunching` runs end to end on a small workload (subprocess emulators),
and what it counts per event is the emulated decode's: one token per decode step."""

from __future__ import annotations

import json
from pathlib import Path

from bench import stream_bunching


def test_the_bunching_bench_runs_direct(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    argv = ["--via", "direct", "--long", "1", "--long-tokens", "3000", "--short", "4", "--every", "3"]
    argv += ["--short-max-tokens", "12", "--time-scale", "0.05", "--gap-ms", "20", "--json", str(out)]
    assert stream_bunching.main(argv) == 0
    (direct,) = json.loads(out.read_text())["results"]
    assert direct["target"] == "direct" and direct["streams"] == 4 and direct["failed"] == 0
    assert direct["tokens_per_event"]["max"] == 1  # a decode step's token is an event of its own
    assert all(n >= 1 for n in direct["first_read_tokens_each"])


def test_the_bunching_bench_compares_a_gateway_with_direct(tmp_path: Path) -> None:
    """The gateway in `prefill_verdict = "before_end"` mode, beside direct: both serve every
    stream, and the TTFT the gateway adds is reported."""
    out = tmp_path / "figures.json"
    argv = ["--via", "direct", "--via", "gateway-before-end", "--long", "1", "--long-tokens", "3000"]
    argv += ["--short", "4", "--every", "3", "--short-max-tokens", "12", "--time-scale", "0.05"]
    argv += ["--gap-ms", "20", "--json", str(out)]
    assert stream_bunching.main(argv) == 0
    direct, gateway = json.loads(out.read_text())["results"]
    assert (direct["target"], gateway["target"]) == ("direct", "gateway-before-end")
    assert gateway["streams"] == 4 and gateway["failed"] == 0
    assert set(gateway["ttft_added_ms"]) == {"median", "p90", "p99", "max"}
