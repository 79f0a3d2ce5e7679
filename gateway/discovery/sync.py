"""Converge the registry to a desired set of workers, one worker at a time.

`set(id, config)` says what a worker should be now (`None`: gone). Each worker id has at most one
task converging it; the task reads the latest wish each time round, so a pod that flaps between
ready and unready ends as it is last reported, and a worker being drained is never added twice.
Removal goes through `gateway.admin.drain_and_remove` (no new requests, in-flight ones finish
within `drain_timeout_s`); an addition probes the worker first and adds it healthy or not (the
health loop brings it in when it answers), as the admin API's `?require_healthy=false` does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from gateway.admin import drain_and_remove
from gateway.config import ConfigError, WorkerConfig
from gateway.health import HealthChecker
from gateway.logging import get_logger
from gateway.registry import Registry, Worker

if TYPE_CHECKING:
    from gateway.orchestration import RequestContext

log = get_logger("pd_gateway.discovery")


class WorkerSync:
    def __init__(
        self,
        registry: Registry,
        health: HealthChecker,
        make_worker: Callable[[WorkerConfig], Worker],
        unstarted: Callable[[], list[RequestContext]],
        *,
        drain_timeout_s: float,
        source: str = "discovery",
    ) -> None:
        self.registry = registry
        self.health = health
        self.make_worker = make_worker
        self.unstarted = unstarted
        self.drain_timeout_s = drain_timeout_s
        self.source = source
        self._desired: dict[str, WorkerConfig | None] = {}
        self._added: dict[str, WorkerConfig] = {}  # what this sync added, by id
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    def managed(self) -> dict[str, WorkerConfig]:
        """The workers this sync added and has not removed."""
        return dict(self._added)

    def set(self, worker_id: str, wc: WorkerConfig | None) -> None:
        """The worker should be `wc` now (None: not exist); converged in the background."""
        if wc is not None and wc.worker_id != worker_id:
            raise ValueError(f"worker id {worker_id!r} != config id {wc.worker_id!r}")
        if wc is None and worker_id not in self._added and worker_id not in self._tasks:
            self._desired.pop(worker_id, None)
            return
        self._desired[worker_id] = wc
        if worker_id not in self._tasks:
            self._idle.clear()
            task = asyncio.create_task(self._converge(worker_id), name=f"sync-{worker_id}")
            self._tasks[worker_id] = task
            task.add_done_callback(lambda _: self._done(worker_id))

    def _done(self, worker_id: str) -> None:
        self._tasks.pop(worker_id, None)
        if not self._tasks:
            self._idle.set()

    async def settled(self) -> None:
        """Wait until every worker is as last wished (tests and start-up)."""
        while self._tasks:
            await self._idle.wait()

    async def _converge(self, worker_id: str) -> None:
        while True:
            want = self._desired.get(worker_id)
            have = self.registry.find(worker_id)
            if have is not None and worker_id not in self._added:
                log.warning(
                    "discovery.id_taken",
                    worker=worker_id,
                    source=self.source,
                    reason="a configured or admin-added worker has this id; not managed",
                )
                self._desired.pop(worker_id, None)
                return
            if want is None:
                if have is None:
                    self._desired.pop(worker_id, None)
                    return
                await self._remove(have)
                continue
            if have is not None:
                if self._added.get(worker_id) == want:
                    return
                await self._remove(have)  # its address or role changed: out, then in again
                continue
            if not await self._add(want):
                return

    async def _add(self, wc: WorkerConfig) -> bool:
        try:
            w = self.make_worker(wc)
        except (ValueError, ConfigError) as e:
            log.error("discovery.worker_invalid", worker=wc.worker_id, url=wc.url, error=str(e))
            self._desired.pop(wc.worker_id, None)
            return False
        added = False
        try:
            healthy = await self.health.probe(w)
            if self._desired.get(wc.worker_id) != wc:  # changed or gone while it was probed
                return True
            self.registry.add(w)
            self._added[wc.worker_id] = wc
            added = True
        finally:
            if not added:
                self.health.forget(w.id)
                await w.pool.close()
        self.health.check_models()
        log.info(
            "discovery.worker_added",
            worker=w.id,
            url=w.url,
            role=w.role.value,
            engine=w.engine.value,
            model=w.model,
            healthy=healthy,
            source=self.source,
        )
        return True

    async def _remove(self, w: Worker) -> None:
        log.info("discovery.worker_removing", worker=w.id, inflight=w.inflight, source=self.source)
        result = await drain_and_remove(w, self.registry, self.health, self.unstarted, self.drain_timeout_s)
        self._added.pop(w.id, None)
        log.info("discovery.worker_removed", worker=w.id, drained=result["drained"], source=self.source)

    async def close(self) -> None:
        """Stop converging (workers stay as they are: the gateway is stopping)."""
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
