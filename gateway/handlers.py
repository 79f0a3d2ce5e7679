"""The client-facing routes. Parsing and answering only: routing lives in policies, engine I/O in
the orchestrator, wire formats in the adapters."""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable

import msgspec

from gateway.errors import BadRequest, GatewayError, NotFound, error_body
from gateway.http.server import HttpRequest, HttpResponder
from gateway.ids import IdGenerator
from gateway.metrics import GatewayMetrics
from gateway.orchestrator import Orchestrator
from gateway.parse import parse_request
from gateway.registry import Registry
from policies.snapshot import ClusterSnapshot, Role, RouteKind

JSON = (b"content-type", b"application/json")
_VALID_ID = re.compile(rb"^[A-Za-z0-9._:\-]{1,128}$")
_encoder = msgspec.json.Encoder()


class ModelCard(msgspec.Struct):
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "pd-gateway"
    max_model_len: int | None = None
    routes: list[str] = []  # "disaggregated:sglang", "colocated:vllm", ...


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class Handlers:
    def __init__(
        self,
        registry: Registry,
        orchestrator: Orchestrator,
        metrics: GatewayMetrics,
        *,
        request_id_headers: tuple[str, ...] = ("x-request-id",),
        max_n: int = 128,
        max_tokens_cap: int | None = None,
    ) -> None:
        self.registry = registry
        self.orchestrator = orchestrator
        self.metrics = metrics
        self.ids = IdGenerator()
        self.id_headers = tuple(h.lower().encode() for h in request_id_headers)
        self.max_n = max_n
        self.max_tokens_cap = max_tokens_cap
        self.started = int(time.time())
        post: dict[str, RouteKind] = {
            "/v1/chat/completions": RouteKind.CHAT,
            "/v1/completions": RouteKind.COMPLETIONS,
            "/generate": RouteKind.GENERATE,
        }
        self._post = post
        self._get: dict[str, Callable[[HttpRequest, HttpResponder], Awaitable[None] | None]] = {
            "/health": self.health,
            "/readiness": self.readiness,
            "/v1/models": self.models,
            "/metrics": self.metrics_page,
        }

    def request_id(self, req: HttpRequest) -> str:
        for name in self.id_headers:
            v = req.header(name)
            if v is not None and _VALID_ID.match(v):
                return v.decode()
        return self.ids.next()

    async def __call__(self, req: HttpRequest, res: HttpResponder) -> None:
        route = self._post.get(req.path)
        if route is not None:
            if req.method != "POST":
                return self._error(res, GatewayError("use POST", status=405), None)
            await self.generate(route, req, res)
            return
        get = self._get.get(req.path)
        if get is not None:
            if req.method not in ("GET", "HEAD"):
                return self._error(res, GatewayError("use GET", status=405), None)
            out = get(req, res)
            if out is not None:
                await out
            return
        self._error(res, NotFound(f"no route for {req.method} {req.path}"), None)

    def _error(self, res: HttpResponder, e: GatewayError, request_id: str | None) -> None:
        headers = e.headers()
        if request_id is not None:
            headers.append((b"x-request-id", request_id.encode()))
        res.send(e.status, headers, e.body())

    async def generate(self, route: RouteKind, req: HttpRequest, res: HttpResponder) -> None:
        request_id = self.request_id(req)
        ctype = req.header(b"content-type")
        try:
            if ctype is not None and b"json" not in ctype.lower():
                raise BadRequest(
                    f"unsupported content-type {ctype.decode(errors='replace')!r}; send application/json"
                )
            models = self.registry.snapshot().models()
            parsed = parse_request(
                route,
                req.path,
                req.body,
                default_model=models[0] if len(models) == 1 else None,
                max_n=self.max_n,
                max_tokens_cap=self.max_tokens_cap,
            )
        except GatewayError as e:
            self.metrics.child(self.metrics.requests, route.value, "", "none", e.code.value).inc()
            return self._error(res, e, request_id)
        await self.orchestrator.serve(parsed, request_id, res, req.header(b"authorization"))

    def health(self, req: HttpRequest, res: HttpResponder) -> None:
        res.send(200, [JSON], b'{"status":"ok"}')

    def readiness(self, req: HttpRequest, res: HttpResponder) -> None:
        snap = self.registry.snapshot()
        models: dict[str, list[str]] = {}
        for m in snap.models():
            models[m] = _routes(snap, m)
        ready = bool(models) and all(models.values())
        body = _encoder.encode({"ready": ready, "models": models})
        res.send(200 if ready else 503, [JSON], body)

    def models(self, req: HttpRequest, res: HttpResponder) -> None:
        snap = self.registry.snapshot()
        cards = []
        for m in snap.models():
            limits = [w.context_length for w in snap.workers if w.model == m and w.context_length]
            cards.append(
                ModelCard(
                    id=m,
                    created=self.started,
                    max_model_len=min(limits) if limits else None,
                    routes=_routes(snap, m),
                )
            )
        res.send(200, [JSON], _encoder.encode(ModelList(data=cards)))

    def metrics_page(self, req: HttpRequest, res: HttpResponder) -> None:
        res.send(200, [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")], self.metrics.render())


def _routes(snap: ClusterSnapshot, model: str) -> list[str]:
    """How a model can be served right now: "disaggregated:<engine>" and/or "colocated:<engine>"."""
    out = []
    for engine in sorted({w.engine for w in snap.workers if w.model == model}):
        pre = [w for w in snap.pool(Role.PREFILL, model) if w.engine is engine and w.model == model]
        dec = [w for w in snap.pool(Role.DECODE, model) if w.engine is engine and w.model == model]
        col = [w for w in snap.pool(Role.COLOCATED, model) if w.engine is engine and w.model == model]
        if pre and dec:
            out.append(f"disaggregated:{engine.value}")
        if col:
            out.append(f"colocated:{engine.value}")
    return out


__all__ = ["Handlers", "error_body"]
