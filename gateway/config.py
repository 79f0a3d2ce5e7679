"""The gateway's configuration: frozen msgspec Structs, decoded strictly from TOML (and flags).

`load_config(path)` reads a TOML file; `gateway.cli_args.parse_serve_args(argv)` reads flags on top
of an optional `--config FILE`. Both produce one frozen `GatewayConfig`, built once in `main` and
passed down; nothing reads configuration from globals or the environment here (`api_key_env` /
`token_env` name variables that the caller resolves with an explicit `environ`). Every section
forbids unknown fields, so a typo is an error naming the key and where it is (``unknown field
`tiemouts` at `$` ``). Validation lives in `__post_init__`. See docs/configuration.md for an
annotated example."""

from __future__ import annotations

import json
import math
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec

from gateway.config_base import (
    SGLANG_DEFAULT_BOOTSTRAP_PORT,
    ConfigError,
    KiB,
    MiB,
    _non_negative,
    _positive,
    _Section,
)
from gateway.config_workers import KubernetesConfig, KvEventsConfig, WorkerConfig
from gateway.routing_tokenizer import TokenizerConfig
from policies.config import DeciderCfg, PolicyCfg, RoundRobinCfg, policy_shorthand

LogLevel = Literal["debug", "info", "warning", "error", "critical"]
FallbackRung = Literal["other_pair", "colocated", "decode_self_prefill", "shed"]
# when an SGLang P/D stream's prefill verdict must be in: before the decode's first byte reaches
# the client (its tokens wait for it), or before the stream's end (they flow at once)
PrefillVerdictAt = Literal["before_first_byte", "before_end"]
POLICY_FIELDS = ("policy", "prefill_policy", "decode_policy")
PHASE_TIMEOUTS = ("connect_s", "prefill_s", "handoff_s", "idle_s", "client_stall_s")

_HEADER_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9a-z-]+$")


class ListenConfig(_Section, frozen=True):
    host: str = "127.0.0.1"
    port: int = 8000  # 0 picks a free port
    # gateway processes on the port (SO_REUSEPORT; `serve --workers N`); each is one core's worth
    processes: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"listen.port must be in 0..65535, got {self.port}")
        if not 1 <= self.processes <= 62:
            raise ValueError(f"listen.processes must be in 1..62, got {self.processes}")


class TimeoutsConfig(_Section, frozen=True):
    """Seconds. Each phase limit is at most `total_s`."""

    connect_s: float = 2.0  # TCP connect to a worker
    prefill_s: float = 60.0  # prefill leg until its response is complete
    handoff_s: float = 30.0  # KV handoff: prefill done -> decode's first byte
    idle_s: float = 60.0  # longest worker silence inside a stream (not while the client is not reading)
    # longest wait for a client that takes none of its answer's bytes (the gateway's writes to it
    # paused): then the request is stopped as if it had gone (its engine legs aborted) and its
    # connection closed; a client that reads, however slowly, is not cut
    client_stall_s: float = 60.0
    total_s: float = 600.0  # whole request
    # added per token a non-streamed answer may generate to prefill_s (colocated) or handoff_s
    # (P/D): its headers come with its last token
    per_token_s: float = 0.25

    def __post_init__(self) -> None:
        values = msgspec.structs.asdict(self)
        _positive("timeouts", **values)
        for name in PHASE_TIMEOUTS:
            if values[name] > self.total_s:
                raise ValueError(
                    f"timeouts.{name} ({values[name]}) must be <= timeouts.total_s ({self.total_s})"
                )


