"""One upstream worker as the gateway knows it (`Worker`): its address, adapter, connection pool,
breaker, load counters and last probe, and the frozen `WorkerState` policies read of it. The
set of them is gateway/registry.py's `Registry`."""

from __future__ import annotations

import ssl
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from adapters import ADAPTERS, EngineAdapter, ProbeInfo
from common.workers import Engine, Role, WorkerLoad, WorkerState
from gateway.breaker import CircuitBreaker
from gateway.config import BreakerConfig, KvEventsConfig, TimeoutsConfig
from gateway.endpoints import canonical_url
from gateway.http.client import UpstreamPool

_TIMEOUTS = TimeoutsConfig()


def new_breaker(cfg: BreakerConfig, guard: Callable[[], bool] | None = None) -> CircuitBreaker:
    """A breaker with `cfg`'s thresholds and ejection rules; `guard` says whether it may open
    now (the registry's share of the pool that may be ejected at once)."""
    b = CircuitBreaker(
        cfg.failure_threshold,
        cfg.success_threshold,
        cfg.open_s,
        max_open_s=cfg.max_open_s,
        eject_failure_share=cfg.eject_failure_share,
    )
    if guard is not None:
        b.guard = guard
    return b


class Worker:
    """Mutable runtime state of one worker. Only the registry's owner mutates it."""

    __slots__ = (
        "adapter",
        "authorization",
        "bootstrap_port",
        "breaker",
        "configured_model",
        "draining",
        "engine",
        "failed_partners",
        "foreign_inflight",
        "foreign_tokens",
        "healthy",
        "host",
        "id",
        "inflight",
        "inflight_tokens",
        "info",
        "kv_events",
        "labels",
        "load",
        "load_path",
        "near_ties",
        "pool",
        "port",
        "probe_failures",
        "probe_successes",
        "reports_details",
        "role",
        "shared",
        "url",
        "vocab_size",
        "weight",
    )

    def __init__(
        self,
        id: str,
        url: str,
        role: Role,
        engine: Engine,
        *,
        model: str | None = None,
        bootstrap_port: int | None = None,
        weight: float = 1.0,
        labels: tuple[tuple[str, str], ...] = (),
        breaker: CircuitBreaker | None = None,
        connect_timeout_s: float = _TIMEOUTS.connect_s,
        authorization: bytes | None = None,
        vocab_size: int | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"worker {id}: only http:// and https:// URLs are supported, got {url!r}")
        if parts.scheme == "https" and tls is None:
            tls = ssl.create_default_context()
        elif parts.scheme == "http":
            tls = None
        port = parts.port or (443 if tls is not None else 80)
        self.id = id
        self.host = parts.hostname or "127.0.0.1"
        self.url = canonical_url(parts.scheme, self.host, port)
        self.port = port
        self.role = role
        self.engine = engine
        self.adapter: EngineAdapter = ADAPTERS[engine]
        self.configured_model = model
        self.bootstrap_port = bootstrap_port
        self.weight = weight
        self.labels = labels
        self.vocab_size = vocab_size
        self.breaker = breaker or CircuitBreaker()
        self.pool = UpstreamPool(self.host, self.port, connect_timeout_s=connect_timeout_s, tls=tls)
        self.authorization = authorization
        self.healthy = False  # until the first probe says otherwise
        self.draining = False
        self.inflight = 0  # this process's requests on it (what acquire/release count)
        self.inflight_tokens = 0
        # the other processes' (`serve --workers N`; gateway/multiprocess/): added in snapshots
        self.foreign_inflight = 0
        self.foreign_tokens = 0
        self.shared: Any = None  # its cells in the shared table (gateway/multiprocess/registry.py)
        self.load = WorkerLoad()
        self.load_path: str | None = None  # which of the adapter's load_paths answered last
        self.info = ProbeInfo()
        self.probe_failures = 0
        self.probe_successes = 0
        # may a greedy request's prefill be asked for its best first tokens' logprobs (the
        # near-tie check)? False once the worker refused them (a vLLM with a low --max-logprobs),
        # True again at the next full info read (gateway/health.py)
        self.near_ties = True
        # it fills OpenAI's `usage.prompt_tokens_details` (SGLang --enable-cache-report, vLLM
        # --enable-prompt-tokens-details): learnt from its first answer that has them; from then
        # on an answer without them reports 0 cached tokens (both engines leave out a 0)
        self.reports_details = False
        # where its engine publishes KV-cache events (its [workers.kv_events]; None: it does not)
        self.kv_events: KvEventsConfig | None = None
        # partner id -> the request whose handoff between this worker and that partner failed
        # last, since this worker's last good handoff, where no one worker was blamed
        # (Registry.record_pair)
        self.failed_partners: dict[str, object] = {}

    @property
    def model(self) -> str | None:
        return self.configured_model or self.info.model

    def state(self) -> WorkerState:
        return WorkerState(
            id=self.id,
            url=self.url,
            role=self.role,
            engine=self.engine,
            model=self.model,
            healthy=self.healthy and self.breaker.admits,
            draining=self.draining,
            context_length=self.info.context_length,
            max_input_len=self.info.max_input_len,
            bootstrap_port=self.bootstrap_port
            if self.bootstrap_port is not None
            else self.info.bootstrap_port,
            weight=self.weight,
            block_size=self.info.block_size,
            kv_capacity_tokens=self.info.kv_capacity_tokens,
            labels=self.labels,
            vocab_size=self.vocab_size,
            decode_alone=self.adapter.decode_alone,
            decodes_beside_prefill=self.adapter.decodes_beside_prefill,
            inflight=self.inflight + self.foreign_inflight,
            inflight_tokens=self.inflight_tokens + self.foreign_tokens,
            load=self.load,
        )
