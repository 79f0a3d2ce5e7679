"""The client-facing routes. Parsing and answering only: routing lives in policies, engine I/O in
the orchestrator, wire formats in the adapters; the routes that describe the gateway (`/health`,
`/readiness`, `/v1/models`, `/metrics`) in `gateway/info_routes.py`."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from common.bodyscan import SCAN_FROM
from common.errors import (
    SHUTDOWN_CANCEL,
    BadRequest,
    ErrorCode,
    GatewayError,
    MethodNotAllowed,
    NotFound,
    Unavailable,
    UnsupportedMediaType,
    cancelled_outcome,
    error_body,
    sse_error_event,
)
from common.request import ParsedRequest, WorkLimits, parse_large_request, parse_request
from common.workers import RouteKind
from gateway.admission import Admission
from gateway.http.server import HttpRequest, HttpResponder, Refusal
from gateway.ids import IdGenerator
from gateway.info_routes import JSON, InfoRoutes
from gateway.logging import get_logger, info_enabled
from gateway.metrics import GatewayMetrics
from gateway.orchestration import Orchestrator, RequestContext
from gateway.registry import Registry

if TYPE_CHECKING:
    from gateway.admin import Admin

# the orchestrator's access log: one `request.done` line per request, these for those answered here
log = get_logger("pd_gateway.request")
_VALID_ID = re.compile(rb"^[A-Za-z0-9._:\-]{1,128}$")
# the `route` label of pdgw_requests_total for a request off the generation routes (an unknown
# path, /v1/models/{id}...) or refused before its path was read: never the path itself
OTHER_ROUTE = "other"


_Lookup = Callable[[bytes], "bytes | None"]  # a request's header lookup (`header`, `fields().get`)


class Handlers:
    def __init__(
        self,
        registry: Registry,
        orchestrator: Orchestrator,
        metrics: GatewayMetrics,
        *,
        request_id_headers: tuple[str, ...],
        max_n: int,
        max_tokens_cap: int | None,
        work: WorkLimits,
        client_key_header: str,
        admission: Admission,
        admin: Admin | None,
        metrics_source: Callable[[], Awaitable[bytes]] | None = None,
    ) -> None:
        """`metrics_source`: what `/metrics` answers when it is more than this process's own
        metrics (several processes: every process's, added up)."""
        self.registry = registry
        self.orchestrator = orchestrator
        self.metrics = metrics
        self.ids = IdGenerator()
        self.id_headers = tuple(h.lower().encode() for h in request_id_headers)
        self.session_headers = tuple(h.encode() for h in orchestrator.cfg.session_headers)
        self.max_n = max_n
        self.max_tokens_cap = max_tokens_cap
        self.work = work
        self.client_key = client_key_reader(client_key_header)
        self.admission = admission
        self._count_tokens = self.admission.max_tokens is not None
        self.admin = admin  # None: /admin/* is 404
        self._log_done = info_enabled(log)  # as the orchestrator: built only when it is written
        # generation requests in flight: their responder and context (for shutdown, admin)
        self._live: dict[HttpResponder, RequestContext] = {}
        # generation requests being handled (parsed, queued or in flight): their ids, for `stalled`
        self._names: dict[HttpResponder, str] = {}
        post: dict[str, RouteKind] = {
            "/v1/chat/completions": RouteKind.CHAT,
            "/v1/completions": RouteKind.COMPLETIONS,
            "/generate": RouteKind.GENERATE,
        }
        self._post = post
        self.info = InfoRoutes(registry, metrics, self._refuse, metrics_source)
        self._get = self.info.routes()

    def request_id(self, req: HttpRequest) -> str:
        return self._client_id(req.header) or self.ids.next()

    async def __call__(self, req: HttpRequest, res: HttpResponder) -> None:
        route = self._post.get(req.path)
        if route is not None:
            if req.method != "POST":
                return self._refuse(req, res, MethodNotAllowed(req.method, "POST"), route=route)
            await self.generate(route, req, res)
            return
        get = self._get.get(req.path)
        if get is not None:
            if req.method not in ("GET", "HEAD"):
                return self._refuse(req, res, MethodNotAllowed(req.method, "GET, HEAD"))
            out = get(req, res)
            if out is not None:
                await out
            return
        if req.path.startswith("/v1/models/"):
            if req.method not in ("GET", "HEAD"):
                return self._refuse(req, res, MethodNotAllowed(req.method, "GET, HEAD"))
            return self.info.model(req, res)
        if self.admin is not None and req.path.startswith("/admin/"):
            await self.admin_request(self.admin, req, res)
            return
        self._refuse(req, res, NotFound(f"no route for {req.method} {req.path}"))

    async def admin_request(self, admin: Admin, req: HttpRequest, res: HttpResponder) -> None:
        """`/admin/...` (a token configured): every answer echoes the request id like the data
        plane's; its refusals (401, 404, 405, and an operation's 400, 409, 422) are logged and
        counted as the routing refusals are (stage "admin", route label "other")."""
        request_id = self.request_id(req)  # before the operation (a drain may wait long)
        try:
            status, body = await admin.answer(req)
        except GatewayError as e:
            self._refuse(req, res, e, request_id=request_id, stage="admin")
            return
        res.send(status, [JSON, (b"x-request-id", request_id.encode())], body)

    async def admin_listener(self, admin: Admin, req: HttpRequest, res: HttpResponder) -> None:
        """The handler of the admin API's own listener (`admin.listen_port`): `/admin/...` and
        nothing else (a 404 as on the gateway's listener, logged and counted the same)."""
        if req.path.startswith("/admin/"):
            await self.admin_request(admin, req, res)
            return
        self._refuse(req, res, NotFound(f"no route for {req.method} {req.path} on the admin listener"))

    def _error(self, res: HttpResponder, e: GatewayError, request_id: str | None) -> None:
        headers = e.headers()
        if request_id is not None:
            headers.append((b"x-request-id", request_id.encode()))
        res.send(e.status, headers, e.body())

    def _refuse(
        self,
        req: HttpRequest,
        res: HttpResponder,
        e: GatewayError,
        *,
        route: RouteKind | None = None,
        model: str | None = None,
        request_id: str | None = None,
        stage: str = "route",
    ) -> None:
        """An error answered here outside a generation request's own path (a wrong method, an
        unknown path or model id, an admin refusal): its request id echoed (the client's, else
        a new one), counted and logged like the requests the orchestrator serves (the model
        label: none, the name is the client's)."""
        if request_id is None:
            request_id = self.request_id(req)
        self._error(res, e, request_id)
        self.metrics.child(
            self.metrics.requests, route.value if route is not None else OTHER_ROUTE, "", "none", e.code.value
        ).inc()
        if self._log_done:
            self._log_early(req.path, route, request_id, model, e, None, stage)

    def refused(self, r: Refusal) -> list[tuple[bytes, bytes]]:
        """The HTTP server's hook (`on_refusal`) for a request it answered itself, before any
        handler (413 body too large, 431, 400 malformed or a bad Content-Length, 408, 501 a
        transfer coding other than chunked, 414, 417, 505, 503 while shutting down, with
        Retry-After): the client's request id when its
        headers were read (else a new one) is echoed, the request counted (route: the
        generation route named by its path, else "other"; outcome: the refusal's code) and
        logged, at stage "http"."""
        request_id = self._client_id(dict(reversed(r.headers)).get) or self.ids.next()  # (r.header)
        route = self._post.get(r.path)
        self.metrics.child(
            self.metrics.requests, route.value if route is not None else OTHER_ROUTE, "", "none", r.code
        ).inc()
        if self._log_done:
            log.info(
                "request.done",
                request_id=request_id,
                model=None,
                route=route.value if route is not None else None,
                path=None if route is not None else (r.path[:200] or None),
                plan="none",
                attempts=0,
                stage="http",
                outcome=r.code,
                status=r.status,
                param=None,
                duration_ms=round(r.elapsed_s * 1000, 3),
            )
        out = [(b"x-request-id", request_id.encode())]
        if r.status == 503:  # shutting down, or out of connections: try again (elsewhere)
            out.append((b"retry-after", str(max(1, round(self.admission.retry_after_s))).encode()))
        return out

    def stalled(self, res: HttpResponder | None, stalled_s: float) -> None:
        """The HTTP server's hook (`on_stall`): it is cutting a client that took no byte of its
        answer for `timeouts.client_stall_s`. Logged and counted here, with the request id of the
        last request on the connection. A request still running is then cancelled as for a
        client that went away (its engine legs aborted; its `request.done` line and
        `pdgw_requests_total` say outcome `client_stalled`); a whole answer already handed to the
        connection was served (its engines done) and keeps its outcome."""
        self.metrics.child(self.metrics.client_stalls).inc()
        request_id = None
        if res is not None:  # a request still handled, else the id its answer echoed
            request_id = self._names.get(res) or _echoed_id(res)
        log.info(
            "request.client_stalled",
            request_id=request_id,
            stalled_s=round(stalled_s, 3),
            answered=res is None or res.finished,  # the whole answer was written (to buffers)
        )

    def _client_id(self, header: _Lookup) -> str | None:
        """The client's valid request id, if it sent one (`header`: the request's lookup)."""
        for name in self.id_headers:
            v = header(name)
            if v is not None and _VALID_ID.match(v):
                return v.decode()
        return None

    def _log_early(
        self,
        path: str,
        route: RouteKind | None,
        request_id: str | None,
        model: str | None,
        e: GatewayError | None,
        started: float | None,
        stage: str,
        gone: str = "client_gone",
    ) -> None:
        """The access log line of a request answered before the orchestrator (which writes the
        others' at the end of `Orchestrator.serve`): the same event and level, its fields where
        they apply (no plan, no attempt), the error's code as the outcome (None: `gone`, the
        client went away), what was refused (`param`: a field's name, never its value) and where
        (`stage`: route, request, admission; `refused` writes the HTTP layer's, stage http). No
        prompt text."""
        log.info(
            "request.done",
            request_id=request_id,
            model=model[:200] if model is not None else None,
            route=route.value if route is not None else None,
            path=None if route is not None else path[:200],
            plan="none",
            attempts=0,
            stage=stage,
            outcome=e.code.value if e is not None else gone,
            status=e.status if e is not None else None,
            param=e.param if e is not None else None,
            duration_ms=round((time.monotonic() - started) * 1000, 3) if started is not None else 0.0,
        )

    async def generate(self, route: RouteKind, req: HttpRequest, res: HttpResponder) -> None:
        """A generation request: parsed, admitted, then served by the orchestrator (each stage's
        refusals answered, counted and logged here)."""
        started = time.monotonic()
        get = req.fields().get  # (each header looked up in C, not through a frame)
        request_id = self._client_id(get) or self.ids.next()
        names = self._names
        names[res] = request_id  # (named by `stalled` if its client stops reading)
        try:
            if len(req.body) <= SCAN_FROM:
                parsed = self._parse(route, req, res, request_id, started, get)
            else:  # measured in slices first, the event loop free between them
                parsed = await self._parse_large(route, req, res, request_id, started)
            if parsed is None:
                return
            task = res.task if res.task is not None else asyncio.current_task()
            assert task is not None
            session = None
            for h in self.session_headers:
                session = get(h)
                if session is not None:
                    break
            ctx = self.orchestrator.context(
                parsed, request_id, res, task, get(b"authorization"), session=session
            )
            if self.orchestrator.cfg.explain_header and get(b"x-pdgw-explain") is not None:
                ctx.explain = True
            # (None: the socket's address, `_address` inline)
            client = self.client_key(req) if self.client_key else req.client[0] if req.client else ""
            tokens = ctx.tokens if self._count_tokens else 0
            try:
                admitted = self.admission.admit_now(client, tokens)
            except GatewayError as e:
                self._not_admitted(route, req, res, ctx, e, started)
                return
            if not admitted and not await self._queue(route, req, res, ctx, client, tokens, started):
                return
            live = self._live
            live[res] = ctx
            try:
                await self.orchestrator.serve(ctx)
            finally:
                del live[res]
                self.admission.leave(client, tokens)
        finally:
            del names[res]

    def _parse(
        self,
        route: RouteKind,
        req: HttpRequest,
        res: HttpResponder,
        request_id: str,
        started: float,
        get: _Lookup,
    ) -> ParsedRequest | None:
        """The request parsed, or None when it was refused (answered, counted and logged)."""
        try:
            return parse_request(
                route,
                req.path,
                req.body,
                default_model=self._checked(route, get),
                max_n=self.max_n,
                max_tokens_cap=self.max_tokens_cap,
                work=self.work,
            )
        except GatewayError as e:
            self._unparsed(route, req, res, request_id, e, started)
            return None

    async def _parse_large(
        self, route: RouteKind, req: HttpRequest, res: HttpResponder, request_id: str, started: float
    ) -> ParsedRequest | None:
        """`_parse` for a body over `bodyscan.SCAN_FROM` bytes: measured in slices first, the
        event loop free between them (`parse_large_request`)."""
        try:
            return await parse_large_request(
                route,
                req.path,
                req.body,
                default_model=self._checked(route, req.header),
                max_n=self.max_n,
                max_tokens_cap=self.max_tokens_cap,
                work=self.work,
            )
        except GatewayError as e:
            self._unparsed(route, req, res, request_id, e, started)
            return None

    def _checked(self, route: RouteKind, header: _Lookup) -> str | None:
        """A generation request's headers checked (a 400 or 415 raised; `header`: its lookup);
        the model a request naming none goes to."""
        ctype = header(b"content-type")
        if ctype is not None and ctype.lower().find(b"json") < 0:  # (not `in`: common/jsonbytes.py)
            raise BadRequest(
                f"unsupported content-type {ctype.decode(errors='replace')!r}; send application/json"
            )
        coding = header(b"content-encoding")
        if coding is not None and coding.strip().lower() not in (b"", b"identity"):
            raise UnsupportedMediaType(
                f"unsupported content-encoding {coding.decode(errors='replace')!r}; send the JSON "
                "body uncompressed"
            )
        # a request naming no model goes to the one model served on its route (SGLang's
        # /generate has no `model` field: behind a gateway that also serves vLLM models, its
        # clients still reach the SGLang one); with none on the route, to the one model
        # served, whose answer then names the route it lacks
        serving = self.registry.models_for(route) or self.registry.models()
        return serving[0] if len(serving) == 1 else None

    def _unparsed(
        self,
        route: RouteKind,
        req: HttpRequest,
        res: HttpResponder,
        request_id: str,
        e: GatewayError,
        started: float,
    ) -> None:
        """The request refused before it was parsed whole: answered, counted and logged."""
        self.metrics.child(self.metrics.requests, route.value, "", "none", e.code.value).inc()
        self._error(res, e, request_id)
        if self._log_done:
            self._log_early(req.path, route, request_id, None, e, started, "request")

    async def _queue(
        self,
        route: RouteKind,
        req: HttpRequest,
        res: HttpResponder,
        ctx: RequestContext,
        client: str,
        tokens: int,
        started: float,
    ) -> bool:
        """Wait in the admission queue for a slot: False when refused (answered, counted and
        logged); a client that leaves while queued is counted and logged too."""
        parsed = ctx.req
        try:
            await self.admission.wait(client, tokens)
            return True
        except GatewayError as e:
            self._not_admitted(route, req, res, ctx, e, started)
            return False
        except asyncio.CancelledError as c:  # the client went away while queued
            # (or the gateway cancelled it, as the orchestrator tells the two apart)
            gone = cancelled_outcome(c, res.stalled_s > 0)
            model = parsed.model if parsed.model in self.registry.models() else ""
            self.metrics.child(self.metrics.requests, route.value, model, "none", gone).inc()
            if self._log_done:
                self._log_early(
                    req.path, route, ctx.request_id, parsed.model, None, started, "admission", gone
                )
            raise

    def _not_admitted(
        self,
        route: RouteKind,
        req: HttpRequest,
        res: HttpResponder,
        ctx: RequestContext,
        e: GatewayError,
        started: float,
    ) -> None:
        """Admission refused the request (a full queue, a per-client cap, shutdown): answered,
        counted and logged."""
        parsed = ctx.req
        # the model label only for a served model: client-chosen names would grow the series
        model = parsed.model if parsed.model in self.registry.models() else ""
        self.metrics.child(self.metrics.requests, route.value, model, "none", e.code.value).inc()
        self._error(res, e, ctx.request_id)
        if self._log_done:
            self._log_early(req.path, route, ctx.request_id, parsed.model, e, started, "admission")

    def unstarted(self) -> list[RequestContext]:
        """Generation requests running whose response has not started: they may still pick (or
        retry onto) workers. Once a response has started, its workers are fixed and counted in
        their `inflight`."""
        return [ctx for ctx in self._live.values() if not ctx.responded]

    def cut(self, message: str = "the gateway is shutting down") -> int:
        """Shutdown after the grace period: end every generation request still running with a
        clear error (an SSE error event on a started stream, else a 503 with Retry-After) and
        cancel its handler, so the orchestrator aborts its engine legs. Returns how many."""
        err = Unavailable(message, code=ErrorCode.SHUTTING_DOWN, retry_after_s=self.admission.retry_after_s)
        n = 0
        for res, ctx in list(self._live.items()):
            task = ctx.task
            if not res.finished and not res.closed:
                if res.started:
                    res.write(sse_error_event(err.message, err.type, err.code.value))
                    res.end()
                else:
                    res.send(err.status, err.headers(), err.body())
            if task is not None and not task.done():
                task.cancel(SHUTDOWN_CANCEL)
            n += 1
        return n


__all__ = ["Handlers", "error_body"]


def _echoed_id(res: HttpResponder) -> str | None:
    value = res.sent_header(b"x-request-id")
    return value.decode() if value is not None else None


def _address(req: HttpRequest) -> str:
    return req.client[0] if req.client is not None else ""


def client_key_reader(header: str) -> Callable[[HttpRequest], str] | None:
    """Who sent a request, for the per-client cap: the socket's address (None: the caller reads
    it, `_address`, without a call of this), or the value of a configured header when the request
    has it (`x-forwarded-for`: its last address, the one the trusted proxy in front of the
    gateway appended; earlier ones are the client's own word)."""
    if not header:
        return None
    name = header.lower().encode()
    last_hop = name == b"x-forwarded-for"

    def key(req: HttpRequest) -> str:
        value = req.header(name)
        if not value:
            return _address(req)
        if last_hop:
            value = value.rpartition(b",")[2].strip()
            if not value:
                return _address(req)
            return value.decode("latin-1")
        return "h:" + value.decode("latin-1")  # never equal to an address key

    return key
