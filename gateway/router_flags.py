"""The command lines of sglang-router 0.3.2 and vllm-router 0.1.17, accepted by `pd-gateway serve`.

Every flag either router defines is known here (tests/unit/test_router_flags.py reads both routers'
own argument parsers): it is **mapped** to the gateway's setting, **ignored** with a note on
stderr saying why, or **refused** with a clear error when ignoring it would change what clients or
workers see (a key, a certificate, a routing policy with no equivalent). The flags the gateway
shares with them (`--host`, `--port`, `--prefill URL [PORT|none]`, `--decode URL`, `--policy`,
`--prefill-policy`, `--decode-policy`, `--log-level`) are its own. docs/migration.md has the table.

`cache_aware` (both routers' default) maps to the gateway's `cache_aware` policy and its knobs
when this build has one; until then to `least_load`, with a note that says so.
"""

from __future__ import annotations

import argparse
import enum
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from common.workers import Engine
from gateway.config import ConfigError
from policies.config import PolicyCfg


class Kind(enum.Enum):
    FLAG = "flag"  # store_true
    VALUE = "value"  # one value
    LIST = "list"  # zero or more values
    LIST1 = "list1"  # one or more values


Action = Literal["map", "ignore", "refuse"]


@dataclass(frozen=True)
class RouterFlag:
    flag: str
    kind: Kind
    action: Action
    text: str  # mapped: "-> the setting"; ignored / refused: why
    type: Callable[[str], Any] = str
    metavar: str | None = None

    @property
    def dest(self) -> str:
        return "router_" + self.flag.lstrip("-").replace("-", "_")


def _m(flag: str, kind: Kind, text: str, type: Callable[[str], Any] = str) -> RouterFlag:
    return RouterFlag(flag, kind, "map", text, type)


def _i(flag: str, kind: Kind, text: str) -> RouterFlag:
    return RouterFlag(flag, kind, "ignore", text)


def _r(flag: str, kind: Kind, text: str) -> RouterFlag:
    return RouterFlag(flag, kind, "refuse", text)


F, V, L, L1 = Kind.FLAG, Kind.VALUE, Kind.LIST, Kind.LIST1
_NO_TLS = "the gateway neither terminates TLS nor sends client certificates; put a TLS proxy in front"
_NO_TOKENIZER = "the gateway passes requests through without tokenizing them"
_NO_HISTORY = "the gateway keeps no conversation history (Responses API storage)"

