"""The configuration of the workers and how they are found: `[[workers]]` (`WorkerConfig`), a
worker's KV-event stream (`KvEventsConfig`) and Kubernetes pod discovery (`KubernetesConfig`).
Re-exported by gateway/config.py."""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from typing import Literal
from urllib.parse import urlsplit

from common.workers import Engine, Role
from gateway.config_base import (
    ConfigError,
    _non_negative,
    _positive,
    _Section,
)
from gateway.endpoints import canonical_url


class KvEventsConfig(_Section, frozen=True):
    """A worker's KV-cache event stream (`[workers.kv_events]`), read by the `cache_aware`
    policy's precise index (docs/policies.md). The engine publishes it with
    `--kv-events-config '{"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint":
    "tcp://*:5558", ...}'` (vLLM: also `"enable_kv_cache_events": true`)."""

    endpoint: str  # the engine's PUB socket as the gateway reaches it: tcp://host:port
    replay_endpoint: str | None = None  # its ROUTER replay socket (gaps and restarts are repaired from it)
    topic: str = ""
    # tokens per KV block (vLLM --block-size, SGLang --page-size); None: taken from the events
    block_size: int | None = None
    # how the engine hashes blocks: None = the worker's engine; "emulator": pd-gateway's emulator
    hash: Literal["vllm", "sglang", "emulator"] | None = None
    hash_algo: Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"] = "sha256"  # vLLM's
    hash_seed: str | None = None  # the vLLM engine's PYTHONHASHSEED, if it sets one
    max_blocks: int = 1 << 20  # blocks indexed for this worker at most (the oldest go first)

    def __post_init__(self) -> None:
        for name, value in (("endpoint", self.endpoint), ("replay_endpoint", self.replay_endpoint)):
            if value is None:
                continue
            head, sep, port = value.rpartition(":")
            if not value.startswith(("tcp://", "ipc://", "inproc://")) or (
                value.startswith("tcp://") and not (sep and port.isdigit() and head != "tcp:/")
            ):
                raise ValueError(f"kv_events.{name} {value!r} must be tcp://host:port (or ipc://, inproc://)")
            if "*" in value:
                raise ValueError(
                    f"kv_events.{name} {value!r}: the gateway connects; give the engine's address"
                )
        if self.block_size is not None and self.block_size < 1:
            raise ValueError("kv_events.block_size must be >= 1")
        if self.max_blocks < 1:
            raise ValueError("kv_events.max_blocks must be >= 1")
        if self.hash_algo.startswith("xxhash") and self.hash_seed is None:
            raise ValueError(
                f"kv_events.hash_algo {self.hash_algo}: vLLM seeds it at random per process unless "
                "the engine sets PYTHONHASHSEED; set that and give it as hash_seed"
            )


class WorkerConfig(_Section, frozen=True):
    """One upstream server. `worker_id` (id, else name, else URL) is its stable key."""

    url: str
    role: Role
    engine: Engine = Engine.SGLANG
    id: str | None = None
    name: str | None = None
    model: str | None = None  # None: learnt by probing
    bootstrap_port: int | None = None  # SGLang prefill only
    weight: float = 1.0
    labels: dict[str, str] = {}
    api_key_env: str | None = None  # env var holding the Bearer key the gateway sends it
    # token ids the model has: prompts given as ids outside [0, vocab_size) are refused with a
    # 400 before they reach it (SGLang 0.5.23 does not check them: its server dies)
    vocab_size: int | None = None
    # https:// workers: the certificate is checked against the system's CAs, or this PEM bundle
    tls_ca_file: str | None = None
    tls_verify: bool = True  # false: no certificate check at all (a test setup, never production)
    kv_events: KvEventsConfig | None = None  # its KV-cache events (cache_aware's precise index)

    def __post_init__(self) -> None:
        try:
            parts = urlsplit(self.url)
        except ValueError as e:  # "Invalid IPv6 URL"
            raise ValueError(f"worker url {self.url!r}: {e}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"worker url {self.url!r} must be http(s)://host[:port]")
        # the gateway adds the API paths itself: anything after host[:port] would be dropped
        extra = [
            what
            for what, present in (
                (f"a path ({parts.path})", parts.path not in ("", "/")),
                ("a query", "?" in self.url),
                ("a fragment", "#" in self.url),
                ("user info", "@" in parts.netloc),
            )
            if present
        ]
        if extra:
            raise ValueError(
                f"worker url {self.url!r} must be http(s)://host[:port], without {' or '.join(extra)}"
            )
        if parts.scheme == "http" and (self.tls_ca_file is not None or not self.tls_verify):
            raise ValueError(f"worker {self.url}: tls_ca_file / tls_verify apply only to https:// workers")
        try:
            parts.port  # noqa: B018 - raises ValueError on a bad port
        except ValueError as e:
            raise ValueError(f"worker url {self.url!r}: {e}") from None
        if self.engine is Engine.OPENAI and self.role is not Role.COLOCATED:
            raise ValueError(f"worker {self.url}: engine openai can only be colocated, not {self.role}")
        if self.kv_events is not None and self.engine is Engine.OPENAI and self.kv_events.hash is None:
            raise ValueError(
                f"worker {self.url}: an openai worker's KV events need kv_events.hash (vllm or sglang)"
            )
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"worker {self.url}: vocab_size must be at least 1")
        if self.bootstrap_port is not None:
            if not (self.engine is Engine.SGLANG and self.role is Role.PREFILL):
                raise ValueError(
                    f"worker {self.url}: bootstrap_port applies only to sglang prefill workers "
                    f"(this one is {self.engine} {self.role})"
                )
            if not 1 <= self.bootstrap_port <= 65535:
                raise ValueError(f"worker {self.url}: bootstrap_port must be in 1..65535")
        _positive("worker", weight=self.weight)
        for key in ("id", "name", "model", "api_key_env", "tls_ca_file"):
            if getattr(self, key) == "":
                raise ValueError(f"worker {self.url}: {key} must not be empty")

    @property
    def worker_id(self) -> str:
        return self.id or self.name or self.url.rstrip("/")

    @property
    def endpoint(self) -> str:
        """The URL as the gateway connects to it: scheme and host in lower case, the port
        explicit (`HTTP://Host` and `http://host:80/` are one worker)."""
        parts = urlsplit(self.url)
        return canonical_url(
            parts.scheme, parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
        )

    def tls_context(self) -> ssl.SSLContext | None:
        """The SSL context for an https:// worker (None for http://); ConfigError if its CA
        bundle cannot be read."""
        if urlsplit(self.url).scheme != "https":
            return None
        try:
            ctx = ssl.create_default_context(cafile=self.tls_ca_file)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"worker {self.worker_id}: tls_ca_file {self.tls_ca_file!r}: {e}") from None
        if not self.tls_verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        return ctx

    def api_key(self, environ: Mapping[str, str]) -> str | None:
        """The key from `environ[api_key_env]`; ConfigError if the variable is named but unset."""
        if self.api_key_env is None:
            return None
        value = environ.get(self.api_key_env)
        if not value:
            raise ConfigError(f"worker {self.worker_id}: environment variable {self.api_key_env} is not set")
        return value


