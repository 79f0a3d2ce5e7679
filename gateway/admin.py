"""The admin API: list, add, drain and remove workers at runtime. Served by the gateway's own
server under `/admin/`, and only when a token is configured (`[admin] token` / `token_env`):
without one every `/admin/...` path is a plain 404, and with one every request must carry
`Authorization: Bearer <token>` (compared in constant time) or get a 401 — before the path,
the method or the body is looked at, so an unauthenticated caller can neither add a worker
(point the gateway at a host) nor learn which routes exist.

    GET    /admin/workers                  every worker: id, url, role, engine, model, healthy,
                                           draining, inflight, load, breaker state
    GET    /admin/workers/{id}             one worker
    POST   /admin/workers                  add one: a JSON object like a [[workers]] TOML entry,
                                           validated by the same `WorkerConfig` rules; probed
                                           (health + info) before it is added, 422 if the probe
                                           fails (`?require_healthy=false`: added unhealthy, the
                                           health loop brings it in)
    POST   /admin/workers/{id}/drain       no new requests are routed to it; in-flight continue
    POST   /admin/workers/{id}/resume      undo a drain
    DELETE /admin/workers/{id}             drain, wait for its in-flight requests (at most
                                           `admin.drain_timeout_s`, or `?timeout_s=`), then remove it
                                           and close its connection pool (connections still in use
                                           close when their request ends); a request planned
                                           before and not yet on it when the wait ends (a vLLM
                                           decode after a long prefill) fails over or gets a 503:
                                           "drained" is false then
    GET    /admin/pairs                    every (prefill, decode) pair that carried a request,
                                           with its breaker (an open one takes the pair out of
                                           routing although both workers are usable)
    GET    /admin/admission                admission control counters
    GET    /admin/token_bounds             per model whose workers do not check token ids: the
                                           largest id proven served, and a recent engine death
                                           of an unproven id (gateway/orchestration/token_bounds.py)
    POST   /admin/token_bounds/reset       forget those deaths (`?model=`: of one model), so that
                                           unproven ids are tried again

`{id}` is percent-decoded (a worker whose id is its URL is `/admin/workers/http%3A%2F%2Fh%3A1`).
A worker added here may name `api_key_env` only if a configured worker already names that
variable: the admin API cannot make the gateway send an arbitrary environment variable to a host.

With several processes (`serve --workers N`) the process that receives an admin request applies
it and passes it on to every other process (`siblings`, gateway/multiprocess/siblings.py): a
change holds in every process, and the answer counts the whole gateway (in-flight figures are
read from the shared table; a removal waits in every process and adds their figures up;
`/admin/admission` adds up every process's counters). An added worker is probed by the process
that got the request, and the others add it whatever their own probe says (it is the same
server; their health loops carry on from there).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote

import msgspec

from common.errors import (
    BadRequest,
    Conflict,
    ErrorCode,
    GatewayError,
    MethodNotAllowed,
    NotFound,
    Unauthorized,
)
from gateway.admin_fanout import _add_admission, _applied, _pass_on
from gateway.admission import Admission
from gateway.breaker import BreakerState
from gateway.config import ConfigError, WorkerConfig
from gateway.endpoints import reaches_self, same_server
from gateway.health import HealthChecker
from gateway.http.server import HttpRequest
from gateway.logging import get_logger
from gateway.registry import Registry, Worker

if TYPE_CHECKING:
    from gateway.multiprocess.siblings import Siblings
    from gateway.orchestration import RequestContext
    from gateway.orchestration.token_bounds import TokenBounds

log = get_logger("pd_gateway.admin")

PREFIX = "/admin/"
_encoder = msgspec.json.Encoder()
_POLL_S = 0.02  # how often a removal checks the worker's in-flight count
_MAX_TIMEOUT_S = 3600.0


def worker_json(w: Worker, registry: Registry | None = None) -> dict[str, Any]:
    inflight, tokens = registry.inflight_of(w) if registry is not None else (w.inflight, w.inflight_tokens)
    return {
        "id": w.id,
        "url": w.url,
        "role": w.role.value,
        "engine": w.engine.value,
        "model": w.model,
        "healthy": w.healthy,
        "draining": w.draining,
        "usable": w.state().usable,
        "inflight": inflight,
        "inflight_tokens": tokens,
        "load": msgspec.to_builtins(w.load),
        "breaker": w.breaker.state.value,
        "context_length": w.info.context_length,
        "bootstrap_port": w.bootstrap_port if w.bootstrap_port is not None else w.info.bootstrap_port,
        "weight": w.weight,
        "labels": dict(w.labels),
    }


class Admin:
    def __init__(
        self,
        token: str,
        registry: Registry,
        health: HealthChecker,
        make_worker: Callable[[WorkerConfig], Worker],
        *,
        drain_timeout_s: float,
        allowed_key_envs: frozenset[str] = frozenset(),
        admission: Admission | None = None,
        siblings: Siblings | None = None,
        token_bounds: TokenBounds | None = None,
    ) -> None:
        if not token:
            raise ValueError("the admin token must not be empty")
        self._token = token.encode()
        self.registry = registry
        self.health = health
        self.make_worker = make_worker
        self.drain_timeout_s = drain_timeout_s
        self.allowed_key_envs = allowed_key_envs
        self.admission = admission
        self.siblings = siblings  # the other processes (serve --workers N); None: this one alone
        self.token_bounds = token_bounds
        # set by the gateway: generation requests whose response has not started yet
        self.unstarted: Callable[[], list[RequestContext]] = list
        # set by the gateway: the (host, port) pairs it listens on (its own and the admin API's
        # listener), to refuse a worker that is itself
        self.own_addresses: Callable[[], list[tuple[str, int]]] = list
        self._adding: dict[str, Worker] = {}  # workers being probed, by id
        self._removing: dict[str, asyncio.Task[dict[str, Any]]] = {}

    # -- entry -------------------------------------------------------------------------------

    def authorized(self, req: HttpRequest) -> bool:
        value = req.header(b"authorization")
        if value is None:
            return False
        scheme, _, token = value.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        return hmac.compare_digest(token.strip(), self._token)

    async def answer(self, req: HttpRequest, *, local: bool = False) -> tuple[int, bytes]:
        """The status and JSON body of an admin request; a refusal (401 first, then 404, 405,
        400, 409, 422) is raised as a GatewayError. The gateway's handlers send either, with the
        request id, and log and count the refusals as they do the data plane's. `local`: apply
        it in this process only (another process of the group passed it on)."""
        if not self.authorized(req):
            raise Unauthorized("missing or wrong admin bearer token")
        status, body = await self._route(req, None if local else self.siblings)
        return status, _encoder.encode(body)

    async def _route(self, req: HttpRequest, fan: Siblings | None) -> tuple[int, Any]:
        parts = req.path[len(PREFIX) :].split("/")
        m = req.method
        if parts == ["workers"] or parts == ["workers", ""]:
            if m in ("GET", "HEAD"):
                return 200, {"workers": [worker_json(w, self.registry) for w in self.registry.workers()]}
            if m == "POST":
                status, out = await self.add(req)
                if fan is not None:
                    target = f"{req.path}?require_healthy=false"
                    out["processes"] = _applied(await _pass_on(fan, req, target), fan, ok=(201, 409))
                return status, out
            raise _method(m, "GET, POST")
        if len(parts) >= 2 and parts[0] == "workers":
            wid = unquote(parts[1])
            action = parts[2:]
            if not action:
                if m in ("GET", "HEAD"):
                    return 200, worker_json(self._get(wid), self.registry)
                if m == "DELETE":
                    timeout_s = _timeout(req.query, self.drain_timeout_s)
                    if fan is None:
                        return 200, await self.remove(wid, timeout_s)
                    return 200, await self._remove_everywhere(fan, req, wid, timeout_s)
                raise _method(m, "GET, DELETE")
            if action in (["drain"], ["resume"]):
                if m != "POST":
                    raise _method(m, "POST")
                out = self.set_draining(wid, action[0] == "drain")
                if fan is not None:
                    out["processes"] = _applied(await _pass_on(fan, req, req.path), fan, ok=(200,))
                return 200, out
        if parts == ["pairs"]:
            if m not in ("GET", "HEAD"):
                raise _method(m, "GET")
            return 200, {"pairs": self.pairs_json()}
        if parts == ["admission"] and self.admission is not None:
            if m not in ("GET", "HEAD"):
                raise _method(m, "GET")
            own: dict[str, Any] = msgspec.to_builtins(self.admission.stats())
            if fan is None:
                return 200, own
            answers = await fan.ask("GET", "/local/admission", timeout_s=5.0)
            return 200, _add_admission(own, answers, fan)
        if parts[0] == "token_bounds" and self.token_bounds is not None:
            return await self._token_bounds(req, parts[1:], fan, self.token_bounds)
        raise NotFound(f"no admin route for {m} {req.path}")

    async def _token_bounds(
        self, req: HttpRequest, action: list[str], fan: Siblings | None, bounds: TokenBounds
    ) -> tuple[int, Any]:
        m = req.method
        if not action:
            if m not in ("GET", "HEAD"):
                raise _method(m, "GET")
            return 200, {"models": bounds.state()}
        if action == ["reset"]:
            if m != "POST":
                raise _method(m, "POST")
            model = _query(req.query).get("model", [None])[0]
            out: dict[str, Any] = {"reset": bounds.reset(model)}
            if fan is not None:
                out["processes"] = _applied(
                    await _pass_on(fan, req, req.path + (f"?{req.query}" if req.query else "")),
                    fan,
                    ok=(200,),
                )
            return 200, out
        raise NotFound(f"no admin route for {m} {req.path}")

    async def _remove_everywhere(
        self, fan: Siblings, req: HttpRequest, wid: str, timeout_s: float
    ) -> dict[str, Any]:
        """A removal in every process at once (each waits for its own requests on the worker);
        the answer adds their figures up."""
        self._get(wid)  # 404 here first, as with one process
        target = f"{req.path}?{req.query}" if req.query else req.path
        mine, answers = await asyncio.gather(
            self.remove(wid, timeout_s), _pass_on(fan, req, target, timeout_s=timeout_s + 30.0)
        )
        out = dict(mine)
        for a in answers:
            if a.status != 200:
                continue
            other = msgspec.json.decode(a.body)
            out["drained"] = out["drained"] and bool(other.get("drained"))
            out["inflight"] += int(other.get("inflight", 0))
            out["pending"] += int(other.get("pending", 0))
            out["waited_s"] = max(out["waited_s"], float(other.get("waited_s", 0.0)))
        out["processes"] = _applied(answers, fan, ok=(200, 404))
        return out

    def pairs_json(self) -> list[dict[str, Any]]:
        """Every (prefill, decode) pair that has carried a request, with its breaker: an open
        one takes the pair out of routing although both workers are usable on their own."""
        return [
            {"prefill": p, "decode": d, "breaker": state.value, "usable": state is not BreakerState.OPEN}
            for p, d, state in self.registry.pair_states()
        ]

    def _get(self, wid: str) -> Worker:
        w = self.registry.find(wid)
        if w is None:
            raise NotFound(f"no worker with id {wid!r}", param="id")
        return w

    # -- operations --------------------------------------------------------------------------

    async def _new_worker(self, wc: WorkerConfig) -> Worker:
        """The worker `wc` describes, built, when it may be added: its key env allowed, its id and URL
        not taken, not this gateway itself; BadRequest or Conflict otherwise."""
        if wc.api_key_env is not None and wc.api_key_env not in self.allowed_key_envs:
            raise BadRequest(
                "api_key_env may only name a variable that a configured worker already uses",
                param="api_key_env",
            )
        wid = wc.worker_id
        if wid in self._adding or self.registry.find(wid) is not None:
            raise Conflict(f"a worker with id {wid!r} already exists", param="id")
        try:
            w = self.make_worker(wc)
        except (ValueError, ConfigError) as e:
            raise BadRequest(f"invalid worker: {e}") from None
        if await reaches_self(w.host, w.port, self.own_addresses()):
            await w.pool.close()
            raise BadRequest(f"{w.url} is this gateway itself (a request loop)", param="url")
        taken = [o.id for o in self.registry.workers() if o.url == w.url]
        taken += [i for i, o in self._adding.items() if o.url == w.url]
        if taken:
            await w.pool.close()
            raise Conflict(f"worker {taken[0]!r} already has url {w.url}", param="url")
        return w

    async def add(self, req: HttpRequest) -> tuple[int, Any]:
        wc = _decode_worker(req.body)
        w = await self._new_worker(wc)
        wid = wc.worker_id
        require = _flag(req.query, "require_healthy", True)
        others = [*self.registry.workers(), *self._adding.values()]
        self._adding[wid] = w  # reserved while it is resolved and probed
        added = False
        try:
            twin = await same_server(w, others)
            if twin is not None:
                other, (addr, port) = twin
                raise Conflict(
                    f"worker {other.id!r} ({other.url}) is the same server as {w.url} "
                    f"(both reach {addr} port {port})",
                    param="url",
                )
            healthy = await self.health.probe(w)
            if not healthy and require:
                raise BadRequest(
                    f"worker {wid} at {w.url} did not pass its health/info probe; not added "
                    "(?require_healthy=false adds it unhealthy)",
                    status=422,
                    code=ErrorCode.PROBE_FAILED,
                )
            self.registry.add(w)
            added = True
        finally:
            del self._adding[wid]
            if not added:  # refused, or the admin client went away during the probe
                self.health.forget(wid)
                await w.pool.close()
        self.health.check_models()  # warns if a model can no longer be served (or now can)
        log.info(
            "admin.worker_added",
            worker=wid,
            url=w.url,
            role=w.role.value,
            engine=w.engine.value,
            model=w.model,
            healthy=w.healthy,
        )
        return 201, worker_json(w, self.registry)

    def set_draining(self, wid: str, draining: bool) -> dict[str, Any]:
        w = self._get(wid)
        if wid in self._removing and not draining:
            raise Conflict(f"worker {wid!r} is being removed", param="id")
        if w.draining != draining:
            w.draining = draining
            self.registry.changed()
            log.info("admin.worker_drain" if draining else "admin.worker_resume", worker=wid)
        return worker_json(w, self.registry)

    async def remove(self, wid: str, timeout_s: float) -> dict[str, Any]:
        if wid in self._removing:
            raise Conflict(f"worker {wid!r} is already being removed", param="id")
        w = self._get(wid)
        task = asyncio.create_task(self._remove(w, timeout_s), name=f"admin-remove-{wid}")
        self._removing[wid] = task
        task.add_done_callback(lambda _: self._removing.pop(wid, None))
        # the removal completes even if this admin client goes away
        return await asyncio.shield(task)

    async def _remove(self, w: Worker, timeout_s: float) -> dict[str, Any]:
        return await drain_and_remove(w, self.registry, self.health, self.unstarted, timeout_s)

    async def close(self) -> None:
        tasks = list(self._removing.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t


async def drain_and_remove(
    w: Worker,
    registry: Registry,
    health: HealthChecker,
    unstarted: Callable[[], list[RequestContext]],
    timeout_s: float,
) -> dict[str, Any]:
    """Drain `w`, wait (at most `timeout_s`) for its in-flight requests and for those planned on it
    before the drain, then remove it and close its pool: the admin API's DELETE and Kubernetes
    discovery's removals (`unstarted`: the gateway's generation requests whose response has not
    started, `Handlers.unstarted`)."""
    if not w.draining:
        w.draining = True
        registry.changed()
    # Requests planned for it before the drain may hold this worker without counting in its
    # `inflight` yet (a vLLM decode is acquired only after its prefill): wait until each of
    # them has started its response (its workers are then fixed and counted) or ended.
    # Requests planned after the drain never pick it.
    planned_before = [r for r in unstarted() if w.id in r.planned]
    t0 = time.monotonic()
    log.info("admin.worker_removing", worker=w.id, inflight=w.inflight, timeout_s=timeout_s)
    deadline = t0 + timeout_s
    # polled: the request path's release() stays a bare decrement, no waiter check
    while time.monotonic() < deadline:
        if planned_before:
            # (a request whose vLLM decode leg moved to another decode no longer names it)
            planned_before = [
                r for r in planned_before if not r.responded and not r.closed and w.id in r.planned
            ]
        if w.inflight == 0 and not planned_before:
            break
        await asyncio.sleep(_POLL_S)
    left = w.inflight
    # planned for it before the drain, response not started: such a request's next leg
    # finds the worker gone (a retry elsewhere, or a 503), so it was not drained either
    pending = sum(1 for r in planned_before if not r.responded and not r.closed and w.id in r.planned)
    await registry.remove(w.id)
    health.forget(w.id)
    health.check_models()
    await w.pool.close()  # idle connections now; those in use when their request ends
    waited = round(time.monotonic() - t0, 3)
    drained = left == 0 and pending == 0
    log.info(
        "admin.worker_removed",
        worker=w.id,
        drained=drained,
        inflight=left,
        pending=pending,
        waited_s=waited,
    )
    return {
        "id": w.id,
        "removed": True,
        "drained": drained,
        "inflight": left,
        "pending": pending,
        "waited_s": waited,
    }


def _decode_worker(body: bytes) -> WorkerConfig:
    """The worker to add, checked like a [[workers]] entry; BadRequest says what is wrong."""
    try:
        return msgspec.json.decode(body, type=WorkerConfig)
    except msgspec.ValidationError as e:
        raise BadRequest(f"invalid worker: {e}") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        bad_json = BadRequest(f"invalid JSON: {e}", code=ErrorCode.INVALID_JSON)
    # JSON has no infinity or NaN, yet clients write them (Python's json.dumps(1e400) is
    # `Infinity`): when that is all that is wrong, the value is what to report
    try:
        loose = json.loads(body)
    except ValueError:
        raise bad_json from None
    try:
        msgspec.convert(loose, WorkerConfig)
    except msgspec.ValidationError as e:
        raise BadRequest(f"invalid worker: {e}") from None
    raise bad_json


def _method(method: str, allowed: str) -> GatewayError:
    return MethodNotAllowed(method, allowed)


def _query(query: str) -> dict[str, list[str]]:
    try:
        return parse_qs(query, strict_parsing=False)
    except ValueError:
        return {}


def _flag(query: str, name: str, default: bool) -> bool:
    values = _query(query).get(name)
    if not values:
        return default
    v = values[-1].lower()
    if v in ("1", "true", "yes"):
        return True
    if v in ("0", "false", "no"):
        return False
    raise BadRequest(f"{name} must be true or false, got {values[-1]!r}", param=name)


def _timeout(query: str, default: float) -> float:
    values = _query(query).get("timeout_s")
    if not values:
        return default
    try:
        t = float(values[-1])
    except ValueError:
        t = math.nan
    if not (0 <= t <= _MAX_TIMEOUT_S):
        raise BadRequest(f"timeout_s must be a number in [0, {_MAX_TIMEOUT_S:g}]", param="timeout_s")
    return t
