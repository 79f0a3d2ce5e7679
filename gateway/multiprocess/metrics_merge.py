"""One Prometheus page for the whole gateway from each of its processes' pages.

Each process keeps its own counters and histograms (no lock or shared write on the request
path); a scrape of `/metrics` on any process asks the others for theirs
(`gateway/multiprocess/siblings.py`) and adds them up here, sample by sample: counters, histogram
buckets, sums and counts, and the admission gauges (each process holds its share of the limits
and its own requests). The per-worker and per-pair gauges are the whole gateway's already in
every process (in-flight counts and breakers are shared), so they are taken from the process
that answers the scrape, not added. Two gauges are added: `pdgw_processes` (how many processes
the gateway runs) and `pdgw_processes_scraped` (how many answered this scrape: fewer means some
counts are missing from it).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

# families whose values are already the whole gateway's in every process
CLUSTER_FAMILIES = frozenset(
    {
        "pdgw_worker_inflight",
        "pdgw_worker_healthy",
        "pdgw_worker_queue",
        "pdgw_worker_kv_usage",
        "pdgw_pair_breaker_open",
    }
)


class _Merged(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families


def merge_pages(pages: Sequence[bytes], processes: int) -> bytes:
    """`pages[0]` is the answering process's own page; the others are added to it."""
    order: list[str] = []
    meta: dict[str, tuple[str, str]] = {}  # family -> (type, help)
    sums: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for n, page in enumerate(pages):
        for fam in text_string_to_metric_families(page.decode("utf-8", "replace")):
            if fam.name not in meta:
                meta[fam.name] = (fam.type, fam.documentation)
                order.append(fam.name)
                sums[fam.name] = {}
            if n > 0 and fam.name in CLUSTER_FAMILIES:
                continue
            acc = sums[fam.name]
            for s in fam.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                acc[key] = acc.get(key, 0.0) + s.value
    families: list[Metric] = []
    for name in order:
        typ, doc = meta[name]
        m = Metric(name, doc, typ)
        for (sample, labels), value in sums[name].items():
            m.add_sample(sample, dict(labels), value)
        families.append(m)
    families.append(GaugeMetricFamily("pdgw_processes", "Processes the gateway runs", value=processes))
    families.append(
        GaugeMetricFamily(
            "pdgw_processes_scraped",
            "Processes whose counts are in this scrape (fewer than pdgw_processes: some are missing)",
            value=len(pages),
        )
    )
    registry = CollectorRegistry()
    registry.register(_Merged(families))
    return generate_latest(registry)
