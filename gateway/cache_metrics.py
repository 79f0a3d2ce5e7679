"""`pdgw_cache_*` metrics: what the cache-aware policy predicted and what the engines reported,
read from its state at scrape time (nothing is counted on the request path for them).

Per (worker, source), `source` being where the prediction came from (`kv_events`, `approx`,
`none`), over the requests whose engine reported its cached tokens:

- `pdgw_cache_outcomes_total`, `pdgw_cache_prompt_tokens_total`,
  `pdgw_cache_reported_tokens_total` (the hit rate: reported / prompt tokens),
  `pdgw_cache_predicted_tokens_total` and `pdgw_cache_prediction_error_tokens_total` (the sum of
  |predicted - reported|: divided by the outcomes, the mean error);
- `pdgw_cache_hit_ratio`: a histogram of each request's reported / prompt tokens.

And `pdgw_cache_decisions_total{role, source, matched}`: routing decisions, `matched` "true"
where the chosen worker was predicted to hold part of the prompt.
With `inflight_hold` (policies/inflight.py): `pdgw_cache_holds_total`, the requests held (turns
behind a running prefill of their prefix, and those routed to its worker meanwhile), and
`pdgw_cache_hold_seconds_total`, the seconds held.

The prompt tokens are the gateway's count: exact for token ids, an estimate for text
(`guards.chars_per_token_estimate`), so a text hit ratio is capped at 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from policies.base import Policy
from policies.cache_aware import HIT_RATIO_BUCKETS, CacheState


def cache_states(policy: Policy) -> list[CacheState]:
    """The cache-aware states a policy's role selectors (and its decider's estimate) keep."""
    out: list[CacheState] = []
    for part in ("prefill", "colocated", "decode", "cache"):
        sel = getattr(policy, part, None)
        st = sel if isinstance(sel, CacheState) else getattr(sel, "state", None)
        if isinstance(st, CacheState) and all(st is not o for o in out):
            out.append(st)
    return out


def hold_source(policy: Policy) -> Callable[[str], float] | None:
    """The hold of a request just routed (`InflightPrefills.hold_s`), where a cache-aware state of
    the policy holds turns behind running prefills (`inflight_hold`); None: none does."""
    for st in cache_states(policy):
        if st.inflight is not None:
            return st.inflight.hold_s
    return None


class CacheCollector(Collector):
    def __init__(self, states: list[CacheState]) -> None:
        self.states = states

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        labels = ["worker", "source"]
        fams = {
            name: CounterMetricFamily(f"pdgw_cache_{name}", text, labels=labels)
            for name, text in (
                ("outcomes", "Requests whose engine reported its cached prompt tokens"),
                ("prediction_error_tokens", "Sum of |predicted - reported| cached tokens"),
                ("predicted_tokens", "Cached prompt tokens the policy predicted"),
                ("reported_tokens", "Cached prompt tokens the engines reported"),
                ("prompt_tokens", "Prompt tokens of the requests with a report"),
            )
        }
        hist = HistogramMetricFamily(
            "pdgw_cache_hit_ratio", "Per request: reported cached tokens / prompt tokens", labels=["worker"]
        )
        decisions = CounterMetricFamily(
            "pdgw_cache_decisions_total",
            "Routing decisions by role, prediction source and whether the chosen worker held part of the prompt",
            labels=["role", "source", "matched"],
        )
        per_worker: dict[str, list[float]] = {}
        for st in self.states:
            for (worker, source), row in st.accuracy.rows().items():
                for i, fam in enumerate(fams.values()):
                    fam.add_metric([worker, source], row[i])
                counts = per_worker.setdefault(worker, [0.0] * (len(HIT_RATIO_BUCKETS) + 1))
                for j in range(len(HIT_RATIO_BUCKETS)):
                    counts[j] += row[6 + j]
                counts[-1] += row[5]  # the ratios' sum
            for (role, source, matched), n in st.decisions.items():
                decisions.add_metric([role, source, "true" if matched else "false"], n)
        for worker, counts in per_worker.items():
            cum, buckets = 0.0, []
            for bound, c in zip(HIT_RATIO_BUCKETS, counts, strict=False):
                cum += c
                buckets.append((str(bound), cum))
            buckets.append(("+Inf", cum))
            hist.add_metric([worker], buckets, sum_value=counts[-1])
        held = [st.inflight for st in self.states if st.inflight is not None]
        if held:
            yield CounterMetricFamily(
                "pdgw_cache_holds",
                "Requests held behind a running prefill of their prefix, or after such a request",
                sum(h.held for h in held),
            )
            yield CounterMetricFamily(
                "pdgw_cache_hold_seconds", "Seconds turns were held (as decided)", sum(h.held_s for h in held)
            )
        yield from fams.values()
        yield hist
        yield decisions
