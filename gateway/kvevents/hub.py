"""The gateway's KV-event subscriptions: one `KvEventSubscriber` task per worker with a
`kv_events` table, all feeding one `KvEventIndex`; started and stopped with the gateway, its
state exported as Prometheus metrics (`KvEventCollector`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator, Sequence

import zmq.asyncio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from adapters import ADAPTERS
from common.workers import Engine
from gateway.config import KvEventsConfig, WorkerConfig
from gateway.kvevents.index import KvEventIndex, WorkerStatus
from gateway.kvevents.pending import PendingBlocks
from gateway.kvevents.subscriber import KvEventSubscriber
from gateway.logging import get_logger

log = get_logger("pd_gateway.kvevents")


class KvEventHub:
    """Subscriptions of the workers that publish KV events (see the module docstring)."""

    def __init__(self, model_of: Callable[[str], str | None] | None = None) -> None:
        self.index = KvEventIndex(model_of)
        self._subs: dict[str, KvEventSubscriber] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._dropped: set[asyncio.Task[None]] = set()  # cancelled, not yet ended
        self._running = False
        self._ctx: zmq.asyncio.Context | None = None  # made with the first subscription

    @classmethod
    def for_workers(
        cls, workers: Sequence[WorkerConfig], model_of: Callable[[str], str | None] | None = None
    ) -> KvEventHub:
        """A hub with the workers that have `kv_events` (others can be added at any time).
        ValueError when a worker's hash scheme cannot be computed here."""
        hub = cls(model_of)
        for wc in workers:
            if wc.kv_events is not None:
                hub.add(wc.worker_id, wc.engine, wc.kv_events)
        return hub

    def __len__(self) -> int:
        return len(self._subs)

    @staticmethod
    def check(engine: Engine, kv: KvEventsConfig) -> None:
        """ValueError when a worker's hash scheme cannot be computed here (what `add` raises)."""
        scheme = kv.hash or ADAPTERS[engine].kv_events_format
        KvEventIndex().add_worker(
            "-",
            endpoint=kv.endpoint,
            scheme=scheme,
            block_size=kv.block_size,
            algo=kv.hash_algo,
            seed=kv.hash_seed,
        )

    def add(self, worker_id: str, engine: Engine, kv: KvEventsConfig) -> None:
        """Index a worker's events (its subscription starts now if the hub is running)."""
        wire = ADAPTERS[engine].kv_events_format
        scheme = kv.hash or wire
        self.index.add_worker(
            worker_id,
            endpoint=kv.endpoint,
            scheme=scheme,
            block_size=kv.block_size,
            algo=kv.hash_algo,
            seed=kv.hash_seed,
            max_blocks=kv.max_blocks,
        )
        self._subs[worker_id] = KvEventSubscriber(
            self.index,
            worker_id,
            wire,
            kv.endpoint,
            replay_endpoint=kv.replay_endpoint,
            topic=kv.topic,
            ctx=self._ctx,
        )
        if self._running:
            self._start(worker_id)

    def drop(self, worker_id: str) -> None:
        """Forget a worker (removed from the gateway): its subscription ends (a task cancelled,
        awaited by `stop`) and its entries leave the index now."""
        task = self._tasks.pop(worker_id, None)
        if task is not None:
            task.cancel()
            self._dropped.add(task)
            task.add_done_callback(self._dropped.discard)
        self._subs.pop(worker_id, None)
        self.index.remove_worker(worker_id)

    async def remove(self, worker_id: str) -> None:
        task = self._tasks.get(worker_id)
        self.drop(worker_id)
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _start(self, worker_id: str) -> None:
        sub = self._subs[worker_id]
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        sub.ctx = self._ctx
        task = asyncio.get_running_loop().create_task(sub.run(), name=f"kv-events-{worker_id}")
        task.add_done_callback(self._ended)
        self._tasks[worker_id] = task

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("kv_events.subscriber_failed", task=task.get_name(), error=repr(task.exception()))

    async def start(self) -> None:
        if self._running:
            return
        self._running = True
        for wid in self._subs:
            self._start(wid)

    async def stop(self) -> None:
        self._running = False
        tasks = [*self._tasks.values(), *self._dropped]
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def status(self) -> list[WorkerStatus]:
        return self.index.status()


