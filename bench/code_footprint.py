"""How much Python code a call runs: the distinct bytecode instructions it executes (each
counted once however often a loop repeats it) and the functions they belong to.

A decision that finds its data and code in the CPU caches costs a fraction of one that finds
them evicted (`bench/cache_decision.py --diagnose`); what it must fetch again is its data and
the code it runs: each function's code object and the bytecode (with its inline caches) of the
instructions it reaches. This count is deterministic, so it tells two versions of the code
apart where a timed tail on a shared machine cannot.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any


def footprint(call: Callable[..., Any], *args: Any) -> tuple[int, int, Any]:
    """(distinct instructions, distinct functions) that `call(*args)` executes, and its result."""
    seen: set[tuple[object, int]] = set()

    def trace(frame: FrameType, event: str, arg: object) -> Callable[..., Any]:
        frame.f_trace_opcodes = True
        if event == "opcode":
            seen.add((frame.f_code, frame.f_lasti))
        return trace

    old = sys.gettrace()
    sys.settrace(trace)
    try:
        got = call(*args)
    finally:
        sys.settrace(old)
    return len(seen), len({code for code, _ in seen}), got


__all__ = ["footprint"]
