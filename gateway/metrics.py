"""Prometheus metrics on an injected CollectorRegistry (no module-level metric objects).

Per-request cost matters. The request-path counters and histograms are this module's own
`Counter` / `Histogram`: a labelled child is a plain object whose `inc()` / `observe()` adds to
ints and floats (the gateway is one event-loop thread, so no lock, unlike prometheus_client's
per-update mutex), rendered through prometheus_client's exposition at scrape time. Label
children are cached, inter-token latency is observed once per request (its mean), and
per-worker gauges are read from the registry at scrape time by a collector instead of being
updated on the hot path.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from gateway.breaker import BreakerState
from policies.base import PolicyMetric
from policies.snapshot import ClusterSnapshot

if TYPE_CHECKING:
    from gateway.admission import AdmissionStats

_LAT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1)


C = TypeVar("C")


class CounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        self.value += amount


class HistogramChild:
    """Per-bucket (not cumulative) counts; `counts[-1]` is the +Inf bucket."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # bucket `le` holds value <= le: the first bound >= value
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


class _Labelled(Collector, Generic[C]):
    """A metric family: one child per label values, made on first use and kept."""

    def __init__(self, name: str, doc: str, labels: Sequence[str], registry: CollectorRegistry) -> None:
        self.name, self.doc, self.label_names = name, doc, list(labels)
        self._children: dict[tuple[str, ...], C] = {}
        registry.register(self)

    def _new(self) -> C:
        raise NotImplementedError

    def labels(self, *values: str) -> C:
        c = self._children.get(values)
        if c is None:
            if len(values) != len(self.label_names):
                raise ValueError(f"{self.name}: expected labels {self.label_names}, got {values}")
            c = self._children[values] = self._new()
        return c


class Counter(_Labelled[CounterChild]):
    """A labelled counter, exposed as `<name>_total`."""

    def _new(self) -> CounterChild:
        return CounterChild()

    def collect(self) -> Iterator[Metric]:
        fam = CounterMetricFamily(self.name, self.doc, labels=self.label_names)
        for values, c in self._children.items():
            fam.add_metric(list(values), c.value)
        yield fam

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self.name, self.doc, labels=self.label_names)


class Histogram(_Labelled[HistogramChild]):
    def __init__(
        self,
        name: str,
        doc: str,
        labels: Sequence[str],
        *,
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self.bounds = tuple(float(b) for b in buckets)
        if list(self.bounds) != sorted(self.bounds):
            raise ValueError(f"{name}: buckets must be sorted")
        super().__init__(name, doc, labels, registry)

    def _new(self) -> HistogramChild:
        return HistogramChild(self.bounds)

    def collect(self) -> Iterator[Metric]:
        fam = HistogramMetricFamily(self.name, self.doc, labels=self.label_names)
        for values, c in self._children.items():
            acc = 0
            buckets: list[tuple[str, float]] = []
            for bound, n in zip((*map(_le, self.bounds), "+Inf"), c.counts, strict=True):
                acc += n
                buckets.append((bound, float(acc)))
            fam.add_metric(list(values), buckets, c.sum)
        yield fam

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self.name, self.doc, labels=self.label_names)


def _le(bound: float) -> str:
    """prometheus_client's spelling of a bucket bound (`1.0`, `0.0025`)."""
    return str(floatToGoString(bound))