ROUTER_FLAGS: tuple[RouterFlag, ...] = (
    # -- workers and P/D
    _m("--pd-disaggregation", F, "P/D: SGLang workers (P/D follows from --prefill/--decode)"),
    _m("--vllm-pd-disaggregation", F, "P/D: vLLM workers (engine vllm, NIXL handoff)"),
    _m("--worker-urls", L, "colocated workers (as --worker)"),
    _m("--backend", V, "openai: the flag workers are OpenAI-compatible servers (engine openai)"),
    _m("--kv-connector", V, "nixl only: the gateway's vLLM handoff is NIXL's (mooncake, moriio refused)"),
    _i("--mini-lb", F, "the gateway is the load balancer"),
    _i("--dp-aware", F, "each URL is one worker; the engine balances its own data-parallel ranks"),
    _i(
        "--intra-node-data-parallel-size",
        V,
        "each URL is one worker; the engine balances its own data-parallel ranks",
    ),
    _i("--enable-igw", F, "the gateway serves every model its workers serve"),
    _i(
        "--worker-startup-timeout-secs",
        V,
        "workers that are down at start are probed every health interval and join when healthy",
    ),
    _i(
        "--worker-startup-check-interval",
        V,
        "workers that are down at start are probed every health interval and join when healthy",
    ),
    _r(
        "--vllm-discovery-address",
        V,
        "ZMQ worker registration is not supported: list workers with --prefill/--decode, the admin "
        "API or Kubernetes discovery (docs/deployment.md)",
    ),
    # -- policies (the names are read by --policy / --prefill-policy / --decode-policy)
    _m("--cache-threshold", V, "cache_aware policy: cache_threshold", float),
    _m("--balance-abs-threshold", V, "cache_aware policy: balance_abs_threshold", float),
    _m("--balance-rel-threshold", V, "cache_aware policy: balance_rel_threshold", float),
    _m("--eviction-interval-secs", V, "cache_aware policy: eviction interval", float),
    _m("--max-tree-size", V, "cache_aware policy: max_tree_size", int),
    _i("--bucket-adjust-interval-secs", V, "the bucket policy has no equivalent (refused)"),
    _i("--max-idle-secs", V, "the manual policy has no equivalent (refused)"),
    _i("--assignment-mode", V, "the manual policy has no equivalent (refused)"),
    _i("--router-temperature", V, "kv_aware has no equivalent (refused)"),
    _i("--kv-penalty-host", V, "kv_aware has no equivalent (refused)"),
    _i("--kv-penalty-external", V, "kv_aware has no equivalent (refused)"),
    _i("--kv-penalty-disk", V, "kv_aware has no equivalent (refused)"),
    _i("--kv-aware-session-affinity-ttl-secs", V, "kv_aware has no equivalent (refused)"),
    _i("--kv-event-source", L1, "KV-event sources are not read from flags"),
    _i("--kv-event-replay-source", L1, "KV-event sources are not read from flags"),
    _i("--kv-event-block-size", V, "KV-event sources are not read from flags"),
    _i("--kv-event-model", V, "KV-event sources are not read from flags"),
    _i("--pd-kv-events", L1, "KV-event sources are not read from flags"),
    _i("--enable-program-scheduling", F, "program scheduling has no equivalent"),
    _i("--program-scheduling-config-json", V, "program scheduling has no equivalent"),
    # -- limits, timeouts, retries, breakers, health
    _m("--request-timeout-secs", V, "timeouts.total_s (as --request-timeout-s)", float),
    _m("--max-payload-size", V, "limits.max_body_bytes", int),
    _m("--max-concurrent-requests", V, "limits.max_concurrent (-1: the gateway's default)", int),
    _m("--queue-size", V, "limits.max_queue", int),
    _m("--queue-timeout-secs", V, "limits.queue_timeout_s", float),
    _i("--rate-limit-tokens-per-second", V, "admission counts requests in flight, not a token rate"),
    _m("--retry-max-retries", V, "retries.max_attempts (both count the first try)", int),
    _m("--retry-initial-backoff-ms", V, "retries.backoff_initial_s (/ 1000)", float),
    _m("--retry-max-backoff-ms", V, "retries.backoff_max_s (/ 1000)", float),
    _m("--retry-backoff-multiplier", V, "retries.multiplier", float),
    _m("--retry-jitter-factor", V, "retries.jitter", float),
    _m("--disable-retries", F, "retries.max_attempts = 1"),
    _m("--cb-failure-threshold", V, "breaker.failure_threshold (consecutive failures)", int),
    _m("--cb-success-threshold", V, "breaker.success_threshold", int),
    _m("--cb-timeout-duration-secs", V, "breaker.open_s", float),
    _i(
        "--cb-window-duration-secs",
        V,
        "the gateway's breakers count consecutive failures, without a time window",
    ),
    _m("--disable-circuit-breaker", F, "breaker.failure_threshold = 2**31 - 1 (never opens)"),
    _m("--health-failure-threshold", V, "health.failure_threshold", int),
    _m("--health-success-threshold", V, "health.success_threshold", int),
    _m("--health-check-timeout-secs", V, "health.timeout_s", float),
    _m("--health-check-interval-secs", V, "health.interval_s", float),
    _m("--health-check-endpoint", V, "/health only: the engine adapters probe each engine's own endpoints"),
    _i("--disable-health-check", F, "the gateway always probes its workers"),
    _m("--request-id-headers", L, "request_id_headers"),
    _m("--shutdown-grace-period-secs", V, "shutdown_grace_s", float),
    _i("--cors-allowed-origins", L, "the gateway sends no CORS headers"),
    # -- Kubernetes discovery
    _m("--service-discovery", F, "[kubernetes] pod discovery (needs a selector)"),
    _m("--selector", L1, "kubernetes.colocated_selector (key=value ...)"),
    _m("--prefill-selector", L1, "kubernetes.prefill_selector (key=value ...)"),
    _m("--decode-selector", L1, "kubernetes.decode_selector (key=value ...)"),
    _m("--service-discovery-port", V, "kubernetes.port", int),
    _m("--service-discovery-namespace", V, "kubernetes.namespace"),
    # -- observability
    _i("--prometheus-port", V, "metrics are served on the gateway's own port at /metrics"),
    _i("--prometheus-host", V, "metrics are served on the gateway's own port at /metrics"),
    _i("--prometheus-duration-buckets", L1, "the gateway's histogram buckets are fixed"),
    _i("--log-dir", V, "logs go to stderr (one JSON line per event)"),
    _i("--enable-trace", F, "no OpenTelemetry tracing; requests are logged with their request id"),
    _i("--otlp-traces-endpoint", V, "no OpenTelemetry tracing; requests are logged with their request id"),
    # -- security: ignoring these would change what clients or workers see
    _r(
        "--api-key",
        V,
        "a key on the command line is visible to every user of the machine: put it in an "
        "environment variable and pass --worker-api-key-env VAR",
    ),
    _r("--tls-cert-path", V, _NO_TLS),
    _r("--tls-key-path", V, _NO_TLS),
    _r("--client-cert-path", V, _NO_TLS),
    _r("--client-key-path", V, _NO_TLS),
    _r("--ca-cert-paths", L, "give https:// workers a CA bundle with [[workers]] tls_ca_file in --config"),
    _r("--control-plane-api-keys", L, "the admin API takes one bearer token: --admin-token-env VAR"),
    _i("--control-plane-audit-enabled", F, "admin API calls are always logged"),
    _r("--jwt-issuer", V, "the admin API takes one bearer token: --admin-token-env VAR"),
    _r("--jwt-audience", V, "the admin API takes one bearer token: --admin-token-env VAR"),
    _r("--jwt-jwks-uri", V, "the admin API takes one bearer token: --admin-token-env VAR"),
    _r("--jwt-role-mapping", L, "the admin API takes one bearer token: --admin-token-env VAR"),
    _i("--wasm-middleware", V, "no WASM middleware; policies are Python plugins (docs/configuration.md)"),
    _i("--wasm-middleware-sha256", V, "no WASM middleware; policies are Python plugins"),
    _i("--wasm-middleware-route", V, "no WASM middleware; policies are Python plugins"),
    # -- tokenizer, parsers, history: features of the routers' gRPC and OpenAI-backend modes
    _i("--model-path", V, _NO_TOKENIZER),
    _i("--tokenizer-path", V, _NO_TOKENIZER),
    _i("--chat-template", V, _NO_TOKENIZER),
    _i("--tokenizer-cache-enable-l0", F, _NO_TOKENIZER),
    _i("--tokenizer-cache-l0-max-entries", V, _NO_TOKENIZER),
    _i("--tokenizer-cache-enable-l1", F, _NO_TOKENIZER),
    _i("--tokenizer-cache-l1-max-memory", V, _NO_TOKENIZER),
    _i("--reasoning-parser", V, "reasoning and tool calls are parsed by the engines, as in HTTP mode"),
    _i("--tool-call-parser", V, "reasoning and tool calls are parsed by the engines, as in HTTP mode"),
    _i("--mcp-config-path", V, "no MCP client in the gateway"),
    _i("--history-backend", V, _NO_HISTORY),
    _i("--oracle-wallet-path", V, _NO_HISTORY),
    _i("--oracle-tns-alias", V, _NO_HISTORY),
    _i("--oracle-connect-descriptor", V, _NO_HISTORY),
    _i("--oracle-username", V, _NO_HISTORY),
    _i("--oracle-password", V, _NO_HISTORY),
    _i("--oracle-pool-min", V, _NO_HISTORY),
    _i("--oracle-pool-max", V, _NO_HISTORY),
    _i("--oracle-pool-timeout-secs", V, _NO_HISTORY),
    _i("--postgres-db-url", V, _NO_HISTORY),
    _i("--postgres-pool-max", V, _NO_HISTORY),
    _i("--redis-url", V, _NO_HISTORY),
    _i("--redis-pool-max", V, _NO_HISTORY),
    _i("--redis-retention-days", V, _NO_HISTORY),
)

