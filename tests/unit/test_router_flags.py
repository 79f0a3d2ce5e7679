"""`pd-gateway serve` takes sglang-router's and vllm-router's command lines: every flag of both
routers (read from their own argument parsers, installed in the venv) is mapped, ignored with a
note or refused with a reason, and the command lines of their READMEs and `--help` parse to the
config they mean."""

from __future__ import annotations

import argparse
import shlex
from typing import Any

import msgspec
import pytest

from gateway import router_flags
from gateway.cli_args import build_serve_parser, parse_serve_command
from gateway.config import ConfigError, GatewayConfig
from gateway.router_flags import ROUTER_FLAGS, SHARED_FLAGS
from policies.config import LeastLoadCfg, PowerOfTwoCfg, RoundRobinCfg
from policies.snapshot import Engine, Role


def _router_parser(module: str) -> argparse.ArgumentParser:
    mod = __import__(f"{module}.router_args", fromlist=["RouterArgs"])
    parser = argparse.ArgumentParser(prog=module)
    mod.RouterArgs.add_cli_args(parser)
    return parser


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}


ROUTERS = ("sglang_router", "vllm_router")


@pytest.mark.parametrize("module", ROUTERS)
def test_every_router_flag_is_known(module: str) -> None:
    theirs = _options(_router_parser(module))
    ours = {f.flag for f in ROUTER_FLAGS} | set(SHARED_FLAGS)
    assert theirs - ours == set(), f"{module} flags pd-gateway serve does not know"
    assert set(SHARED_FLAGS) <= _options(build_serve_parser())


@pytest.mark.parametrize("module", ROUTERS)
def test_workers_is_the_gateway_s_own_flag_beside_the_routers(module: str) -> None:
    """`--workers N` (gateway processes, listen.processes) is no router's flag, nor taken for one
    of theirs: a router's command line with it keeps its workers and gets N processes."""
    assert "--workers" not in _options(_router_parser(module))
    assert "--workers" not in router_flags._BY_FLAG and "--workers" not in SHARED_FLAGS
    argv = ["--worker-urls", "http://w1:8000", "http://w2:8000", "--workers", "3"]
    check_router_accepts(module, argv[:3])
    c, _ = parse_serve_command(argv)
    assert c.listen.processes == 3
    assert [w.url for w in c.workers] == ["http://w1:8000", "http://w2:8000"]


@pytest.mark.parametrize("module", ROUTERS)
def test_flags_take_values_as_the_routers_do(module: str) -> None:
    """A flag that takes no value there takes none here (else a command line would be misread)."""
    theirs = {
        o: a.nargs
        for a in _router_parser(module)._actions
        for o in a.option_strings
        if o in router_flags._BY_FLAG
    }
    for flag, nargs in theirs.items():
        kind = router_flags._BY_FLAG[flag].kind
        assert (nargs == 0) == (kind is router_flags.Kind.FLAG), flag
        if nargs in ("*", "+"):
            assert kind in (router_flags.Kind.LIST, router_flags.Kind.LIST1), flag


def command(line: str) -> list[str]:
    """The arguments of a documented command line, after the program name."""
    words = shlex.split(line.replace("\\\n", " "))  # a shell joins continued lines
    if "--" in words:  # cargo run --release -- ARGS
        return words[words.index("--") + 1 :]
    while words and not words[0].startswith("--"):
        words.pop(0)
    return words


def check_router_accepts(module: str, argv: list[str]) -> None:
    _router_parser(module).parse_args(argv)  # exits on an error: the line is theirs as written


