"""One emulated server: HTTP app (aiohttp), engine, KV server, bootstrap server, KV events.

The engine-specific HTTP surfaces (:class:`emulator.sglang.api.SglangApi`,
:class:`emulator.vllm.api.VllmApi`) register their routes on :attr:`EmulatorServer.app`
(:func:`emulator.api.build_server`); this module owns what they share: startup/shutdown, fault
handling, ``/emulator/stats`` and ``/emulator/faults``. It imports neither surface.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import ssl
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec
from aiohttp import web

from emulator import timing
from emulator.auth import api_key_middleware
from emulator.bootstrap import BootstrapServer, register_rank, url_host
from emulator.faults import Fault, FaultSet, FaultSpecError
from emulator.kvevents import KvEventPublisher
from emulator.kvtransfer import KvServer
from emulator.profiles import get_profile
from emulator.scheduler import Engine, StepPolicy
from emulator.wire import hang_forever, json_response

if TYPE_CHECKING:
    from emulator.spec import EmulatorSpec

log = logging.getLogger("emulator")


class EmulatorServer:
    def __init__(self, spec: EmulatorSpec) -> None:
        self.spec = spec
        self.profile = get_profile(spec.profile)
        self.engine_name = spec.engine
        self.role = spec.role
        self.model_name = spec.model
        self.block_size = spec.block_size or 16
        self.max_model_len = spec.max_model_len
        capacity = spec.max_total_tokens or self.profile.kv_capacity_tokens
        self.max_total_tokens = capacity
        self.engine = Engine(
            self.profile,
            role=spec.role,
            time_scale=spec.time_scale,
            seed=spec.seed,
            num_blocks=max(4, capacity // self.block_size),
            block_size=self.block_size,
            policy=StepPolicy.of(spec.engine, self.profile),
        )
        self.faults = FaultSet(list(spec.faults), seed=spec.seed)
        self.engine_id = str(
            uuid.UUID(int=(hash((spec.seed, os.getpid(), time.time_ns())) & ((1 << 128) - 1)))
        )
        self.fingerprint = f"vllm-0.32.0-{uuid.uuid4().hex[:8]}"
        self.unauthorized = 0  # requests --api-key turned away
        middlewares = [api_key_middleware(spec.engine, spec.api_key, self._refused)] if spec.api_key else []
        self.app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=middlewares)
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.bootstrap_port: int | None = None
        self.kv_port: int | None = None
        self.kv_server: KvServer | None = None
        self.bootstrap: BootstrapServer | None = None
        self.publisher: KvEventPublisher | None = None
        self.session: aiohttp.ClientSession | None = None
        self.rank_cache: dict[tuple[str, int], tuple[str, int]] = {}
        self.started_at = time.time()
        self.http_requests = 0
        self.on_death: Callable[[], Awaitable[None]] | None = None
        self.dead = False
        self._death_task: asyncio.Task[None] | None = None
        self._notices: set[asyncio.Task[None]] = set()  # best-effort notifications to peers
        self.app.router.add_get("/emulator/stats", self.handle_stats)
        self.app.router.add_post("/emulator/faults", self.handle_faults)
        self.app.router.add_get("/emulator/faults", self.handle_get_faults)

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        scheme = "https" if self.spec.ssl_certfile else "http"
        return f"{scheme}://{url_host(self.spec.host)}:{self.port}"

    @property
    def advertised_host(self) -> str:
        """The address peers reach this server's KV at: the listening host, or this machine's
        own address when it listens on every interface (as SGLang and vLLM advertise theirs:
        a container's peers cannot reach its 0.0.0.0)."""
        if self.spec.host not in ("0.0.0.0", "::", ""):
            return self.spec.host
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"

    @property
    def kv_scale(self) -> int:
        return max(1, self.spec.kv_scale)

    def kv_pad_bytes(self, num_tokens: int) -> int:
        return num_tokens * self.profile.model.kv_bytes_per_token // self.kv_scale

    def link_delay(self, num_tokens: int) -> float:
        return timing.transfer_time(self.profile, num_tokens) * self.spec.time_scale

    async def start(self) -> None:
        spec = self.spec
        self.engine.start()
        self.session = aiohttp.ClientSession()
        if spec.kv_events:
            self.publisher = KvEventPublisher(spec.kv_events, spec.engine, self.block_size)
            self.engine.pool.on_stored = self.publisher.stored
            self.engine.pool.on_removed = self.publisher.removed
            self.engine.pool.on_cleared = self.publisher.cleared
        if spec.role in ("prefill", "both"):
            self.kv_server = KvServer(
                engine_id=self.engine_id,
                read_blocks=self._read_blocks,
                pad_for=self.kv_pad_bytes,
                link_delay=self.link_delay,
                release=self.engine.free_blocks,
                on_transfer=self._on_send,
                concurrency_fault=self.concurrency_fault,
            )
            self.kv_port = await self.kv_server.start(spec.host, spec.kv_port or 0)
        self.runner = web.AppRunner(
            self.app, access_log=None, handler_cancellation=True, shutdown_timeout=0.5
        )
        await self.runner.setup()
        tls = None
        if spec.ssl_certfile:
            tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            tls.load_cert_chain(spec.ssl_certfile, spec.ssl_keyfile)
        site = web.TCPSite(
            self.runner, spec.host, spec.port, backlog=2048, reuse_address=True, ssl_context=tls
        )
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        self.port = int(sockets[0].getsockname()[1]) if sockets else spec.port
        if spec.engine == "sglang" and spec.role == "prefill":
            await self._start_bootstrap()

    async def _start_bootstrap(self) -> None:
        """An SGLang prefill's bootstrap server, with this rank registered on it."""
        spec = self.spec
        assert self.session is not None
        self.bootstrap = BootstrapServer()
        port = spec.bootstrap_port if spec.bootstrap_port is not None else 8998  # 0: pick a free one
        self.bootstrap_port = await self.bootstrap.start(spec.host, port)
        await register_rank(
            self.session,
            f"{url_host(spec.host)}:{self.bootstrap_port}",
            {
                "role": "Prefill",
                "attn_tp_size": 1,
                "attn_tp_rank": 0,
                "attn_cp_size": 1,
                "attn_cp_rank": 0,
                "attn_dp_size": 1,
                "attn_dp_rank": 0,
                "pp_size": 1,
                "pp_rank": 0,
                "system_dp_size": 1,
                "system_dp_rank": 0,
                "rank_ip": self.advertised_host,
                "rank_port": self.kv_port,
                "page_size": self.block_size,
                "kv_cache_dtype": "auto",
                "prefill_http_port": self.port,
                "decode_allocation_policy": "early",
            },
        )

    def notify_in_background(self, aw: Coroutine[Any, Any, None]) -> None:
        """Run a best-effort notification to a peer to its end even if the request that sent
        it is cancelled (its failure is ignored; `stop` cancels what is left)."""

        async def run() -> None:
            with contextlib.suppress(Exception):
                await aw

        task = asyncio.ensure_future(run())
        self._notices.add(task)
        task.add_done_callback(self._notices.discard)

    async def stop(self) -> None:
        for task in list(self._notices):
            task.cancel()
        await self.engine.stop()
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
        if self.bootstrap is not None:
            await self.bootstrap.close()
            self.bootstrap = None
        if self.kv_server is not None:
            await self.kv_server.close()
            self.kv_server = None
        if self.publisher is not None:
            await self.publisher.close()
            self.publisher = None
        if self.session is not None:
            await self.session.close()
            self.session = None

    def fatal(self) -> None:
        """The engine core died: fail in-flight work, then stop listening (like the process exiting)."""
        if self.dead:
            return
        self.dead = True
        self.engine.die()
        loop = asyncio.get_running_loop()

        async def die_later() -> None:
            await asyncio.sleep(0.05)
            if self.on_death is not None:
                await self.on_death()
            else:
                os.kill(os.getpid(), signal.SIGTERM)

        self._death_task = loop.create_task(die_later())

    # ------------------------------------------------------------------ KV server hooks
    def _read_blocks(self, block_ids: list[int]) -> list[bytes] | None:
        pool = self.engine.pool
        if not all(pool.in_range(b) for b in block_ids):
            return None
        return [pool.content(b) for b in block_ids]

    def _on_send(self, ok: bool, nbytes: int, seconds: float) -> None:
        c = self.engine.counters
        if ok:
            c.kv_transfers_ok += 1
            c.kv_bytes_transferred += nbytes
            c.kv_transfer_seconds += seconds
        else:
            c.kv_transfers_failed += 1

    def concurrency_fault(self, active: int) -> bool:
        for f in self.faults.faults:
            if f.kind == "transfer_fail_concurrent" and active > f.get_int("over", 8):
                return True
        return False

    # ------------------------------------------------------------------ faults
    async def apply_entry_faults(
        self, hit: dict[str, Fault], error: Callable[[int, str], web.StreamResponse]
    ) -> web.StreamResponse | None:
        """Faults that act before any work: http_error, hangs."""
        f = hit.get("http_error")
        if f is not None:
            status = f.get_int("status", 500)
            return error(status, f.get_str("message", "Internal server error (injected)"))
        if "hang_before_first_byte" in hit or "health_ok_but_hung" in hit:
            await hang_forever()
        return None

    @contextlib.contextmanager
    def tracked(self) -> Iterator[None]:
        """Count a request from its arrival to its answer (`received`, `in_flight`)."""
        c = self.engine.counters
        c.received += 1
        c.in_flight += 1
        try:
            yield
        finally:
            c.in_flight -= 1

    def _refused(self) -> None:
        self.unauthorized += 1

    # ------------------------------------------------------------------ admin
    def stats(self) -> dict[str, Any]:
        c = self.engine.counters
        pool = self.engine.pool
        return {
            "engine": self.engine_name,
            "role": self.role,
            "received": c.received,
            "in_flight": c.in_flight,
            "completed": c.completed,
            "aborted": c.aborted,
            "errors": c.errors,
            "unauthorized": self.unauthorized,
            "running": len(self.engine.seqs),
            "waiting": self.engine.waiting,
            "kv_transfers_ok": c.kv_transfers_ok,
            "kv_transfers_failed": c.kv_transfers_failed,
            "kv_bytes_transferred": c.kv_bytes_transferred,
            "cached_tokens_total": c.cached_tokens_total,
            "prompt_tokens_total": c.prompt_tokens_total,
            "generation_tokens_total": c.generation_tokens_total,
            "external_kv_tokens": c.external_kv_tokens,
            "local_compute_tokens": c.local_compute_tokens,
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_used": pool.used_blocks,
            "kv_blocks_cached": pool.cached_blocks,
            "held_transfers": len(self.kv_server.held) if self.kv_server else 0,
            "pending_rooms": len(self.kv_server.rooms) if self.kv_server else 0,
            "faults": self.faults.specs,
            "dead": self.dead,
        }

    async def handle_stats(self, request: web.Request) -> web.Response:
        return json_response(self.stats())

    async def handle_get_faults(self, request: web.Request) -> web.Response:
        return json_response(self.faults.specs)

    async def handle_faults(self, request: web.Request) -> web.Response:
        try:
            specs = msgspec.json.decode(await request.read(), type=list[str])
            self.faults.replace(specs)
        except (msgspec.DecodeError, msgspec.ValidationError, FaultSpecError, ValueError) as e:
            return json_response({"error": str(e)}, status=400)
        return json_response({"faults": self.faults.specs})