# the routers' flags that are the gateway's own (gateway/cli_args.py)
SHARED_FLAGS = (
    "--host",
    "--port",
    "--prefill",
    "--decode",
    "--policy",
    "--prefill-policy",
    "--decode-policy",
    "--log-level",
)

# router policy names without an equivalent, and why
_NO_EQUIVALENT = {
    "manual": "routing by a client-chosen key",
    "bucket": "prefill buckets by prompt length (see --min-prefill-tokens for length-based P/D)",
    "kv_aware": "scoring by engine KV events",
    "consistent_hash": "session affinity by a hashed header",
    "sticky_least_loaded": "session affinity",
}
CACHE_AWARE = "cache_aware"
CACHE_AWARE_FALLBACK = "least_load"
POLICY_FLAGS = ("policy", "prefill_policy", "decode_policy")

# knob flag -> config field names it may have in the cache_aware policy's table (the first that
# the policy's config declares is used): the knobs light up with the policy
CACHE_KNOBS: dict[str, tuple[str, ...]] = {
    "--cache-threshold": ("cache_threshold",),
    "--balance-abs-threshold": ("balance_abs_threshold",),
    "--balance-rel-threshold": ("balance_rel_threshold",),
    "--eviction-interval-secs": ("eviction_interval_s", "eviction_interval_secs", "eviction_interval"),
    "--max-tree-size": ("max_tree_size",),
}

