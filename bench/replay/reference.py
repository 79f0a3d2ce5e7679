"""Reachable reuse: what share of prompt tokens a router *could* have served from cache.

Simulated in seconds, without servers, over the same rows at the same arrival times:

  * `ideal`: one cache of unbounded size shared by every worker: a row reuses the longest
    prefix of its blocks that any earlier row had. No router can beat it.
  * `reference`: a cache-and-load-aware router over the real workers, each with an LRU of
    512-token blocks as large as its KV pool (`capacity_tokens`, as the workers report it).
    Each row goes to the worker with the least predicted TTFT = wait for that worker's earlier
    prefills + the prefill of the tokens it does not hold (the emulator's timing model,
    emulator/timing.py, for the cluster's profile and time scale); ties go to more reuse.
  * `cache_first`: the same LRUs, each row to the worker holding most of its prefix (ties: the
    least busy), whatever the load: about the most reuse the capacities allow, load-blind;
  * `round_robin`: the same LRUs, rows dealt in turn: the floor a cache-blind router gets.

An engine always computes a prompt's last token, so a row reuses at most `input_length - 1`.
The simulation leaves out what the LRU does not see: running requests pin their blocks, a
decode slows a colocated worker's prefills; the measured hit rates are read against these
figures, not held to them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import msgspec

from bench.replay.trace import BLOCK_TOKENS, Row

PrefillTime = Callable[[int, int], float]  # (new tokens, cached tokens) -> seconds
POLICIES = ("ideal", "cache_first", "reference", "round_robin")


class SimResult(msgspec.Struct):
    policy: str
    prompt_tokens: int
    reused_tokens: int
    per_worker_requests: list[int]
    per_worker_computed: list[int]

    @property
    def reuse(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class _Lru:
    def __init__(self, blocks: int | None) -> None:
        self.cap = blocks
        self.held: OrderedDict[int, None] = OrderedDict()

    def prefix(self, ids: Sequence[int]) -> int:
        n = 0
        for h in ids:
            if h not in self.held:
                break
            n += 1
        return n

    def touch(self, ids: Sequence[int]) -> None:
        for h in ids:
            self.held[h] = None
            self.held.move_to_end(h)
        if self.cap is not None:
            while len(self.held) > self.cap:
                self.held.popitem(last=False)


def _reused(row: Row, blocks: int, block_tokens: int) -> int:
    return min(blocks * block_tokens, row.input_length - 1)


def simulate(
    rows: Sequence[Row],
    policy: str,
    *,
    capacity_tokens: Sequence[int] = (),
    prefill_time: PrefillTime | None = None,
    block_tokens: int = BLOCK_TOKENS,
) -> SimResult:
    """Reuse of `rows` (arrivals in seconds) under `policy` over workers of `capacity_tokens`."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    total = sum(r.input_length for r in rows)
    if policy == "ideal":
        cache = _Lru(None)
        reused = 0
        for r in rows:
            reused += _reused(r, cache.prefix(r.hash_ids), block_tokens)
            cache.touch(r.hash_ids)
        return SimResult(policy, total, reused, [len(rows)], [total - reused])
    if not capacity_tokens:
        raise ValueError(f"{policy} needs the workers' KV capacities")
    lrus = [_Lru(max(1, c // block_tokens)) for c in capacity_tokens]
    busy = [0.0] * len(lrus)
    reqs = [0] * len(lrus)
    computed = [0] * len(lrus)
    reused = 0
    cost = prefill_time or (lambda new, cached: 0.0)
    for i, r in enumerate(rows):
        hits = [_reused(r, lru.prefix(r.hash_ids), block_tokens) for lru in lrus]
        if policy == "round_robin":
            w = i % len(lrus)
        elif policy == "cache_first":
            w = min(range(len(lrus)), key=lambda k: (-hits[k], max(r.t_s, busy[k])))
        else:
            scores = [
                (max(r.t_s, busy[k]) - r.t_s + cost(r.input_length - hits[k], hits[k]), -hits[k], k)
                for k in range(len(lrus))
            ]
            w = min(scores)[2]
        start = max(r.t_s, busy[w])
        busy[w] = start + cost(r.input_length - hits[w], hits[w])
        lrus[w].touch(r.hash_ids)
        reused += hits[w]
        reqs[w] += 1
        computed[w] += r.input_length - hits[w]
    return SimResult(policy, total, reused, reqs, computed)


def emulator_prefill_time(profile_name: str, time_scale: float) -> PrefillTime:
    """The emulator's prefill model for a profile, in wall seconds at `time_scale`."""
    from emulator.profiles import get_profile
    from emulator.timing import prefill_time

    profile = get_profile(profile_name)

    def t(new: int, cached: int) -> float:
        return prefill_time(profile, new, cached) * time_scale

    return t
