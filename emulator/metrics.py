"""Prometheus text for ``/metrics`` with the engines' metric names and label sets."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from emulator.app import EmulatorServer


def _fmt(v: float) -> str:
    return repr(float(v))


def render_sglang(s: EmulatorServer, max_req_input_len: int) -> str:
    e = s.engine
    c = e.counters
    pool = e.pool
    mode = "unified" if s.role == "both" else s.role
    m = s.model_name
    g = f'engine_type="{mode}",model_name="{m}",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
    base = f'engine_type="{mode}",model_name="{m}"'
    hit_rate = pool.hits / pool.queries if pool.queries else 0.0
    running = len(e.seqs)
    out: list[str] = []

    def gauge(name: str, help_: str, value: float, labels: str = g) -> None:
        out.append(
            f"# HELP sglang:{name} {help_}\n# TYPE sglang:{name} gauge\nsglang:{name}{{{labels}}} {_fmt(value)}\n"
        )

    def counter(name: str, help_: str, value: float, labels: str = base) -> None:
        out.append(
            f"# HELP sglang:{name} {help_}\n# TYPE sglang:{name} counter\nsglang:{name}{{{labels}}} {_fmt(value)}\n"
        )

    counter("prompt_tokens_total", "Number of prefill tokens processed.", c.prompt_tokens_total)
    counter("generation_tokens_total", "Number of generation tokens processed.", c.generation_tokens_total)
    counter("num_requests_total", "Number of requests processed.", c.completed + c.errors + c.aborted)
    counter(
        "cached_tokens_total",
        "Number of cached prompt tokens by source (device/host/storage).",
        c.cached_tokens_total,
        f'cache_source="device",{base}',
    )
    counter("num_bootstrap_failed_reqs_total", "Number of bootstrap failed requests.", c.bootstrap_failed)
    counter("num_transfer_failed_reqs_total", "Number of transfer failed requests.", c.kv_transfers_failed)
    gauge("max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", s.max_total_tokens)
    gauge("context_len", "The context length.", s.max_model_len)
    gauge("page_size", "The page size.", s.block_size)
    gauge("http_requests_active", "Active HTTP requests.", c.in_flight, f'model_name="{m}"')
    if not (c.prompt_tokens_total or c.generation_tokens_total):
        # Real SGLang sets its scheduler gauges only when it logs stats for a forward batch:
        # before the first one they are simply absent (a reader must not take that for zero).
        return "".join(out)
    gauge("num_running_reqs", "The number of running requests.", running)
    gauge("num_queue_reqs", "The number of requests in the waiting queue.", e.waiting)
    gauge("num_used_tokens", "The number of used tokens.", pool.used_blocks * s.block_size)
    gauge("token_usage", "The token usage.", pool.usage())
    gauge("full_token_usage", "The token usage for full attention layers.", pool.usage())
    gauge("swa_token_usage", "The token usage for SWA layers.", 0.0)
    gauge("cache_hit_rate", "The prefix cache hit rate.", hit_rate)
    gauge("gen_throughput", "The generation throughput (token/s).", 0.0)
    gauge("kv_available_tokens", "Number of available KV tokens.", pool.available_blocks * s.block_size)
    gauge("kv_evictable_tokens", "Number of evictable KV tokens.", pool.cached_blocks * s.block_size)
    gauge("num_prefill_bootstrap_queue_reqs", "The number of requests in the prefill bootstrap queue.", 0)
    gauge(
        "num_prefill_inflight_queue_reqs",
        "The number of requests in the prefill inflight queue.",
        len(s.kv_server.rooms) if s.kv_server else 0,
    )
    gauge("num_decode_prealloc_queue_reqs", "The number of requests in the decode prealloc queue.", 0)
    gauge(
        "num_decode_transfer_queue_reqs",
        "The number of requests in the decode transfer queue.",
        c.in_transfer,
    )
    gauge(
        "pending_prealloc_token_usage",
        "The token usage for pending preallocated tokens (not preallocated yet).",
        0.0,
    )
    gauge("num_retracted_reqs", "The number of retracted requests.", 0)
    gauge("num_paused_reqs", "The number of paused requests by async weight sync.", 0)
    n = c.kv_transfers_ok
    mb = c.kv_bytes_transferred / 1e6
    ms = c.kv_transfer_seconds * 1000.0
    for name, total in (("kv_transfer_latency_ms", ms), ("kv_transfer_total_mb", mb)):
        out.append(
            f"# HELP sglang:{name} KV transfer histogram.\n# TYPE sglang:{name} histogram\n"
            f'sglang:{name}_bucket{{{g},le="+Inf"}} {_fmt(n)}\n'
            f"sglang:{name}_count{{{g}}} {_fmt(n)}\nsglang:{name}_sum{{{g}}} {_fmt(total)}\n"
        )
    _ = max_req_input_len
    return "".join(out)


def render_vllm(s: EmulatorServer) -> str:
    e = s.engine
    c = e.counters
    pool = e.pool
    lab = f'engine="0",model_name="{s.model_name}"'
    out: list[str] = []

    def gauge(name: str, help_: str, value: float) -> None:
        out.append(
            f"# HELP vllm:{name} {help_}\n# TYPE vllm:{name} gauge\nvllm:{name}{{{lab}}} {_fmt(value)}\n"
        )

    def counter(name: str, help_: str, value: float, extra: str = "") -> None:
        labels = lab + ("," + extra if extra else "")
        out.append(
            f"# HELP vllm:{name}_total {help_}\n# TYPE vllm:{name}_total counter\nvllm:{name}_total{{{labels}}} {_fmt(value)}\n"
        )

    gauge("num_requests_running", "Number of requests in model execution batches.", len(e.seqs))
    gauge("num_requests_waiting", "Number of requests waiting to be processed.", e.waiting)
    gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", pool.usage())
    counter(
        "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", pool.queries
    )
    counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", pool.hits)
    counter("external_prefix_cache_queries", "External prefix cache queries.", c.external_kv_tokens)
    counter("external_prefix_cache_hits", "External prefix cache hits.", c.external_kv_tokens)
    counter("prompt_tokens", "Number of prefill tokens processed.", c.prompt_tokens_total)
    counter("generation_tokens", "Number of generation tokens processed.", c.generation_tokens_total)
    counter("prompt_tokens_cached", "Number of cached prompt tokens.", c.cached_tokens_total)
    counter("num_preemptions", "Cumulative number of preemption from the engine.", 0)
    counter(
        "request_success",
        "Count of successfully processed requests.",
        c.completed,
        'finished_reason="length"',
    )
    out.append(
        "# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.\n# TYPE vllm:prompt_tokens_by_source_total counter\n"
    )
    for source, value in (
        ("local_compute", c.local_compute_tokens),
        ("local_cache_hit", c.cached_tokens_total),
        ("external_kv_transfer", c.external_kv_tokens),
    ):
        out.append(f'vllm:prompt_tokens_by_source_total{{{lab},source="{source}"}} {_fmt(value)}\n')
    n = c.kv_transfers_ok
    for name, total in (
        ("nixl_xfer_time_seconds", c.kv_transfer_seconds),
        ("nixl_bytes_transferred", float(c.kv_bytes_transferred)),
    ):
        out.append(
            f"# HELP vllm:{name} NIXL histogram.\n# TYPE vllm:{name} histogram\n"
            f'vllm:{name}_bucket{{{lab},le="+Inf"}} {_fmt(n)}\n'
            f"vllm:{name}_count{{{lab}}} {_fmt(n)}\nvllm:{name}_sum{{{lab}}} {_fmt(total)}\n"
        )
    counter("nixl_num_failed_transfers", "Number of failed NIXL KV Cache transfers.", c.kv_transfers_failed)
    counter("nixl_num_failed_notifications", "Number of failed NIXL KV Cache notifications.", 0)
    counter("nixl_num_kv_expired_reqs", "Number of requests whose KV blocks expired.", c.kv_expired)
    counter("nixl_num_notifications_after_expiry", "Notifications after the KV lease expired.", 0)
    out.append(
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\n"
        f'vllm:cache_config_info{{{lab},block_size="{s.block_size}",num_gpu_blocks="{pool.num_blocks}",enable_prefix_caching="True"}} 1.0\n'
    )
    return "".join(out)
