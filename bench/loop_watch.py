"""How long the event loop goes without running a task: a task that sleeps `tick_s` at a time
records the longest gap between its wake-ups while the watch is open.

    async with LoopWatch() as watch:
        ...  # the work whose stalls are measured
    watch.worst_s  # the longest gap; `late_s`: beyond the sleep itself

(bench/body_stall.py has its own ticker: it also counts the loop thread's CPU time per gap.)
"""

from __future__ import annotations

import asyncio
import time
from types import TracebackType


class LoopWatch:
    __slots__ = ("_done", "_task", "tick_s", "worst_s")

    def __init__(self, tick_s: float = 0.001) -> None:
        self.tick_s = tick_s
        self.worst_s = 0.0  # the longest gap between two wake-ups of the ticking task
        self._done = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def late_s(self) -> float:
        """The longest gap beyond the sleep it asked for."""
        return max(0.0, self.worst_s - self.tick_s)

    async def _tick(self) -> None:
        last = time.perf_counter()
        while not self._done.is_set():
            await asyncio.sleep(self.tick_s)
            now = time.perf_counter()
            self.worst_s = max(self.worst_s, now - last)
            last = now

    async def __aenter__(self) -> LoopWatch:
        self._task = asyncio.create_task(self._tick())
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._done.set()
        if self._task is not None:
            await self._task