# The command lines of sglang-router 0.3.2's README (its PyPI description) and `--help` epilog,
# as written there (launcher prefix and line continuations included).
SGLANG_DOCS = {
    "regular": """python3 -m sglang_router.launch_router \\
        --worker-urls http://worker1:8000 http://worker2:8000 \\
        --policy cache_aware""",
    "pd": """python3 -m sglang_router.launch_router \\
        --pd-disaggregation \\
        --prefill http://prefill1:30001 9001 \\
        --prefill http://prefill2:30002 \\
        --decode http://decode1:30011 \\
        --decode http://decode2:30012 \\
        --policy cache_aware""",
    "pd-policies": """./target/release/sgl-model-gateway \\
        --pd-disaggregation \\
        --prefill http://prefill1:30001 9001 \\
        --prefill http://prefill2:30002 \\
        --decode http://decode1:30011 \\
        --decode http://decode2:30012 \\
        --policy cache_aware \\
        --prefill-policy cache_aware \\
        --decode-policy power_of_two""",
    "mini-lb": """python3 -m sglang_router.launch_router \\
        --mini-lb \\
        --pd-disaggregation \\
        --prefill http://localhost:30001 \\
        --decode http://localhost:30011""",
    "help-bootstrap": """python -m sglang_router.launch_router --pd-disaggregation \\
        --prefill http://prefill1:8000 9000 --prefill http://prefill2:8000 none \\
        --prefill http://prefill3:8000 --decode http://decode1:8001 --decode http://decode2:8001""",
    "help-policies": """python -m sglang_router.launch_router --pd-disaggregation \\
        --prefill http://prefill1:8000 --prefill http://prefill2:8000 \\
        --decode http://decode1:8001 --decode http://decode2:8001 \\
        --prefill-policy cache_aware --decode-policy power_of_two""",
    "trace": """python -m sglang_router.launch_router \\
        --worker-urls http://worker1:8000 \\
        --enable-trace \\
        --otlp-traces-endpoint localhost:4317""",
    "discovery": """./target/release/sgl-model-gateway \\
        --service-discovery \\
        --selector app=sglang-worker role=inference \\
        --service-discovery-namespace sglang-system \\
        --service-discovery-port 8000""",
    "discovery-pd": """--pd-disaggregation \\
        --prefill-selector app=sglang component=prefill \\
        --decode-selector app=sglang component=decode \\
        --service-discovery""",
    "api-key": """python3 -m sglang_router.launch_router \\
        --api-key "shared-api-key" \\
        --worker-urls http://worker1:8000 http://worker2:8000""",
    "tls": """python3 -m sglang_router.launch_router \\
        --worker-urls http://worker1:8000 \\
        --tls-cert-path /path/to/server.crt \\
        --tls-key-path /path/to/server.key""",
}

# vllm-router 0.1.17's README and `--help` epilog
VLLM_DOCS = {
    "dp": """vllm-router \\
        --worker-urls http://worker1:8000 http://worker2:8000 \\
        --policy consistent_hash \\
        --intra-node-data-parallel-size 8""",
    "pd-nixl": """cargo run --release -- \\
        --policy consistent_hash \\
        --vllm-pd-disaggregation \\
        --prefill http://127.0.0.1:8081 \\
        --prefill http://127.0.0.1:8082 \\
        --decode http://127.0.0.1:8083 \\
        --decode http://127.0.0.1:8084 \\
        --decode http://127.0.0.1:8085 \\
        --decode http://127.0.0.1:8086 \\
        --host 127.0.0.1 \\
        --port 8090 \\
        --intra-node-data-parallel-size 1""",
    "zmq-discovery": """cargo run --release -- \\
        --policy consistent_hash \\
        --vllm-pd-disaggregation \\
        --vllm-discovery-address 0.0.0.0:30001 \\
        --host 0.0.0.0 \\
        --port 10001 \\
        --prefill-policy consistent_hash \\
        --decode-policy consistent_hash""",
    "mooncake": """cargo run --release -- \\
        --policy consistent_hash \\
        --vllm-pd-disaggregation \\
        --kv-connector mooncake \\
        --prefill http://127.0.0.1:8081 \\
        --prefill http://127.0.0.1:8082 \\
        --decode http://127.0.0.1:8083 \\
        --decode http://127.0.0.1:8084 \\
        --host 127.0.0.1 \\
        --port 8090 \\
        --intra-node-data-parallel-size 1""",
    "metrics": """vllm-router \\
        --worker-urls http://localhost:8080 http://localhost:8081 \\
        --prometheus-host 0.0.0.0 \\
        --prometheus-port 9000""",
    "retries": """vllm-router \\
      --worker-urls http://localhost:8080 http://localhost:8081 \\
      --retry-max-retries 3 \\
      --retry-initial-backoff-ms 100 \\
      --retry-max-backoff-ms 10000 \\
      --retry-backoff-multiplier 2.0 \\
      --retry-jitter-factor 0.1""",
    "breaker": """vllm-router \\
      --worker-urls http://localhost:8080 http://localhost:8081 \\
      --cb-failure-threshold 5 \\
      --cb-success-threshold 2 \\
      --cb-timeout-duration-secs 30 \\
      --cb-window-duration-secs 60""",
    "request-ids": """vllm-router \\
        --worker-urls http://localhost:8080 \\
        --request-id-headers x-trace-id x-request-id""",
    "discovery": """vllm-router \\
        --service-discovery \\
        --selector app=vllm-worker role=inference \\
        --service-discovery-namespace default""",
    "help-pd": """vllm-router --vllm-pd-disaggregation \\
        --prefill http://prefill1:8000 9000 --prefill http://prefill2:8000 \\
        --decode http://decode1:8001 --decode http://decode2:8001 \\
        --policy cache_aware""",
    "help-policies": """vllm-router --vllm-pd-disaggregation \\
        --prefill http://prefill1:8000 --prefill http://prefill2:8000 \\
        --decode http://decode1:8001 --decode http://decode2:8001 \\
        --prefill-policy cache_aware --decode-policy power_of_two""",
}


