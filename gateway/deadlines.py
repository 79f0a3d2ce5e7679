"""Per-request deadlines at a fraction of `asyncio.timeout`'s cost.

`asyncio.timeout` costs a Timeout object, an `async` enter and exit, a `current_task()` and a
loop timer per use; the orchestrator used two or three per request (the total deadline and each
phase's). Here a deadline is a small object put in a bucket of a coarse timer wheel (`tick_s`,
10 ms by default): one loop timer per bucket, not per deadline, and a plain `with` block.
A deadline fires up to one tick late, which is nothing against timeouts of seconds.

Semantics are `asyncio.timeout`'s: when it fires, the task is cancelled; leaving the block with
that cancellation raises `TimeoutError` instead, unless something else also cancelled the task
(the client went away), in which case the `CancelledError` goes on.
"""

from __future__ import annotations

import asyncio
import math
from types import TracebackType
from typing import Any


class Deadline:
    """One armed deadline; use as a `with` block around awaits of `task`."""

    __slots__ = ("_cancelling", "_slot", "_wheel", "expired", "task", "when")

    def __init__(self, wheel: DeadlineWheel, task: asyncio.Task[Any], when: float) -> None:
        self._wheel = wheel
        self.task = task
        self.when = when
        self.expired = False
        self._cancelling = task.cancelling()
        self._slot: set[Deadline] | None = None
        wheel._add(self)

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
        if self.expired and exc_type is asyncio.CancelledError:
            if self.task.uncancel() <= self._cancelling:
                raise TimeoutError from exc


class DeadlineWheel:
    """Deadlines of one event loop, bucketed by `tick_s`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, tick_s: float = 0.01) -> None:
        self.loop = self._loop = loop
        self._tick = tick_s
        self._buckets: dict[int, set[Deadline]] = {}

    def after(self, seconds: float, task: asyncio.Task[Any]) -> Deadline:
        """A deadline `seconds` from now for `task` (the running one)."""
        return Deadline(self, task, self._loop.time() + seconds)

    def at(self, when: float, task: asyncio.Task[Any]) -> Deadline:
        return Deadline(self, task, when)

    def __len__(self) -> int:
        return sum(len(b) for b in self._buckets.values())

    def _add(self, d: Deadline) -> None:
        key = math.ceil(d.when / self._tick)
        slot = self._buckets.get(key)
        if slot is None:
            slot = self._buckets[key] = set()
            self._loop.call_at(key * self._tick, self._fire, key)
        slot.add(d)
        d._slot = slot

    def _discard(self, d: Deadline) -> None:
        slot = d._slot
        if slot is not None:
            slot.discard(d)
            d._slot = None

    def _fire(self, key: int) -> None:
        slot = self._buckets.pop(key, None)
        if not slot:
            return
        now = self._loop.time()
        for d in slot:
            d._slot = None
            if d.when > now:  # the loop's clock is a little behind the bucket's bound
                self._add(d)
                continue
            d.expired = True
            d.task.cancel()


__all__ = ["Deadline", "DeadlineWheel"]
