"""Wiring: a `Gateway` built from a `GatewayConfig` — registry, policy, orchestrator, server and the
background tasks (health probes, metric scrapes). Nothing here is global; tests build as many
gateways as they like in one process."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import os
import signal
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING

from common.request import WorkLimits
from gateway.admin import Admin
from gateway.admission import Admission
from gateway.cache_metrics import CacheCollector, cache_states
from gateway.config import ConfigError, GatewayConfig, WorkerConfig
from gateway.discovery.sync import WorkerSync
from gateway.endpoints import first_duplicate, url_host
from gateway.handlers import Handlers
from gateway.health import HealthChecker
from gateway.http.limits import ServerLimits
from gateway.http.server import HttpServer, start_server
from gateway.kvevents.hub import KvEventCollector, KvEventHub
from gateway.listen import bind_host, listen_error
from gateway.logging import get_logger
from gateway.membership import Membership
from gateway.metrics import GatewayMetrics
from gateway.multiprocess.siblings import ControlServer, ProcessContext, Siblings
from gateway.orchestration import Orchestrator
from gateway.registry import Registry, Worker
from gateway.routing_tokenizer import Tokenizing, make_tokenizer
from policies.base import MetricSource
from policies.build import build_policy

if TYPE_CHECKING:
    from gateway.discovery.kubernetes import KubernetesDiscovery

log = get_logger("pd_gateway")


class Gateway:
    def __init__(
        self,
        cfg: GatewayConfig,
        metrics: GatewayMetrics | None = None,
        environ: Mapping[str, str] | None = None,
        process: ProcessContext | None = None,
    ) -> None:
        """`environ` (default `os.environ`) is where `api_key_env` / `admin.token_env` are read.
        Raises ConfigError when a named variable is unset. `process`: this gateway is one of
        several processes on one port (`serve --workers N`, gateway/multiprocess/): in-flight
        counts and breakers are shared with the others, admission limits split between them,
        and admin changes and metrics span them all."""
        self.cfg = cfg
        self.environ = os.environ if environ is None else environ
        self.process = process
        if process is not None:
            from gateway.multiprocess.registry import SharedRegistry

            self.registry: Registry = SharedRegistry(
                process.table, cfg.breaker, inflight_cap=cfg.limits.max_inflight_per_worker
            )
        else:
            self.registry = Registry(cfg.breaker, inflight_cap=cfg.limits.max_inflight_per_worker)
        # the workers' KV-event streams (those with [workers.kv_events], from the configuration,
        # the admin API or discovery): the cache-aware policy's precise index
        self.kv_events = KvEventHub(self._model_of)
        self.policy = build_policy(
            cfg.policy,
            prefill=cfg.prefill_policy,
            decode=cfg.decode_policy,
            decider=cfg.decider,
            precise=self.kv_events.index,
        )
        # workers joining and leaving: KV-event subscriptions, the policy's per-worker state
        self.registry.watch(Membership(self.policy, self.kv_events))
        for wc in cfg.workers:
            try:
                w = self.make_worker(wc)
            except ValueError as e:
                raise ConfigError(f"worker {wc.worker_id}: {e}") from None
            self.registry.add(w)
        self.metrics = metrics or GatewayMetrics()
        self.metrics.registry.register(KvEventCollector(self.kv_events))
        states = cache_states(self.policy)
        if states:
            self.metrics.registry.register(CacheCollector(states))
        self.metrics.watch_cluster(self.registry.snapshot, self.registry.pair_states)
        if isinstance(self.policy, MetricSource):
            self.metrics.watch_policy(self.policy.metrics)
        self.orchestrator = Orchestrator(self.registry, self.policy, self.metrics, cfg)
        if cfg.tokenizer is not None and any(st.precise is not None for st in states):
            try:  # text prompts' ids for the precise index, while a worker publishes KV events
                tok = make_tokenizer(cfg.tokenizer)
            except ValueError as e:
                raise ConfigError(str(e)) from None
            self.orchestrator.s.tokenizing = Tokenizing(
                tok, self.kv_events.__len__, cfg.tokenizer.offload_bytes
            )
        self.health = HealthChecker(self.registry, cfg.health)
        lim = cfg.limits
        # with several processes each takes its share of the gateway-wide limits
        share = self._share
        self.admission = Admission(
            share(lim.max_concurrent),
            share(lim.max_queue) if lim.max_queue else 0,
            lim.queue_timeout_s,
            per_client_max_concurrent=share(lim.per_client_max_concurrent)
            if lim.per_client_max_concurrent
            else 0,
            max_inflight_tokens=share(lim.max_inflight_tokens) if lim.max_inflight_tokens else None,
            retry_after_s=lim.retry_after_s,
        )
        self.metrics.watch_admission(self.admission.stats)
        self.siblings = Siblings(process) if process is not None else None
        self.admin = self._admin()
        self.handlers = Handlers(
            self.registry,
            self.orchestrator,
            self.metrics,
            request_id_headers=cfg.request_id_headers,
            max_n=lim.max_n,
            max_tokens_cap=lim.max_tokens_cap,
            work=WorkLimits(
                max_batch=lim.max_batch,
                max_request_tokens=lim.max_request_tokens,
                max_json_values=lim.max_json_values,
                chars_per_token=cfg.guards.chars_per_token_estimate,
            ),
            client_key_header=lim.client_key_header,
            admission=self.admission,
            # on its own listener (admin.listen_port), /admin/ is not served on the gateway's
            admin=self.admin if cfg.admin.listen_port is None else None,
            metrics_source=self._all_metrics if process is not None else None,
        )
        self.control: ControlServer | None = None
        if process is not None:
            self.control = ControlServer(process, self.metrics, self.admission, self.admin)
        if self.admin is not None:
            self.admin.unstarted = self.handlers.unstarted
            self.admin.own_addresses = self._own_addresses
        self.discovery: KubernetesDiscovery | None = None
        if cfg.kubernetes is not None:
            from gateway.discovery.kubernetes import KubernetesDiscovery

            sync = WorkerSync(
                self.registry,
                self.health,
                self.make_worker,
                self.handlers.unstarted,
                drain_timeout_s=cfg.kubernetes.drain_timeout_s,
                source="kubernetes",
            )
            self.discovery = KubernetesDiscovery(cfg.kubernetes, sync)
        self.server: HttpServer | None = None
        self.admin_server: HttpServer | None = None  # the admin API's own listener, when configured
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = False
        self._hurry = asyncio.Event()

    def _admin(self) -> Admin | None:
        """The admin API, when a token is configured (read from its environment variable)."""
        cfg = self.cfg
        token = cfg.admin.resolve_token(self.environ)
        if token is None:
            return None
        return Admin(
            token,
            self.registry,
            self.health,
            self.make_worker,
            drain_timeout_s=cfg.admin.drain_timeout_s,
            allowed_key_envs=frozenset(w.api_key_env for w in cfg.workers if w.api_key_env),
            admission=self.admission,
            siblings=self.siblings,
            token_bounds=self.orchestrator.bounds,
        )

    def make_worker(self, wc: WorkerConfig) -> Worker:
        """A `Worker` for one [[workers]] entry (from the file or the admin API)."""
        key = wc.api_key(self.environ)
        if wc.kv_events is not None:
            KvEventHub.check(wc.engine, wc.kv_events)  # ValueError: a scheme not computable here
        w = Worker(
            wc.worker_id,
            wc.url,
            wc.role,
            wc.engine,
            model=wc.model,
            bootstrap_port=wc.bootstrap_port,
            weight=wc.weight,
            labels=tuple(sorted(wc.labels.items())),
            vocab_size=wc.vocab_size,
            tls=wc.tls_context(),
            connect_timeout_s=self.cfg.timeouts.connect_s,
            authorization=f"Bearer {key}".encode() if key else None,
        )
        w.kv_events = wc.kv_events
        return w

    def _share(self, limit: int) -> int:
        """This process's part of a gateway-wide limit: all of it, or with several processes
        ceil(limit / N) (at least 1)."""
        return limit if self.process is None else self.process.share(limit)

    def _model_of(self, worker_id: str) -> str | None:
        w = self.registry.find(worker_id)
        return None if w is None else w.model

    def _own_addresses(self) -> list[tuple[str, int]]:
        """Where the gateway listens: its own listener and the admin API's, when started."""
        out = [] if self.server is None else [(self.cfg.listen.host, self.server.port)]
        if self.admin_server is not None:
            out.append((self.admin_server.host, self.admin_server.port))
        return out

    async def _all_metrics(self) -> bytes:
        """`/metrics` with several processes: every process's, added up."""
        from gateway.multiprocess.metrics_merge import merge_pages

        assert self.siblings is not None and self.process is not None
        own = self.metrics.render()
        answers = await self.siblings.ask("GET", "/local/metrics", timeout_s=2.0)
        pages = [own] + [a.body for a in answers if a.status == 200]
        return merge_pages(pages, self.process.count)

    @property
    def port(self) -> int:
        assert self.server is not None, "the gateway is not started"
        return self.server.port

    @property
    def url(self) -> str:
        return f"http://{url_host(self.cfg.listen.host)}:{self.port}"

    async def start(self) -> None:
        """Bind the listening address (ListenError if it cannot be had), refuse two workers that
        are one server under two names (ConfigError), probe every worker once (bounded by the
        probe timeout), then listen."""
        host, port = self.cfg.listen.host, self.cfg.listen.port
        # several processes (serve --workers N): each listens on the same ports (SO_REUSEPORT)
        many = self.process is not None
        socks = await bind_host(host, port, reuse_port=many)
        admin_socks: list[socket.socket] = []
        try:
            admin_cfg = self.cfg.admin
            if self.admin is not None and admin_cfg.listen_port is not None:
                admin_socks = await bind_host(admin_cfg.listen_host, admin_cfg.listen_port, reuse_port=many)
            twins = await first_duplicate(self.registry.workers())
            if twins is not None:
                a, b, (addr, aport) = twins
                raise ConfigError(
                    f"workers {a.id!r} and {b.id!r} are one server (both reach {addr} port {aport}); "
                    "list each server once"
                )
            await self.health.probe_all()
            if self.discovery is not None:  # the pods ready now are workers before it listens
                await self.discovery.start()
            lim = self.cfg.limits
            # a configured limit is the gateway's, split between its processes like admission's;
            # the default is per process already (half of each process's open-files limit)
            most = self._share(lim.max_connections) if lim.max_connections else default_max_connections()
            limits = ServerLimits(
                max_body_bytes=lim.max_body_bytes,
                max_header_bytes=lim.max_header_bytes,
                read_timeout_s=lim.read_timeout_s,
                keepalive_timeout_s=lim.keepalive_timeout_s,
                client_stall_s=self.cfg.timeouts.client_stall_s,
                max_connections=most,
                reserved_connections=min(lim.reserved_connections, most // 2),
                reserved_paths=RESERVED_PATHS,
            )
            sock = socks[0] if len(socks) == 1 else None
            if sock is None:  # several addresses (e.g. "localhost"): the server binds them all again
                for s in socks:
                    s.close()
            try:
                self.server = await start_server(
                    self.handlers,
                    host,
                    port,
                    limits=limits,
                    reuse_port=many,
                    sock=sock,
                    on_refusal=self.handlers.refused,
                    on_stall=self.handlers.stalled,
                )
            except OSError as e:  # listen() itself (the port was taken since the bind), or a bind
                raise listen_error(host, port, e) from None
            if admin_socks:
                await self._start_admin(admin_socks)
        except BaseException:
            for sock in [*socks, *admin_socks]:
                sock.close()
            if self.server is not None:
                await self.server.close()
                self.server = None
            raise
        server = self.server
        self.metrics.watch_connections(
            lambda: (server.connections, server.limits.max_connections, server.connections_refused)
        )
        if self.control is not None:
            await self.control.start()
        self._tasks = [
            asyncio.create_task(self.health.run_probes(), name="health-probes"),
            asyncio.create_task(self.health.run_scrapes(), name="metric-scrapes"),
        ]
        unchecked = sorted(
            w.id for w in self.registry.workers() if not w.adapter.checks_token_ids and w.vocab_size is None
        )
        if unchecked:
            # neither SGLang 0.5.23 (/server_info, /model_info) nor vLLM 0.32 says its vocabulary
            # size over HTTP, so it cannot be learnt: only configuration tells it
            log.warning(
                "workers.vocab_size_unknown",
                workers=unchecked,
                detail="SGLang does not check prompt token ids: one id outside its vocabulary kills "
                "the server. Set vocab_size on these workers (--vocab-size) so the gateway refuses "
                "such requests with a 400",
            )
        await self.kv_events.start()
        snap = self.registry.snapshot()
        if self.process is not None:
            self.process.started()
        log.info(
            "gateway.started",
            url=self.url,
            policy=self.policy.name,
            workers=[
                {
                    "id": w.id,
                    "role": w.role.value,
                    "engine": w.engine.value,
                    "model": w.model,
                    "healthy": w.healthy,
                }
                for w in snap.workers
            ],
        )

    async def _start_admin(self, socks: list[socket.socket]) -> None:
        """The admin API on its own listener (`admin.listen_port`), e.g. on a management
        network or loopback only while the gateway's own listener faces clients."""
        assert self.admin is not None
        a = self.cfg.admin
        sock = socks[0] if len(socks) == 1 else None
        if sock is None:
            for s in socks:
                s.close()
        try:
            self.admin_server = await start_server(
                functools.partial(self.handlers.admin_listener, self.admin),
                a.listen_host,
                a.listen_port or 0,
                limits=ServerLimits(max_body_bytes=1 << 20, read_timeout_s=self.cfg.limits.read_timeout_s),
                reuse_port=self.process is not None,
                sock=sock,
                on_refusal=self.handlers.refused,
            )
        except OSError as e:
            raise listen_error(a.listen_host, a.listen_port or 0, e) from None

    @property
    def admin_url(self) -> str | None:
        """The admin API's own listener's URL, when it has one."""
        s = self.admin_server
        return None if s is None else f"http://{url_host(self.cfg.admin.listen_host)}:{s.port}"

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop accepting (queued requests get a 503), let in-flight requests finish for
        `grace_s`, then end the rest with a clear error (an SSE error event mid-stream) and
        cancel them: the orchestrator aborts their engine legs as they unwind. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self.admission.close()
        if self.server is not None:
            self.server.stop_accepting()
            idle = await self._wait_idle_or_hurry(grace_s)
            if not idle:
                n = self.handlers.cut()
                log.warning("gateway.grace_expired", grace_s=grace_s, cut=n)
                # let the cancelled handlers unwind (abort calls are queued as they do)
                await self.server.wait_idle(min(5.0, max(1.0, grace_s)))
            await self.server.close()
        if self.admin_server is not None:
            await self.admin_server.close()
        if self.admin is not None:
            await self.admin.close()
        if self.discovery is not None:
            await self.discovery.stop()
        if self.control is not None:
            await self.control.close()
        if self.siblings is not None:
            await self.siblings.close()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        await self.kv_events.stop()
        await self.orchestrator.drain_background()
        await self.registry.close()

    def hurry(self) -> None:
        """End the grace period of a `stop()` in progress now (a second SIGTERM/SIGINT)."""
        self._hurry.set()

    async def _wait_idle_or_hurry(self, grace_s: float) -> bool:
        assert self.server is not None
        idle = asyncio.ensure_future(self.server.wait_idle(grace_s))
        hurry = asyncio.ensure_future(self._hurry.wait())
        try:
            await asyncio.wait((idle, hurry), return_when=asyncio.FIRST_COMPLETED)
        finally:
            hurry.cancel()
            if not idle.done():
                idle.cancel()
        return idle.done() and not idle.cancelled() and idle.result()


# what a connection accepted into the reserve (limits.reserved_connections) may ask for: the load
# balancer's and the operator's view of the gateway, never generation
RESERVED_PATHS = ("/health", "/readiness", "/metrics", "/admin/")


def default_max_connections() -> int:
    """`limits.max_connections` when not configured: half this process's open-files limit (the
    other half for upstream connections, a P/D request holding two, and files), at most 65536."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on Windows
        return 4096
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 65536
    return max(64, min(65536, soft // 2))


async def run_forever(gw: Gateway, grace_s: float = 10.0, *, hurry_signal: int | None = None) -> None:
    """Serve until SIGINT/SIGTERM, then shut down gracefully; a second signal cuts the grace
    period short. A signal while the gateway starts (probing its workers, before it listens)
    ends the start: `gateway.interrupted` is logged and this returns, as after a shutdown.

    `hurry_signal` (a process of `serve --workers N`): only that signal cuts the grace period
    short; a second SIGINT/SIGTERM does not (a terminal's Ctrl-C reaches every process of the
    group and the supervisor passes it on too: one Ctrl-C must stay one)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    starting = asyncio.ensure_future(gw.start())

    def on_signal() -> None:
        if not starting.done():
            starting.cancel()
        elif stop.is_set() and hurry_signal is None:
            log.warning("gateway.hurry", reason="second signal: ending the grace period now")
            gw.hurry()
        stop.set()

    def on_hurry() -> None:
        if not starting.done():
            starting.cancel()
        elif stop.is_set():
            log.warning("gateway.hurry", reason="the supervisor ends the grace period now")
            gw.hurry()
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, on_signal)
    if hurry_signal is not None:
        loop.add_signal_handler(hurry_signal, on_hurry)
    try:
        await asyncio.wait((starting,))
    finally:
        if not starting.done():  # this task itself was cancelled
            starting.cancel()
    if starting.cancelled() and stop.is_set():
        log.info("gateway.interrupted", reason="signal during start-up, before listening")
        await gw.stop(0.0)
        return
    starting.result()  # ListenError, ConfigError...: the caller tells the user
    # Everything alive now (modules, config, workers, pools) lives as long as the process:
    # keep it out of the cycle collector's scans, which otherwise run every few hundred
    # requests over all of it.
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 50)
    try:
        await stop.wait()
    finally:
        log.info("gateway.stopping", grace_s=grace_s)
        await gw.stop(grace_s)