class RetriesConfig(_Section, frozen=True):
    """Attempts per request (first try included) and exponential backoff with jitter."""

    max_attempts: int = 3
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.2  # fraction of each delay drawn at random, 0..1
    # a request whose engine broke its connection holding it gets one more try at most; if the
    # engine stopped listening within death_probe_s, copies of the request are refused for
    # quarantine_s (0: never quarantined) (gateway/orchestration/quarantine.py)
    quarantine_s: float = 300.0
    death_probe_s: float = 0.5
    # where a model's workers neither check token ids nor have a vocab_size, after an engine died
    # of a request with token ids above every id served: for quarantine_s, "refuse" every such
    # request, or "probe": refuse only ids at or above the one that killed, try those below one
    # at a time (each may cost another engine) (gateway/orchestration/token_bounds.py)
    unproven_after_death: Literal["refuse", "probe"] = "refuse"

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("retries.max_attempts must be >= 1")
        _non_negative(
            "retries",
            backoff_initial_s=self.backoff_initial_s,
            backoff_max_s=self.backoff_max_s,
            quarantine_s=self.quarantine_s,
            death_probe_s=self.death_probe_s,
        )
        if self.backoff_initial_s > self.backoff_max_s:
            raise ValueError("retries.backoff_initial_s must be <= retries.backoff_max_s")
        if self.multiplier < 1:
            raise ValueError("retries.multiplier must be >= 1")
        if not 0 <= self.jitter <= 1:
            raise ValueError("retries.jitter must be in [0, 1]")


class BreakerConfig(_Section, frozen=True):
    """Per worker and per (prefill, decode) pair."""

    failure_threshold: int = 5  # consecutive failures that open it
    success_threshold: int = 2  # successes in half-open that close it
    open_s: float = 30.0  # time open before a half-open trial (times the ejections in a row)
    max_open_s: float = 300.0  # the longest an ejection lasts
    # at most this share of a pool (a role's workers of one model; one model's pairs) open at once,
    # unless the worker's recent failures (its last 20 outcomes) reach eject_failure_share
    max_ejected_share: float = 0.5
    eject_failure_share: float = 0.85

    def __post_init__(self) -> None:
        _positive(
            "breaker",
            failure_threshold=self.failure_threshold,
            success_threshold=self.success_threshold,
            open_s=self.open_s,
            max_open_s=self.max_open_s,
        )
        if self.max_open_s < self.open_s:
            raise ValueError("breaker.max_open_s must be at least breaker.open_s")
        for name, share in (
            ("max_ejected_share", self.max_ejected_share),
            ("eject_failure_share", self.eject_failure_share),
        ):
            if not 0.0 <= share <= 1.0:
                raise ValueError(f"breaker.{name} must be in [0, 1], got {share!r}")


class HealthConfig(_Section, frozen=True):
    interval_s: float = 5.0  # between probes of one worker
    timeout_s: float = 3.0  # each probe request: /health, each info endpoint, a load report
    failure_threshold: int = 3  # failed probes before unhealthy
    success_threshold: int = 1  # good probes before healthy again
    scrape_interval_s: float = 2.0  # the engines' load reports (SGLang /v1/loads, else /metrics)

    def __post_init__(self) -> None:
        _positive("health", **msgspec.structs.asdict(self))