def parse(line: str) -> tuple[GatewayConfig, list[str]]:
    return parse_serve_command(command(line))


def workers(c: GatewayConfig) -> list[tuple[str, Role, Engine, int | None]]:
    return [(w.url, w.role, w.engine, w.bootstrap_port) for w in c.workers]


CACHE_AWARE_NOW = router_flags.registered_policy("cache_aware")
# the policy that `cache_aware` stands for in this build (least_load until it is registered)
CACHE_AWARE_AS: Any = LeastLoadCfg() if CACHE_AWARE_NOW is None else msgspec.convert({}, CACHE_AWARE_NOW)


@pytest.mark.parametrize("name", sorted(SGLANG_DOCS))
def test_sglang_router_documented_lines_are_accepted_by_the_router_itself(name: str) -> None:
    check_router_accepts("sglang_router", command(SGLANG_DOCS[name]))


@pytest.mark.parametrize("name", sorted(VLLM_DOCS))
def test_vllm_router_documented_lines_are_accepted_by_the_router_itself(name: str) -> None:
    check_router_accepts("vllm_router", command(VLLM_DOCS[name]))


def test_sglang_router_lines() -> None:
    c, notes = parse(SGLANG_DOCS["regular"])
    assert workers(c) == [
        ("http://worker1:8000", Role.COLOCATED, Engine.SGLANG, None),
        ("http://worker2:8000", Role.COLOCATED, Engine.SGLANG, None),
    ]
    assert c.policy == CACHE_AWARE_AS
    if CACHE_AWARE_NOW is None:
        assert notes == ["--policy cache_aware: this build has no cache_aware policy yet; using least_load"]

    c, _ = parse(SGLANG_DOCS["pd"])
    assert workers(c) == [
        ("http://prefill1:30001", Role.PREFILL, Engine.SGLANG, 9001),
        ("http://prefill2:30002", Role.PREFILL, Engine.SGLANG, 8998),  # SGLang's own default
        ("http://decode1:30011", Role.DECODE, Engine.SGLANG, None),
        ("http://decode2:30012", Role.DECODE, Engine.SGLANG, None),
    ]

    c, _ = parse(SGLANG_DOCS["pd-policies"])
    assert (c.policy, c.prefill_policy, c.decode_policy) == (CACHE_AWARE_AS, CACHE_AWARE_AS, PowerOfTwoCfg())

    c, notes = parse(SGLANG_DOCS["mini-lb"])
    assert len(c.workers) == 2 and notes == ["--mini-lb ignored: the gateway is the load balancer"]

    c, _ = parse(SGLANG_DOCS["help-bootstrap"])
    assert [w.bootstrap_port for w in c.workers] == [9000, None, 8998, None, None]

    c, _ = parse(SGLANG_DOCS["help-policies"])
    assert (c.policy, c.prefill_policy, c.decode_policy) == (RoundRobinCfg(), CACHE_AWARE_AS, PowerOfTwoCfg())

    c, notes = parse(SGLANG_DOCS["trace"])
    assert [n.split(" ")[0] for n in notes] == ["--enable-trace", "--otlp-traces-endpoint"]

    c, _ = parse(SGLANG_DOCS["discovery"])
    assert c.kubernetes is not None and c.workers == ()
    k = c.kubernetes
    assert (k.colocated_selector, k.namespace, k.port, k.engine) == (
        "app=sglang-worker,role=inference",
        "sglang-system",
        8000,
        Engine.SGLANG,
    )

    c, _ = parse(SGLANG_DOCS["discovery-pd"])
    assert c.kubernetes is not None
    assert (c.kubernetes.prefill_selector, c.kubernetes.decode_selector, c.kubernetes.port) == (
        "app=sglang,component=prefill",
        "app=sglang,component=decode",
        80,  # the routers' default --service-discovery-port
    )

    with pytest.raises(ConfigError, match=r"--api-key is not supported: .*--worker-api-key-env"):
        parse(SGLANG_DOCS["api-key"])
    with pytest.raises(ConfigError, match="--tls-cert-path is not supported"):
        parse(SGLANG_DOCS["tls"])


