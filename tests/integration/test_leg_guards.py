"""Engine legs as guards (gateway/orchestration/legs.py): however a leg ends (it completes, its
engine fails, its client goes away), its worker's load counters come back, its engine stops
working on it (the connection closed, SGLang's `/abort_request` sent), and its outcome reaches
the worker's breaker, and the attempt's records, exactly once.

Real sockets: an upstream HTTP server stands in for the engine (it records what reaches it), a
front server runs each scenario inside a real request handler, whose task the front server
cancels when the client goes away."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest

from common.errors import UpstreamFailure
from common.outcomes import LegOutcome
from common.request import parse_request
from common.workers import Engine, Role, RouteKind
from gateway.breaker import CircuitBreaker
from gateway.http import HttpRequest, HttpResponder, HttpServer, start_server
from gateway.metrics import GatewayMetrics
from gateway.orchestration import Orchestrator, RequestContext
from gateway.orchestration.blame import LegShape, upstream_status_error
from gateway.orchestration.legs import Handoff, Leg
from gateway.registry import Registry, Worker
from policies.build import build_policy
from policies.config import RoundRobinCfg

BODY = b'{"model":"m","prompt":"hello","max_tokens":4}'


class CountingRegistry(Registry):
    """The real registry, which also notes each verdict it is given (the breakers' input)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, bool | None]] = []
        self.pair_records: list[tuple[str, str, bool | None]] = []

    def record(self, w: Worker, ok: bool | None) -> None:
        self.records.append((w.id, ok))
        super().record(w, ok)

    def record_pair(
        self,
        p: Worker,
        d: Worker,
        pair: CircuitBreaker,
        ok: bool | None,
        *,
        suspects: tuple[Worker, ...] = (),
        request: object = None,
    ) -> None:
        self.pair_records.append((p.id, d.id, ok))
        super().record_pair(p, d, pair, ok, suspects=suspects, request=request)


@dataclass
class Upstream:
    """An upstream that records the requests reaching it; `mode` says how it answers."""

    mode: str = "hang"  # "hang": never answers; "fail": a 500; "ok": a 200
    paths: list[str] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    gone: asyncio.Event = field(default_factory=asyncio.Event)  # a held request's connection closed
    aborted: asyncio.Event = field(default_factory=asyncio.Event)

    async def __call__(self, req: HttpRequest, res: HttpResponder) -> None:
        self.paths.append(req.path)
        if req.path == "/abort_request":
            self.aborted.set()
            res.send(200, [(b"content-type", b"application/json")], b"{}")
            return
        self.arrived.set()
        if self.mode == "fail":
            res.send(500, [(b"content-type", b"application/json")], b'{"error":"engine failed"}')
        elif self.mode == "ok":
            res.send(200, [(b"content-type", b"application/json")], b'{"choices":[{"text":"ok"}]}')
        else:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.gone.set()
                raise


Scenario = Callable[[RequestContext, Orchestrator, CountingRegistry], Awaitable[None]]


@dataclass
class Rig:
    registry: CountingRegistry
    orch: Orchestrator
    front: HttpServer
    contexts: list[RequestContext]
    ended: asyncio.Event


@asynccontextmanager
async def rig(scenario: Scenario, *engines: tuple[str, Role, Upstream]) -> AsyncIterator[Rig]:
    registry = CountingRegistry()
    upstreams = []
    for wid, role, engine in engines:
        up = await start_server(engine, "127.0.0.1", 0)
        upstreams.append(up)
        w = Worker(wid, f"http://127.0.0.1:{up.port}", role, Engine.SGLANG, model="m")
        registry.add(w)
        w.healthy = True
    orch = Orchestrator(registry, build_policy(RoundRobinCfg()), GatewayMetrics())
    contexts: list[RequestContext] = []
    ended = asyncio.Event()

    async def handler(req: HttpRequest, res: HttpResponder) -> None:
        parsed = parse_request(
            RouteKind.COMPLETIONS, req.path, BODY, default_model=None, max_n=8, max_tokens_cap=None
        )
        assert res.task is not None
        ctx = orch.context(parsed, "leg-test", res, res.task)
        contexts.append(ctx)
        try:
            await scenario(ctx, orch, registry)
        finally:
            ended.set()

    front = await start_server(handler, "127.0.0.1", 0)
    try:
        yield Rig(registry, orch, front, contexts, ended)
    finally:
        await front.close()
        for up in upstreams:
            await up.close()
        await registry.close()
        await orch.drain_background(1.0)


async def _send(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\n{}")
    await writer.drain()
    return reader, writer


async def _colocated(ctx: RequestContext, orch: Orchestrator, registry: CountingRegistry) -> None:
    w = registry.get("w")
    body = w.adapter.colocated_body(ctx.req, ctx.request_id)  # names the request: its rid
    async with Leg(orch.s, ctx, w, ctx.tokens, Role.COLOCATED, LegShape.ALONE) as leg:
        leg.resp = await w.pool.request("POST", "/v1/completions", ctx.headers, body)
        out = await leg.resp.read()
        leg.resp.release()
        if leg.resp.status != 200:
            raise upstream_status_error(leg.resp.status, out, w.id, "colocated")
        ctx.res.send(200, [(b"content-type", b"application/json")], out)
        leg.complete()


async def test_a_leg_whose_client_leaves_is_aborted_freed_and_reported_once() -> None:
    engine = Upstream("hang")
    async with rig(_colocated, ("w", Role.COLOCATED, engine)) as r:
        _, writer = await _send(r.front.port)
        await asyncio.wait_for(engine.arrived.wait(), 5)
        assert r.registry.get("w").inflight == 1
        writer.close()  # the client goes away: the front server cancels the handler
        await asyncio.wait_for(r.ended.wait(), 5)
        await asyncio.wait_for(engine.gone.wait(), 5)  # its connection to the engine closed
        await asyncio.wait_for(engine.aborted.wait(), 5)  # and SGLang's abort call sent
        w = r.registry.get("w")
        assert w.inflight == 0 and w.inflight_tokens == 0
        assert r.registry.records == [("w", None)]  # no verdict: the client left
        [ctx] = r.contexts
        assert [rec.outcome for rec in ctx.attempt.legs] == [LegOutcome.NO_VERDICT]


async def test_a_leg_whose_engine_fails_is_reported_once_as_its_failure() -> None:
    engine = Upstream("fail")
    async with rig(_colocated, ("w", Role.COLOCATED, engine)) as r:
        _, writer = await _send(r.front.port)
        await asyncio.wait_for(r.ended.wait(), 5)
        w = r.registry.get("w")
        assert w.inflight == 0 and w.inflight_tokens == 0
        assert r.registry.records == [("w", False)]
        assert w.breaker._failures == 1
        [ctx] = r.contexts
        [rec] = ctx.attempt.legs
        assert (rec.worker_id, rec.role, rec.outcome, rec.error) == (
            "w",
            "colocated",
            LegOutcome.FAILED,
            "upstream_error",
        )
        await asyncio.wait_for(engine.aborted.wait(), 5)  # a leg that did not complete is aborted
        writer.close()


async def test_a_completed_leg_is_not_aborted_and_counts_once() -> None:
    engine = Upstream("ok")
    async with rig(_colocated, ("w", Role.COLOCATED, engine)) as r:
        _, writer = await _send(r.front.port)
        await asyncio.wait_for(r.ended.wait(), 5)
        await asyncio.sleep(0.1)
        assert engine.paths == ["/v1/completions"]  # no abort call
        assert r.registry.records == [("w", True)]
        [ctx] = r.contexts
        [leg_record] = ctx.attempt.legs
        assert leg_record.outcome is LegOutcome.DONE
        writer.close()


@pytest.mark.parametrize("again", ["close", "report"])
async def test_reporting_a_leg_again_changes_nothing(again: str) -> None:
    seen: list[Leg] = []

    async def scenario(ctx: RequestContext, orch: Orchestrator, registry: CountingRegistry) -> None:
        w = registry.get("w")
        try:
            async with Leg(orch.s, ctx, w, ctx.tokens, Role.COLOCATED, LegShape.ALONE) as leg:
                seen.append(leg)
                raise UpstreamFailure("worker w: reset", phase="colocated", worker="w")
        except UpstreamFailure:
            pass
        leg = seen[0]
        if again == "close":
            leg.close(None)  # a second close, as a Handoff's exit meets a leg that ended before it
        else:
            assert leg.report(None) is LegOutcome.FAILED
        ctx.res.send(200, [], b"")

    async with rig(scenario, ("w", Role.COLOCATED, Upstream("ok"))) as r:
        _, writer = await _send(r.front.port)
        await asyncio.wait_for(r.ended.wait(), 5)
        w = r.registry.get("w")
        assert r.registry.records == [("w", False)] and w.inflight == 0 and w.inflight_tokens == 0
        assert len(r.contexts[0].attempt.legs) == 1
        writer.close()


async def _handoff(ctx: RequestContext, orch: Orchestrator, registry: CountingRegistry) -> None:
    """Both legs of an SGLang handoff in flight at once, as run_concurrent starts them."""
    p, d = registry.get("p"), registry.get("d")
    pleg = Leg(orch.s, ctx, p, ctx.view.prompt_tokens, Role.PREFILL, LegShape.CONCURRENT)
    dleg = Leg(orch.s, ctx, d, ctx.tokens, Role.DECODE, LegShape.CONCURRENT)
    body = p.adapter.colocated_body(ctx.req, ctx.request_id)  # (a rid to abort by is all it needs)
    async with Handoff(orch.s, ctx, pleg, dleg, concurrent=True):
        pleg.call = p.pool.fetch("POST", "/v1/completions", ctx.headers, body, replay=False)
        dleg.call = d.pool.start("POST", "/v1/completions", ctx.headers, body, replay=False)
        status, _ = await pleg.call
        pleg.free()
        if status != 200:
            raise UpstreamFailure(
                f"prefill p answered HTTP {status}", phase="prefill", worker="p", answered=True
            )
        pleg.complete()
        dleg.resp = await dleg.call
        await dleg.resp.read()


async def test_a_handoff_whose_client_leaves_stops_both_legs_and_reports_each_once() -> None:
    prefill, decode = Upstream("hang"), Upstream("hang")
    async with rig(_handoff, ("p", Role.PREFILL, prefill), ("d", Role.DECODE, decode)) as r:
        _, writer = await _send(r.front.port)
        await asyncio.wait_for(asyncio.gather(prefill.arrived.wait(), decode.arrived.wait()), 5)
        writer.close()
        await asyncio.wait_for(r.ended.wait(), 5)
        await asyncio.wait_for(asyncio.gather(prefill.gone.wait(), decode.gone.wait()), 5)
        await asyncio.wait_for(asyncio.gather(prefill.aborted.wait(), decode.aborted.wait()), 5)
        for wid in ("p", "d"):
            w = r.registry.get(wid)
            assert w.inflight == 0 and w.inflight_tokens == 0
        assert r.registry.records == [("p", None), ("d", None)]
        assert r.registry.pair_records == [("p", "d", None)]


async def test_a_handoff_whose_prefill_fails_blames_the_prefill_alone() -> None:
    prefill, decode = Upstream("fail"), Upstream("hang")
    async with rig(_handoff, ("p", Role.PREFILL, prefill), ("d", Role.DECODE, decode)) as r:
        _, writer = await _send(r.front.port)
        await asyncio.wait_for(r.ended.wait(), 5)
        await asyncio.wait_for(decode.gone.wait(), 5)  # the decode waiting for KV is stopped
        await asyncio.wait_for(decode.aborted.wait(), 5)
        for wid in ("p", "d"):
            w = r.registry.get(wid)
            assert w.inflight == 0 and w.inflight_tokens == 0
        # the prefill answered its own failure: its breaker counts it; the decode was cut short
        assert r.registry.records == [("p", False), ("d", None)]
        assert r.registry.pair_records == [("p", "d", False)]
        [ctx] = r.contexts
        assert [(x.worker_id, x.outcome) for x in ctx.attempt.legs] == [
            ("p", LegOutcome.FAILED),
            ("d", LegOutcome.SPARED),
        ]
        writer.close()
