"""The colocated shape: one worker does both phases (a colocated worker, or a decode worker that
prefills itself). One leg; its answer is relayed as it comes."""

from __future__ import annotations

from common.errors import UpstreamTimeout
from common.workers import Role
from gateway.http.errors import UpstreamConnectError, UpstreamProtocolError
from gateway.orchestration.blame import LegShape, leg_failure
from gateway.orchestration.context import Phase, RequestContext
from gateway.orchestration.feedback import read_colocated
from gateway.orchestration.legs import Leg
from gateway.orchestration.relay import relay
from gateway.orchestration.services import Services, engine_headers
from gateway.registry import Worker


async def run_colocated(s: Services, ctx: RequestContext, w: Worker) -> None:
    req = ctx.req
    body = w.adapter.colocated_body(req, ctx.request_id)
    async with Leg(s, ctx, w, ctx.tokens, Role.COLOCATED, LegShape.ALONE) as leg:
        ctx.attempt.phase = Phase.PREFILL
        wait_s = s.head_budget(req, w, s.cfg.timeouts.prefill_s)
        try:
            try:
                with ctx.wheel.after(wait_s, ctx.task):
                    leg.resp = await w.pool.request("POST", req.path, engine_headers(w, ctx.headers), body)
            except TimeoutError:
                raise UpstreamTimeout(
                    f"worker {w.id} sent no response headers within {wait_s:g}s",
                    phase="first_byte",
                    worker=w.id,
                    public=f"the engine sent no response headers within {wait_s:g}s",
                ) from None
            await relay(s, ctx, leg.resp, w, phase="colocated")
        except (UpstreamConnectError, UpstreamProtocolError) as e:
            raise leg_failure(e, f"worker {w.id}", "colocated", w.id) from None
        leg.complete()
        if s.needs.cached_tokens:
            read_colocated(ctx, w, leg.resp)
