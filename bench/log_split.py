"""The access-log line's timed cost, step by step: `bench.python_cost` with the line's writer
(`gateway.logging._InfoLine.info`) cut after its first k steps.

    taskset -c 0 .venv/bin/python -m bench.log_split STEP --log-file /tmp/gw.log

STEP: `noop` (the call and its 16 fields built, nothing done), `event` (+ the event field),
`merge` (+ the bound context variables and the level), `stamp` (+ the timestamp), `encode`
(+ msgspec's rendering, the line dropped), `full` (the real writer: + the queued write). Every
other argument goes to `bench.python_cost` (default: `--client openai --modes nonstream
--engines sglang -n 4000 --repeats 3`). Run the steps interleaved to compare them.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from structlog.contextvars import merge_contextvars  # noqa: E402

import gateway.logging as gl  # noqa: E402

STEPS = ("noop", "event", "merge", "stamp", "encode", "full")
DEFAULT = [
    "--client",
    "openai",
    "--modes",
    "nonstream",
    "--engines",
    "sglang",
    "-n",
    "4000",
    "--repeats",
    "3",
]


def cut(step: str) -> Any:
    """`_InfoLine.info` doing only the steps up to `step`."""
    upto = STEPS.index(step)

    def info(self: Any, event: str, **fields: Any) -> None:
        if upto < 1:
            return
        fields["event"] = event
        if upto < 2:
            return
        merge_contextvars(None, "info", fields)
        fields["level"] = "info"
        if upto < 3:
            return
        self._stamp(None, "info", fields)
        if upto < 4:
            return
        line = self._encode(fields)
        if upto < 5:
            return
        self._writer.msg(line)

    return info


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in STEPS:
        print(__doc__, file=sys.stderr)
        return 2
    step, rest = argv[0], argv[1:]
    if step != "full":
        gl._InfoLine.info = cut(step)  # type: ignore[method-assign]
    sys.argv = ["bench.python_cost", *DEFAULT, *rest]
    runpy.run_module("bench.python_cost", run_name="__main__")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