class LimitsConfig(_Section, frozen=True):
    max_body_bytes: int = 16 * MiB  # 413 above
    max_header_bytes: int = 64 * KiB  # 431 above
    read_timeout_s: float = 30.0  # 408 if the request is not read by then
    max_concurrent: int = 4096  # requests in flight upstream
    max_queue: int = 1024  # requests waiting for a slot; 503 beyond
    queue_timeout_s: float = 30.0  # longest wait for a slot
    max_tokens_cap: int | None = None  # reject (400) larger max_tokens; None: no cap
    max_n: int = 128  # largest `n`
    # one request's work: completions asked for (prompts x n), tokens (prompts + max_tokens for
    # each), JSON values in its body (bounds its decoding: more is a 413 before it is decoded)
    max_batch: int = 1024
    max_request_tokens: int = 2_097_152
    max_json_values: int = 131_072
    # handoffs of one split request (`n > 1` or a batch on SGLang P/D: one handoff per prompt and
    # sample) in flight at once; the rest wait their turn (one request cannot take every socket)
    split_concurrency: int = 32
    per_client_max_concurrent: int = 0  # per client (see client_key_header); 0 = off
    # who "a client" is for per_client_max_concurrent: empty, the socket's address; a header name
    # (e.g. "x-api-key", "authorization"), its value when sent (the address otherwise); for
    # "x-forwarded-for" its last address, the one the proxy in front of the gateway saw
    client_key_header: str = ""
    max_inflight_tokens: int | None = None  # prompt + max_tokens estimate in flight; None: no limit
    retry_after_s: float = 1.0  # Retry-After of 429/503: admission control, no route, no fallback left
    max_inflight_per_worker: int = 0  # a worker at this many requests is skipped (0 = no cap)
    # open client connections at most; 0: half the process's open-files limit, at most 65536
    # (the rest is for upstream connections: a P/D request holds two)
    max_connections: int = 0
    # of max_connections, the last this many serve only /health, /readiness, /metrics, /admin/
    reserved_connections: int = 32
    keepalive_timeout_s: float = 75.0  # an idle client connection is closed after this long

    def __post_init__(self) -> None:
        _positive(
            "limits",
            max_body_bytes=self.max_body_bytes,
            max_header_bytes=self.max_header_bytes,
            read_timeout_s=self.read_timeout_s,
            max_concurrent=self.max_concurrent,
            queue_timeout_s=self.queue_timeout_s,
            max_n=self.max_n,
            split_concurrency=self.split_concurrency,
            max_batch=self.max_batch,
            max_request_tokens=self.max_request_tokens,
            max_json_values=self.max_json_values,
        )
        _non_negative(
            "limits", max_queue=self.max_queue, per_client_max_concurrent=self.per_client_max_concurrent
        )
        name = self.client_key_header
        if name and (not name.isascii() or not all(c.isalnum() or c in "-_" for c in name)):
            raise ValueError(f"limits.client_key_header: {name!r} is not a header name")
        if self.max_tokens_cap is not None:
            _positive("limits", max_tokens_cap=self.max_tokens_cap)
        if self.max_inflight_tokens is not None:
            _positive("limits", max_inflight_tokens=self.max_inflight_tokens)
        _positive("limits", retry_after_s=self.retry_after_s, keepalive_timeout_s=self.keepalive_timeout_s)
        _non_negative(
            "limits", max_connections=self.max_connections, reserved_connections=self.reserved_connections
        )
        if self.max_connections and self.reserved_connections >= self.max_connections:
            raise ValueError("limits.reserved_connections must be below limits.max_connections")


class GuardsConfig(_Section, frozen=True):
    length_preflight: bool = True  # prompt + max_tokens vs the chosen workers' context length
    decode_consistency: bool = True  # decode's prompt tokens == prefill's; greedy first token agrees
    shadow_fraction: float = 0.05  # share of greedy P/D answers re-run elsewhere and compared
    shadow_tokens: int = 8  # tokens a shadow run generates and compares
    shadow_seed: int = 0  # seeds which answers the sample picks: the same in every run and process
    shadow_before_delivery: bool = True  # a sampled answer's clean end waits until its re-run agrees
    suspect_window_s: float = 120.0  # after a KV-integrity failure: the pair's answers verified first
    chars_per_token_estimate: float = 4.0  # prompt length estimate without a tokenizer
    near_tie_alternatives: int = 3  # vLLM: a greedy prefill is asked for its best first tokens (0: not)
    near_tie_margin: float = 0.2  # nats: a decode first token this close to the prefill's is a tie
    # SGLang P/D streams: the prefill's verdict checked before the first byte (tokens held until
    # it is in) or before the stream's end (tokens flow; a bad verdict ends it with an error event)
    prefill_verdict: PrefillVerdictAt = "before_first_byte"

    def __post_init__(self) -> None:
        if not 0.0 <= self.shadow_fraction <= 1.0:
            raise ValueError("guards.shadow_fraction must be in [0, 1]")
        if not 0 <= self.near_tie_alternatives <= 20:
            raise ValueError(
                "guards.near_tie_alternatives must be in [0, 20] (vLLM's default --max-logprobs)"
            )
        _non_negative("guards", near_tie_margin=self.near_tie_margin)
        _positive("guards", shadow_tokens=self.shadow_tokens)
        _non_negative("guards", suspect_window_s=self.suspect_window_s)
        _positive("guards", chars_per_token_estimate=self.chars_per_token_estimate)


class FallbackConfig(_Section, frozen=True):
    """Rungs tried in order after a failure before the first byte reached the client."""

    ladder: tuple[FallbackRung, ...] = ("other_pair", "colocated", "decode_self_prefill", "shed")

    def __post_init__(self) -> None:
        if len(set(self.ladder)) != len(self.ladder):
            raise ValueError(f"fallback.ladder has duplicates: {list(self.ladder)}")
        if "shed" in self.ladder and self.ladder[-1] != "shed":
            raise ValueError("fallback.ladder: 'shed' must be the last rung")