class KubernetesConfig(_Section, frozen=True):
    """Kubernetes pod discovery (`gateway/discovery/`): the workers are the ready pods that each
    role's label selector matches, added and removed as pods become ready, unready or deleted."""

    namespace: str = ""  # "": every namespace (the service account then needs cluster-wide list/watch)
    # label selectors, one per role ("app=sglang,component=prefill"); "" = no pods of that role
    prefill_selector: str = ""
    decode_selector: str = ""
    colocated_selector: str = ""
    port: int = 8000  # the engine's HTTP port in each pod, unless the pod's `port_annotation` says
    port_annotation: str = "pd-gateway/port"
    # an SGLang prefill's bootstrap port (the annotation sglang-router reads; default 8998)
    bootstrap_port_annotation: str = "sglang.ai/bootstrap-port"
    engine_label: str = "pd-gateway/engine"  # sglang | vllm | openai; absent: `engine`
    engine: Engine = Engine.SGLANG
    model_label: str = "pd-gateway/model"  # absent: the model is probed from the engine
    scheme: Literal["http", "https"] = "http"
    # where the API server is: "" = in the cluster (the pod's service account); else a URL, e.g.
    # `kubectl proxy`'s http://127.0.0.1:8001; `kubeconfig` = a kubeconfig file instead
    api_url: str = ""
    kubeconfig: str = ""
    watch_timeout_s: float = 240.0  # each watch asks the server to end it after this; then re-watched
    retry_s: float = 2.0  # after a failed list or watch
    drain_timeout_s: float = 30.0  # an unready or deleted pod's in-flight requests: longest wait

    def __post_init__(self) -> None:
        if not (self.prefill_selector or self.decode_selector or self.colocated_selector):
            raise ValueError(
                "kubernetes: give at least one of prefill_selector, decode_selector, colocated_selector"
            )
        if not 1 <= self.port <= 65535:
            raise ValueError(f"kubernetes.port must be in 1..65535, got {self.port}")
        if self.api_url and self.kubeconfig:
            raise ValueError("kubernetes: set api_url or kubeconfig, not both")
        if self.api_url and urlsplit(self.api_url).scheme not in ("http", "https"):
            raise ValueError(f"kubernetes.api_url {self.api_url!r} must be an http(s):// URL")
        _positive("kubernetes", watch_timeout_s=self.watch_timeout_s, retry_s=self.retry_s)
        _non_negative("kubernetes", drain_timeout_s=self.drain_timeout_s)

    def selectors(self) -> dict[Role, str]:
        """The configured selector of each role that has one."""
        pairs = (
            (Role.PREFILL, self.prefill_selector),
            (Role.DECODE, self.decode_selector),
            (Role.COLOCATED, self.colocated_selector),
        )
        return {role: sel for role, sel in pairs if sel}
