"""`python -m bench.guard_misses` measures what each guards preset lets through, end to end on
the emulator's servers: vLLM's `silent_truncation` (a prefill computing garbage consistently) is
delivered wrong without guards and caught by strict verification, the default guards re-run a
sample of the answers; the default guards deliver none of another request's KV."""

from __future__ import annotations

import asyncio

from bench import guard_misses


def test_the_miss_rate_bench_tells_the_presets_apart() -> None:
    args = guard_misses.build_parser().parse_args(
        ["--requests", "60", "--engines", "vllm", "--kinds", "silent_truncation,wrong_request_kv"]
    )
    rows = {(r["kind"], r["preset"]): r for r in asyncio.run(guard_misses.measure(args))}
    assert rows["silent_truncation", "off"]["wrong"] > 0  # the fault is real
    assert rows["silent_truncation", "strict"]["wrong"] == 0
    assert rows["silent_truncation", "strict"]["reruns_per_100"] >= 90  # every greedy answer
    assert rows["silent_truncation", "default"]["reruns_per_100"] > 0  # a sample of them
    assert rows["silent_truncation", "off"]["reruns_per_100"] == 0
    assert all(r["last_wrong"] == 0 for r in rows.values() if r["wrong"] == 0)
    assert rows["wrong_request_kv", "default"]["wrong"] == 0
    assert rows["wrong_request_kv", "off"]["wrong"] > 0  # the fault is real: the guards catch it
    table = guard_misses.table(list(rows.values()), args.fraction)
    assert table.count("\n") == len(rows) + 1 and "| `silent_truncation` | vllm | strict | 0 of 60 |" in table