_BY_FLAG = {f.flag: f for f in ROUTER_FLAGS}
_NEVER_OPENS = 2**31 - 1


def add_router_flags(parser: argparse.ArgumentParser) -> None:
    """The routers' flags that `pd-gateway serve` does not share, in their own help group."""
    g = parser.add_argument_group(
        "sglang-router / vllm-router flags",
        "accepted for drop-in use (docs/migration.md): mapped to the setting named, or ignored / "
        "refused for the reason given",
    )
    for f in ROUTER_FLAGS:
        label = {"map": "maps to", "ignore": "ignored:", "refuse": "refused:"}[f.action]
        kw: dict[str, Any] = {"dest": f.dest, "help": f"{label} {f.text}", "default": None}
        if f.kind is Kind.FLAG:
            kw["action"] = "store_true"
        else:
            kw["type"] = f.type
            if f.kind is Kind.LIST:
                kw["nargs"] = "*"
            elif f.kind is Kind.LIST1:
                kw["nargs"] = "+"
        g.add_argument(f.flag, **kw)
    g.add_argument(
        "--worker-api-key-env",
        default=None,
        metavar="VAR",
        help="workers given by flags get `Authorization: Bearer $VAR` (workers[].api_key_env)",
    )


def _given(args: argparse.Namespace, flag: str) -> Any:
    return getattr(args, _BY_FLAG[flag].dest, None)


def registered_policy(name: str) -> type[msgspec.Struct] | None:
    """The config Struct of the policy named `name` in this build, if any."""
    for cls in typing.get_args(PolicyCfg):
        if getattr(cls, "__struct_config__", None) is not None and cls.__struct_config__.tag == name:
            return typing.cast(type[msgspec.Struct], cls)
    return None


