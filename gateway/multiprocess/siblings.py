"""How the gateway's processes talk to each other: one control server per process, on loopback.

Each process of `pd-gateway serve --workers N` listens on a port of its own on 127.0.0.1 (the
port is published in the shared table) and answers there, to requests that carry the group's
secret (random, made by the supervisor before the fork, never written anywhere):

    GET  /local/metrics      this process's metrics, Prometheus text (no other process's)
    GET  /local/admission    this process's admission counters, JSON
    *    /admin/...          an admin request applied in this process only (the admin token is
                             still required)

`Siblings` is the client side: the process that received a client's `/metrics` scrape or admin
request asks every other process and puts the answers together (gateway/admin.py,
gateway/multiprocess/metrics_merge.py). None of this is on the request path.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import msgspec

from gateway.http.client import UpstreamPool
from gateway.http.errors import UpstreamError
from gateway.http.server import HttpRequest, HttpResponder, HttpServer, start_server
from gateway.logging import get_logger
from gateway.multiprocess.table import SharedTable

if TYPE_CHECKING:
    from gateway.admin import Admin
    from gateway.admission import Admission
    from gateway.metrics import GatewayMetrics

log = get_logger("pd_gateway.multiprocess")

SECRET_HEADER = b"x-pdgw-group-secret"
_JSON = (b"content-type", b"application/json")
_TEXT = (b"content-type", b"text/plain; version=0.0.4; charset=utf-8")
_encoder = msgspec.json.Encoder()


class ProcessContext:
    """What a process of the group knows about the group: its index, how many there are, the
    shared table and the group's secret. `started` is called once it listens."""

    def __init__(
        self,
        index: int,
        count: int,
        table: SharedTable,
        secret: bytes,
        started: Callable[[], None] = lambda: None,
    ) -> None:
        self.index = index
        self.count = count
        self.table = table
        self.secret = secret.hex().encode()
        self.started = started

    def share(self, value: int) -> int:
        """This process's part of a gateway-wide limit: ceil(value / count), at least 1."""
        return max(1, -(-value // self.count))


class SiblingAnswer(msgspec.Struct, frozen=True):
    process: int
    status: int  # 0: no answer (the error says why)
    body: bytes = b""
    error: str | None = None


class Siblings:
    """Requests to every other process of the group, at once."""

    def __init__(self, ctx: ProcessContext) -> None:
        self.ctx = ctx
        self._pools: dict[int, UpstreamPool] = {}

    @property
    def others(self) -> list[int]:
        return [i for i in range(self.ctx.count) if i != self.ctx.index]

    def _pool(self, index: int) -> UpstreamPool | None:
        port = self.ctx.table.control_port(index)
        if not port:
            return None  # not listening yet (or gone)
        pool = self._pools.get(index)
        if pool is None or pool.port != port:
            pool = self._pools[index] = UpstreamPool("127.0.0.1", port, connect_timeout_s=1.0)
        return pool

    async def ask(
        self,
        method: str,
        target: str,
        *,
        body: bytes = b"",
        headers: Sequence[tuple[bytes, bytes]] = (),
        timeout_s: float = 5.0,
    ) -> list[SiblingAnswer]:
        """`method target` to every other process, each bounded by `timeout_s`."""
        return list(
            await asyncio.gather(
                *(self._one(i, method, target, body, headers, timeout_s) for i in self.others)
            )
        )

    async def _one(
        self,
        index: int,
        method: str,
        target: str,
        body: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        timeout_s: float,
    ) -> SiblingAnswer:
        pool = self._pool(index)
        if pool is None:
            return SiblingAnswer(index, 0, error="not listening")
        hdrs = [*headers, (SECRET_HEADER, self.ctx.secret)]
        try:
            async with asyncio.timeout(timeout_s):
                resp = await pool.request(method, target, hdrs, body or None)
                try:
                    data = await resp.read()
                finally:
                    resp.release()
        except TimeoutError:
            return SiblingAnswer(index, 0, error=f"no answer within {timeout_s:g}s")
        except (UpstreamError, OSError) as e:
            return SiblingAnswer(index, 0, error=str(e) or type(e).__name__)
        return SiblingAnswer(index, resp.status, data)

    async def close(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        for p in pools:
            await p.close()


class ControlServer:
    """This process's side: the control server (see the module docstring)."""

    def __init__(
        self,
        ctx: ProcessContext,
        metrics: GatewayMetrics,
        admission: Admission,
        admin: Admin | None,
    ) -> None:
        self.ctx = ctx
        self.metrics = metrics
        self.admission = admission
        self.admin = admin
        self.server: HttpServer | None = None

    async def start(self) -> None:
        self.server = await start_server(self.handle, "127.0.0.1", 0)
        self.ctx.table.set_control_port(self.server.port)

    async def close(self) -> None:
        if self.server is not None:
            self.ctx.table.set_control_port(0)
            self.server.stop_accepting()
            await self.server.close()
            self.server = None

    async def handle(self, req: HttpRequest, res: HttpResponder) -> None:
        secret = req.header(SECRET_HEADER)
        if secret is None or not hmac.compare_digest(secret, self.ctx.secret):
            res.send(403, [_JSON], b'{"error":"forbidden"}')
            return
        if req.path == "/local/metrics":
            res.send(200, [_TEXT], self.metrics.render())
            return
        if req.path == "/local/admission":
            res.send(200, [_JSON], _encoder.encode(self.admission.stats()))
            return
        if req.path.startswith("/admin/") and self.admin is not None:
            from common.errors import GatewayError

            try:
                status, body = await self.admin.answer(req, local=True)
            except GatewayError as e:
                res.send(e.status, [*e.headers()], e.body())
                return
            res.send(status, [_JSON], body)
            return
        res.send(404, [_JSON], b'{"error":"no such control route"}')


def gather_texts(own: bytes, answers: Sequence[SiblingAnswer]) -> tuple[list[bytes], int]:
    """The metric pages to merge (this process's first) and how many processes answered."""
    pages = [own] + [a.body for a in answers if a.status == 200]
    return pages, len(pages)


MetricsSource = Callable[[], Awaitable[bytes]]
