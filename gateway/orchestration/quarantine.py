"""Queries of death: a request that may have killed the engine holding it is not replayed blindly
onto healthy ones (issue #27, item 2).

How an attempt failed decides what may follow it:

- the request never reached an engine (connect refused, the pool closed, an engine's 503 or 429:
  it answered, so it is up): retried elsewhere as usual (attempts.py);
- the engine took the request and failed it (`UpstreamFailure.held`: its connection broke
  without an answer, a 5xx other than 503, an error event): it may have died of the request.
  The attempt's workers are probed (`engine_gone`: a port that refuses connections, or a
  /health that answers anything but 200, within `retries.death_probe_s`; both legs of a P/D
  attempt, which a query of death kills together). Each death, or else a broken connection,
  counts against the request: at two it gets no other try (`Quarantine.held`). A death is also
  remembered against the request's fingerprint (route, model, body bytes) for
  `retries.quarantine_s`; a second death (its one more try killed another engine, or a copy
  of it did) quarantines the fingerprint: an identical request is then refused at once
  (`Quarantine.check`), reaching no engine, with a 503 naming the wait (Retry-After). One
  death alone quarantines nothing: an engine that crashes or is stopped fails every request it
  holds, and each of them is served by its one more try. Each event is logged and counted
  (`pdgw_query_of_death_total`).

So one poison request takes down at most two engines (a colocated try and its one more try,
or a P/D attempt's two legs), and its copies none. A connection broken by an engine that stays up (a reset, a proxy's hiccup) costs
the request its third try, not a quarantine; a 500 from an engine that stays up costs nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import time

from common.errors import ErrorCode, GatewayError, UpstreamFailure
from gateway.http.errors import LocalResourceError, UpstreamConnectError, UpstreamProtocolError
from gateway.logging import get_logger
from gateway.metrics import GatewayMetrics
from gateway.orchestration.context import RequestContext
from gateway.registry import Registry, Worker

log = get_logger("pd_gateway.request")

MAX_ENTRIES = 10_000  # fingerprints kept at most (the oldest go first)


class RequestQuarantined(GatewayError):
    """A request identical to one that coincided with an engine's death, refused unsent."""

    status = 503
    code = ErrorCode.REQUEST_QUARANTINED
    type = "server_error"


class DroppedTwice(GatewayError):
    """A request whose connection two engines dropped without an answer: not tried again."""

    status = 502
    code = ErrorCode.ENGINE_DROPPED_REQUEST
    type = "server_error"


def fingerprint(ctx: RequestContext) -> bytes:
    """What makes two requests the same to an engine: route, model and the body's bytes."""
    req = ctx.req
    h = hashlib.blake2b(digest_size=16)
    h.update(req.route.value.encode())
    h.update(b"\0")
    h.update(req.model.encode())
    h.update(b"\0")
    h.update(req.body)
    return h.digest()


async def engine_gone(w: Worker, within_s: float) -> bool:
    """Is the engine of `w` dead: its port refuses connections, or its health endpoint answers
    anything but 200 (an engine whose core died: SGLang's and vLLM's /health say 503)? An engine
    that does not answer within `within_s` (hung, or busy) is not found dead."""
    headers = [(b"accept", b"*/*")]
    if w.authorization is not None:
        headers.append((b"authorization", w.authorization))
    try:
        async with asyncio.timeout(within_s):
            resp = await w.pool.request("GET", w.adapter.health_path, headers, None)
            try:
                await resp.read()
            except BaseException:
                resp.abort()
                raise
            resp.release()
    except LocalResourceError:
        return False  # the gateway's own shortage: no verdict
    except UpstreamConnectError:
        return True
    except (TimeoutError, UpstreamProtocolError):
        return False
    return resp.status != 200


class Quarantine:
    """The fingerprints of requests that coincided with engine deaths (`_deaths`: how many, until
    when they are remembered) and those quarantined (`_until`: two deaths or more), each until
    it expires (one per Orchestrator)."""

    __slots__ = ("_deaths", "_until", "metrics", "probe_s", "registry", "seconds")

    def __init__(self, registry: Registry, metrics: GatewayMetrics, seconds: float, probe_s: float) -> None:
        self.registry = registry
        self.metrics = metrics
        self.seconds = seconds
        self.probe_s = probe_s
        self._deaths: dict[bytes, tuple[int, float]] = {}
        self._until: dict[bytes, float] = {}

    def __len__(self) -> int:
        return len(self._until)

    def check(self, ctx: RequestContext) -> None:
        """Raise `RequestQuarantined` for a request identical to a quarantined one. Costs
        nothing while none is (the fingerprint is taken only then)."""
        if not self._until:
            return
        key = fingerprint(ctx)
        until = self._until.get(key)
        if until is None:
            return
        left = until - time.monotonic()
        if left <= 0:
            del self._until[key]
            return
        self.metrics.child(self.metrics.query_of_death, "refused").inc()
        log.warning(
            "request.quarantined", request_id=ctx.request_id, fingerprint=key.hex(), left_s=round(left, 1)
        )
        raise RequestQuarantined(
            "identical requests were in flight when two engines died, so this one is not sent to "
            f"any engine for another {left:.0f}s",
            retry_after_s=max(1.0, left),
        )

    async def held(self, ctx: RequestContext, e: UpstreamFailure) -> list[str]:
        """An attempt's engine failed the request it held (`e.held`): probe whether the
        attempt's engines died (both legs of a P/D attempt: a query of death kills the prefill
        and the decode it is sent to). Each death, or else a broken connection, counts against
        the request (`ctx.drops`): at two it gets no other try (`e.instead` is then what its
        client is told). Each death is remembered against the request's fingerprint; the
        second quarantines it. Returns the workers found dead."""
        ids = ctx.planned or ((e.worker,) if e.worker is not None else ())
        workers = [w for i in ids if (w := self.registry.find(i)) is not None]
        gone = await asyncio.gather(*(engine_gone(w, self.probe_s) for w in workers))
        died = [w.id for w, g in zip(workers, gone, strict=True) if g]
        ctx.drops += len(died) or int(e.dropped)
        for worker in died:
            self._died(ctx, e, worker)
        if ctx.drops > 1:
            self.metrics.child(self.metrics.query_of_death, "not_retried").inc()
            e.instead = DroppedTwice(
                "engines died or broke their connection while holding this request, twice; "
                "it is not tried on another"
            )
        return died

    def _died(self, ctx: RequestContext, e: UpstreamFailure, worker: str) -> None:
        """The engine holding the request died: one more death against its fingerprint. One
        alone quarantines nothing (an engine that crashes, or is stopped, fails every request it
        holds; each gets its one more try elsewhere); a second, on another engine, does."""
        self.metrics.child(self.metrics.query_of_death, "engine_died").inc()
        if self.seconds <= 0:
            return
        key = fingerprint(ctx)
        now = time.monotonic()
        count, until = self._deaths.pop(key, (0, 0.0))
        count = count + 1 if until > now else 1
        self._deaths[key] = (count, now + self.seconds)
        quarantined = count >= 2
        if quarantined:
            self._until.pop(key, None)
            self._until[key] = now + self.seconds
            self.metrics.child(self.metrics.query_of_death, "quarantined").inc()
        for kept in (self._deaths, self._until):
            while len(kept) > MAX_ENTRIES:
                del kept[next(iter(kept))]
        log.warning(
            "request.engine_died",
            request_id=ctx.request_id,
            worker=worker,
            fingerprint=key.hex(),
            deaths=count,
            quarantined_s=self.seconds if quarantined else None,
            error=e.detail,
        )