def prepare_router_flags(args: argparse.Namespace) -> list[str]:
    """Fold the router flags that feed the gateway's own flags into `args` (before `merge_args`):
    the engine, `--worker-urls`, the timeout, the log level, a vLLM prefill's bootstrap port.
    Returns notes for stderr; raises ConfigError for a refused flag or value."""
    notes: list[str] = []
    for f in ROUTER_FLAGS:
        value = getattr(args, f.dest, None)
        if value is None or value is False:
            continue
        if f.action == "refuse":
            raise ConfigError(f"{f.flag} is not supported: {f.text}")
        if f.action == "ignore":
            notes.append(f"{f.flag} ignored: {f.text}")

    sglang_pd = bool(_given(args, "--pd-disaggregation"))
    vllm_pd = bool(_given(args, "--vllm-pd-disaggregation"))
    backend = _given(args, "--backend")
    if sglang_pd and vllm_pd:
        raise ConfigError(
            "--pd-disaggregation (SGLang) and --vllm-pd-disaggregation (vLLM) exclude each other"
        )
    if backend not in (None, "sglang", "openai"):
        raise ConfigError(f"--backend {backend!r}: expected sglang or openai")
    implied = (
        Engine.VLLM.value
        if vllm_pd
        else Engine.OPENAI.value
        if backend == "openai"
        else Engine.SGLANG.value
        if sglang_pd or backend == "sglang"
        else None
    )
    if args.engine is None:
        args.engine = implied or Engine.SGLANG.value
    elif implied is not None and implied != args.engine:
        raise ConfigError(f"--engine {args.engine} contradicts the router flags, which mean {implied}")

    connector = _given(args, "--kv-connector")
    if connector is not None and connector != "nixl":
        raise ConfigError(
            f"--kv-connector {connector} is not supported: the gateway's vLLM P/D handoff is "
            "NIXL's (--kv-transfer-config with NixlConnector on both servers)"
        )
    if vllm_pd:
        for values in args.prefill:
            if len(values) == 2:
                notes.append(
                    f"--prefill {values[0]} {values[1]}: bootstrap port ignored (vLLM's NIXL handoff has none)"
                )
                del values[1:]

    urls = _given(args, "--worker-urls")
    if urls:
        args.worker = [*args.worker, *urls]

    timeout = _given(args, "--request-timeout-secs")
    if timeout is not None:
        if args.request_timeout_s is not None and args.request_timeout_s != timeout:
            raise ConfigError("--request-timeout-secs and --request-timeout-s disagree")
        args.request_timeout_s = timeout

    if args.log_level == "warn":  # sglang-router's spelling
        args.log_level = "warning"

    endpoint = _given(args, "--health-check-endpoint")
    if endpoint is not None and endpoint != "/health":
        raise ConfigError(
            f"--health-check-endpoint {endpoint} is not supported: the gateway probes each engine's "
            "own health and info endpoints (GET /health first)"
        )

    for key in POLICY_FLAGS:
        name = getattr(args, key)
        if name in _NO_EQUIVALENT:
            raise ConfigError(
                f"--{key.replace('_', '-')} {name}: pd-gateway has no policy for {_NO_EQUIVALENT[name]}; "
                "choose round_robin, random, least_load, power_of_two or cache_aware"
            )
    return notes


def _selector(values: list[str] | None) -> str | None:
    """sglang-router's `key1=value1 key2=value2` as a Kubernetes label selector string."""
    if not values:
        return None
    for v in values:
        key, eq, _ = v.partition("=")
        if not eq or not key:
            raise ConfigError(f"selector {v!r}: expected key=value")
    return ",".join(values)


