"""Enum class-attribute look-ups (`Role.DECODE`, `RouteKind.CHAT`...) per request on the
gateway's path, with where they are.

On Python 3.11 `enum.EnumType` defines `__getattr__`, so such a look-up in a function is an
unspecialised `LOAD_ATTR` through the type's slot hook: ~900 machine instructions each here,
against a module constant's `LOAD_GLOBAL` (docs/benchmarks.md, "Enum members read through a
hook"). This counts them over `bench.python_cost`'s rig (the real gateway, in-memory
transports): a `sys.settrace` tracer with opcode events that counts each `LOAD_ATTR` whose
operand a `LOAD_GLOBAL` of an Enum class just pushed.

    .venv/bin/python -m bench.enum_lookups                 # both engines, non-streamed
    .venv/bin/python -m bench.enum_lookups --engines vllm --modes nonstream,stream64 -n 100
"""

from __future__ import annotations

import argparse
import dis
import enum
import itertools
import sys
from collections import Counter
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import uvloop  # noqa: E402

from bench.python_cost import Rig  # noqa: E402


def _enum_loads(code: CodeType, globals_: dict[str, Any]) -> frozenset[int]:
    """The offsets in `code` of a `LOAD_ATTR` on an Enum class named by the `LOAD_GLOBAL` before."""
    ins = list(dis.get_instructions(code))
    return frozenset(
        b.offset
        for a, b in itertools.pairwise(ins)
        if a.opname == "LOAD_GLOBAL"
        and b.opname in ("LOAD_ATTR", "LOAD_METHOD")
        and isinstance(globals_.get(a.argval), enum.EnumType)
    )


class EnumLookupCounter:
    """A `sys.settrace` tracer: Enum class-attribute look-ups by (file, line, function)."""

    def __init__(self) -> None:
        self.hits: Counter[tuple[str, int, str]] = Counter()
        self._offsets: dict[CodeType, frozenset[int]] = {}
        self._skip = {str(ROOT / "bench" / "python_cost.py"), __file__}

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event != "call" or frame.f_code.co_filename in self._skip:
            return None
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        return self._local

    def _local(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            code = frame.f_code
            offsets = self._offsets.get(code)
            if offsets is None:
                offsets = self._offsets[code] = _enum_loads(code, frame.f_globals)
            if frame.f_lasti in offsets:
                where = code.co_filename.removeprefix(str(ROOT) + "/")
                self.hits[(where, frame.f_lineno or 0, code.co_qualname)] += 1
        return self._local


async def count(engine: str, mode: str, n: int, warmup: int = 50) -> Counter[tuple[str, int, str]]:
    """Enum class-attribute look-ups over `n` requests of the gateway (after `warmup`)."""
    rig = Rig(engine, mode, "gateway", "", False, None, 1, "openai")
    for i in range(warmup):
        await rig.one(-i - 1)
    counter = EnumLookupCounter()
    sys.settrace(counter)
    try:
        for k in range(n):
            await rig.one(k)
    finally:
        sys.settrace(None)
    return counter.hits


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="sglang,vllm")
    ap.add_argument("--modes", default="nonstream")
    ap.add_argument("-n", type=int, default=300)
    args = ap.parse_args(argv)
    for engine in args.engines.split(","):
        for mode in args.modes.split(","):
            hits = uvloop.run(count(engine, mode, args.n))
            print(f"{engine} {mode}: {sum(hits.values()) / args.n:.2f} Enum look-ups/request")
            for (where, line, fn), k in hits.most_common(30):
                print(f"  {k / args.n:6.2f}  {where}:{line} {fn}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
