"""Per-request deadlines at a fraction of `asyncio.timeout`'s cost.

`asyncio.timeout` costs a Timeout object, an `async` enter and exit, a `current_task()` and a
loop timer per use; the orchestrator used two or three per request (the total deadline and each
phase's). Here a deadline is a small object put in a bucket of a coarse timer wheel (`tick_s`,
10 ms by default) and a plain `with` block; the wheel keeps one loop timer, for its earliest
bucket that still holds a deadline, so deadlines that are met do not wake the loop each tick.
A deadline fires up to one tick late, which is nothing against timeouts of seconds.

Semantics are `asyncio.timeout`'s: when it fires, the task is cancelled; leaving the block with
that cancellation raises `TimeoutError` instead, unless something else also cancelled the task
(the client went away), in which case the `CancelledError` goes on.
"""

from __future__ import annotations

import asyncio
import heapq
import math
from types import TracebackType
from typing import Any

import msgspec


class Deadline(msgspec.Struct, eq=False):
    """One armed deadline (`DeadlineWheel.after`); use as a `with` block around awaits of `task`.
    (A Struct: built in C, as each request makes two or three.)"""

    _wheel: DeadlineWheel
    task: asyncio.Task[Any]
    when: float
    _cancelling: int  # the task's pending cancellations when the deadline was set
    expired: bool = False
    _slot: set[Deadline] | None = None
    _key: int = 0

    def reschedule(self, when: float) -> None:
        """Move the deadline (loop time), as `asyncio.Timeout.reschedule`."""
        if self.expired:
            return
        self._wheel._discard(self)
        self.when = when
        self._wheel._add(self)

    def __enter__(self) -> Deadline:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._wheel._discard(self)
        # as asyncio.timeout: a deadline that fired takes its cancellation back in any case (the
        # block may have ended in the same loop turn), and turns it into TimeoutError unless
        # another cancellation is pending too
        if self.expired and self.task.uncancel() <= self._cancelling:
            if exc_type is asyncio.CancelledError:
                raise TimeoutError from exc


class DeadlineWheel:
    """Deadlines of one event loop, bucketed by `tick_s`.

    One loop timer at most, for the earliest bucket: a bucket is dropped as soon as its last
    deadline leaves, and when the timer finds its bucket gone it re-arms for the earliest one
    still held (or not at all). So deadlines that are met cost no wake-up of their own: the
    loop wakes about once per shortest timeout, not once per tick. Bucket keys wait in a heap
    (one push per new bucket, not per deadline); keys of dropped buckets are skipped."""

    def __init__(self, loop: asyncio.AbstractEventLoop, tick_s: float = 0.01) -> None:
        self.loop = self._loop = loop
        self._tick = tick_s
        self._buckets: dict[int, set[Deadline]] = {}
        self._keys: list[int] = []  # heap of bucket keys, some of them dropped
        self._timer: asyncio.TimerHandle | None = None
        self._armed: int | None = None  # the key the timer is set for

    def after(self, seconds: float, task: asyncio.Task[Any]) -> Deadline:
        """A deadline `seconds` from now for `task` (the running one)."""
        d = Deadline(self, task, self._loop.time() + seconds, task.cancelling())
        self._add(d)
        return d

    def __len__(self) -> int:
        return sum(len(b) for b in self._buckets.values())

    @property
    def armed(self) -> bool:
        """A loop timer is set."""
        return self._timer is not None

    @property
    def buckets(self) -> int:
        """Buckets holding deadlines now."""
        return len(self._buckets)

    def _add(self, d: Deadline) -> None:
        key = math.ceil(d.when / self._tick)
        slot = self._buckets.get(key)
        if slot is None:
            slot = self._buckets[key] = set()
            keys = self._keys
            heapq.heappush(keys, key)
            if len(keys) > 1024 and len(keys) > 8 * len(self._buckets):
                self._keys = [k for k in keys if k in self._buckets]
                heapq.heapify(self._keys)
            if self._armed is None or key < self._armed:
                self._arm(key)
        slot.add(d)
        d._slot = slot
        d._key = key

    def _discard(self, d: Deadline) -> None:
        slot = d._slot
        if slot is not None:
            slot.discard(d)
            d._slot = None
            if not slot:
                # dropped; if the timer is set for it, it stays so (one late wake-up, which
                # re-arms for the earliest live bucket, is cheaper than a cancel and a new
                # timer at the end of every request)
                del self._buckets[d._key]

    def _arm(self, key: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._armed = key
        self._timer = self._loop.call_at(key * self._tick, self._fire)

    def _rearm(self) -> None:
        """Set the timer for the earliest live bucket, or none."""
        keys, buckets = self._keys, self._buckets
        while keys and keys[0] not in buckets:
            heapq.heappop(keys)
        if keys:
            if keys[0] != self._armed:
                self._arm(keys[0])
        elif self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._armed = None

    def _fire(self) -> None:
        self._timer = None
        self._armed = None
        now = self._loop.time()
        keys, buckets, tick = self._keys, self._buckets, self._tick
        due: list[Deadline] = []
        while keys and keys[0] * tick <= now:
            slot = buckets.pop(heapq.heappop(keys), None)
            if slot:
                due.extend(slot)
        for d in due:
            d._slot = None
            if d.when > now:  # the loop's clock is a little behind the bucket's bound
                self._add(d)
                continue
            d.expired = True
            d.task.cancel()
        self._rearm()


__all__ = ["Deadline", "DeadlineWheel"]