class KvEventCollector(Collector):
    """`pdgw_kv_index_*` metrics from the index's status at scrape time."""

    def __init__(self, hub: KvEventHub) -> None:
        self.hub = hub

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        rows = self.hub.status()
        usable = GaugeMetricFamily(
            "pdgw_kv_index_usable",
            "1 when the worker's KV-event index is live and verified (else the approximate index is used)",
            labels=["worker", "state"],
        )
        aligned = GaugeMetricFamily(
            "pdgw_kv_index_misaligned",
            "1 when the worker's block hashes or cached-token reports disagree with the index (see the log)",
            labels=["worker"],
        )
        blocks = GaugeMetricFamily("pdgw_kv_index_blocks", "Blocks indexed per worker", labels=["worker"])
        lag = GaugeMetricFamily(
            "pdgw_kv_index_lag_seconds",
            "The last event batch's delay: applied to the index less published by the engine",
            labels=["worker"],
        )
        max_lag = GaugeMetricFamily(
            "pdgw_kv_index_max_lag_seconds", "The longest event batch delay seen", labels=["worker"]
        )
        counters = {
            name: CounterMetricFamily(f"pdgw_kv_index_{name}", text, labels=["worker"])
            for name, text in (
                ("events", "KV events applied"),
                ("stored", "Blocks the engine announced stored"),
                ("removed", "Blocks the engine announced evicted"),
                ("gaps", "Sequence gaps seen in the event stream"),
                ("replays", "Replays asked from the engine"),
                ("resyncs", "Index rebuilds after a gap that could not be filled"),
                ("restarts", "Engine restarts detected (new epochs)"),
                ("evicted", "Blocks dropped because the worker reached max_blocks"),
                ("verified", "Stored events whose hashes were recomputed and matched"),
            )
        }
        for r in rows:
            usable.add_metric([r.worker, r.state], 1.0 if r.usable else 0.0)
            aligned.add_metric([r.worker], 1.0 if r.state == "misaligned" else 0.0)
            blocks.add_metric([r.worker], r.blocks)
            if r.lag_s is not None:
                lag.add_metric([r.worker], r.lag_s)
            max_lag.add_metric([r.worker], r.max_lag_s)
            for name, fam in counters.items():
                fam.add_metric([r.worker], getattr(r, name))
        memory = GaugeMetricFamily("pdgw_kv_index_bytes", "Estimated memory of the KV-event index")
        memory.add_metric([], self.hub.index.memory_bytes())
        yield from pending_metrics(self.hub.index.pending)
        yield usable
        yield aligned
        yield blocks
        yield lag
        yield max_lag
        yield memory
        yield from counters.values()


def pending_metrics(p: PendingBlocks) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """`pdgw_kv_index_pending_*`: the overlay of prompts routed, not yet ended (pending.py)."""
    requests = GaugeMetricFamily(
        "pdgw_kv_index_pending_requests", "Requests routed, not yet ended, that the overlay counts"
    )
    requests.add_metric([], len(p.entries))
    blocks = GaugeMetricFamily("pdgw_kv_index_pending_blocks", "Their prompts' whole blocks")
    blocks.add_metric([], p.blocks)
    dropped = CounterMetricFamily(
        "pdgw_kv_index_pending_dropped", "Pending prompts dropped, by why", labels=["why"]
    )
    for why, n in (("ended", p.dropped_ended), ("expired", p.dropped_expired)):
        dropped.add_metric([why], n)
    yield requests
    yield blocks
    yield dropped
