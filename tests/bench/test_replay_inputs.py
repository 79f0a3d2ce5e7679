"""bench/replay inputs: trace formats, synthetic workloads, target specs, the reachable-reuse
simulation and the engines' Prometheus counters."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from bench.replay import reference, synthetic, trace
from bench.replay.cluster import Cluster, ClusterSpec, Worker, counters_from_metrics, kv_capacity_from_metrics
from bench.replay.targets import TargetSpec, target_argv
from gateway.config import load_config
from policies.config import CacheAwareCfg

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "traces" / "mooncake_synthetic_head.jsonl"


def test_mooncake_fixture_loads_with_arrivals_in_seconds() -> None:
    rows = trace.load(FIXTURE)
    assert len(rows) == 50
    assert rows[0].t_s == 0.0 and rows[0].input_length == 40160 and len(rows[0].hash_ids) == 79
    assert all(b.t_s >= a.t_s for a, b in itertools.pairwise(rows))
    sl = trace.select(rows, 10, 20)
    assert len(sl) == 10 and sl[0].t_s == 0.0
    assert trace.scale_arrivals(sl, 2.0)[-1].t_s == pytest.approx(sl[-1].t_s / 2)


def test_a_row_whose_hash_ids_do_not_cover_its_length_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(
        json.dumps({"timestamp": 0, "input_length": 1025, "output_length": 3, "hash_ids": [1, 2]}) + "\n"
    )
    with pytest.raises(trace.TraceError, match="row 1: input_length 1025 spans 3 blocks"):
        trace.load(p)


def test_csv_round_trip_and_rows_without_ids_share_nothing(tmp_path: Path) -> None:
    p = tmp_path / "t.csv"
    p.write_text("timestamp_ms,input_length,output_length,hash_ids,session_id\n0,600,5,3 4,s1\n500,700,6,,\n")
    rows = trace.load(p)
    assert rows[0].hash_ids == (3, 4) and rows[0].session_id == "s1"
    assert rows[1].t_s == 0.5 and len(rows[1].hash_ids) == 2 and not set(rows[1].hash_ids) & {3, 4}
    out = tmp_path / "back.csv"
    trace.write_csv(rows, out)
    assert trace.load(out) == rows


def test_csv_without_a_needed_column_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "t.csv"
    p.write_text("timestamp_ms,input_length\n0,5\n")
    with pytest.raises(trace.TraceError, match="lacks output_length"):
        trace.load(p)


@pytest.mark.parametrize("kind", synthetic.KINDS)
def test_synthetic_workloads_are_valid_and_deterministic(kind: str) -> None:
    spec = synthetic.SynthSpec(kind, requests=40, seed=3)
    rows = synthetic.generate(spec)
    assert rows == synthetic.generate(spec)
    assert len(rows) == 40
    for r in rows:
        assert len(r.hash_ids) == trace.blocks_needed(r.input_length)
    assert all(b.t_s >= a.t_s for a, b in itertools.pairwise(rows))


def test_multiturn_turns_extend_their_sessions_prefix() -> None:
    rows = synthetic.generate(synthetic.SynthSpec("multiturn", requests=12, turns=4, seed=1))
    by_session: dict[str, list[trace.Row]] = {}
    for r in rows:
        assert r.session_id
        by_session.setdefault(r.session_id, []).append(r)
    for turns in by_session.values():
        for a, b in itertools.pairwise(turns):
            assert b.input_length > a.input_length
            assert b.hash_ids[: len(a.hash_ids)] == a.hash_ids


def test_bursty_arrivals_come_in_bursts() -> None:
    rows = synthetic.generate(synthetic.SynthSpec("bursty", requests=16, burst=8))
    assert {r.t_s for r in rows[:8]} == {0.0}
    assert rows[8].t_s > 0.0


def test_target_specs() -> None:
    assert TargetSpec.parse("direct") == TargetSpec("direct", "direct")
    assert TargetSpec.parse("gateway:least_load") == TargetSpec(
        "gateway:least_load", "gateway", ("--policy", "least_load")
    )
    t = TargetSpec.parse("mine=gateway --config my.toml --min-prefill-tokens 2048")
    assert t == TargetSpec("mine", "gateway", ("--config", "my.toml", "--min-prefill-tokens", "2048"))
    assert TargetSpec.parse("sglang-router:cache_aware").args == ("--policy", "cache_aware")
    with pytest.raises(ValueError, match="unknown kind"):
        TargetSpec.parse("nginx")
    with pytest.raises(ValueError, match="SGLang's handoff"):
        TargetSpec.parse("sglang-router").check("pd", "vllm")
    with pytest.raises(ValueError, match="SGLang's handoff"):
        TargetSpec.parse("sglang-router").check("mixed", "vllm")
    TargetSpec.parse("vllm-router").check("mixed", "vllm")
    TargetSpec.parse("vllm-router").check("colocated", "sglang")


def test_a_router_on_a_mixed_cluster_gets_its_p_d_pool_only() -> None:
    """The Rust routers take colocated workers or a P/D pool: on a mixed cluster they are the
    always-disaggregate baseline, the colocated worker idle."""
    workers = [
        Worker("c0", "both", "http://127.0.0.1:1"),
        Worker("p0", "prefill", "http://127.0.0.1:2", bootstrap_port=9),
        Worker("d0", "decode", "http://127.0.0.1:3"),
    ]
    cluster = Cluster(ClusterSpec(engine="sglang", colocated=1, prefill=1, decode=1), workers)
    argv = target_argv(TargetSpec.parse("sglang-router:cache_aware"), cluster, 10, 11)
    assert "--pd-disaggregation" in argv and "--worker-urls" not in argv
    assert "http://127.0.0.1:1" not in argv
    assert argv[argv.index("--prefill") : argv.index("--prefill") + 3] == [
        "--prefill",
        "http://127.0.0.1:2",
        "9",
    ]
    gw = target_argv(TargetSpec.parse("gateway:least_load"), cluster, 10, 11)
    assert "http://127.0.0.1:1" in gw


def _r(t: float, n_blocks: int, ids: tuple[int, ...]) -> trace.Row:
    return trace.Row(t, n_blocks * 512, 4, ids)


def test_ideal_reuse_is_every_earlier_prefix() -> None:
    rows = [_r(0, 2, (1, 2)), _r(1, 3, (1, 2, 3)), _r(2, 2, (1, 9))]
    sim = reference.simulate(rows, "ideal")
    assert sim.reused_tokens == 1024 + 512
    assert sim.prompt_tokens == 7 * 512


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    rows = [_r(0, 2, (1, 2)), _r(1, 2, (1, 2))]
    assert reference.simulate(rows, "ideal").reused_tokens == 1023


def test_the_reference_follows_the_cache_and_an_lru_forgets() -> None:
    rows = [_r(0, 2, (1, 2)), _r(0, 2, (5, 6)), _r(10, 2, (1, 2)), _r(20, 2, (5, 6))]
    ref = reference.simulate(
        rows, "reference", capacity_tokens=[4096, 4096], prefill_time=lambda n, c: n * 1e-4
    )
    assert ref.reused_tokens == 2 * 1023
    rr = reference.simulate(rows, "round_robin", capacity_tokens=[4096, 4096])
    assert rr.reused_tokens == 2 * 1023  # rows 0,2 on worker 0; rows 1,3 on worker 1
    rr3 = reference.simulate(rows[:3], "round_robin", capacity_tokens=[1024, 1024, 1024])
    assert rr3.reused_tokens == 0
    # a one-block LRU holds only the last block: the prefix (block 1) is gone
    small = reference.simulate(rows, "reference", capacity_tokens=[512, 512], prefill_time=lambda n, c: 0.0)
    assert small.reused_tokens == 0


def test_the_reference_spreads_load_when_the_cache_is_cold() -> None:
    rows = [_r(0, 4, (i * 10 + 1, i * 10 + 2, i * 10 + 3, i * 10 + 4)) for i in range(4)]
    ref = reference.simulate(
        rows, "reference", capacity_tokens=[10**6] * 4, prefill_time=lambda n, c: n * 1e-3
    )
    assert ref.per_worker_requests == [1, 1, 1, 1]


SGLANG_METRICS = """# HELP x
sglang:num_requests_total{engine_type="unified",model_name="m"} 7.0
sglang:prompt_tokens_total{engine_type="unified",model_name="m"} 1000.0
sglang:cached_tokens_total{cache_source="device",engine_type="unified",model_name="m"} 250.0
sglang:max_total_num_tokens{engine_type="unified",model_name="m",tp_rank="0"} 426784.0
"""
VLLM_METRICS = """vllm:request_success_total{engine="0",model_name="m",finished_reason="length"} 3.0
vllm:request_success_total{engine="0",model_name="m",finished_reason="stop"} 1.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 800.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 320.0
vllm:cache_config_info{engine="0",block_size="16",num_gpu_blocks="100",enable_prefix_caching="True"} 1.0
"""


def test_engine_counters_from_prometheus() -> None:
    s = counters_from_metrics("sglang", SGLANG_METRICS)
    assert (s.requests, s.prompt_tokens, s.cached_tokens, s.computed_tokens) == (7, 1000, 250, 750)
    v = counters_from_metrics("vllm", VLLM_METRICS)
    assert (v.requests, v.prompt_tokens, v.cached_tokens) == (4, 800, 320)
    assert kv_capacity_from_metrics("sglang", SGLANG_METRICS) == 426784
    assert kv_capacity_from_metrics("vllm", VLLM_METRICS) == 1600


def test_with_kv_events_a_gateway_gets_its_workers_and_their_events_in_its_config(tmp_path: Path) -> None:
    """`--kv-events`: a gateway target's own TOML, then each worker with its `kv_events`; a
    router gets the same workers as always."""
    own = tmp_path / "own.toml"
    own.write_text('policy = "cache_aware"\n\n[tokenizer]\nkind = "emulator"\n')
    workers = [
        Worker("c0", "both", "http://127.0.0.1:1", kv_events="tcp://127.0.0.1:5000"),
        Worker("p0", "prefill", "http://127.0.0.1:2", bootstrap_port=9, kv_events="tcp://127.0.0.1:5002"),
        Worker("d0", "decode", "http://127.0.0.1:3", kv_events="tcp://127.0.0.1:5004"),
    ]
    cluster = Cluster(ClusterSpec(engine="sglang", colocated=1, prefill=1, decode=1, kv_events=True), workers)
    spec = TargetSpec.parse(f"mine=gateway --config {own} --log-level debug")
    argv = target_argv(spec, cluster, 10, 11, tmp_path / "logs")
    written = tmp_path / "logs" / "mine.kv.toml"
    assert argv[argv.index("--config") + 1] == str(written) and str(own) not in argv
    assert argv[-2:] == ["--log-level", "debug"] and "--worker" not in argv
    cfg = load_config(written)
    assert isinstance(cfg.policy, CacheAwareCfg) and cfg.tokenizer is not None
    assert [(w.url, w.role.value, w.bootstrap_port) for w in cfg.workers] == [
        ("http://127.0.0.1:1", "colocated", None),
        ("http://127.0.0.1:2", "prefill", 9),
        ("http://127.0.0.1:3", "decode", None),
    ]
    kv = cfg.workers[1].kv_events
    assert kv is not None and kv.hash == "emulator"
    assert (kv.endpoint, kv.replay_endpoint) == ("tcp://127.0.0.1:5002", "tcp://127.0.0.1:5003")
    # without its own file: the workers alone
    target_argv(TargetSpec.parse("gateway:least_load"), cluster, 10, 11, tmp_path)
    assert len(load_config(tmp_path / "gateway:least_load.kv.toml").workers) == 3
    router = target_argv(TargetSpec.parse("sglang-router:cache_aware"), cluster, 10, 11, tmp_path)
    assert "--config" not in router and "tcp://127.0.0.1:5000" not in " ".join(router)
    with pytest.raises(ValueError, match="given URLs"):
        ClusterSpec(worker_urls=["http://127.0.0.1:1"], kv_events=True).check()
