"""SGLang 0.5.23's information routes: ``/model_info``, ``/server_info``, ``/v1/models`` and the
scheduler's live load snapshot ``/v1/loads`` (its old ``/get_load`` is gone: a 404)."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import msgspec

from emulator.server import EmulatorServer

LOAD_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})


def _mode(s: EmulatorServer) -> str:
    return "null" if s.role == "both" else s.role


def model_info(s: EmulatorServer) -> dict[str, Any]:
    model_path = s.model_name
    return {
        "model_path": model_path,
        "served_model_name": model_path,
        "tokenizer_path": model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "load_format": "auto",
        "reasoning_parser": None,
        "tool_call_parser": None,
        "disaggregation_mode": _mode(s),
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
    }


def server_info(s: EmulatorServer, context_length: int, max_req_input_len: int) -> dict[str, Any]:
    """The fields routers read (not SGLang's full server args)."""
    spec = s.spec
    model_path = s.model_name
    return {
        "model_path": model_path,
        "tokenizer_path": model_path,
        "served_model_name": model_path,
        "context_length": context_length,
        "max_total_tokens": s.max_total_tokens,
        "chunked_prefill_size": s.profile.chunk_tokens,
        "max_prefill_tokens": s.profile.max_prefill_tokens,
        "max_running_requests": s.profile.max_running,
        "schedule_policy": "fcfs",
        "page_size": s.block_size,
        "disable_radix_cache": False,
        "tp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "host": spec.host,
        "port": s.port,
        "random_seed": spec.seed,
        "enable_metrics": True,
        "disaggregation_mode": _mode(s),
        "disaggregation_transfer_backend": "mooncake",
        "disaggregation_bootstrap_port": s.bootstrap_port if s.bootstrap_port is not None else 8998,
        "disaggregation_decode_allocation_policy": "early",
        "kv_events_config": None
        if not spec.kv_events
        else msgspec.json.encode({"publisher": "zmq", "endpoint": spec.kv_events, "topic": ""}).decode(),
        "max_req_input_len": max_req_input_len,
        "max_total_num_tokens": s.max_total_tokens,
        "version": "0.5.23",
        "emulator": {"profile": s.profile.name, "time_scale": spec.time_scale, "kv_port": s.kv_port},
        "internal_states": [
            {
                "context_length": context_length,
                "max_req_input_len": max_req_input_len,
                "max_total_num_tokens": s.max_total_tokens,
                "page_size": s.block_size,
                "disaggregation_mode": _mode(s),
                "effective_max_running_requests_per_dp": s.profile.max_running,
                "last_gen_throughput": 0.0,
                "memory_usage": {"token_capacity": s.max_total_tokens},
            }
        ],
    }


def models(s: EmulatorServer, context_length: int) -> dict[str, Any]:
    model_path = s.model_name
    return {
        "object": "list",
        "data": [
            {
                "id": model_path,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "sglang",
                "root": model_path,
                "parent": None,
                "max_model_len": context_length,
            }
        ],
    }


def loads(s: EmulatorServer, sections: set[str]) -> dict[str, Any]:
    """``GET /v1/loads``: core scalars always, then the memory, disaggregation and queues
    sections unless `sections` (``?include=``, checked against :data:`LOAD_SECTIONS`) narrows
    them."""
    engine = s.engine
    load = _core_load(s)
    every = "all" in sections
    if every or "memory" in sections:
        load["memory"] = {
            "weight_gb": 0.0,
            "kv_cache_gb": 0.0,
            "graph_gb": 0.0,
            "token_capacity": s.max_total_tokens,
        }
    if s.role != "both" and (every or "disagg" in sections):
        load["disaggregation"] = _disagg_load(s)
    if every or "queues" in sections:
        load["queues"] = {
            "waiting": engine.waiting,
            "grammar": 0,
            "paused": 0,
            "retracted": 0,
            "prealloc_ready": 0,
        }
    if sections == {"core"}:
        load = {k: v for k, v in load.items() if not isinstance(v, dict)}
    return {
        "timestamp": datetime.now(UTC).isoformat(),
        "version": "0.5.23",
        "accelerator": None,
        "num_accelerators": 1,
        "loads": [load],
    }


def _in_transfer(s: EmulatorServer) -> int:
    return s.engine.counters.in_transfer if s.role == "decode" else 0


def _core_load(s: EmulatorServer) -> dict[str, object]:
    engine = s.engine
    pool = engine.pool
    running = len(engine.seqs)
    used = pool.used_blocks * s.block_size
    return {
        "timestamp": time.time(),
        "dp_rank": 0,
        "num_running_reqs": running,
        "num_waiting_reqs": engine.waiting + _in_transfer(s),
        "num_waiting_uncached_tokens": 0,
        "num_used_tokens": used,
        "num_total_tokens": used,
        "num_active_tokens": used,
        "num_prealloc_ready_tokens": 0,
        "max_total_num_tokens": s.max_total_tokens,
        "max_running_requests": s.profile.max_running,
        "token_usage": pool.usage(),
        "gen_throughput": 0.0,
        "cache_hit_rate": pool.hits / pool.queries if pool.queries else 0.0,
        "utilization": min(1.0, running / max(1, s.profile.max_running)),
        "total_prefill_uncached_tokens": engine.counters.prompt_tokens_total,
        "total_prefill_busy_us": 0,
        "decode_moments": None,
    }


def _disagg_load(s: EmulatorServer) -> dict[str, object]:
    inflight = len(s.kv_server.rooms) if s.kv_server else 0
    return {
        "mode": s.role,
        "prefill_bootstrap_queue_reqs": 0,
        "prefill_inflight_queue_reqs": inflight if s.role == "prefill" else 0,
        "decode_prealloc_queue_reqs": 0,
        "decode_transfer_queue_reqs": _in_transfer(s),
        "decode_retracted_queue_reqs": 0,
        "kv_transfer_speed_gb_s": 0.0,
        "kv_transfer_latency_ms": 0.0,
    }
