"""Turns sent while the prefill that writes their prefix still runs on their worker (`inflight_hold`).

An engine matches a waiting prompt's prefix as it schedules the prompt's first chunk, not as
the prompt arrives (SGLang's scheduler as it forms a prefill batch, vLLM's as it schedules a
waiting request, the emulator's `_plan_step`), and a chunked engine fills the step of a running
prefill's last chunk with the next waiting prompt's first chunk. SGLang (and the emulator's
SGLang) has put the running prefill's earlier chunks into its radix cache by then, not its last
one (vLLM caches a chunk as it schedules it, so there the turn reads all of it). So a
conversation's turn sent to the worker where its predecessor's prompt is still being prefilled,
with nothing queued between the two, computes the part of the prefix in its predecessor's last
chunk again (up to one chunk, 8,192 tokens), where `cache_aware` predicted the queue and its
suffix only (the approximate index counts a prompt from its routing on). Before the emulator
cached chunk by chunk it lost the whole prefix, and holding the turn won 2-3 % goodput on the
Mooncake slice at x3; after, nothing measurable (docs/benchmarks.md, "Turns behind a prefill
still running" and "Wave 16 after the merges"), so the hold is off by default.

With `inflight_hold` (seconds, 0: off) the gateway holds such a turn before it sends it, until
the predicted end of the prefill it waits for (at most `inflight_hold` seconds from its
routing; a longer wait is not held): it reaches the engine as its prefix is registered there,
and prefills only its own suffix. The wait is the one the cost already predicted for it on that
worker (the queue ahead, then its uncached suffix), so the choice of the worker is unchanged.

A request routed to a worker while a turn held for it waits is held too, until just after that
turn is sent: the engine queues in arrival order, and the cost predicted each request behind
those routed before it (sent at once, a long prompt routed during the hold went ahead of the
held turn, which then waited for it: 1.4 s where 0.3 s was predicted, in a replay).

A turn is held where a prefill routed to the same worker (colocated), predicted still running,
writes at least `HOLD_MIN_TOKENS` of its prompt's prefix beyond what that prefill found cached
itself; it waits for the one that writes the most. A prefill's predicted end is its routing
time plus the worker's queue and its own work at the worker's rate, as the policy predicts them
(policies/prefill_cost.py); it is forgotten at that end, or when its answer or failure comes.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.base import Completed, Failed, PolicyEvent, WorkerGone
from policies.decode_slo import shared_blocks

HOLD_MIN_TOKENS = 512  # a running prefill writing less of the prompt than this is not waited for
ORDER_S = 0.001  # a request routed after a held one is sent this long after it
MAX_HOLDS = 10_000  # holds not taken by a gateway (a policy driven by tests) are dropped past this


@dataclass(slots=True)
class Filling:
    """A prefill routed to a worker whose predicted end has not come."""

    chain: tuple[int, ...]  # its prompt's prefix-chained block keys (the approximate index's)
    found: int  # the cached tokens it was predicted to find there itself
    end: float  # its predicted end (the clock's time)


class InflightPrefills:
    """Per worker, the prefills predicted still running there; per request, the hold decided."""

    __slots__ = ("_by_worker", "_holds", "_release", "_where", "block_tokens", "held", "held_s", "max_hold_s")

    def __init__(self, max_hold_s: float, block_tokens: int) -> None:
        self.max_hold_s = max_hold_s
        self.block_tokens = block_tokens
        self._by_worker: dict[str, dict[str, Filling]] = {}
        self._where: dict[str, str] = {}  # request -> worker
        self._holds: dict[str, float] = {}  # request -> seconds to hold it before it is sent
        self._release: dict[str, float] = {}  # worker -> when the last request held for it is sent
        self.held = 0  # requests held so far
        self.held_s = 0.0  # seconds held so far (as decided)

    def routed(
        self, rid: str, worker_id: str, chain: tuple[int, ...], found: int, end: float, now: float
    ) -> float:
        """A prefill routed to `worker_id` (colocated) that finds `found` cached tokens and is
        predicted to end at `end`: its hold (seconds from `now`; 0: none, module docstring),
        kept for `hold_s`; at least until just after the last one held for the worker is sent.
        Then it is a running prefill there itself."""
        running = self._by_worker.setdefault(worker_id, {})
        wait, gain = 0.0, 0
        for other, f in list(running.items()):
            if f.end <= now:
                del running[other]
                self._where.pop(other, None)
                continue
            writes = shared_blocks(chain, f.chain) * self.block_tokens - f.found
            if writes >= HOLD_MIN_TOKENS and writes > gain:
                wait, gain = f.end - now, writes
        hold = wait if 0.0 < wait <= self.max_hold_s else 0.0
        last = self._release.get(worker_id)
        if last is not None and last > now:  # one held before it: sent after it (module docstring)
            hold = max(hold, last - now + ORDER_S)
        if hold > 0.0:
            self._release[worker_id] = now + hold
            if len(self._holds) >= MAX_HOLDS:
                self._holds.clear()
            self._holds[rid] = hold
            self.held += 1
            self.held_s += hold
        running[rid] = Filling(chain, found, end)
        self._where[rid] = worker_id
        return hold

    def hold_s(self, rid: str) -> float:
        """The seconds the request routed as `rid` is to be held before it is sent (taken: 0
        after the first call)."""
        return self._holds.pop(rid, 0.0)

    def observe(self, event: PolicyEvent) -> None:
        """The events after `Routed` (the owner calls `routed` itself)."""
        match event:
            case Completed() | Failed():
                self.done(event.request_id)
            case WorkerGone():
                self.forget(event.worker_id)

    def done(self, rid: str) -> None:
        """Its answer or failure came: its prefill is not running (any more)."""
        self._holds.pop(rid, None)
        wid = self._where.pop(rid, None)
        if wid is not None:
            self._by_worker.get(wid, {}).pop(rid, None)

    def forget(self, worker_id: str) -> None:
        """The worker left or restarted."""
        self._release.pop(worker_id, None)
        for rid in self._by_worker.pop(worker_id, {}):
            self._where.pop(rid, None)

    def running(self, worker_id: str) -> int:
        """Prefills tracked as running on the worker (stale ones go as the next is routed there)."""
        return len(self._by_worker.get(worker_id, {}))
