"""vLLM's ``/metrics``: Prometheus text with vLLM 0.32's metric names and labels (NIXL's
transfer metrics included)."""

from __future__ import annotations

from emulator.server import EmulatorServer


def _fmt(v: float) -> str:
    return repr(float(v))


class _Text:
    def __init__(self, labels: str) -> None:
        self.lab = labels
        self.out: list[str] = []

    def gauge(self, name: str, help_: str, value: float) -> None:
        lab = self.lab
        self.out.append(
            f"# HELP vllm:{name} {help_}\n# TYPE vllm:{name} gauge\nvllm:{name}{{{lab}}} {_fmt(value)}\n"
        )

    def counter(self, name: str, help_: str, value: float, extra: str = "") -> None:
        labels = self.lab + ("," + extra if extra else "")
        self.out.append(
            f"# HELP vllm:{name}_total {help_}\n# TYPE vllm:{name}_total counter\nvllm:{name}_total{{{labels}}} {_fmt(value)}\n"
        )


def render_vllm(s: EmulatorServer) -> str:
    e = s.engine
    c = e.counters
    pool = e.pool
    t = _Text(f'engine="0",model_name="{s.model_name}"')
    lab = t.lab
    t.gauge("num_requests_running", "Number of requests in model execution batches.", len(e.seqs))
    t.gauge("num_requests_waiting", "Number of requests waiting to be processed.", e.waiting)
    t.gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", pool.usage())
    t.counter(
        "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", pool.queries
    )
    t.counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", pool.hits)
    t.counter("external_prefix_cache_queries", "External prefix cache queries.", c.external_kv_tokens)
    t.counter("external_prefix_cache_hits", "External prefix cache hits.", c.external_kv_tokens)
    t.counter("prompt_tokens", "Number of prefill tokens processed.", c.prompt_tokens_total)
    t.counter("generation_tokens", "Number of generation tokens processed.", c.generation_tokens_total)
    t.counter("prompt_tokens_cached", "Number of cached prompt tokens.", c.cached_tokens_total)
    t.counter("num_preemptions", "Cumulative number of preemption from the engine.", 0)
    t.counter(
        "request_success",
        "Count of successfully processed requests.",
        c.completed,
        'finished_reason="length"',
    )
    t.out.append(
        "# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.\n# TYPE vllm:prompt_tokens_by_source_total counter\n"
    )
    for source, value in (
        ("local_compute", c.local_compute_tokens),
        ("local_cache_hit", c.cached_tokens_total),
        ("external_kv_transfer", c.external_kv_tokens),
    ):
        t.out.append(f'vllm:prompt_tokens_by_source_total{{{lab},source="{source}"}} {_fmt(value)}\n')
    _nixl(s, t)
    t.out.append(
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\n"
        f'vllm:cache_config_info{{{lab},block_size="{s.block_size}",num_gpu_blocks="{pool.num_blocks}",enable_prefix_caching="True"}} 1.0\n'
    )
    return "".join(t.out)


def _nixl(s: EmulatorServer, t: _Text) -> None:
    """The NixlConnector's transfer metrics."""
    c = s.engine.counters
    lab = t.lab
    n = c.kv_transfers_ok
    for name, total in (
        ("nixl_xfer_time_seconds", c.kv_transfer_seconds),
        ("nixl_bytes_transferred", float(c.kv_bytes_transferred)),
    ):
        t.out.append(
            f"# HELP vllm:{name} NIXL histogram.\n# TYPE vllm:{name} histogram\n"
            f'vllm:{name}_bucket{{{lab},le="+Inf"}} {_fmt(n)}\n'
            f"vllm:{name}_count{{{lab}}} {_fmt(n)}\nvllm:{name}_sum{{{lab}}} {_fmt(total)}\n"
        )
    t.counter("nixl_num_failed_transfers", "Number of failed NIXL KV Cache transfers.", c.kv_transfers_failed)
    t.counter("nixl_num_failed_notifications", "Number of failed NIXL KV Cache notifications.", 0)
    t.counter("nixl_num_kv_expired_reqs", "Number of requests whose KV blocks expired.", c.kv_expired)
    t.counter("nixl_num_notifications_after_expiry", "Notifications after the KV lease expired.", 0)