def test_vllm_router_lines() -> None:
    # vllm-router's own examples route by consistent_hash, register workers over ZMQ or use
    # Mooncake's connector: none of these has an equivalent, and each is refused by name
    for name, error in (
        ("dp", "--policy consistent_hash: pd-gateway has no policy for session affinity"),
        ("pd-nixl", "--policy consistent_hash: pd-gateway has no policy for session affinity"),
        ("zmq-discovery", "--vllm-discovery-address is not supported: ZMQ worker registration"),
        ("mooncake", "--kv-connector mooncake is not supported"),
    ):
        with pytest.raises(ConfigError, match=error):
            parse(VLLM_DOCS[name])
    # the same lines with a policy the gateway has: what is left is mapped or refused
    c, notes = parse(VLLM_DOCS["pd-nixl"].replace("consistent_hash", "power_of_two"))
    assert workers(c) == [
        ("http://127.0.0.1:8081", Role.PREFILL, Engine.VLLM, None),
        ("http://127.0.0.1:8082", Role.PREFILL, Engine.VLLM, None),
        *[(f"http://127.0.0.1:{p}", Role.DECODE, Engine.VLLM, None) for p in (8083, 8084, 8085, 8086)],
    ]
    assert (c.listen.host, c.listen.port, c.policy) == ("127.0.0.1", 8090, PowerOfTwoCfg())
    assert notes == [
        "--intra-node-data-parallel-size ignored: each URL is one worker; the engine balances its own data-parallel ranks"
    ]
    with pytest.raises(ConfigError, match="--vllm-discovery-address is not supported"):
        parse(VLLM_DOCS["zmq-discovery"].replace("consistent_hash", "random"))
    with pytest.raises(ConfigError, match="--kv-connector mooncake is not supported"):
        parse(VLLM_DOCS["mooncake"].replace("consistent_hash", "random"))

    c, notes = parse(VLLM_DOCS["metrics"])
    assert len(c.workers) == 2 and [n.split(" ")[0] for n in notes] == [
        "--prometheus-port",
        "--prometheus-host",
    ]

    c, _ = parse(VLLM_DOCS["retries"])
    r = c.retries
    assert (r.max_attempts, r.backoff_initial_s, r.backoff_max_s, r.multiplier, r.jitter) == (
        3,
        0.1,
        10.0,
        2.0,
        0.1,
    )

    c, notes = parse(VLLM_DOCS["breaker"])
    assert (c.breaker.failure_threshold, c.breaker.success_threshold, c.breaker.open_s) == (5, 2, 30.0)
    assert notes == [
        "--cb-window-duration-secs ignored: the gateway's breakers count consecutive failures, without a time window"
    ]

    c, _ = parse(VLLM_DOCS["request-ids"])
    assert c.request_id_headers == ("x-trace-id", "x-request-id")

    c, _ = parse(VLLM_DOCS["discovery"])
    assert c.kubernetes is not None and c.kubernetes.colocated_selector == "app=vllm-worker,role=inference"

    c, notes = parse(VLLM_DOCS["help-pd"])
    assert [(w.engine, w.bootstrap_port) for w in c.workers] == [(Engine.VLLM, None)] * 4
    assert (
        notes[0]
        == "--prefill http://prefill1:8000 9000: bootstrap port ignored (vLLM's NIXL handoff has none)"
    )

    c, _ = parse(VLLM_DOCS["help-policies"])
    assert (c.prefill_policy, c.decode_policy) == (CACHE_AWARE_AS, PowerOfTwoCfg())