class AdminConfig(_Section, frozen=True):
    """The admin API (worker add/remove/drain) is off unless a token is configured."""

    token_env: str | None = None  # env var holding the bearer token (preferred)
    token: str | None = None  # the token itself (avoid in shared files)
    drain_timeout_s: float = 30.0  # DELETE /admin/workers/{id}: longest wait for its in-flight requests
    # serve the admin API on its own listener (listen_host:listen_port) instead of the gateway's
    # (where /admin/ then is a 404); None: on the gateway's listener
    listen_port: int | None = None
    listen_host: str = "127.0.0.1"
    # true: a `token_env` variable that is unset or empty turns the admin API off instead of being
    # an error (one image and config for deployments with and without an admin token)
    token_optional: bool = False

    def __post_init__(self) -> None:
        if self.token_env is not None and self.token is not None:
            raise ValueError("admin: set token_env or token, not both")
        if self.token == "" or self.token_env == "":
            raise ValueError("admin: token / token_env must not be empty")
        _non_negative("admin", drain_timeout_s=self.drain_timeout_s)
        if self.listen_port is not None:
            if not 0 <= self.listen_port <= 65535:
                raise ValueError(f"admin.listen_port must be in [0, 65535], got {self.listen_port}")
            if not self.enabled:
                raise ValueError("admin.listen_port needs a token (admin.token_env or admin.token)")

    @property
    def enabled(self) -> bool:
        return self.token_env is not None or self.token is not None

    def resolve_token(self, environ: Mapping[str, str]) -> str | None:
        """The token, reading `environ[token_env]`; ConfigError if that variable is unset."""
        if self.token is not None:
            return self.token
        if self.token_env is None:
            return None
        value = environ.get(self.token_env)
        if not value:
            if self.token_optional:
                return None
            raise ConfigError(f"admin.token_env: environment variable {self.token_env} is not set")
        return value


class GatewayConfig(_Section, frozen=True):
    listen: ListenConfig = ListenConfig()
    workers: tuple[WorkerConfig, ...] = ()
    policy: PolicyCfg = RoundRobinCfg()
    prefill_policy: PolicyCfg | None = None  # None: `policy`
    decode_policy: PolicyCfg | None = None  # None: `policy`
    decider: DeciderCfg = DeciderCfg()
    timeouts: TimeoutsConfig = TimeoutsConfig()
    retries: RetriesConfig = RetriesConfig()
    breaker: BreakerConfig = BreakerConfig()
    health: HealthConfig = HealthConfig()
    limits: LimitsConfig = LimitsConfig()
    guards: GuardsConfig = GuardsConfig()
    fallback: FallbackConfig = FallbackConfig()
    request_id_headers: tuple[str, ...] = ("x-request-id", "x-correlation-id")
    # a request's session key (the session_affinity policy), the first of these headers sent,
    # else the body's `session_id`, else its `user`
    session_headers: tuple[str, ...] = ("x-session-id",)
    forward_authorization: bool = False  # pass the client's Authorization header to workers
    # a request with an `x-pdgw-explain` header is answered with an `x-pdgw-decision` header:
    # why its worker was chosen (policies/explain.py); off: routing stays private
    explain_header: bool = False
    admin: AdminConfig = AdminConfig()
    kubernetes: KubernetesConfig | None = None  # pod discovery; None: only the configured workers
    tokenizer: TokenizerConfig | None = None  # text prompts' ids for the KV-event index; None: off
    shutdown_grace_s: float = 10.0  # SIGTERM: how long in-flight requests may finish before they are cut
    log_level: LogLevel = "info"
    log_json: bool = True

    def __post_init__(self) -> None:
        _non_negative("gateway", shutdown_grace_s=self.shutdown_grace_s)
        ids: set[str] = set()
        urls: set[str] = set()
        for w in self.workers:
            if w.worker_id in ids:
                raise ValueError(f"duplicate worker id {w.worker_id!r}")
            url = w.endpoint
            if url in urls:
                raise ValueError(f"duplicate worker url {w.url!r} (as {url})")
            ids.add(w.worker_id)
            urls.add(url)
        for h in self.request_id_headers:
            if not _HEADER_TOKEN.match(h):
                raise ValueError(f"request_id_headers: {h!r} must be a lowercase header name")
        for h in self.session_headers:
            if not _HEADER_TOKEN.match(h):
                raise ValueError(f"session_headers: {h!r} must be a lowercase header name")

    @property
    def effective_prefill_policy(self) -> PolicyCfg:
        return self.prefill_policy if self.prefill_policy is not None else self.policy

    @property
    def effective_decode_policy(self) -> PolicyCfg:
        return self.decode_policy if self.decode_policy is not None else self.policy


