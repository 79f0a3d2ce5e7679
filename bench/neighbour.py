"""A CPU neighbour for `bench overhead --neighbour`: a process that keeps a core busy beside a
target, to tell what sharing a core costs a target's CPU per request (issue #33's `--workers 2`
rows, where two gateway processes share one core).

    python -m bench.neighbour spin          # the interpreter's loop: a few KB of data, no I/O
    python -m bench.neighbour copy:8        # copy 4 MiB into another 4 MiB buffer, over and over

`spin` takes the core's time but hardly its caches; `copy:MB` takes its time and sweeps MB of
cache lines each pass (memcpy), as a second process with its own heap would evict the first's."""

from __future__ import annotations

import sys


def parse(kind: str) -> int:
    """0 for `spin`, the MiB swept for `copy:MB`; ValueError otherwise."""
    if kind == "spin":
        return 0
    name, _, mb = kind.partition(":")
    if name != "copy" or not mb.isdigit() or int(mb) < 2:
        raise ValueError(f"neighbour {kind!r}: spin or copy:MB (MB >= 2)")
    return int(mb)


def run(kind: str) -> None:  # pragma: no cover - runs until killed
    mb = parse(kind)
    if mb == 0:
        n = 0
        while True:
            n = (n + 1) & 0xFFFF
    half = (mb << 20) // 2
    src, dst = bytearray(b"x" * half), bytearray(half)
    while True:
        dst[:] = src
        src[:] = dst


if __name__ == "__main__":
    run(sys.argv[1] if len(sys.argv) > 1 else "spin")