class _FixedHistogramChild:
    """A histogram child whose labels are fixed in the code (`phase="prefill"`), looked up once:
    made on its first observation (a scrape shows no series for what never happened, as with
    `labels()`), after which `observe` is that child's own bound method."""

    __slots__ = ("_labels", "_metric", "observe")

    def __init__(self, metric: Histogram, *labels: str) -> None:
        self._metric, self._labels = metric, labels
        self.observe: Callable[[float], None] = self._first

    def _first(self, value: float) -> None:
        self.observe = self._metric.labels(*self._labels).observe
        self.observe(value)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pdgw_requests",
            "Client requests by route, model, plan kind and outcome",
            ("route", "model", "plan", "outcome"),
            registry=r,
        )
        self.e2e = Histogram(
            "pdgw_request_duration_seconds",
            "End-to-end request latency",
            ("route", "plan"),
            buckets=_LAT_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "pdgw_time_to_first_token_seconds",
            "Time from request to the first body byte sent to the client",
            ("route", "plan"),
            buckets=_LAT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pdgw_inter_token_latency_seconds",
            "Mean gap between streamed chunks, one observation per request",
            ("route", "plan"),
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.phase = Histogram(
            "pdgw_phase_duration_seconds",
            "Duration of each handoff phase (prefill, handoff, decode)",
            ("phase",),
            buckets=_LAT_BUCKETS,
            registry=r,
        )
        self.verdict_hold = Histogram(
            "pdgw_prefill_verdict_hold_seconds",
            "SGLang P/D handoffs: how long the decode's bytes waited for the prefill's verdict, "
            "by what was held (first_byte: the answer's start; end: a stream's end)",
            ("held",),
            buckets=_LAT_BUCKETS,
            registry=r,
        )
        # the per-request observations of fixed labels, without a label lookup each
        self.phase_prefill = _FixedHistogramChild(self.phase, "prefill")
        self.phase_handoff = _FixedHistogramChild(self.phase, "handoff")
        self.phase_decode = _FixedHistogramChild(self.phase, "decode")
        self.hold_first_byte = _FixedHistogramChild(self.verdict_hold, "first_byte")
        self.hold_end = _FixedHistogramChild(self.verdict_hold, "end")
        self.upstream_errors = Counter(
            "pdgw_upstream_errors",
            "Engine failures by worker, phase and code",
            ("worker", "phase", "code"),
            registry=r,
        )
        self.retries = Counter(
            "pdgw_retries", "Attempts retried on another worker or pair", ("reason",), registry=r
        )
        self.fallbacks = Counter("pdgw_fallbacks", "Fallback ladder rungs taken", ("rung",), registry=r)
        self.guard_failures = Counter(
            "pdgw_guard_failures", "KV-integrity guard failures", ("guard", "stage"), registry=r
        )
        self.near_ties = Counter(
            "pdgw_guard_near_ties",
            "Greedy vLLM handoffs whose decode started on a token near-tied with the prefill's "
            "(within guards.near_tie_margin by the prefill's logprobs): accepted, not failures",
            (),
            registry=r,
        )
        self.shadow_runs = Counter(
            "pdgw_shadow_runs",
            "Colocated re-runs that verify a P/D answer, by when and what they found",
            ("when", "outcome"),  # before_delivery|after_delivery; agreed|differed|failed
            registry=r,
        )
        self.query_of_death = Counter(
            "pdgw_query_of_death",
            "Requests whose engine failed holding them: engine_died (it is gone), quarantined "
            "(a second death for the request's fingerprint), not_retried (a second drop), "
            "refused (a copy of a quarantined request, sent to no engine); requests with token "
            "ids above every id their model served (no vocab_size): unproven_killed (its engine "
            "died of it), unproven_refused (refused after such a death), unproven_waited (waited "
            "for another's outcome)",
            ("event",),
            registry=r,
        )
        self.aborts_sent = Counter(
            "pdgw_engine_aborts", "Abort calls sent to engines", ("engine",), registry=r
        )
        self.client_stalls = Counter(
            "pdgw_client_stalls",
            "Client connections cut for taking none of their answer for timeouts.client_stall_s",
            (),
            registry=r,
        )

    def child(self, metric: Any, *labels: str) -> Any:
        return metric.labels(*labels)

    def watch_cluster(
        self,
        snapshot: Callable[[], ClusterSnapshot],
        pairs: Callable[[], Sequence[tuple[str, str, BreakerState]]] = tuple,
    ) -> None:
        """Per-worker gauges from the registry's snapshot, and each (prefill, decode) pair's
        breaker (`pairs`: Registry.pair_states) at scrape time."""
        self.registry.register(_ClusterCollector(snapshot, pairs))

    def watch_admission(self, stats: Callable[[], AdmissionStats]) -> None:
        """Admission counters and gauges, read from the controller's ints at scrape time."""
        self.registry.register(_AdmissionCollector(stats))

    def watch_connections(self, stats: Callable[[], tuple[int, int, int]]) -> None:
        """Client connections: (open now, limits.max_connections, refused past it so far), read
        from the HTTP server at scrape time."""
        self.registry.register(_ConnectionsCollector(stats))

    def watch_policy(self, source: Callable[[], Iterable[PolicyMetric]]) -> None:
        """What the routing policy exports (its decider's learned rates and verdicts), read at
        scrape time (`policies.base.MetricSource`)."""
        self.registry.register(_PolicyCollector(source))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PolicyCollector(Collector):
    """A policy's `PolicyMetric`s as metric families, one per name (its first doc and kind)."""

    def __init__(self, source: Callable[[], Iterable[PolicyMetric]]) -> None:
        self._source = source

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for m in self._source():
            fam = families.get(m.name)
            if fam is None:
                names = [k for k, _ in m.labels]
                kind = CounterMetricFamily if m.kind == "counter" else GaugeMetricFamily
                fam = families[m.name] = kind(m.name, m.doc, labels=names)
            fam.add_metric([v for _, v in m.labels], m.value)
        yield from families.values()


class _ConnectionsCollector(Collector):
    def __init__(self, stats: Callable[[], tuple[int, int, int]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        open_now, most, refused = self._stats()
        yield GaugeMetricFamily("pdgw_client_connections", "Open client connections", value=open_now)
        yield GaugeMetricFamily("pdgw_max_connections", "limits.max_connections in effect", value=most)
        yield CounterMetricFamily(
            "pdgw_connections_refused",
            "Client connections answered 503 too_many_connections at once (past limits.max_connections)",
            value=refused,
        )


class _ClusterCollector(Collector):
    def __init__(
        self,
        snapshot: Callable[[], ClusterSnapshot],
        pairs: Callable[[], Sequence[tuple[str, str, BreakerState]]],
    ) -> None:
        self._snapshot = snapshot
        self._pairs = pairs

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snap = self._snapshot()
        labels = ["worker", "role", "engine", "model"]
        inflight = GaugeMetricFamily(
            "pdgw_worker_inflight", "Requests the gateway has in flight per worker", labels=labels
        )
        healthy = GaugeMetricFamily("pdgw_worker_healthy", "1 when the worker is usable", labels=labels)
        waiting = GaugeMetricFamily("pdgw_worker_queue", "Engine-reported waiting requests", labels=labels)
        kv = GaugeMetricFamily("pdgw_worker_kv_usage", "Engine-reported KV cache usage (0..1)", labels=labels)
        for w in snap.workers:
            lv = [w.id, w.role.value, w.engine.value, w.model or ""]
            inflight.add_metric(lv, w.inflight)
            healthy.add_metric(lv, 1.0 if w.usable else 0.0)
            waiting.add_metric(lv, w.load.waiting)
            kv.add_metric(lv, w.load.kv_usage)
        yield from (inflight, healthy, waiting, kv)
        pair_open = GaugeMetricFamily(
            "pdgw_pair_breaker_open",
            "1 while the breaker of a (prefill, decode) pair refuses it traffic (failed handoffs)",
            labels=["prefill", "decode"],
        )
        for prefill, decode, state in self._pairs():
            pair_open.add_metric([prefill, decode], 1.0 if state is BreakerState.OPEN else 0.0)
        yield pair_open


class _AdmissionCollector(Collector):
    def __init__(self, stats: Callable[[], AdmissionStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._stats()
        admitted = CounterMetricFamily(
            "pdgw_admitted", "Requests admitted, at once or after queueing", labels=["how"]
        )
        admitted.add_metric(["immediate"], s.admitted)
        admitted.add_metric(["queued"], s.admitted_after_queue)
        shed = CounterMetricFamily("pdgw_shed", "Requests refused by admission control", labels=["reason"])
        for reason, n in s.shed.items():
            shed.add_metric([reason], n)
        wait = CounterMetricFamily(
            "pdgw_queue_wait_seconds", "Total time admitted requests spent in the admission queue"
        )
        wait.add_metric([], s.queue_wait_s)
        yield admitted
        yield shed
        yield wait
        yield GaugeMetricFamily("pdgw_inflight_requests", "Client requests holding a slot", value=s.active)
        yield GaugeMetricFamily("pdgw_queued_requests", "Client requests waiting for a slot", value=s.queued)
        yield GaugeMetricFamily(
            "pdgw_inflight_tokens",
            "Token estimate (prompt + max_tokens) of admitted requests",
            value=s.active_tokens,
        )
        yield GaugeMetricFamily("pdgw_max_concurrent", "limits.max_concurrent", value=s.max_concurrent)
