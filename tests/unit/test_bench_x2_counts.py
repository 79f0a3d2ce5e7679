"""The pieces of `bench/x2_counts.py` and `bench/log_split.py` that are not timing: what they
read from /proc, and which steps of the access-log line a cut keeps (their figures are
docs/perf/workers.md's and docs/benchmarks.md's)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from bench import log_split, x2_counts

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@linux
def test_counts_cover_a_process_tree() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        c = x2_counts.counts(os.getpid())
        assert set(c) == set(x2_counts.FIELDS)
        assert c["cpu"] > 0 and c["syscr"] > 0 and c["syscw"] >= 0
        assert c["vol"] + c["invol"] > 0  # every thread's switches, this one's at least
        assert child.pid in x2_counts.tree_pids(os.getpid())
    finally:
        child.kill()
        child.wait()


class _Line:
    def __init__(self) -> None:
        self.steps: list[str] = []
        self.fields: dict[str, Any] = {}

    def _stamp(self, _logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
        self.steps.append("stamp")
        event["timestamp"] = "t"
        return event

    def _encode(self, event: dict[str, Any]) -> bytes:
        self.steps.append("encode")
        self.fields = dict(event)
        return b"{}"

    @property
    def _writer(self) -> _Line:
        return self

    def msg(self, line: bytes) -> None:
        self.steps.append("write")


@pytest.mark.parametrize(
    ("step", "done"),
    [
        ("noop", []),
        ("event", []),
        ("merge", []),
        ("stamp", ["stamp"]),
        ("encode", ["stamp", "encode"]),
    ],
)
def test_a_cut_line_stops_after_its_step(step: str, done: list[str]) -> None:
    line = _Line()
    log_split.cut(step)(line, "request.done", a=1)
    assert line.steps == done
    if step == "encode":
        assert line.fields == {"a": 1, "event": "request.done", "level": "info", "timestamp": "t"}


def test_every_step_but_the_whole_line_can_be_cut() -> None:
    line = _Line()
    log_split.cut("full")(line, "request.done")
    assert line.steps == ["stamp", "encode", "write"]
    assert log_split.main(["nonsense"]) == 2
