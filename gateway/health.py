"""Active health checks and metric scrapes: background tasks that update the registry.

A worker becomes healthy after `success_threshold` good probes in a row and unhealthy after
`failure_threshold` bad ones. A probe is the adapter's health endpoint; once healthy, the
worker's info endpoints (model, context length, SGLang's input limit and bootstrap port) are
read, again every `info_every` probes. Metrics are scraped on their own interval and parsed by
the adapter into a `WorkerLoad`. Request outcomes (passive detection) act through the breakers.
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from gateway.http.errors import UpstreamError
from gateway.logging import get_logger
from gateway.registry import Registry, Worker

log = get_logger("pd_gateway.health")


class HealthSettings(msgspec.Struct, frozen=True):
    interval_s: float = 5.0
    timeout_s: float = 3.0
    failure_threshold: int = 3
    success_threshold: int = 1
    scrape_interval_s: float = 2.0
    info_every: int = 12


async def _get(w: Worker, path: str, timeout_s: float) -> tuple[int, bytes]:
    async with asyncio.timeout(timeout_s):
        resp = await w.pool.request("GET", path, [(b"accept", b"*/*")], None)
        try:
            body = await resp.read()
        except BaseException:
            resp.abort()
            raise
        resp.release()
        return resp.status, body


class HealthChecker:
    def __init__(self, registry: Registry, settings: HealthSettings | None = None) -> None:
        self.registry = registry
        self.settings = settings or HealthSettings()
        self._rounds: dict[str, int] = {}

    def forget(self, worker_id: str) -> None:
        """Drop what is kept about a removed worker."""
        self._rounds.pop(worker_id, None)

    async def probe(self, w: Worker) -> bool:
        s = self.settings
        try:
            status, _ = await _get(w, w.adapter.health_path, s.timeout_s)
            ok = status == 200
            reason = f"HTTP {status}"
        except (TimeoutError, UpstreamError, OSError) as e:
            ok, reason = False, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        n = self._rounds.get(w.id, 0)
        self._rounds[w.id] = n + 1
        if ok and (w.info.model is None or n % s.info_every == 0):
            ok = await self._read_info(w)
            reason = "info endpoints failed"
        was = w.healthy
        if ok:
            w.probe_failures = 0
            w.probe_successes += 1
            if w.probe_successes >= s.success_threshold:
                w.healthy = True
        else:
            w.probe_successes = 0
            w.probe_failures += 1
            if w.probe_failures >= s.failure_threshold or not was:
                w.healthy = False
        if was != w.healthy:
            log.info("worker.health", worker=w.id, healthy=w.healthy, reason=None if ok else reason)
            self.registry.changed()
        return ok

    async def _read_info(self, w: Worker) -> bool:
        info = w.info
        for path in w.adapter.info_paths:
            try:
                status, body = await _get(w, path, self.settings.timeout_s)
            except (TimeoutError, UpstreamError, OSError):
                return False
            if status != 200:
                # /server_info is SGLang-only; a missing optional endpoint is not a failure
                continue
            try:
                info = w.adapter.parse_info(path, body, info)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
        if info != w.info:
            w.info = info
            self.registry.changed()
        return w.model is not None

    async def scrape(self, w: Worker) -> None:
        """Read the engine's own load report. The path that answered last is asked first; one
        that is not there (404) passes to the next, so an older engine falls back by itself."""
        paths = w.adapter.load_paths
        if w.load_path in paths:
            paths = (w.load_path, *(p for p in paths if p != w.load_path))
        for path in paths:
            try:
                status, body = await _get(w, path, self.settings.timeout_s)
            except (TimeoutError, UpstreamError, OSError):
                return
            if status != 200:
                continue
            w.load_path = path
            load = w.adapter.parse_load(path, body)
            if load is not None:
                w.load = msgspec.structs.replace(load, scraped_at=time.monotonic())
                self.registry.changed()
            return

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(w) for w in list(self.registry.workers())))

    async def run_probes(self) -> None:
        while True:
            await asyncio.sleep(self.settings.interval_s)
            await self.probe_all()
            for w in list(self.registry.workers()):
                w.pool.prune()  # idle upstream connections past their reuse window

    async def run_scrapes(self) -> None:
        while True:
            await asyncio.gather(*(self.scrape(w) for w in list(self.registry.workers()) if w.healthy))
            await asyncio.sleep(self.settings.scrape_interval_s)
