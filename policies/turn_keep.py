"""`turn_keep_x`: a cached turn stays on its holder where the SLO rank's alternative costs far more.

Told the SLOs (policies/decode_slo.py), `cache_aware` keeps the candidates with the fewest
predicted SLO misses and takes the cheapest of those. One short answer predicted broken on a
turn's cache holder sends the turn to a worker that breaks none, whatever it costs there: on the
x3 replay (docs/benchmarks.md, "The prefix-hit gap to sglang-router, per request") such turns
of 19k-62k cached tokens went to workers whose cost was 2.4-12x the holder's (row 170: 0.63 s
on its holder, 6.79 s where it went), computed their whole prompt again and wrote it over other
conversations' prefixes; they were half the hit-rate gap to sglang-router. A price on every
miss (`slo_miss_s`, measured, not merged) moved cold prompts instead, whose candidates cost
about the same.

With `turn_keep_x = x > 0` the rank is kept for everything but the **holder** of a **cached
turn**: of the candidates, the one predicted to hold the most of the prompt (credited tokens,
past `cache_threshold`; ties: the fewest misses, then the cheaper), where it holds at least
`turn_keep_share` of the prompt. It stays among the candidates the cost chooses from, beside
those with the fewest misses, when

    cost(cheapest with the fewest misses) >= x * (misses(holder) - fewest) * cost(holder)

that is, when leaving costs at least `x` times as much per miss the move spares (a holder that
breaks two decodes more must be twice as far ahead). A cold prompt (no candidate holding the
share) is ranked as before, and so is every turn whose holder is not far cheaper.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from policies.snapshot import WorkerState

if TYPE_CHECKING:
    from policies.cache_state import CacheState
    from policies.prefix_source import Lookup

T = TypeVar("T")
Part = tuple[float, float, float, float, WorkerState]  # `_choose`'s (wait, prefill s, work, evict s, w)


@dataclass(frozen=True, slots=True)
class TurnKeep:
    """`turn_keep_x` and `turn_keep_share` (`policies.config.CacheAwareCfg` documents both)."""

    x: float = 0.0  # 0: off
    share: float = 0.5

    @property
    def on(self) -> bool:
        return self.x > 0.0


def holder(costs: Sequence[float], misses: Sequence[int], cached: Sequence[int]) -> int:
    """The candidate holding the most (credited) tokens; ties: the fewest misses, then the cheaper,
    then the first."""
    best = 0
    for i in range(1, len(cached)):
        if (-cached[i], misses[i], costs[i]) < (-cached[best], misses[best], costs[best]):
            best = i
    return best


def kept_holder(
    keep: TurnKeep, prompt: int, costs: Sequence[float], misses: Sequence[int], cached: Sequence[int]
) -> int | None:
    """The position of the holder the SLO step keeps beside the fewest misses (the module
    docstring), or None: the knob off, no cached turn, the holder among the fewest, or leaving
    it not costly enough. `cached` is each candidate's credited tokens (0 below the threshold)."""
    if not keep.on or not costs:
        return None
    fewest = min(misses)
    h = holder(costs, misses, cached)
    extra = misses[h] - fewest
    if extra <= 0 or cached[h] <= 0 or cached[h] < keep.share * prompt:
        return None
    alt = min(c for c, n in zip(costs, misses, strict=True) if n == fewest)
    return h if alt >= keep.x * extra * costs[h] else None


def slo_kept(
    keep: TurnKeep, prompt: int, costs: Sequence[float], misses: Sequence[int], cached: Sequence[int]
) -> list[bool]:
    """Which candidates the SLO step passes to the cost: those with the fewest predicted misses,
    and the holder `kept_holder` keeps."""
    fewest = min(misses)
    out = [n == fewest for n in misses]
    h = kept_holder(keep, prompt, costs, misses, cached)
    if h is not None:
        out[h] = True
    return out


class Row(Protocol):
    """What `keep_estimates` reads of a candidate's prediction (`policies.cache_state.Estimate`)."""

    @property
    def cost(self) -> float: ...
    @property
    def slo_misses(self) -> int: ...
    @property
    def cached_tokens(self) -> int: ...


R = TypeVar("R", bound=Row)


def keep_estimates(keep: TurnKeep, prompt: int, threshold: float, ok: list[tuple[T, R]]) -> list[tuple[T, R]]:
    """`decide`'s SLO step over (worker, estimate) pairs (`threshold`: the tokens a match must
    exceed to count, `cache_threshold x prompt`)."""
    misses = [e.slo_misses for _, e in ok]
    if not keep.on:  # the knob off (the default): the fewest misses, no more lists
        fewest = min(misses)
        return [p for p, n in zip(ok, misses, strict=True) if n == fewest]
    costs = [e.cost for _, e in ok]
    cached = [e.cached_tokens if e.cached_tokens > threshold else 0 for _, e in ok]
    mask = slo_kept(keep, prompt, costs, misses, cached)
    return [p for p, m in zip(ok, mask, strict=True) if m]


def keep_parts(
    keep: TurnKeep,
    prompt: int,
    parts: list[Part],
    counted: Sequence[int],
    k: float,
    factor: float,
    state: CacheState,
    lookups: tuple[Lookup | None, Lookup],
) -> list[Part]:
    """`_choose`'s SLO step (`k` the queue externality, `factor` inflight_factor: the parts'
    costs as `_rank` computes them); the indexes are read only where the fewest misses would
    drop a candidate."""
    fewest = min(counted)
    if not keep.on or all(n == fewest for n in counted):
        return [p for p, n in zip(parts, counted, strict=True) if n == fewest]
    cost = part_cost(k, factor)
    got = credit(state, lookups, prompt)
    mask = slo_kept(keep, prompt, [cost(p) for p in parts], counted, [got(p[4].id) for p in parts])
    return [p for p, m in zip(parts, mask, strict=True) if m]


def part_cost(k: float, factor: float) -> Callable[[Part], float]:
    """A part's cost as `_rank` computes it (`k` the queue externality, `factor` inflight_factor)."""

    def cost(p: Part) -> float:
        wait, seconds, work, evict, w = p
        return wait + seconds * (1.0 + factor * w.inflight) + k * work + evict

    return cost


def credit(state: CacheState, lookups: tuple[Lookup | None, Lookup], prompt: int) -> Callable[[str], int]:
    """A worker's credited tokens of the prompt as `_parts` counts them: the indexes' match, at
    most `prompt - 1`, 0 unless past `cache_threshold`."""
    threshold = math.floor(state.settings.cache_threshold * prompt)

    def got(worker_id: str) -> int:
        cached = min(state.cached(lookups, worker_id)[0], prompt - 1)
        return cached if cached > threshold else 0

    return got


__all__ = [
    "Part",
    "Row",
    "TurnKeep",
    "credit",
    "holder",
    "keep_estimates",
    "keep_parts",
    "kept_holder",
    "part_cost",
    "slo_kept",
]