def test_more_mappings() -> None:
    argv = [
        "--worker-urls", "http://w:1",
        "--disable-retries", "--disable-circuit-breaker",
        "--health-failure-threshold", "4", "--health-success-threshold", "2",
        "--health-check-timeout-secs", "7", "--health-check-interval-secs", "9",
        "--health-check-endpoint", "/health",
        "--max-concurrent-requests", "64", "--queue-size", "10", "--queue-timeout-secs", "5",
        "--max-payload-size", "1048576", "--request-timeout-secs", "120",
        "--shutdown-grace-period-secs", "3", "--log-level", "warn",
        "--worker-api-key-env", "ENGINE_KEY",
    ]  # fmt: skip
    c, _ = parse_serve_command(argv)
    assert c.retries.max_attempts == 1 and c.breaker.failure_threshold == 2**31 - 1
    h = c.health
    assert (h.failure_threshold, h.success_threshold, h.timeout_s, h.interval_s) == (4, 2, 7.0, 9.0)
    lim = c.limits
    assert (lim.max_concurrent, lim.max_queue, lim.queue_timeout_s, lim.max_body_bytes) == (
        64,
        10,
        5.0,
        1048576,
    )
    assert (c.timeouts.total_s, c.shutdown_grace_s, c.log_level) == (120.0, 3.0, "warning")
    assert c.workers[0].api_key_env == "ENGINE_KEY"
    # -1 (the routers' "no limit") keeps the gateway's default
    c, _ = parse_serve_command(["--worker-urls", "http://w:1", "--max-concurrent-requests", "-1"])
    assert c.limits.max_concurrent == GatewayConfig().limits.max_concurrent
    # --backend openai: OpenAI-compatible workers
    c, _ = parse_serve_command(["--backend", "openai", "--worker-urls", "https://api.example.com"])
    assert c.workers[0].engine is Engine.OPENAI


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (
            ["--policy", "manual"],
            "--policy manual: pd-gateway has no policy for routing by a client-chosen key",
        ),
        (
            ["--prefill-policy", "bucket"],
            "--prefill-policy bucket: pd-gateway has no policy for prefill buckets",
        ),
        (["--decode-policy", "kv_aware"], "--decode-policy kv_aware: pd-gateway has no policy"),
        (["--health-check-endpoint", "/ready"], "--health-check-endpoint /ready is not supported"),
        (["--pd-disaggregation", "--vllm-pd-disaggregation"], "exclude each other"),
        (["--engine", "vllm", "--pd-disaggregation"], "--engine vllm contradicts the router flags"),
        (["--selector", "app=x"], "need --service-discovery"),
        (["--service-discovery", "--selector", "app"], "selector 'app': expected key=value"),
        (["--control-plane-api-keys", "k:n:admin:s"], "--admin-token-env"),
    ],
)
def test_refusals_say_why(argv: list[str], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        parse_serve_command(["--worker", "http://w:1", *argv])


def test_cache_knobs_light_up_with_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["--worker-urls", "http://w:1", "--cache-threshold", "0.5", "--eviction-interval-secs", "30"]
    _, notes = parse_serve_command(argv)  # no cache_aware policy chosen: the knobs do nothing
    assert notes == [
        "--cache-threshold, --eviction-interval-secs ignored: only the cache_aware policy reads them"
    ]

    class CacheAware(msgspec.Struct, tag="cache_aware"):  # stands for the policy's config
        cache_threshold: float = 0.3
        eviction_interval_s: float = 120.0

    monkeypatch.setattr(router_flags, "registered_policy", lambda name: CacheAware)
    args = build_serve_parser().parse_args([*argv, "--max-tree-size", "1000", "--policy", "cache_aware"])
    notes = router_flags.prepare_router_flags(args)
    doc: dict[str, Any] = {}
    router_flags.apply_router_flags(doc, args, notes, 1)
    assert doc["policy"] == {"type": "cache_aware", "cache_threshold": 0.5, "eviction_interval_s": 30.0}
    assert notes == ["--max-tree-size ignored: the cache_aware policy has no such setting"]


def test_help_names_what_each_router_flag_does() -> None:
    text = build_serve_parser().format_help()
    assert "sglang-router / vllm-router flags" in text
    assert "--cb-window-duration-secs" in text and "ignored: the gateway's breakers count" in text
    assert "--retry-max-retries" in text and "maps to retries.max_attempts" in text
    assert "refused: a key on the command line" in text


def test_migration_guide_lists_every_flag_as_the_code_does() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "migration.md").read_text()
    for f in ROUTER_FLAGS:
        assert f"| `{f.flag}` | {f.text} |" in doc, f.flag
