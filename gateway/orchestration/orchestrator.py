"""`Orchestrator`: the request path's facade, which the handlers call.

    ctx = orchestrator.context(parsed, request_id, res, authorization)
    await orchestrator.serve(ctx)

`serve` runs attempts until one serves the request or none is left: each plans with the policy
(`_plan`: attempts.plan), runs the plan (dispatch.execute) and, on a retryable failure before
the first byte (`_failed`), the next attempt plans again with what failed excluded, following
the fallback ladder (attempts). At the end it answers what failed (an error, or an SSE error event after the first
byte), counts the request and writes its access log line.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from common.errors import (
    ErrorCode,
    GatewayError,
    ShortOfResources,
    UpstreamFailure,
    UpstreamTimeout,
    cancelled_outcome,
    sse_error_event,
)
from common.outcomes import Timings
from common.request import ParsedRequest
from common.workers import RouteKind
from gateway.cache_metrics import hold_source
from gateway.config import GatewayConfig
from gateway.deadlines import DeadlineWheel
from gateway.http.server import HttpResponder, Responder
from gateway.logging import debug_enabled, get_logger, info_enabled, line_logger
from gateway.metrics import GatewayMetrics
from gateway.orchestration.attempts import backoff_s, out_of_rungs, plan, rung
from gateway.orchestration.blame import exclusions
from gateway.orchestration.context import Attempt, Phase, RequestContext, request_view
from gateway.orchestration.decisions import explain_plan
from gateway.orchestration.dispatch import execute
from gateway.orchestration.keying import later
from gateway.orchestration.public import screened
from gateway.orchestration.quarantine import Quarantine
from gateway.orchestration.services import Services
from gateway.orchestration.sizing import exceeded, outgrows
from gateway.orchestration.token_bounds import TokenBounds
from gateway.registry import Registry
from policies.base import Completed, Failed, Policy, routed_event, wants
from policies.snapshot import Colocated, Disaggregated, Reject, RequestView

# Enum members as module constants on the request path: on Python 3.11 a class attribute of an
# Enum goes through EnumType.__getattr__'s slot hook, unspecialised; a global does not
# (gateway/breaker.py)
_DONE = Phase.DONE

Plan = Colocated | Disaggregated | Reject

log = get_logger("pd_gateway.request")

# after running out of descriptors, pools keep no idle connection this long
SHORTAGE_S = 4.0


class Orchestrator:
    def __init__(
        self,
        registry: Registry,
        policy: Policy,
        metrics: GatewayMetrics,
        cfg: GatewayConfig | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.registry = registry
        self.policy = policy
        self.metrics = metrics
        self.cfg = cfg or GatewayConfig()
        self.s = Services(registry, policy, metrics, self.cfg, rng or random.Random())
        r = self.cfg.retries
        self.quarantine = Quarantine(registry, metrics, r.quarantine_s, r.death_probe_s)
        self.bounds = TokenBounds(registry, metrics, r.quarantine_s, r.unproven_after_death == "probe")
        self._log_done = info_enabled(log)  # the access log line is built only when it is written
        self._access = line_logger(log)  # what writes it
        self._log_decisions = debug_enabled(log)  # decision records: at debug level
        self._wheel: DeadlineWheel | None = None
        self._done_metrics: dict[tuple[RouteKind, str, str, str], tuple[Any, Any, Any]] = {}

    @property
    def policy(self) -> Policy:
        return self._policy

    @policy.setter
    def policy(self, policy: Policy) -> None:
        self._policy = policy
        # a served request's `Completed` event is built only for a policy that observes it
        # (`policies.base.wants`: round robin does not, ~80 bytecodes a request)
        self._tell_completed = wants(policy, Completed)
        # a cache_aware policy that holds turns behind a running prefill (policies/inflight.py)
        self._hold = hold_source(policy)

    # -- entry ---------------------------------------------------------------------------------

    def view(self, req: ParsedRequest, request_id: str) -> RequestView:
        s = self.s
        keyed = s.needs.prompt_key
        return request_view(
            req,
            request_id,
            self.cfg.guards.chars_per_token_estimate,
            keyed,
            tokenizer=s.tokenizer() if keyed else None,
        )

    def context(
        self,
        req: ParsedRequest,
        request_id: str,
        res: Responder,
        task: asyncio.Task[None],
        auth: bytes | None = None,
        session: bytes | None = None,
    ) -> RequestContext:
        """A request's context, for `serve`: `task` is its handler's (what its deadlines cancel),
        `auth` the client's Authorization header (forwarded where configured), `session` its
        session header's value (`session_headers`)."""
        echo = (b"x-request-id", request_id.encode())
        headers = [(b"content-type", b"application/json"), echo]
        if auth is not None and self.cfg.forward_authorization:
            headers.append((b"authorization", auth))
        wheel = self._wheel
        if wheel is None or wheel.loop is not task.get_loop():
            wheel = self._wheel = DeadlineWheel(task.get_loop())
        keyed = self.s.needs.prompt_key
        deferred = self.s.offloaded(req) if keyed else None  # (tokenized as it is served: `serve`)
        view = request_view(
            req,
            request_id,
            self.cfg.guards.chars_per_token_estimate,
            keyed,
            session,
            self.s.tokenizer() if keyed and deferred is None else None,
        )
        ctx = RequestContext(req, request_id, res, task, view, wheel, headers, echo)
        ctx.client_sized = outgrows(view, self.cfg.timeouts)
        ctx.tokenize = deferred
        return ctx

    async def serve(self, ctx: RequestContext) -> None:
        """Serve one request: attempts until one serves it or none is left (module docstring)."""
        ctx.began = time.monotonic()
        try:
            with ctx.wheel.after(self.cfg.timeouts.total_s, ctx.task) as ctx.total:
                if ctx.tokenize is not None and await later(ctx):
                    ctx.client_sized = outgrows(ctx.view, self.cfg.timeouts)
                self.quarantine.check(ctx)  # a copy of a request that coincided with an engine death
                if ctx.req.index_id >= 0 and not self.bounds.proven(ctx):
                    await self.bounds.turn(ctx)  # token ids above every one served (token_bounds.py)
                while True:
                    p = self._plan(ctx)
                    if ctx.hold_s > 0.0:  # (deadlines and a client leaving cancel it as any wait)
                        await asyncio.sleep(ctx.hold_s)
                        ctx.hold_s = 0.0
                    try:
                        await execute(self.s, ctx, p)
                    except UpstreamFailure as e:
                        if e.held:  # the engine may have died of it: one more try at most
                            died = await self.quarantine.held(ctx, e)
                            if died and ctx.unproven:  # of its unproven token ids: no other try
                                self.bounds.killed(ctx, e, died)
                        # raises when no other attempt may follow; else after the backoff
                        await asyncio.sleep(self._failed(ctx, e))
                        continue
                    self._served(ctx)
                    if ctx.unproven:
                        self.bounds.done(ctx, served=True)
                    return
        except TimeoutError:
            if ctx.client_sized:  # its own size explains it: the client's (sizing.py)
                ctx.outcome = ErrorCode.REQUEST_EXCEEDS_DEADLINE.value
                self._fail(ctx, exceeded(ctx.view, self.cfg.timeouts))
            else:
                ctx.outcome = "timeout"
                self._fail(ctx, UpstreamTimeout("the request exceeded its total deadline", phase="total"))
        except GatewayError as e:
            if isinstance(e, UpstreamFailure) and e.instead is not None:
                e = e.instead
            elif isinstance(e, ShortOfResources):
                # out of descriptors: every pool gives back what it keeps idle, for a while
                for w in self.registry.workers():
                    w.pool.shed_idle(SHORTAGE_S)
            ctx.outcome = e.code.value
            self._fail(ctx, e)
        except asyncio.CancelledError as e:
            # the gateway's shutdown cancels with its own message (Handlers.cut); any other
            # cancellation of a request is its client leaving: gone, or cut by the server for
            # reading nothing (timeouts.client_stall_s), which aborts its connection likewise
            res = ctx.res
            ctx.outcome = cancelled_outcome(e, isinstance(res, HttpResponder) and res.stalled_s > 0)
            raise
        finally:
            if ctx.unproven:  # not served: the next unproven request of its model may go
                self.bounds.done(ctx, served=False)
            if ctx.routed:  # ended without `Completed` or `Failed`: the policy hears how
                self._unrouted(ctx)
            self._done(ctx)

    def _unrouted(self, ctx: RequestContext) -> None:
        """The attempt the policy was told about ended otherwise than served or failed by an
        engine (the client left, the total deadline, the gateway's own refusal after planning):
        a `Failed` event, so that what the policy counts per request never drifts."""
        ctx.routed = False
        out = ctx.outcome
        phase = (
            "cancelled" if out in ("timeout", "client_gone", "client_stalled", "shutting_down") else "refused"
        )
        self._policy.observe(Failed(ctx.request_id, ctx.planned, phase, legs=tuple(ctx.attempt.legs)))

    def _plan(self, ctx: RequestContext) -> Plan:
        """The next attempt's plan, with what failed excluded; after a failure it must be a rung
        of the ladder (else the request fails for good: raised)."""
        ctx.attempt_no += 1
        p = plan(self.s, ctx.view, ctx.req, ctx.exclude)
        if ctx.last_error is not None:
            step = rung(p)
            if step is None or step not in self.cfg.fallback.ladder:
                raise out_of_rungs(self.s, ctx.last_error)
            self.metrics.child(self.metrics.fallbacks, step).inc()
            # after the rung check: a request that fails for good keeps its last attempt's plan
            # and phase in its metrics and log line
            ctx.attempt = Attempt()
        else:
            ctx.attempt.started = time.monotonic()  # (made with the context, before admission)
        if not isinstance(p, Reject):
            ctx.attempt.decision = p.reason
            routed = routed_event(ctx.view, p)
            ctx.planned = routed.worker_ids  # (`plan_worker_ids(p)`, made once for both)
            if ctx.explain or self._log_decisions:
                explain_plan(self.s, ctx, p)
            ctx.routed = True
            self._policy.observe(routed)
            if self._hold is not None:
                ctx.hold_s = self._hold(ctx.request_id)
        return p

    def _served(self, ctx: RequestContext) -> None:
        a = ctx.attempt
        a.phase = _DONE
        ctx.routed = False
        if not self._tell_completed:
            return
        # a stream's first token (its first content from the engine: the response head goes
        # out before any work is done), a whole answer's first byte (its last)
        first = a.first_token_at if ctx.req.stream and a.first_token_at else a.first_byte_at
        ttft = (first - ctx.began) if first else None
        # the plan's workers (a moved vLLM decode's new one)
        self._policy.observe(
            Completed(
                ctx.request_id,
                ctx.planned,
                ttft_s=ttft,
                cached_tokens=a.cached,
                output_tokens=a.output_tokens or 0,
                legs=tuple(a.legs),
                timings=_timings(a, ctx.req.stream),
            )
        )

    def _failed(self, ctx: RequestContext, e: UpstreamFailure) -> float:
        """An attempt failed: told to the policy and counted; raises `e` when no other attempt
        may follow, else returns the backoff before the next, with what failed excluded from
        its plan."""
        a = ctx.attempt
        ctx.history.append(f"{a.plan_kind}:{a.phase.value}:{e.code.value}")
        ran = ctx.planned  # the plan's workers (a moved vLLM decode's new one)
        ctx.routed = False
        self._policy.observe(Failed(ctx.request_id, ran, e.phase, legs=tuple(a.legs)))
        self.metrics.child(self.metrics.upstream_errors, e.worker or "", e.phase, e.code.value).inc()
        if ctx.responded or ctx.attempt_no >= self.cfg.retries.max_attempts or ctx.drops > 1:
            raise e
        ctx.last_error = e
        ctx.exclude.update(exclusions(ran, e))
        if a.moved_from:  # decodes it could not reach: failed for this request
            ctx.exclude.update(a.moved_from)
        self.metrics.child(self.metrics.retries, e.phase).inc()
        log.info(
            "request.retry",
            request_id=ctx.request_id,
            attempt=ctx.attempt_no,
            phase=e.phase,
            worker=e.worker,
            error=e.detail,
        )
        return backoff_s(ctx.attempt_no, self.cfg.retries, self.s.rng)

    # -- the end of a request -------------------------------------------------------------------

    def _fail(self, ctx: RequestContext, e: GatewayError) -> None:
        """Answer the request's failure: its client gets `e`'s public words (an engine's own
        refusal only where it names no internals: `public.screened`), the log its detail."""
        ctx.error = e.detail
        res = ctx.res
        if res.closed:
            return
        e = screened(e, self.registry.addresses())
        if res.started:
            # Mid-stream: a final error event and the end of the stream; no [DONE] after it.
            res.write(sse_error_event(e.client_message(ctx.request_id), e.type, e.code.value))
            res.end()
        else:
            # errors name their request too
            res.send(e.status, [*e.headers(), ctx.echo, *ctx.extra], e.body(ctx.request_id))

    def _done(self, ctx: RequestContext) -> None:
        """The request's counters and latency figures, and its access log line."""
        end = time.monotonic()
        req, a = ctx.req, ctx.attempt
        key = (req.route, req.model, a.plan_kind, ctx.outcome)
        done = self._done_metrics.get(key)
        if done is None:
            done = self._done_metrics_for(key)
        done[0].inc()
        done[1].observe(end - ctx.began)
        if a.first_byte_at:
            done[2].observe(a.first_byte_at - ctx.began)
        if self._log_done:
            self._log_request(ctx, end)

    def _done_metrics_for(self, key: tuple[RouteKind, str, str, str]) -> tuple[Any, Any, Any]:
        """The request counter, latency and TTFT children for one (route, model, plan, outcome),
        looked up once and then kept: three label lookups per request become one."""
        route, model, plan_kind, outcome = key[0].value, key[1], key[2], key[3]
        m = self.metrics
        label = self.registry.model_label(model)
        children = (
            m.child(m.requests, route, label, plan_kind, outcome),
            m.child(m.e2e, route, plan_kind),
            m.child(m.ttft, route, plan_kind),
        )
        if label == model and len(self._done_metrics) < 10_000:  # client-chosen names: not kept
            self._done_metrics[key] = children
        return children

    def _log_request(self, ctx: RequestContext, end: float) -> None:
        """The per-request access log line (only built when info is logged)."""
        req, a, began = ctx.req, ctx.attempt, ctx.began
        self._access.info(
            "request.done",
            request_id=ctx.request_id,
            model=req.model[:200],  # a client's name for it, served or not: never a whole body
            route=req.route._value_,  # `.value` is a Python-level property: two calls
            plan=a.plan_kind,
            decision=a.decision or None,
            prefill=a.prefill,
            decode=a.decode,
            attempts=ctx.attempt_no,
            failed_attempts=ctx.history or None,
            phase=a.phase._value_,
            outcome=ctx.outcome,
            duration_ms=round((end - began) * 1000, 3),
            ttft_ms=round((a.first_byte_at - began) * 1000, 3) if a.first_byte_at else None,
            prefill_ms=round((a.prefill_done_at - a.started) * 1000, 3) if a.prefill_done_at else None,
            error=ctx.error,
        )

    async def drain_background(self, within_s: float = 5.0) -> None:
        await self.s.drain(within_s)


def _timings(a: Attempt, stream: bool) -> Timings:
    """When the served attempt's phases ended, from its start (`common.outcomes.Timings`)."""
    start = a.started
    return Timings(
        end_s=time.monotonic() - start,
        prefill_s=(a.prefill_done_at - start) if a.prefill_done_at else None,
        first_token_s=(a.first_token_at - start) if stream and a.first_token_at else None,
        chunks=a.chunks,
        output_tokens=a.output_tokens,
    )
