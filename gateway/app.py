"""Wiring: a `Gateway` built from a `GatewayConfig` — registry, policy, orchestrator, server and the
background tasks (health probes, metric scrapes). Nothing here is global; tests build as many
gateways as they like in one process."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import socket
from collections.abc import Mapping

from gateway.admin import Admin
from gateway.admission import Admission
from gateway.config import ConfigError, GatewayConfig, WorkerConfig
from gateway.endpoints import first_duplicate, url_host
from gateway.handlers import Handlers
from gateway.health import HealthChecker
from gateway.http.limits import ServerLimits
from gateway.http.server import HttpServer, start_server
from gateway.logging import get_logger
from gateway.metrics import GatewayMetrics
from gateway.orchestration import Orchestrator
from gateway.registry import Registry, Worker
from policies.build import build_policy

log = get_logger("pd_gateway")


class ListenError(Exception):
    """The gateway cannot listen on `listen.host`:`listen.port` (the port is taken, the host does
    not resolve or is not this machine's). `Gateway.start` finds out before probing any worker."""


class Gateway:
    def __init__(
        self,
        cfg: GatewayConfig,
        metrics: GatewayMetrics | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        """`environ` (default `os.environ`) is where `api_key_env` / `admin.token_env` are read.
        Raises ConfigError when a named variable is unset."""
        self.cfg = cfg
        self.environ = os.environ if environ is None else environ
        self.registry = Registry(cfg.breaker, inflight_cap=cfg.limits.max_inflight_per_worker)
        for wc in cfg.workers:
            self.registry.add(self.make_worker(wc))
        self.policy = build_policy(
            cfg.policy, prefill=cfg.prefill_policy, decode=cfg.decode_policy, decider=cfg.decider
        )
        self.metrics = metrics or GatewayMetrics()
        self.metrics.watch_cluster(self.registry.snapshot, self.registry.pair_states)
        self.orchestrator = Orchestrator(self.registry, self.policy, self.metrics, cfg)
        self.health = HealthChecker(self.registry, cfg.health)
        lim = cfg.limits
        self.admission = Admission(
            lim.max_concurrent,
            lim.max_queue,
            lim.queue_timeout_s,
            per_client_max_concurrent=lim.per_client_max_concurrent,
            max_inflight_tokens=lim.max_inflight_tokens,
            retry_after_s=lim.retry_after_s,
        )
        self.metrics.watch_admission(self.admission.stats)
        self.admin = self._admin()
        self.handlers = Handlers(
            self.registry,
            self.orchestrator,
            self.metrics,
            request_id_headers=cfg.request_id_headers,
            max_n=lim.max_n,
            max_tokens_cap=lim.max_tokens_cap,
            client_key_header=lim.client_key_header,
            admission=self.admission,
            admin=self.admin,
        )
        if self.admin is not None:
            self.admin.unstarted = self.handlers.unstarted
            self.admin.own_address = self._own_address
        self.server: HttpServer | None = None
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
        )

    def make_worker(self, wc: WorkerConfig) -> Worker:
        """A `Worker` for one [[workers]] entry (from the file or the admin API)."""
        key = wc.api_key(self.environ)
        return Worker(
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

    def _own_address(self) -> tuple[str, int] | None:
        return None if self.server is None else (self.cfg.listen.host, self.server.port)

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
        socks = await _bind(host, port)
        try:
            twins = await first_duplicate(self.registry.workers())
            if twins is not None:
                a, b, (addr, aport) = twins
                raise ConfigError(
                    f"workers {a.id!r} and {b.id!r} are one server (both reach {addr} port {aport}); "
                    "list each server once"
                )
            await self.health.probe_all()
            lim = self.cfg.limits
            limits = ServerLimits(
                max_body_bytes=lim.max_body_bytes,
                max_header_bytes=lim.max_header_bytes,
                read_timeout_s=lim.read_timeout_s,
                client_stall_s=self.cfg.timeouts.client_stall_s,
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
                    sock=sock,
                    on_refusal=self.handlers.refused,
                    on_stall=self.handlers.stalled,
                )
            except OSError as e:  # listen() itself (the port was taken since the bind), or a bind
                raise _listen_error(host, port, e) from None
        except BaseException:
            for sock in socks:
                sock.close()
            raise
        self._tasks = [
            asyncio.create_task(self.health.run_probes(), name="health-probes"),
            asyncio.create_task(self.health.run_scrapes(), name="metric-scrapes"),
        ]
        snap = self.registry.snapshot()
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
        if self.admin is not None:
            await self.admin.close()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
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


def _listen_error(host: str, port: int, e: OSError) -> ListenError:
    return ListenError(f"cannot listen on {host}:{port}: {e.strerror or e}")


async def _bind(host: str, port: int) -> list[socket.socket]:
    """Sockets bound (not yet listening: connections are refused until the server starts) to
    every address `host` resolves to, with the options asyncio's create_server sets."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(
            host or None, port, family=socket.AF_UNSPEC, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError as e:  # socket.gaierror
        raise _listen_error(host, port, e) from None
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.setblocking(False)
            try:
                sock.bind(addr)
            except OSError as e:
                raise _listen_error(host, port, e) from None
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    if not socks:
        raise ListenError(f"cannot listen on {host}:{port}: no address")
    return socks


async def run_forever(gw: Gateway, grace_s: float = 10.0) -> None:
    """Serve until SIGINT/SIGTERM, then shut down gracefully; a second signal cuts the grace
    period short. A signal while the gateway starts (probing its workers, before it listens)
    ends the start: `gateway.interrupted` is logged and this returns, as after a shutdown."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    starting = asyncio.ensure_future(gw.start())

    def on_signal() -> None:
        if not starting.done():
            starting.cancel()
        elif stop.is_set():
            log.warning("gateway.hurry", reason="second signal: ending the grace period now")
            gw.hurry()
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, on_signal)
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
