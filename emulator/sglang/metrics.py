"""SGLang's ``/metrics``: Prometheus text with SGLang 0.5.23's metric names and label sets."""

from __future__ import annotations

from emulator.server import EmulatorServer


def _fmt(v: float) -> str:
    return repr(float(v))


class _Text:
    def __init__(self, gauge_labels: str, counter_labels: str) -> None:
        self.g = gauge_labels
        self.base = counter_labels
        self.out: list[str] = []

    def gauge(self, name: str, help_: str, value: float, labels: str | None = None) -> None:
        labels = self.g if labels is None else labels
        self.out.append(
            f"# HELP sglang:{name} {help_}\n# TYPE sglang:{name} gauge\nsglang:{name}{{{labels}}} {_fmt(value)}\n"
        )

    def counter(self, name: str, help_: str, value: float, labels: str | None = None) -> None:
        labels = self.base if labels is None else labels
        self.out.append(
            f"# HELP sglang:{name} {help_}\n# TYPE sglang:{name} counter\nsglang:{name}{{{labels}}} {_fmt(value)}\n"
        )


def render_sglang(s: EmulatorServer) -> str:
    c = s.engine.counters
    mode = "unified" if s.role == "both" else s.role
    m = s.model_name
    g = f'engine_type="{mode}",model_name="{m}",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
    t = _Text(g, f'engine_type="{mode}",model_name="{m}"')
    _always(s, t)
    if not (c.prompt_tokens_total or c.generation_tokens_total):
        # Real SGLang sets its scheduler gauges only when it logs stats for a forward batch:
        # before the first one they are simply absent (a reader must not take that for zero).
        return "".join(t.out)
    _scheduler_gauges(s, t)
    n = c.kv_transfers_ok
    mb = c.kv_bytes_transferred / 1e6
    ms = c.kv_transfer_seconds * 1000.0
    for name, total in (("kv_transfer_latency_ms", ms), ("kv_transfer_total_mb", mb)):
        t.out.append(
            f"# HELP sglang:{name} KV transfer histogram.\n# TYPE sglang:{name} histogram\n"
            f'sglang:{name}_bucket{{{g},le="+Inf"}} {_fmt(n)}\n'
            f"sglang:{name}_count{{{g}}} {_fmt(n)}\nsglang:{name}_sum{{{g}}} {_fmt(total)}\n"
        )
    return "".join(t.out)


def _always(s: EmulatorServer, t: _Text) -> None:
    """The counters and the configuration gauges, there from the start."""
    c = s.engine.counters
    m = s.model_name
    t.counter("prompt_tokens_total", "Number of prefill tokens processed.", c.prompt_tokens_total)
    t.counter("generation_tokens_total", "Number of generation tokens processed.", c.generation_tokens_total)
    t.counter("num_requests_total", "Number of requests processed.", c.completed + c.errors + c.aborted)
    t.counter(
        "cached_tokens_total",
        "Number of cached prompt tokens by source (device/host/storage).",
        c.cached_tokens_total,
        f'cache_source="device",{t.base}',
    )
    t.counter("num_bootstrap_failed_reqs_total", "Number of bootstrap failed requests.", c.bootstrap_failed)
    t.counter("num_transfer_failed_reqs_total", "Number of transfer failed requests.", c.kv_transfers_failed)
    t.gauge(
        "max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", s.max_total_tokens
    )
    t.gauge("context_len", "The context length.", s.max_model_len)
    t.gauge("page_size", "The page size.", s.block_size)
    t.gauge("http_requests_active", "Active HTTP requests.", c.in_flight, f'model_name="{m}"')


def _scheduler_gauges(s: EmulatorServer, t: _Text) -> None:
    e = s.engine
    c = e.counters
    pool = e.pool
    hit_rate = pool.hits / pool.queries if pool.queries else 0.0
    t.gauge("num_running_reqs", "The number of running requests.", len(e.seqs))
    t.gauge("num_queue_reqs", "The number of requests in the waiting queue.", e.waiting)
    t.gauge("num_used_tokens", "The number of used tokens.", pool.used_blocks * s.block_size)
    t.gauge("token_usage", "The token usage.", pool.usage())
    t.gauge("full_token_usage", "The token usage for full attention layers.", pool.usage())
    t.gauge("swa_token_usage", "The token usage for SWA layers.", 0.0)
    t.gauge("cache_hit_rate", "The prefix cache hit rate.", hit_rate)
    t.gauge("gen_throughput", "The generation throughput (token/s).", 0.0)
    t.gauge("kv_available_tokens", "Number of available KV tokens.", pool.available_blocks * s.block_size)
    t.gauge("kv_evictable_tokens", "Number of evictable KV tokens.", pool.cached_blocks * s.block_size)
    t.gauge("num_prefill_bootstrap_queue_reqs", "The number of requests in the prefill bootstrap queue.", 0)
    t.gauge(
        "num_prefill_inflight_queue_reqs",
        "The number of requests in the prefill inflight queue.",
        len(s.kv_server.rooms) if s.kv_server else 0,
    )
    t.gauge("num_decode_prealloc_queue_reqs", "The number of requests in the decode prealloc queue.", 0)
    t.gauge(
        "num_decode_transfer_queue_reqs",
        "The number of requests in the decode transfer queue.",
        c.in_transfer,
    )
    t.gauge(
        "pending_prealloc_token_usage",
        "The token usage for pending preallocated tokens (not preallocated yet).",
        0.0,
    )
    t.gauge("num_retracted_reqs", "The number of retracted requests.", 0)
    t.gauge("num_paused_reqs", "The number of paused requests by async weight sync.", 0)