def apply_router_flags(
    doc: dict[str, Any], args: argparse.Namespace, notes: list[str], flag_workers: int
) -> None:
    """Write the router flags that are settings into the merged document (after `merge_args`).
    `flag_workers`: how many workers at the end of `doc["workers"]` came from flags."""

    def section(name: str) -> dict[str, Any]:
        table = doc.get(name)
        if table is None:
            table = doc[name] = {}
        elif not isinstance(table, dict):
            raise ConfigError(f"{name} must be a table, got {type(table).__name__}")
        else:
            table = doc[name] = dict(table)
        return typing.cast(dict[str, Any], table)

    def put(flag: str, sect: str | None, key: str, convert: Callable[[Any], Any] = lambda v: v) -> None:
        value = _given(args, flag)
        if value is None or value is False:
            return
        target = doc if sect is None else section(sect)
        target[key] = convert(value)

    ms = 1000.0
    put("--max-payload-size", "limits", "max_body_bytes")
    concurrent = _given(args, "--max-concurrent-requests")
    if concurrent is not None and concurrent != -1:
        section("limits")["max_concurrent"] = concurrent
    put("--queue-size", "limits", "max_queue")
    put("--queue-timeout-secs", "limits", "queue_timeout_s")
    put("--retry-max-retries", "retries", "max_attempts")
    put("--retry-initial-backoff-ms", "retries", "backoff_initial_s", lambda v: v / ms)
    put("--retry-max-backoff-ms", "retries", "backoff_max_s", lambda v: v / ms)
    put("--retry-backoff-multiplier", "retries", "multiplier")
    put("--retry-jitter-factor", "retries", "jitter")
    if _given(args, "--disable-retries"):
        section("retries")["max_attempts"] = 1
    retries = doc.get("retries")
    if isinstance(retries, dict) and "backoff_initial_s" in retries and "backoff_max_s" not in retries:
        # the routers' own default maximum (30 s) keeps a larger initial backoff valid
        retries["backoff_max_s"] = max(retries["backoff_initial_s"], 2.0)
    put("--cb-failure-threshold", "breaker", "failure_threshold")
    put("--cb-success-threshold", "breaker", "success_threshold")
    put("--cb-timeout-duration-secs", "breaker", "open_s")
    if _given(args, "--disable-circuit-breaker"):
        section("breaker")["failure_threshold"] = _NEVER_OPENS
    put("--health-failure-threshold", "health", "failure_threshold")
    put("--health-success-threshold", "health", "success_threshold")
    put("--health-check-timeout-secs", "health", "timeout_s")
    put("--health-check-interval-secs", "health", "interval_s")
    put("--request-id-headers", None, "request_id_headers", lambda v: [h.lower() for h in v])
    put("--shutdown-grace-period-secs", None, "shutdown_grace_s")

    env = getattr(args, "worker_api_key_env", None)
    if env is not None:
        workers = doc.get("workers", [])
        for w in workers[len(workers) - flag_workers :]:
            w["api_key_env"] = env

    _apply_discovery(doc, args, section)
    _apply_policies(doc, args, notes)


def _apply_discovery(
    doc: dict[str, Any], args: argparse.Namespace, section: Callable[[str], dict[str, Any]]
) -> None:
    selectors = {
        "colocated_selector": _selector(_given(args, "--selector")),
        "prefill_selector": _selector(_given(args, "--prefill-selector")),
        "decode_selector": _selector(_given(args, "--decode-selector")),
    }
    if not _given(args, "--service-discovery"):
        if any(selectors.values()):
            raise ConfigError("--selector / --prefill-selector / --decode-selector need --service-discovery")
        return
    k8s = section("kubernetes")
    for key, value in selectors.items():
        if value is not None:
            k8s[key] = value
    port = _given(args, "--service-discovery-port")
    k8s["port"] = port if port is not None else k8s.get("port", 80)  # the routers' default port
    namespace = _given(args, "--service-discovery-namespace")
    if namespace is not None:
        k8s["namespace"] = namespace
    k8s.setdefault("engine", args.engine)


def _apply_policies(doc: dict[str, Any], args: argparse.Namespace, notes: list[str]) -> None:
    knobs = {flag: _given(args, flag) for flag in CACHE_KNOBS}
    given = {flag: v for flag, v in knobs.items() if v is not None}
    cache_aware = [key for key in POLICY_FLAGS if getattr(args, key) == CACHE_AWARE]
    if given and not cache_aware:
        notes.append(f"{', '.join(given)} ignored: only the cache_aware policy reads them")
        return
    if not cache_aware:
        return
    cls = registered_policy(CACHE_AWARE)
    if cls is None:
        for key in cache_aware:
            doc[key] = {"type": CACHE_AWARE_FALLBACK}
        notes.append(
            f"--{'/--'.join(k.replace('_', '-') for k in cache_aware)} cache_aware: this build has no "
            f"cache_aware policy yet; using {CACHE_AWARE_FALLBACK}"
            + (f" ({', '.join(given)} ignored)" if given else "")
        )
        return
    fields = set(cls.__struct_fields__)
    table: dict[str, Any] = {"type": CACHE_AWARE}
    for flag, value in given.items():
        name = next((n for n in CACHE_KNOBS[flag] if n in fields), None)
        if name is None:
            notes.append(f"{flag} ignored: the cache_aware policy has no such setting")
        else:
            table[name] = value
    for key in cache_aware:
        doc[key] = dict(table)