# ---- decoding --------------------------------------------------------------------------------

_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<key>[^`]*)`(?: - at `(?P<path>[^`]*)`)?$")


# settings that were removed, with what to use instead (named in the "unknown field" error)
_REMOVED = {
    ("$.timeouts", "probe_s"): "removed: a probe request is bounded by health.timeout_s",
}


def _message(e: msgspec.ValidationError) -> str:
    text = str(e)
    m = _UNKNOWN.match(text)
    if m:
        path = m["path"] or "$"
        hint = _REMOVED.get((path, m["key"]))
        return f"unknown field `{m['key']}` at `{path}`" + (f" ({hint})" if hint else "")
    return text


def normalize_raw(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Expand shorthands that plain TOML allows: `policy = "least_load"` becomes a table."""
    out = dict(raw)
    for key in POLICY_FIELDS:
        if isinstance(out.get(key), str):
            out[key] = policy_shorthand(out[key])
    return out


def config_from_raw(raw: Mapping[str, Any], source: str = "config") -> GatewayConfig:
    """Decode a parsed document (dict) strictly; raises ConfigError naming `source` and the key."""
    try:
        return msgspec.convert(normalize_raw(raw), GatewayConfig)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{source}: {_message(e)}") from None


def read_toml(path: str | Path) -> dict[str, Any]:
    """The raw TOML document; ConfigError when unreadable or not TOML."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None


def load_config(path: str | Path) -> GatewayConfig:
    """Read and strictly decode a TOML config file. Raises ConfigError."""
    return config_from_raw(read_toml(path), str(path))


# ---- encoding (for `--print-config` and round trips) ----------------------------------------

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(k: str) -> str:
    return k if _BARE_KEY.match(k) else json.dumps(k)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        items = ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items() if x is not None)
        return "{ " + items + " }" if items else "{}"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def to_toml(cfg: GatewayConfig) -> str:
    """The config as TOML that `load_config` reads back to an equal config (None values omitted)."""
    doc: dict[str, Any] = msgspec.to_builtins(cfg)
    head: list[str] = []
    tables: list[str] = []
    for key, value in doc.items():
        if value is None:
            continue
        if isinstance(value, dict):
            tables.append(f"\n[{_key(key)}]")
            tables += [f"{_key(k)} = {_value(v)}" for k, v in value.items() if v is not None]
        elif isinstance(value, list | tuple) and value and all(isinstance(x, dict) for x in value):
            for item in value:
                tables.append(f"\n[[{_key(key)}]]")
                tables += [f"{_key(k)} = {_value(v)}" for k, v in item.items() if v is not None]
        else:
            head.append(f"{_key(key)} = {_value(value)}")
    return "\n".join(head + tables).lstrip("\n") + "\n"


__all__ = [
    "PHASE_TIMEOUTS",
    "POLICY_FIELDS",
    "SGLANG_DEFAULT_BOOTSTRAP_PORT",
    "AdminConfig",
    "BreakerConfig",
    "ConfigError",
    "FallbackConfig",
    "FallbackRung",
    "GatewayConfig",
    "GuardsConfig",
    "HealthConfig",
    "KiB",
    "KubernetesConfig",
    "KvEventsConfig",
    "LimitsConfig",
    "ListenConfig",
    "LogLevel",
    "MiB",
    "RetriesConfig",
    "TimeoutsConfig",
    "WorkerConfig",
    "config_from_raw",
    "load_config",
    "normalize_raw",
    "read_toml",
    "to_toml",
]
