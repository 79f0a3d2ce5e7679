"""The routes that describe the gateway instead of generating: `/health`, `/readiness`,
`/v1/models` (and `/v1/models/{id}`), `/metrics`."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Protocol
from urllib.parse import parse_qs, unquote

import msgspec

from common.errors import GatewayError, ModelNotFound
from common.workers import Role
from gateway.http.server import HttpRequest, HttpResponder
from gateway.metrics import GatewayMetrics
from gateway.registry import Registry
from policies.snapshot import ClusterSnapshot

JSON = (b"content-type", b"application/json")
_PROMETHEUS = (b"content-type", b"text/plain; version=0.0.4; charset=utf-8")
_encoder = msgspec.json.Encoder()

Route = Callable[[HttpRequest, HttpResponder], Awaitable[None] | None]


class Refuse(Protocol):
    """How an error answered here is counted and logged (`Handlers._refuse`)."""

    def __call__(
        self, req: HttpRequest, res: HttpResponder, e: GatewayError, *, model: str | None
    ) -> None: ...


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


class InfoRoutes:
    def __init__(
        self,
        registry: Registry,
        metrics: GatewayMetrics,
        refuse: Refuse,
        metrics_source: Callable[[], Awaitable[bytes]] | None = None,
    ) -> None:
        """`metrics_source`: what `/metrics` answers when it is more than this process's own
        metrics (several processes: every process's, added up)."""
        self.registry = registry
        self.metrics = metrics
        self._refuse = refuse
        self._metrics_source = metrics_source
        self.started = int(time.time())

    def routes(self) -> dict[str, Route]:
        """The GET routes by path (`/v1/models/{id}` is `model`, by prefix)."""
        return {
            "/health": self.health,
            "/readiness": self.readiness,
            "/v1/models": self.models,
            "/metrics": self.metrics_page if self._metrics_source is None else self.merged_metrics_page,
        }

    def health(self, req: HttpRequest, res: HttpResponder) -> None:
        res.send(200, [JSON], b'{"status":"ok"}')

    def readiness(self, req: HttpRequest, res: HttpResponder) -> None:
        """200 when every model (or every one named by `?model=`, repeatable: a load balancer
        in front of one model's traffic) has a usable route right now; 503 otherwise."""
        snap = self.registry.snapshot()
        asked = parse_qs(req.query).get("model") if req.query else None
        models: dict[str, list[str]] = {}
        open_pairs = self.registry.open_pairs()
        for m in asked or snap.models():
            models[m] = _routes(snap, m, open_pairs)
        ready = bool(models) and all(models.values())
        body = _encoder.encode({"ready": ready, "models": models})
        res.send(200 if ready else 503, [JSON], body)

    def models(self, req: HttpRequest, res: HttpResponder) -> None:
        snap = self.registry.snapshot()
        cards = [self._card(snap, m) for m in snap.models()]
        res.send(200, [JSON], _encoder.encode(ModelList(data=cards)))

    def model(self, req: HttpRequest, res: HttpResponder) -> None:
        """`GET /v1/models/{id}` (the openai client's `models.retrieve`); ids may hold slashes."""
        name = unquote(req.path[len("/v1/models/") :])
        snap = self.registry.snapshot()
        if name not in snap.models():
            e = ModelNotFound(f"the model {name!r} does not exist", param="model")
            return self._refuse(req, res, e, model=name)
        res.send(200, [JSON], _encoder.encode(self._card(snap, name)))

    def _card(self, snap: ClusterSnapshot, model: str) -> ModelCard:
        limits = [w.context_length for w in snap.workers if w.model == model and w.context_length]
        return ModelCard(
            id=model,
            created=self.started,
            max_model_len=min(limits) if limits else None,
            routes=_routes(snap, model, self.registry.open_pairs()),
        )

    def metrics_page(self, req: HttpRequest, res: HttpResponder) -> None:
        res.send(200, [_PROMETHEUS], self.metrics.render())

    async def merged_metrics_page(self, req: HttpRequest, res: HttpResponder) -> None:
        assert self._metrics_source is not None
        page = await self._metrics_source()
        if not res.closed:
            res.send(200, [_PROMETHEUS], page)


def _routes(snap: ClusterSnapshot, model: str, open_pairs: frozenset[str]) -> list[str]:
    """How a model can be served right now: "disaggregated:<engine>" and/or "colocated:<engine>".
    A P/D route needs a usable prefill and decode whose pair breaker is not open (`open_pairs`,
    "prefill|decode"): the planner skips such pairs, so a model whose only pair is open is not
    served although both workers are usable on their own."""
    out = []
    for engine in sorted({w.engine for w in snap.workers if w.model == model}):
        pre = [w for w in snap.pool(Role.PREFILL, model) if w.engine is engine and w.model == model]
        dec = [w for w in snap.pool(Role.DECODE, model) if w.engine is engine and w.model == model]
        col = [w for w in snap.pool(Role.COLOCATED, model) if w.engine is engine and w.model == model]
        paired = any(f"{p.id}|{d.id}" not in open_pairs for p in pre for d in dec)
        if paired:
            out.append(f"disaggregated:{engine.value}")
        if col:
            out.append(f"colocated:{engine.value}")
        elif not paired and any(w.decode_alone for w in dec):
            out.append(f"decode_self_prefill:{engine.value}")  # the planner's last resort (policies/pd.py)
    return out
