"""A small Prometheus text-format reader: enough to pull a few gauges out of an engine's /metrics."""

from __future__ import annotations

from collections.abc import Iterable


def sum_metrics(text: str, names: Iterable[str]) -> dict[str, float]:
    """Sum each named metric over all its label sets (engines label per rank/engine index).

    A name matches the sample name exactly, so `vllm:prefix_cache_hits_total` and
    `vllm:prefix_cache_hits_created` stay apart.
    """
    wanted = set(names)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        end = brace if 0 <= brace < space or (brace >= 0 and space < 0) else space
        if end <= 0:
            continue
        name = line[:end]
        if name not in wanted:
            continue
        value_part = line[line.rfind("}") + 1 :] if brace >= 0 else line[space:]
        fields = value_part.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + value
    return out
