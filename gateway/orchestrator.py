"""Runs one request's plan: colocated, SGLang-style concurrent P/D, or vLLM-style sequential P/D.

Per request: plan with the policy → execute through the worker's adapter → relay the decode's
bytes to the client. Failures before the first byte reached the client are retried on another
worker or pair (the failed ones excluded) up to `retries.max_attempts`; after the first byte,
the client's stream ends with an SSE error event, never a clean `[DONE]`.

Every engine request is tied to the client's: when the client goes away (the server cancels the
handler) or a phase deadline expires, both legs are cancelled, their connections closed (vLLM's
abort), and SGLang's `/abort_request` is sent, so no engine keeps working for nobody.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import random
import time
from collections.abc import Callable
from typing import Any

import msgspec

from adapters import EngineAdapter, HandoffCtx, HandoffMode, PrefillVerdict
from common.errors import (
    BadRequest,
    ContextLengthExceeded,
    GatewayError,
    KVIntegrityError,
    ModelNotFound,
    NoWorker,
    PrefillFailed,
    ShortOfResources,
    UpstreamFailure,
    UpstreamRejected,
    UpstreamTimeout,
    cancelled_outcome,
    sse_error_event,
)
from common.jsonbytes import iter_sse_data
from common.jsonbytes import rewrite as _body_rewrite
from common.request import ParsedRequest
from common.summary import Summary
from common.workers import Engine, Role, RouteKind, WorkerState
from gateway.deadlines import DeadlineWheel
from gateway.guards import Guard, GuardSettings, check_decode, preflight
from gateway.http.client import UpstreamResponse
from gateway.http.errors import LocalResourceError, UpstreamConnectError, UpstreamProtocolError
from gateway.http.server import HttpResponder, Responder
from gateway.ids import new_room
from gateway.logging import get_logger, info_enabled
from gateway.metrics import GatewayMetrics
from gateway.registry import Registry, Worker
from gateway.samples import SampleMerger, sample_request, unit_count
from gateway.streamwatch import StreamStopped, StreamWatch
from policies.base import Completed, Failed, Policy, pair_id, plan_worker_ids, routed_event
from policies.snapshot import Colocated, Disaggregated, Reject, RequestView

log = get_logger("pd_gateway.request")

_EVENT_STREAM = b"text/event-stream"


class Timeouts(msgspec.Struct, frozen=True):
    connect_s: float = 2.0
    prefill_s: float = 60.0  # to the prefill's verdict (SGLang: also to the decode's headers)
    handoff_s: float = 30.0  # decode's response headers after the prefill finished
    # a non-streamed answer's headers come with its last token: per token it may generate, this
    # much is added to the wait for them (prefill_s colocated, handoff_s after a prefill)
    per_token_s: float = 0.25
    idle_s: float = 60.0  # between two body chunks of a stream
    total_s: float = 600.0  # the whole request
    abort_s: float = 2.0  # an abort call to an engine
    abort_repeat_s: float = 0.5  # the abort call is sent again after this long
    shortage_s: float = 4.0  # after running out of descriptors, pools keep no idle connection this long


class RetrySettings(msgspec.Struct, frozen=True):
    max_attempts: int = 3
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.2


def backoff_s(attempt: int, r: RetrySettings, rng: random.Random) -> float:
    """Delay before attempt `attempt + 1` (attempt counts from 1): exponential with jitter."""
    base = min(r.backoff_max_s, r.backoff_initial_s * r.multiplier ** (attempt - 1))
    return max(0.0, base * (1.0 + r.jitter * (2.0 * rng.random() - 1.0)))


class OrchestratorSettings(msgspec.Struct, frozen=True):
    timeouts: Timeouts = Timeouts()
    retries: RetrySettings = RetrySettings()
    chars_per_token: float = 4.0  # estimate for text prompts when no tokenizer is configured
    forward_authorization: bool = False
    guards: GuardSettings = GuardSettings()
    # rungs tried after a failure before the first byte: "other_pair", "colocated",
    # "decode_self_prefill", then "shed" (503 + Retry-After naming the failure) when none is left
    ladder: tuple[str, ...] = ("other_pair", "colocated", "decode_self_prefill", "shed")
    split_concurrency: int = 32  # handoffs of one split request (n > 1, SGLang batches) at once
    retry_after_s: float = 1.0  # Retry-After of a 503 for no route or no fallback left


class Phase(enum.StrEnum):
    """Where an attempt is. planned → prefill (SGLang: prefill ∥ decode) → handoff → streaming
    → done; a failure is recorded with the phase it happened in."""

    PLANNED = "planned"
    PREFILL = "prefill"
    HANDOFF = "handoff"
    STREAMING = "streaming"
    DONE = "done"


class _Attempt:
    """One attempt's state machine position and what it learned, for logging and metrics."""

    __slots__ = (
        "cut",
        "decode",
        "echo",
        "first_byte_at",
        "moved_from",
        "phase",
        "plan_kind",
        "prefill",
        "prefill_done_at",
        "started",
        "task",
        "wheel",
    )

    def __init__(self, echo: tuple[bytes, bytes], task: asyncio.Task[None], wheel: DeadlineWheel) -> None:
        self.task = task  # the request's handler task: what a deadline cancels
        self.wheel = wheel
        self.cut = False  # a split unit cancelled because a sibling failed: no verdict on its workers
        self.phase = Phase.PLANNED
        self.echo = echo  # the x-request-id header echoed to the client
        self.plan_kind = "none"
        self.prefill: str | None = None
        self.decode: str | None = None
        self.started = time.monotonic()
        self.prefill_done_at = 0.0
        self.first_byte_at = 0.0
        self.moved_from: list[str] | None = None  # vLLM decodes this attempt's decode leg left


class Orchestrator:
    def __init__(
        self,
        registry: Registry,
        policy: Policy,
        metrics: GatewayMetrics,
        settings: OrchestratorSettings | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.registry = registry
        self.policy = policy
        self.metrics = metrics
        self.settings = settings or OrchestratorSettings()
        self.rng = rng or random.Random()
        self._background: set[asyncio.Task[None]] = set()
        self._loop_time: Callable[[], float] = time.monotonic
        self._log_done = info_enabled(log)  # the access log line is built only when it is written
        self._wheel: DeadlineWheel | None = None
        self._done_metrics: dict[tuple[RouteKind, str, str, str], tuple[Any, Any, Any]] = {}

    # -- entry ---------------------------------------------------------------------------------

    def view(self, req: ParsedRequest, request_id: str) -> RequestView:
        units = (
            req.prompt_units
            if req.prompt_is_ids
            else int(req.prompt_units / self.settings.chars_per_token) + 1
        )
        return RequestView(
            request_id=request_id,
            model=req.model,
            route=req.route,
            prompt_tokens=units,
            max_tokens=req.accounting_max_tokens * req.n * req.batch,
            stream=req.stream,
            n=req.n,
            greedy=req.greedy,
            session_key=_session_key(req.fields.session_id) or req.fields.user,
        )

    async def serve(
        self, req: ParsedRequest, request_id: str, res: HttpResponder, auth: bytes | None
    ) -> None:
        started = time.monotonic()
        echo = (b"x-request-id", request_id.encode())
        headers = [(b"content-type", b"application/json"), echo]
        if auth is not None and self.settings.forward_authorization:
            headers.append((b"authorization", auth))
        view = self.view(req, request_id)
        exclude: set[str] = set()
        last_error: UpstreamFailure | None = None
        attempt_no = 0
        history: list[str] = []  # failed attempts: "plan:phase reached:error code"
        outcome = "ok"
        task: asyncio.Task[None] = res.task or asyncio.current_task()  # type: ignore[assignment]
        wheel = self._wheel
        if wheel is None or wheel.loop is not task.get_loop():
            wheel = self._wheel = DeadlineWheel(task.get_loop())
        a = _Attempt(echo, task, wheel)
        try:
            with wheel.after(self.settings.timeouts.total_s, task):
                while True:
                    attempt_no += 1
                    plan = self._plan(view, req, exclude)
                    if last_error is not None:
                        rung = _rung(plan)
                        if rung is None or rung not in self.settings.ladder:
                            raise self._out_of_rungs(last_error)
                        self.metrics.child(self.metrics.fallbacks, rung).inc()
                        # after the rung check: a request that fails for good keeps its last
                        # attempt's plan and phase in its metrics and log line
                        a = _Attempt(echo, task, wheel)
                    if not isinstance(plan, Reject):
                        res.planned = plan_worker_ids(plan)
                        self.policy.observe(routed_event(view, plan))
                    try:
                        await self._execute(plan, req, request_id, res, headers, view, a)
                        a.phase = Phase.DONE
                        self.policy.observe(
                            Completed(
                                request_id,
                                res.planned,  # the plan's workers (a moved vLLM decode's new one)
                                ttft_s=(a.first_byte_at - started) if a.first_byte_at else None,
                            )
                        )
                        return
                    except UpstreamFailure as e:
                        history.append(f"{a.plan_kind}:{a.phase.value}:{e.code.value}")
                        ran = res.planned  # the plan's workers (a moved vLLM decode's new one)
                        self.policy.observe(Failed(request_id, ran, e.phase))
                        self.metrics.child(
                            self.metrics.upstream_errors, e.worker or "", e.phase, e.code.value
                        ).inc()
                        if res.started or attempt_no >= self.settings.retries.max_attempts:
                            raise
                        last_error = e
                        exclude.update(_blame(ran, e))
                        if a.moved_from:  # decodes it could not reach: failed for this request
                            exclude.update(a.moved_from)
                        self.metrics.child(self.metrics.retries, e.phase).inc()
                        log.info(
                            "request.retry",
                            request_id=request_id,
                            attempt=attempt_no,
                            phase=e.phase,
                            worker=e.worker,
                            error=e.message,
                        )
                        await asyncio.sleep(backoff_s(attempt_no, self.settings.retries, self.rng))
        except TimeoutError:
            outcome = "timeout"
            self._fail(res, UpstreamTimeout("the request exceeded its total deadline", phase="total"), echo)
        except GatewayError as e:
            if isinstance(e, UpstreamFailure) and e.instead is not None:
                e = e.instead
            elif isinstance(e, ShortOfResources):
                # out of descriptors: every pool gives back what it keeps idle, for a while
                for w in self.registry.workers():
                    w.pool.shed_idle(self.settings.timeouts.shortage_s)
            outcome = e.code.value
            self._fail(res, e, echo)
        except asyncio.CancelledError as e:
            # the gateway's shutdown cancels with its own message (Handlers.cut); any other
            # cancellation of a request is its client leaving: gone, or cut by the server for
            # reading nothing (timeouts.client_stall_s), which aborts its connection likewise
            outcome = cancelled_outcome(e, res.stalled_s > 0)
            raise
        finally:
            end = time.monotonic()
            key = (req.route, req.model, a.plan_kind, outcome)
            done = self._done_metrics.get(key)
            if done is None:
                done = self._done_metrics_for(key)
            done[0].inc()
            done[1].observe(end - started)
            if a.first_byte_at:
                done[2].observe(a.first_byte_at - started)
            if self._log_done:
                self._log_request(req, request_id, a, attempt_no, history, outcome, started, end)

    def _done_metrics_for(self, key: tuple[RouteKind, str, str, str]) -> tuple[Any, Any, Any]:
        """The request counter, latency and TTFT children for one (route, model, plan, outcome),
        looked up once and then kept: three label lookups per request become one."""
        route, model, plan, outcome = key[0].value, key[1], key[2], key[3]
        m = self.metrics
        label = self.registry.model_label(model)
        children = (
            m.child(m.requests, route, label, plan, outcome),
            m.child(m.e2e, route, plan),
            m.child(m.ttft, route, plan),
        )
        if label == model and len(self._done_metrics) < 10_000:  # client-chosen names: not kept
            self._done_metrics[key] = children
        return children

    def _log_request(
        self,
        req: ParsedRequest,
        request_id: str,
        a: _Attempt,
        attempt_no: int,
        history: list[str],
        outcome: str,
        started: float,
        end: float,
    ) -> None:
        """The per-request access log line (only built when info is logged)."""
        log.info(
            "request.done",
            request_id=request_id,
            model=req.model[:200],  # a client's name for it, served or not: never a whole body
            route=req.route.value,
            plan=a.plan_kind,
            prefill=a.prefill,
            decode=a.decode,
            attempts=attempt_no,
            failed_attempts=history or None,
            phase=a.phase.value,
            outcome=outcome,
            duration_ms=round((end - started) * 1000, 3),
            ttft_ms=round((a.first_byte_at - started) * 1000, 3) if a.first_byte_at else None,
            prefill_ms=round((a.prefill_done_at - a.started) * 1000, 3) if a.prefill_done_at else None,
        )

    def _out_of_rungs(self, last: UpstreamFailure) -> GatewayError:
        """No rung left: shed with 503 + Retry-After naming what failed, or the failure itself
        (or what it says the client should be told instead)."""
        if last.instead is not None:
            return last.instead
        if "shed" not in self.settings.ladder:
            return last
        self.metrics.child(self.metrics.fallbacks, "shed").inc()
        return NoWorker(
            f"{last.message} (phase {last.phase}); no fallback left",
            code=last.code,
            retry_after_s=self.settings.retry_after_s,
        )

    def _plan(
        self, view: RequestView, req: ParsedRequest, failed: set[str]
    ) -> Colocated | Disaggregated | Reject:
        """The policy's plan. Pairs under KV suspicion are avoided, while any other route exists,
        by requests whose answers cannot be verified (sampling, n > 1, batches) and by streams
        (whose tokens would flow before the verdict; a failed one ends in an error event, so a
        colocated answer is better)."""
        snap = self.registry.snapshot()
        excl = self._exclude(failed)
        unable = self.registry.not_serving(req.route)
        if unable:
            excl = excl | unable
        if req.local_prefill is not None and req.local_prefill.all_engines:
            alone = self.registry.decodes_not_alone()
            if alone:
                excl = excl | alone
        suspects = self.registry.suspect_pairs()
        if suspects and (req.stream or not _verifiable(req)):
            plan = self.policy.plan(view, snap, excl | suspects)
            if not isinstance(plan, Reject) or plan.status == 404:
                return plan
        return self.policy.plan(view, snap, excl)

    def _exclude(self, failed: set[str]) -> frozenset[str]:
        """What the policy must avoid: ids that failed for this request, and open pairs."""
        open_pairs = self.registry.open_pairs()
        full = self.registry.full()
        if not failed and not full:
            return open_pairs
        return frozenset(failed) | open_pairs | full

    def _fail(self, res: HttpResponder, e: GatewayError, echo: tuple[bytes, bytes]) -> None:
        if res.closed:
            return
        if res.started:
            # Mid-stream: a final error event and the end of the stream; no [DONE] after it.
            res.write(sse_error_event(e.message, e.type, e.code.value))
            res.end()
        else:
            res.send(e.status, [*e.headers(), echo], e.body())  # errors name their request too

    # -- plans ---------------------------------------------------------------------------------

    async def _execute(
        self,
        plan: Colocated | Disaggregated | Reject,
        req: ParsedRequest,
        request_id: str,
        res: Responder,
        headers: list[tuple[bytes, bytes]],
        view: RequestView,
        a: _Attempt,
    ) -> None:
        tokens = view.prompt_tokens + view.max_tokens
        if isinstance(plan, Reject):
            if plan.status == 404:
                raise ModelNotFound(plan.reason, param="model")
            mine = [w for w in self.registry.workers() if w.model == req.model]
            if mine and not any(req.route in w.adapter.routes for w in mine):
                engines = ", ".join(sorted({w.engine.value for w in mine}))
                raise BadRequest(
                    f"model {req.model!r} is served by {engines} workers, which do not answer "
                    f"{req.path} (SGLang's native route); use /v1/completions or /v1/chat/completions",
                    param="model",
                )
            if req.local_prefill is not None and req.local_prefill.all_engines and mine:
                alone = self.registry.decodes_not_alone()
                if all(
                    w.role is not Role.COLOCATED and (w.role is Role.PREFILL or w.id in alone) for w in mine
                ):
                    raise BadRequest(
                        f"{req.local_prefill.why}, which model {req.model!r} cannot answer: it is "
                        "served only by SGLang prefill/decode pairs, and only the prefill computes "
                        "the prompt (the decode's answer would lack it); use /generate with "
                        "return_logprob and logprob_start_len, or serve the model on a colocated "
                        "worker too",
                        param=req.local_prefill.param,
                    )
            raise NoWorker(plan.reason, retry_after_s=self.settings.retry_after_s)
        chosen = (plan.worker,) if isinstance(plan, Colocated) else (plan.prefill, plan.decode)
        if req.max_id >= 0:
            _check_vocab(req, chosen)
        if self.settings.guards.length_preflight:
            why = preflight(
                req.prompt_peak,
                req.prompt_is_ids,
                req.max_tokens,
                chosen,
                self.settings.guards,
                pairs=req.prompt_pairs,
            )
            if why is not None:
                self._guard_failed(Guard.LENGTH_PREFLIGHT, "preflight", request_id, why)
                if why.startswith("max_tokens"):
                    param = "max_new_tokens" if req.route is RouteKind.GENERATE else "max_tokens"
                elif req.route is RouteKind.GENERATE:
                    param = "input_ids" if req.prompt_is_ids else "text"
                else:
                    param = "messages" if req.route is RouteKind.CHAT else "prompt"
                raise ContextLengthExceeded(why, param=param)
        if isinstance(plan, Colocated):
            w = self.registry.get(plan.worker.id)
            a.plan_kind, a.decode = "colocated", w.id
            await self._colocated(w, req, request_id, res, headers, tokens, a)
            return
        p = self.registry.get(plan.prefill.id)
        d = self.registry.get(plan.decode.id)
        if not d.adapter.supports_pd(req):
            # e.g. a vLLM batch: the decode worker (kv_both) serves it alone, correctly
            a.plan_kind, a.decode = "decode_self_prefill", d.id
            self.metrics.child(self.metrics.fallbacks, "decode_self_prefill").inc()
            await self._colocated(d, req, request_id, res, headers, tokens, a)
            return
        a.plan_kind, a.prefill, a.decode = "disaggregated", p.id, d.id
        a.phase = Phase.PREFILL
        if (req.n > 1 or req.is_batch) and d.adapter.splits_samples:
            await self._split_samples(p, d, plan, req, request_id, res, headers, view, a)
            return
        g = self.settings.guards
        ctx = HandoffCtx(
            request_id=request_id,
            prefill=plan.prefill,
            decode=plan.decode,
            room=new_room(self.rng),
            stream_usage=self._stream_usage(req),
            near_ties=g.near_tie_alternatives if req.greedy and p.near_ties and self._guarded(req) else 0,
            near_tie_margin=g.near_tie_margin,
        )
        if d.adapter.handoff is HandoffMode.CONCURRENT:
            await self._concurrent(p, d, ctx, req, res, headers, view, tokens, a)
        elif d.adapter.handoff is HandoffMode.SEQUENTIAL:
            await self._sequential(p, d, ctx, req, res, headers, view, tokens, a)
        else:
            raise NoWorker(f"engine {d.engine.value} has no P/D protocol")

    async def _colocated(
        self,
        w: Worker,
        req: ParsedRequest,
        request_id: str,
        res: Responder,
        headers: list[tuple[bytes, bytes]],
        tokens: int,
        a: _Attempt,
    ) -> None:
        body = w.adapter.colocated_body(req, request_id)
        self.registry.acquire(w, tokens)
        resp: UpstreamResponse | None = None
        ok = client_fault = False
        a.phase = Phase.PREFILL
        wait_s = self._head_budget(req, w, self.settings.timeouts.prefill_s)
        try:
            try:
                with a.wheel.after(wait_s, a.task):
                    resp = await w.pool.request("POST", req.path, _for(w, headers), body)
            except TimeoutError:
                raise UpstreamTimeout(
                    f"worker {w.id} sent no response headers within {wait_s:g}s",
                    phase="first_byte",
                    worker=w.id,
                ) from None
            await self._relay(resp, w, req, res, a, phase="colocated")
            ok = True
        except (UpstreamConnectError, UpstreamProtocolError) as e:
            raise _leg_failure(e, f"worker {w.id}", "colocated", w.id, a) from None
        except GatewayError as e:
            client_fault = not e.retryable  # an engine's 4xx: the request's fault, not the worker's
            raise
        finally:
            if not ok:
                self._abort_leg(w, resp, req, request_id)
            self.registry.release(w, tokens)
            self.registry.record(w, _judged(ok, True, client_fault, res.closed or a.cut))

    async def _concurrent(
        self,
        p: Worker,
        d: Worker,
        ctx: HandoffCtx,
        req: ParsedRequest,
        res: Responder,
        headers: list[tuple[bytes, bytes]],
        view: RequestView,
        tokens: int,
        a: _Attempt,
    ) -> None:
        """SGLang: prefill and decode start together; the decode's bytes are held until the
        prefill's verdict is in (its response arrives once the KV has been shipped)."""
        t = self.settings.timeouts
        pbody = p.adapter.prefill_body(req, ctx)
        dbody = d.adapter.decode_body(req, ctx, None)
        self.registry.acquire(p, view.prompt_tokens)
        self.registry.acquire(d, tokens)
        pair = self.registry.pair_breaker(p.id, d.id)
        # Futures, not Tasks: on pooled connections both requests are written right here and
        # resolved from the connections' callbacks.
        # never re-sent by the pool: each leg names a bootstrap room, used once (a copy of a leg
        # the engine already took would wait for KV that never comes); a retry gets a new room
        prefill_task = p.pool.fetch("POST", req.path, _for(p, headers), pbody, replay=False)
        decode_task = d.pool.start("POST", req.path, _for(d, headers), dbody, replay=False)
        resp: UpstreamResponse | None = None
        guard: _DecodeGuard | None = None
        ok_p = ok_d = client_fault = False
        p_held = True  # the prefill counts as in flight until its answer is in, not the decode's end
        t0 = time.monotonic()
        in_handoff = False
        culprit: str | None = None
        between = False  # the failure is of the handoff between the two (see record_pair)
        provoked = False  # the failure may be the request's own doing: no breaker verdict
        wait_s = t.handoff_s
        try:
            try:
                # One timer for both phases (rescheduled at the verdict) instead of one each.
                with a.wheel.after(t.prefill_s, a.task) as deadline:
                    status, prefill_out = await self._await_prefill(prefill_task, decode_task, p, d)
                    p_held = False
                    self.registry.release(p, view.prompt_tokens)
                    a.prefill_done_at = time.monotonic()
                    self.metrics.child(self.metrics.phase, "prefill").observe(a.prefill_done_at - t0)
                    verdict = p.adapter.judge_prefill(req, ctx, status, prefill_out)
                    if not verdict.ok:
                        # the decode, sent the same body, is waiting for this KV: it is aborted
                        # below. The guard's catch, unless the decode refused the request too
                        # (the request's fault) or the prefill failed (5xx: an upstream error)
                        took = (
                            status != 200
                            and status < 500
                            and not await _refused_too(decode_task, _AGREEMENT_S)
                        )
                        caught = status == 200 or took
                        raise self._prefill_refused(p, d, verdict, ctx.request_id, caught, decode_took=took)
                    ok_p = in_handoff = True
                    a.phase = Phase.HANDOFF
                    guard = self._decode_guard(req, ctx, p.adapter, prefill_out)
                    if not decode_task.done():
                        wait_s = self._head_budget(req, d, t.handoff_s)
                        deadline.reschedule(a.wheel.loop.time() + wait_s)
                    try:
                        resp = await decode_task
                    except (UpstreamConnectError, UpstreamProtocolError) as e:
                        raise _leg_failure(e, f"decode {d.id}", "decode", d.id, a) from None
            except TimeoutError:
                if not in_handoff:
                    raise UpstreamTimeout(
                        f"prefill {p.id} gave no verdict within {t.prefill_s:g}s (an SGLang prefill "
                        f"answers once its KV reached decode {d.id}: either may be the one stuck)",
                        phase="prefill",
                        worker=p.id,
                    ) from None
                raise UpstreamTimeout(
                    f"decode {d.id} sent no response headers within {wait_s:g}s of the prefill's verdict",
                    phase="handoff",
                    worker=d.id,
                ) from None
            self.metrics.child(self.metrics.phase, "handoff").observe(time.monotonic() - a.prefill_done_at)
            await self._relay(
                resp,
                d,
                req,
                res,
                a,
                phase="decode",
                transform=d.adapter.decode_transformer(req, prefill_out),
                guard=guard,
            )
            ok_d = True
        except UpstreamFailure as e:
            culprit, between, provoked = _failure_verdict(e, concurrent=True)
            raise
        except ShortOfResources:
            a.cut = True  # the gateway's own shortage: no verdict on either worker
            raise
        except GatewayError as e:
            client_fault = not e.retryable  # an engine's 4xx: the request's fault, not the workers'
            raise
        finally:
            if guard is not None:
                guard.drop_verification()
            if not ok_d:
                if not prefill_task.cancel() and not prefill_task.cancelled():
                    prefill_task.exception()  # retrieved: no "never retrieved" log
                if not decode_task.done():
                    decode_task.cancel()
                elif resp is None and not decode_task.cancelled() and decode_task.exception() is None:
                    resp = decode_task.result()
                if not ok_p:
                    self._abort_leg(p, None, req, ctx.request_id)
                self._abort_leg(d, resp, req, ctx.request_id)
            if p_held:
                self.registry.release(p, view.prompt_tokens)
            self.registry.release(d, tokens)
            # each worker is judged only on what it did: a leg cut short by the other's failure,
            # or a handoff that failed between them, is no verdict on it (the pair breaker counts);
            # a request that ended without a verdict (the client left) counts for no one
            unjudged = res.closed or a.cut
            self.registry.record(p, _judged(ok_p, culprit == p.id, client_fault, unjudged))
            self.registry.record(d, _judged(ok_d, culprit == d.id, client_fault, unjudged))
            pair_ok = None if provoked else _judged(ok_d, True, client_fault, unjudged)
            suspects = tuple(w for w, did in ((p, ok_p), (d, ok_d)) if not did) if between else ()
            self.registry.record_pair(p, d, pair, pair_ok, suspects=suspects, request=a.echo[1])

    async def _split_samples(
        self,
        p: Worker,
        d: Worker,
        plan: Disaggregated,
        req: ParsedRequest,
        request_id: str,
        res: Responder,
        headers: list[tuple[bytes, bytes]],
        view: RequestView,
        a: _Attempt,
    ) -> None:
        """`n > 1` or a batch on an engine whose P/D cannot pair several samples (SGLang): one
        handoff per prompt and sample, each in its own task with its own room, deadlines and
        guards, merged into one answer (gateway/samples.py). At most `split_concurrency` units
        are in flight at once (each is two upstream connections: a batch of 100 prompts with
        `n` = 128 must not open 25,600 of them); the first failure cancels the other units. A
        stream starts once every unit of that first wave is past its engines' refusals: a unit
        refused before then is the request's error, not an error event after other units' tokens."""
        width = min(unit_count(req), self.settings.split_concurrency)
        merger = SampleMerger(
            req,
            res,
            first_wave=width,
            head=((b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), a.echo),
        )
        attempts: list[_Attempt] = []

        async def one(j: int, sreq: ParsedRequest) -> None:
            task: asyncio.Task[None] = asyncio.current_task()  # type: ignore[assignment]
            sa = _Attempt(a.echo, task, a.wheel)
            sa.plan_kind, sa.prefill, sa.decode = a.plan_kind, a.prefill, a.decode  # its metrics' labels
            attempts.append(sa)
            sink = merger.sink(j, task)
            uid = f"{request_id}-{j}"  # each unit's own, in logs and engine rids
            uview = self.view(sreq, uid)  # its own prompt and budget, in the workers' accounting
            ctx = HandoffCtx(
                request_id=uid,
                prefill=plan.prefill,
                decode=plan.decode,
                room=new_room(self.rng),
                stream_usage=self._stream_usage(sreq),
            )
            tokens = uview.prompt_tokens + uview.max_tokens
            await self._concurrent(p, d, ctx, sreq, sink, headers, uview, tokens, sa)

        body = msgspec.json.decode(req.body)
        # every unit is built (and checked) before any starts: a unit the engine would refuse is
        # the request's 400, not an error after other units' tokens went out
        todo = iter([(k, sample_request(req, k, body)) for k in range(merger.units)])

        async def runner() -> None:
            for k, sreq in todo:  # shared: each runner takes the next unit not yet started
                await one(k, sreq)

        tasks = [asyncio.ensure_future(runner()) for _ in range(width)]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for sa in attempts:
                sa.cut = True  # cancelled for a sibling's failure (or with the request): no verdict
            for t in tasks:
                t.cancel()
            raise
        a.prefill_done_at = max(sa.prefill_done_at for sa in attempts)
        if req.stream:
            merger.end_stream()
        else:
            merger.send_whole()
        a.first_byte_at = merger.first_byte_at
        a.phase = Phase.STREAMING if req.stream else Phase.DONE

    async def _await_prefill(
        self,
        prefill_task: asyncio.Future[tuple[int, bytes]],
        decode_task: asyncio.Future[UpstreamResponse],
        p: Worker,
        d: Worker,
    ) -> tuple[int, bytes]:
        """The prefill's (status, body); fails early if the decode fails before it.

        Awaits the prefill directly (one wake-up); a decode that fails or refuses first cancels
        the prefill (which aborts its leg, as the failure would anyway) to wake this up early."""

        def on_decode(f: asyncio.Future[UpstreamResponse]) -> None:
            if not prefill_task.done() and (
                f.cancelled() or f.exception() is not None or f.result().status != 200
            ):
                prefill_task.cancel()

        decode_task.add_done_callback(on_decode)
        try:
            return await prefill_task
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not decode_task.done() or decode_task.cancelled() or (task is not None and task.cancelling()):
                raise  # the client went away or a deadline expired
            exc = decode_task.exception()
            if exc is not None:
                if isinstance(exc, UpstreamConnectError | UpstreamProtocolError):
                    raise _leg_failure(exc, f"decode {d.id}", "decode", d.id) from None
                raise exc from None
            resp = decode_task.result()
            if resp.status == 200:
                raise
            # The decode refused before the prefill finished: its answer is final.
            body = await resp.read()
            resp.release()
            raise _upstream_status_error(resp.status, body, d, "decode") from None
        except (UpstreamConnectError, UpstreamProtocolError) as e:
            raise _leg_failure(e, f"prefill {p.id}", "prefill", p.id) from None
        finally:
            decode_task.remove_done_callback(on_decode)

    async def _sequential(
        self,
        p: Worker,
        d: Worker,
        ctx: HandoffCtx,
        req: ParsedRequest,
        res: Responder,
        headers: list[tuple[bytes, bytes]],
        view: RequestView,
        tokens: int,
        a: _Attempt,
    ) -> None:
        """vLLM: prefill (max_tokens=1) to the end, judge its kv_transfer_params, then decode.

        A decode that the request never reached (connection refused, its pool closed by a
        removal) leaves the prefill's KV untouched, held for a decode to pull: the decode leg
        goes to another decode of the pool with the same `kv_transfer_params` (they name the
        prefill, not a decode) instead of prefilling again elsewhere, which would leave this
        KV held until the engine's lease ends."""
        t = self.settings.timeouts
        pbody = p.adapter.prefill_body(req, ctx)
        t0 = time.monotonic()
        ok_p = False
        self.registry.acquire(p, tokens)
        try:
            try:
                with a.wheel.after(t.prefill_s, a.task):
                    status, out = await self._call_whole(p, req.path, _for(p, headers), pbody, "prefill")
                    verdict = p.adapter.judge_prefill(req, ctx, status, out)
                    if verdict.refused_ask:
                        # the worker takes no near-tie logprobs: asked no more, and this request's
                        # prefill goes again without them (it refused before doing any work)
                        p.near_ties = False
                        log.warning("worker.refuses_near_tie_logprobs", worker=p.id, reason=verdict.reason)
                        ctx = msgspec.structs.replace(ctx, near_ties=0)
                        pbody = p.adapter.prefill_body(req, ctx)
                        status, out = await self._call_whole(p, req.path, _for(p, headers), pbody, "prefill")
                        verdict = p.adapter.judge_prefill(req, ctx, status, out)
            except TimeoutError:
                raise UpstreamTimeout(
                    f"prefill {p.id} did not answer within {t.prefill_s:g}s", phase="prefill", worker=p.id
                ) from None
            if not verdict.ok:
                ok_p = not verdict.retryable  # a 4xx verdict is the request's fault
                raise self._prefill_refused(p, d, verdict, ctx.request_id, status == 200)
            ok_p = True
        except ShortOfResources:
            a.cut = True  # the gateway's own shortage: no verdict on the prefill
            raise
        finally:
            self.registry.release(p, tokens)
            self.registry.record(p, _judged(ok_p, True, False, res.closed or a.cut))
        a.prefill_done_at = time.monotonic()
        a.phase = Phase.HANDOFF
        self.metrics.child(self.metrics.phase, "prefill").observe(a.prefill_done_at - t0)
        tried = {d.id}
        while True:
            try:
                await self._vllm_decode(p, d, ctx, req, res, headers, tokens, a, verdict, out)
                return
            except _DecodeUnreached as e:
                if res.started or res.closed or len(tried) >= self.settings.retries.max_attempts:
                    raise
                plan = self._other_decode(view, req, p, tried)
                if plan is None:
                    raise
                self.policy.observe(Failed(ctx.request_id, (p.id, d.id), e.phase))
                self.metrics.child(self.metrics.upstream_errors, d.id, e.phase, e.code.value).inc()
                self.metrics.child(self.metrics.fallbacks, "other_decode").inc()
                log.info(
                    "request.decode_moved",
                    request_id=ctx.request_id,
                    prefill=p.id,
                    decode=d.id,
                    to=plan.decode.id,
                    error=e.message,
                )
                a.moved_from = [*(a.moved_from or ()), d.id]
                d = self.registry.get(plan.decode.id)
                tried.add(d.id)
                a.decode = d.id
                if isinstance(res, HttpResponder):
                    res.planned = (p.id, d.id)
                self.policy.observe(routed_event(view, plan))

    def _other_decode(
        self, view: RequestView, req: ParsedRequest, p: Worker, tried: set[str]
    ) -> Disaggregated | None:
        """Another decode for prefill `p`'s KV, chosen by the policy with every other prefill
        left out (the plan pairing them); None when it plans anything else (no such decode, or
        a colocated answer)."""
        if "other_pair" not in self.settings.ladder:
            return None
        others = {w.id for w in self.registry.workers() if w.role is Role.PREFILL and w.id != p.id}
        plan = self._plan(view, req, tried | others)
        if not isinstance(plan, Disaggregated) or plan.prefill.id != p.id or plan.decode.id in tried:
            return None
        chosen = (plan.prefill, plan.decode)  # the checks the first plan passed, for this decode
        if req.max_id >= 0:
            try:
                _check_vocab(req, chosen)
            except BadRequest:
                return None
        g = self.settings.guards
        if g.length_preflight and preflight(
            req.prompt_peak, req.prompt_is_ids, req.max_tokens, chosen, g, pairs=req.prompt_pairs
        ):
            return None
        return plan

    async def _vllm_decode(
        self,
        p: Worker,
        d: Worker,
        ctx: HandoffCtx,
        req: ParsedRequest,
        res: Responder,
        headers: list[tuple[bytes, bytes]],
        tokens: int,
        a: _Attempt,
        verdict: PrefillVerdict,
        out: bytes,
    ) -> None:
        """The decode leg of a vLLM handoff, after a good prefill: `_DecodeUnreached` when the
        request never reached decode `d`."""
        t = self.settings.timeouts
        pair = self.registry.pair_breaker(p.id, d.id)
        dbody = d.adapter.decode_body(req, ctx, verdict)
        resp: UpstreamResponse | None = None
        ok_d = client_fault = False
        culprit: str | None = None
        between = False
        provoked = False
        self.registry.acquire(d, tokens)
        if verdict.kv_params is None:
            # the prefill ended on its first token (EOS or a stop id) and hands over no KV: the
            # decode computes the prompt itself, with the client's whole request; nothing was
            # handed over for a guard to check
            guard = None
            log.info("request.prefill_stopped", request_id=ctx.request_id, prefill=p.id, decode=d.id)
        else:
            guard = self._decode_guard(req, ctx, p.adapter, out)
            if guard is not None:
                if not verdict.same_first_token:
                    guard.prefill.first_token_id = None  # its token is no measure of the decode's
                    guard.prefill.first_text = None
                guard.prefill.ties = verdict.ties
        wait_s = self._head_budget(req, d, t.handoff_s)
        try:
            try:
                with a.wheel.after(wait_s, a.task):
                    resp = await d.pool.request("POST", req.path, _for(d, headers), dbody)
            except TimeoutError:
                raise UpstreamTimeout(
                    f"decode {d.id} sent no response headers within {wait_s:g}s",
                    phase="handoff",
                    worker=d.id,
                ) from None
            except (UpstreamConnectError, UpstreamProtocolError) as e:
                failure = _leg_failure(e, f"decode {d.id}", "decode", d.id, a)
                if isinstance(e, UpstreamConnectError) and type(failure) is UpstreamFailure:
                    failure = _DecodeUnreached(failure.message, phase="decode", worker=d.id)
                raise failure from None
            self.metrics.child(self.metrics.phase, "handoff").observe(time.monotonic() - a.prefill_done_at)
            await self._relay(resp, d, req, res, a, phase="decode", guard=guard)
            ok_d = True
        except UpstreamFailure as e:
            culprit, between, provoked = _failure_verdict(e, concurrent=False)
            raise
        except ShortOfResources:
            raise  # (the attempt is marked unjudged already): not the request's fault either
        except GatewayError as e:
            client_fault = not e.retryable
            raise
        finally:
            if guard is not None:
                guard.drop_verification()
            if not ok_d:
                self._abort_leg(d, resp, req, ctx.request_id)
            self.registry.release(d, tokens)
            # a suspect handoff is no verdict on the decode (the pair breaker counts it)
            unjudged = res.closed or a.cut
            self.registry.record(d, _judged(ok_d, culprit == d.id, client_fault, unjudged))
            pair_ok = None if provoked else _judged(ok_d, True, client_fault, unjudged)
            suspects = (d,) if between and not ok_d else ()  # (its prefill did its part)
            self.registry.record_pair(p, d, pair, pair_ok, suspects=suspects, request=a.echo[1])

    def _head_budget(self, req: ParsedRequest, w: Worker, first_byte_s: float) -> float:
        """How long to wait for a worker's response headers. A stream's come with its first
        token: `first_byte_s`. A non-streamed answer's come with its last token, so it also gets
        `per_token_s` for each token it may generate (its max_tokens, else the worker's context
        length); the request's total deadline bounds both."""
        if req.stream:
            return first_byte_s
        limit = req.max_tokens
        if limit is None:
            limit = w.info.context_length or req.accounting_max_tokens
        return first_byte_s + self.settings.timeouts.per_token_s * limit

    # -- I/O helpers -----------------------------------------------------------------------------

    async def _call_whole(
        self, w: Worker, path: str, headers: list[tuple[bytes, bytes]], body: bytes, phase: str
    ) -> tuple[int, bytes]:
        """One engine call read to the end: (status, body)."""
        try:
            return await w.pool.fetch("POST", path, headers, body)
        except (UpstreamConnectError, UpstreamProtocolError) as e:
            raise _leg_failure(e, f"{phase} {w.id}", phase, w.id) from None

    async def _relay(
        self,
        resp: UpstreamResponse,
        w: Worker,
        req: ParsedRequest,
        res: Responder,
        a: _Attempt,
        *,
        phase: str,
        transform: Callable[[bytes], bytes] | None = None,
        guard: _DecodeGuard | None = None,
    ) -> None:
        """Pass an engine's answer to the client: errors mapped, bodies and streams as bytes.

        With a `guard` (a disaggregated decode), nothing reaches the client before the answer's
        first token agrees with the prefill, and a stream's end is checked before it is sent."""
        status = resp.status
        ctype = resp.header(b"content-type") or b"application/json"
        if status != 200:
            body = await resp.read()
            resp.release()
            raise _upstream_status_error(status, body, w, phase, ctype)
        if not ctype.startswith(_EVENT_STREAM):
            body = await resp.read()
            resp.release()
            if guard is not None:
                why = guard.check_end(guard.summarize([body]))
                if why is not None:
                    raise self._integrity(guard, why, w, "before_first_byte")
                if guard.verify is not None:
                    why = await self._verified(guard, body)
                    if why is not None:
                        raise self._integrity(guard, why, w, "before_first_byte", Guard.SHADOW)
                else:
                    self._maybe_shadow(guard, body)
            if transform is not None:
                body = transform(body)
            a.first_byte_at = time.monotonic()
            res.send(200, [(b"content-type", ctype), a.echo], body)
            return
        head = [(b"content-type", ctype), (b"cache-control", b"no-cache"), a.echo]
        watch: StreamWatch | None = None
        if guard is None:
            res.start_stream(200, head)
            a.first_byte_at = time.monotonic()
            a.phase = Phase.STREAMING
            write = res.write
        else:

            def started_write(data: bytes) -> None:
                # the first token passed its check: the stream starts now, head and first bytes
                # in one send; from here on the watch writes to the client directly
                res.start_stream(200, head, data)
                a.first_byte_at = time.monotonic()
                a.phase = Phase.STREAMING
                sw.write_to(res.write)

            sw = StreamWatch(
                started_write,
                guard.summarize,
                guard.check_first,
                guard.check_end,
                drop_usage=guard.ctx.stream_usage,
            )
            watch = sw
            write = sw.feed
        idle = self.settings.timeouts.idle_s
        loop = a.wheel.loop
        # a stream verified before its clean end: its bytes are kept for the comparison
        kept: list[bytes] | None = [] if guard is not None and guard.verify is not None else None
        sink = write
        if kept is not None or transform is not None:

            def sink(data: bytes) -> None:
                if kept is not None:
                    kept.append(data)
                write(data if transform is None else transform(data))

        # Per upstream read the sink is the watch's feed (or the client's write) itself; the
        # response counts the reads and keeps the last one's time, and a failed first-token
        # check raises out of the feed, which stops the pipe and closes the upstream connection.
        piped = resp.pipe(sink, flow=res, batch=res)
        # The idle deadline is checked lazily: one timer that re-arms itself at the last read +
        # idle when it finds the stream has moved, instead of a new timer per chunk.
        timed_out = False
        timer: asyncio.TimerHandle

        def watchdog() -> None:
            nonlocal timer, timed_out
            due = resp.last_read_at + idle
            if resp.held_back:  # the client is not reading: no upstream silence to judge
                timer = loop.call_at(loop.time() + idle, watchdog)
            elif loop.time() < due:
                timer = loop.call_at(due, watchdog)
            else:
                timed_out = True
                piped.cancel()  # aborts the upstream connection

        timer = loop.call_at(resp.last_read_at + idle, watchdog)
        try:
            await piped
        except StreamStopped:
            assert guard is not None and watch is not None and watch.violation is not None
            resp.abort()
            raise self._integrity(guard, watch.violation, w, "before_first_byte") from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not timed_out or (task is not None and task.cancelling()):
                raise  # the client went away or an outer deadline expired: not ours
            resp.abort()
            where = "mid-stream" if resp.reads else "after its response headers"
            raise UpstreamTimeout(
                f"worker {w.id} sent nothing for {idle:g}s {where}", phase="idle", worker=w.id
            ) from None
        except UpstreamProtocolError as e:
            raise UpstreamFailure(f"worker {w.id} broke the stream: {e}", phase=phase, worker=w.id) from None
        finally:
            timer.cancel()
        if res.started:
            res.cork()  # the held end of the stream and its last chunk go out in one send
        if watch is not None and guard is not None:
            if kept is not None and watch.violation is None:
                # the end (finish event, usage, [DONE]) is still held: release it only if the
                # stream agrees with its verification run
                why = await self._verified(guard, b"".join(kept), stream=True)
                if why is not None:
                    resp.release()
                    stage = "mid_stream" if res.started else "before_first_byte"
                    raise self._integrity(guard, why, w, stage, Guard.SHADOW)
            why = watch.finish()
            if watch.failed is not None:
                resp.release()
                raise UpstreamFailure(
                    f"worker {w.id} failed the request: {watch.failed}",
                    phase=phase,
                    worker=w.id,
                    answered=True,
                )
            if why is not None:
                resp.release()
                raise self._integrity(guard, why, w, "mid_stream" if res.started else "before_first_byte")
        resp.release()
        end = time.monotonic()
        self.metrics.child(self.metrics.phase, "decode").observe(end - a.first_byte_at)
        if resp.reads > 1:
            self.metrics.child(self.metrics.itl, req.route.value, a.plan_kind).observe(
                (end - a.first_byte_at) / (resp.reads - 1)
            )
        res.end()

    def _stream_usage(self, req: ParsedRequest) -> bool:
        """Does the decode of this handoff get asked for a usage chunk the client did not ask
        for? Yes for a guarded stream on an OpenAI route: the guard's "finished early" check
        needs the real token count, and counting events is wrong both ways (role-only events;
        SGLang sends several tokens in one event with --stream-interval > 1 or a held-back
        multi-byte character). The chunk is dropped on the way to the client."""
        return (
            req.stream
            and not req.include_usage
            and req.route is not RouteKind.GENERATE
            and self._guarded(req)
        )

    def _guarded(self, req: ParsedRequest) -> bool:
        """Does the decode-consistency guard watch this request's decode? (One answer to compare.)"""
        return self.settings.guards.decode_consistency and req.n == 1 and not req.is_batch

    def _decode_guard(
        self, req: ParsedRequest, ctx: HandoffCtx, prefill_adapter: EngineAdapter, prefill_body: bytes
    ) -> _DecodeGuard | None:
        """The decode-consistency guard for one handoff, or None where it does not apply."""
        if not self._guarded(req):
            return None
        if prefill_body.lstrip().startswith(b"data:"):
            payloads = list(iter_sse_data(prefill_body))
        else:
            payloads = [prefill_body]
        g = _DecodeGuard(ctx, prefill_adapter, req, prefill_adapter.summarize(req, payloads))
        g.on_tie = self._near_tie
        s = self.settings.guards
        suspects = self.registry.suspect_pairs()  # a shared empty set while no pair is suspect
        if _verifiable(req) and (
            (suspects and f"{ctx.prefill.id}|{ctx.decode.id}" in suspects)
            or (s.shadow_before_delivery and s.shadow_fraction > 0 and self.rng.random() < s.shadow_fraction)
        ):
            # verified before delivery: a colocated re-run of the first tokens starts now, beside
            # the decode, and the answer is released only if it agrees
            worker = self._shadow_worker(g)
            if worker is not None:
                g.verify = asyncio.ensure_future(self._shadow_run(g, worker))
            else:
                log.info("verify.unavailable", request_id=ctx.request_id, reason="no colocated worker")
        return g

    def _shadow_worker(self, g: _DecodeGuard) -> Worker | None:
        """Where a shadow re-run goes: a colocated worker of the model (vLLM: else the decode
        worker itself, without KV params)."""
        targets = self.registry.snapshot().pool(Role.COLOCATED, g.req.model)
        if not targets and g.ctx.decode.engine is Engine.VLLM:
            targets = (g.ctx.decode,)
        if not targets:
            return None
        return self.registry.find(self.rng.choice(targets).id)

    async def _verified(self, g: _DecodeGuard, body: bytes, stream: bool = False) -> str | None:
        """Why the answer (a whole body, or a stream's bytes) disagrees with its verification
        run, or None (it agrees, or there is no verdict)."""
        assert g.verify is not None
        out = await g.verify
        g.verify = None
        got = _stream_text(body) if stream else _answer_text(body)
        want = self._shadow_disagrees("before_delivery", got, out)
        if want is None or got is None:
            return None
        log.warning(
            "verify.mismatch",
            request_id=g.ctx.request_id,
            delivered_sha1=hashlib.sha1(got.encode()).hexdigest()[:12],
            shadow_sha1=hashlib.sha1(want.encode()).hexdigest()[:12],
        )
        return "the answer differs from a colocated re-run of its first tokens"

    def _maybe_shadow(self, g: _DecodeGuard, delivered: bytes) -> None:
        """Shadow verification: re-run a sampled share of greedy answers on a colocated worker
        (for vLLM, the decode worker without KV params) and compare their first tokens."""
        s = self.settings.guards
        req = g.req
        if (
            s.shadow_fraction <= 0
            or s.shadow_before_delivery
            or not req.greedy
            or req.route is RouteKind.GENERATE
        ):
            return
        if self.rng.random() >= s.shadow_fraction:
            return
        worker = self._shadow_worker(g)
        if worker is None:
            return
        task = asyncio.ensure_future(self._shadow(g, worker, delivered))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _shadow_run(self, g: _DecodeGuard, w: Worker) -> bytes | None:
        """The request's first `shadow_tokens` tokens, greedy, on `w` alone; None if it failed."""
        s = self.settings.guards
        fields = g.req.decode_dict()
        if g.req.route is RouteKind.GENERATE:  # SGLang's native route: the limit is a sampling param
            sp = msgspec.json.decode(fields.get("sampling_params", b"{}"))
            sp = dict(sp) if isinstance(sp, dict) else {}
            sp["max_new_tokens"] = s.shadow_tokens
            set_ = {"sampling_params": msgspec.json.encode(sp), "stream": b"false"}
        else:
            set_ = {"max_tokens": str(s.shadow_tokens).encode(), "stream": b"false"}
        body = _body_rewrite(
            fields,
            drop=(
                "max_completion_tokens",
                "stream_options",
                "kv_transfer_params",
                "bootstrap_host",
                "bootstrap_port",
                "bootstrap_room",
                "rid",
            ),
            set_=set_,
        )
        headers = [
            (b"content-type", b"application/json"),
            (b"x-request-id", f"{g.ctx.request_id}-shadow".encode()),
        ]
        try:
            async with asyncio.timeout(self.settings.timeouts.prefill_s):
                status, out = await w.pool.fetch("POST", g.req.path, _for(w, headers), body)
        except (TimeoutError, UpstreamConnectError, UpstreamProtocolError) as e:
            log.info("shadow.skipped", request_id=g.ctx.request_id, worker=w.id, error=str(e))
            return None
        if status != 200:
            log.info("shadow.skipped", request_id=g.ctx.request_id, worker=w.id, error=f"HTTP {status}")
            return None
        return out

    def _shadow_disagrees(self, when: str, got: str | None, shadow_body: bytes | None) -> str | None:
        """The shadow's text when it contradicts the delivered text `got`, else None; counted in
        `pdgw_shadow_runs_total{when,outcome}`. One is a prefix of the other when they agree
        (the shadow generates `shadow_tokens`, the answer as many as it asked for)."""
        if shadow_body is None:
            self.metrics.child(self.metrics.shadow_runs, when, "failed").inc()
            return None  # the re-run failed: nothing to compare (logged there)
        want = _answer_text(shadow_body)
        if got is None or want is None or texts_agree(got, want):
            self.metrics.child(self.metrics.shadow_runs, when, "agreed").inc()
            return None
        self.metrics.child(self.metrics.shadow_runs, when, "differed").inc()
        return want

    async def _shadow(self, g: _DecodeGuard, w: Worker, delivered: bytes) -> None:
        """After delivery: compare, and on a mismatch count it and take the pair out."""
        got = _answer_text(delivered)
        want = self._shadow_disagrees("after_delivery", got, await self._shadow_run(g, w))
        if want is None or got is None:
            return
        self.metrics.child(self.metrics.guard_failures, Guard.SHADOW.value, "after_delivery").inc()
        log.warning(
            "guard.failed",
            guard=Guard.SHADOW.value,
            stage="after_delivery",
            request_id=g.ctx.request_id,
            prefill=g.ctx.prefill.id,
            decode=g.ctx.decode.id,
            shadow_worker=w.id,
            delivered_sha1=hashlib.sha1(got.encode()).hexdigest()[:12],
            shadow_sha1=hashlib.sha1(want.encode()).hexdigest()[:12],
            delivered_chars=len(got),
            shadow_chars=len(want),
        )
        pair = f"{g.ctx.prefill.id}|{g.ctx.decode.id}"
        self.registry.pair_breaker(g.ctx.prefill.id, g.ctx.decode.id).force_open()
        self.registry.mark_suspect(pair, self.settings.guards.suspect_window_s)
        self.registry.changed()

    def _integrity(
        self, g: _DecodeGuard, why: str, w: Worker, stage: str, guard: Guard = Guard.DECODE_CONSISTENCY
    ) -> KVIntegrityError:
        """A handoff's answer failed a check: counted, and the pair is suspect from now on (its
        next answers are verified before delivery)."""
        self.registry.mark_suspect(
            f"{g.ctx.prefill.id}|{g.ctx.decode.id}", self.settings.guards.suspect_window_s
        )
        self._guard_failed(
            guard,
            stage,
            g.ctx.request_id,
            why,
            prefill=g.ctx.prefill.id,
            decode=g.ctx.decode.id,
        )
        return KVIntegrityError(f"KV integrity check failed: {why}", phase="decode", worker=w.id)

    def _prefill_refused(
        self,
        p: Worker,
        d: Worker,
        v: PrefillVerdict,
        request_id: str,
        caught: bool,
        decode_took: bool = False,
    ) -> GatewayError:
        """The error for a prefill answer that is no basis for a decode (counted as a guard hit
        when `caught`: it kept a broken handoff from the client). `decode_took`: the prefill
        refused (4xx) what its decode did not refuse."""
        if v.handoff:
            # its KV did not reach the decode: no verdict on either worker (the pair breaker
            # counts it, and the retry avoids the pair), whichever leg's failure came first
            return PrefillFailed(
                f"prefill {p.id}: its KV transfer to decode {d.id} failed: {v.reason}",
                phase="prefill",
                worker=None,
            )
        if caught:
            self._guard_failed(
                Guard.PREFILL_VERDICT, "before_first_byte", request_id, v.reason, prefill=p.id, decode=d.id
            )
            if decode_took and not v.retryable:
                # sglang #30233 (a prefill whose limit is below its decode's): not the request's
                # fault, so the next rung (another pair, a colocated worker) may serve it; no
                # verdict on the prefill (worker None: the pair is avoided), since a request can
                # provoke this
                return PrefillFailed(
                    f"prefill {p.id} refused what decode {d.id} accepted: {v.reason}",
                    phase="prefill",
                    worker=None,
                    instead=_prefill_error(p, v),  # no other route: the engine's own answer
                )
        return _prefill_error(p, v)

    def _near_tie(self, g: _DecodeGuard, decode: Summary) -> None:
        """The decode started on another token than the prefill, one the prefill's logprobs put
        within the near-tie margin of its own: not a failure, but counted and logged."""
        self.metrics.child(self.metrics.near_ties).inc()
        log.info(
            "guard.near_tie",
            request_id=g.ctx.request_id,
            prefill=g.ctx.prefill.id,
            decode=g.ctx.decode.id,
            prefill_token=g.prefill.first_text,
            decode_start=(decode.first_text or "")[:16],
        )

    def _guard_failed(self, guard: Guard, stage: str, request_id: str, why: str, **kw: object) -> None:
        self.metrics.child(self.metrics.guard_failures, guard.value, stage).inc()
        log.warning("guard.failed", guard=guard.value, stage=stage, request_id=request_id, reason=why, **kw)

    def _abort_leg(
        self, w: Worker, resp: UpstreamResponse | None, req: ParsedRequest, request_id: str
    ) -> None:
        """Stop an engine working on a request nobody will read: close the connection, and send
        the engine's abort call where it has one."""
        if resp is not None:
            resp.abort()
        call = w.adapter.abort_call(req, request_id)
        if call is None:
            return
        task = asyncio.ensure_future(self._send_abort(w, *call))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send_abort(self, w: Worker, path: str, body: bytes) -> None:
        """Send the engine's abort call, and once more a moment later: an abort that overtakes
        the request it names (still in the engine's socket buffer) finds nothing to abort, and
        the request would then wait for KV that never comes (300 s on SGLang)."""
        for delay in (0.0, self.settings.timeouts.abort_repeat_s):
            if delay:
                await asyncio.sleep(delay)
            self.metrics.child(self.metrics.aborts_sent, w.engine.value).inc()
            try:
                async with asyncio.timeout(self.settings.timeouts.abort_s):
                    resp = await w.pool.request("POST", path, _for(w, _ABORT_HEADERS), body)
                    await resp.read()
                    resp.release()
            except (TimeoutError, UpstreamConnectError, UpstreamProtocolError) as e:
                log.warning("abort.failed", worker=w.id, error=str(e))
                return

    async def drain_background(self, within_s: float = 5.0) -> None:
        if self._background:
            await asyncio.wait(list(self._background), timeout=within_s)


def _rung(plan: Colocated | Disaggregated | Reject) -> str | None:
    """Which fallback rung a plan made after a failure is."""
    if isinstance(plan, Disaggregated):
        return "other_pair"
    if isinstance(plan, Colocated):
        return "decode_self_prefill" if plan.worker.role is Role.DECODE else "colocated"
    return None


def _for(w: Worker, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The engine-bound headers, with the worker's own API key when it has one."""
    if w.authorization is None:
        return headers
    return [*(h for h in headers if h[0] != b"authorization"), (b"authorization", w.authorization)]


def _check_vocab(req: ParsedRequest, chosen: tuple[WorkerState, ...]) -> None:
    """Token ids beyond a worker's (configured) vocabulary: a 400 here, not a dead engine (SGLang
    0.5.23 does not check them; its scheduler's embedding lookup raises and the server exits)."""
    for w in chosen:
        if w.vocab_size is not None and req.max_id >= w.vocab_size:
            raise BadRequest(
                f"Token id {req.max_id} is out of vocabulary (the model has {w.vocab_size} tokens)",
                param="input_ids" if req.route is RouteKind.GENERATE else "prompt",
            )


def _verifiable(req: ParsedRequest) -> bool:
    """Can this request's answer be checked against a short colocated re-run before its clean
    end is sent? (Greedy, one answer; a stream's tokens flow meanwhile, only its end is held.)"""
    return req.greedy and req.n == 1 and not req.is_batch


# How long a refused SGLang prefill waits for its decode's answer to the same body: a decode
# that refuses it too (within this) makes it the request's fault, not a guard's catch.
_AGREEMENT_S = 0.25


async def _refused_too(decode: asyncio.Future[UpstreamResponse], within_s: float) -> bool:
    """Whether the decode refused the request as well, waiting up to `within_s` for it: a 4xx,
    or a stream that is one error event (SGLang's /generate refuses a streamed request so)."""
    end = time.monotonic() + within_s
    if not decode.done():
        await asyncio.wait((decode,), timeout=within_s)
    if not decode.done() or decode.cancelled() or decode.exception() is not None:
        return False
    resp = decode.result()
    if 400 <= resp.status < 500:
        return True
    if resp.status != 200 or not (resp.header(b"content-type") or b"").startswith(b"text/event-stream"):
        return False
    try:  # (the caller aborts this leg whatever it holds)
        body = await asyncio.wait_for(resp.read(), max(0.0, end - time.monotonic()))
    except (TimeoutError, UpstreamConnectError, UpstreamProtocolError):
        return False
    return body.lstrip().startswith(b'data: {"error"')


def _session_key(sid: object) -> str | None:
    """A client's `session_id` as a routing key: a string or an integer; anything else (not an
    engine field, so no engine refuses it) is ignored."""
    if sid is None or isinstance(sid, str):
        return sid
    if isinstance(sid, int) and not isinstance(sid, bool):
        return str(sid)
    return None


_ABORT_HEADERS = [(b"content-type", b"application/json")]


class _DecodeUnreached(UpstreamFailure):
    """A vLLM decode leg that never reached its decode (connect failed, pool closed): the
    prefill's KV is untouched and another decode may take it (`Orchestrator._sequential`)."""


def _leg_failure(
    e: UpstreamConnectError | UpstreamProtocolError,
    leg: str,
    phase: str,
    worker: str,
    a: _Attempt | None = None,
) -> GatewayError:
    """What an upstream call's failure is to the request: the worker's failure (retried elsewhere,
    counted by its breaker), or, when the gateway itself could not open a connection (out of file
    descriptors or ports), a 503 to retry later, for which no worker is blamed (`a` is marked as
    having no verdict)."""
    if isinstance(e, LocalResourceError):
        if a is not None:
            a.cut = True
        return ShortOfResources(
            f"the gateway is short of resources to reach {leg}: {e}; retry later", retry_after_s=1.0
        )
    return UpstreamFailure(f"{leg}: {e}", phase=phase, worker=worker)


def _judged(ok: bool, blamed: bool, client_fault: bool, unjudged: bool) -> bool | None:
    """A breaker's verdict on one leg: True when it did its part (or refused the request for the
    request's own fault), False when the failure is its, None when there is no verdict on it (the
    client went away, or a sibling unit of a split request failed: that says nothing of a worker,
    and counting it as a success closed half-open breakers on hung workers; or another leg failed
    first). A request's own deadline is still a verdict."""
    if ok or client_fault:
        return True
    if unjudged:
        return None
    return False if blamed else None


def _failure_verdict(e: UpstreamFailure, *, concurrent: bool) -> tuple[str | None, bool, bool]:
    """(the culprit, a failure of the handoff between the two workers, provoked by the request).
    A failure the request itself may have provoked (a prefill refused what its decode took: a
    limit below the decode's, or a decode slow to refuse) may be served by the next rung, but no
    breaker, the pair's included, counts it: clients would open them."""
    culprit = _culprit(e, concurrent=concurrent)
    provoked = e.instead is not None
    return culprit, culprit is None and not provoked, provoked


def _culprit(e: UpstreamFailure, *, concurrent: bool) -> str | None:
    """The worker a failed handoff is held against in its breaker, or None when the failure is
    of the handoff between the two (the pair breaker counts it): a failed integrity check, a
    decode that answered with a failure (a KV transfer that failed looks so), and, where both
    legs run at once (SGLang), a prefill with no verdict in time (it may be waiting for a decode
    that does not take its KV)."""
    if isinstance(e, KVIntegrityError) or (e.answered and e.phase == "decode"):
        return None
    if concurrent and isinstance(e, UpstreamTimeout) and e.phase == "prefill":
        return None
    return e.worker


def _blame(ran: tuple[str, ...], e: UpstreamFailure) -> set[str]:
    """Ids to exclude from the next attempt, from the workers the attempt ran on (prefill and
    decode, or the colocated one): the failed worker, or the pair when the link failed."""
    if len(ran) == 2:
        pair = pair_id(ran[0], ran[1])
        # a bad handoff (a decode that answered with a transfer failure is up): both workers may
        # still serve, colocated or in another pair (vLLM: the decode prefilling itself). A
        # prefill with no verdict is avoided by the retry all the same (it may be the one hung).
        worker = _culprit(e, concurrent=False)
        return {pair} if worker is None else {pair, worker}
    return set(ran)


def _upstream_status_error(
    status: int, body: bytes, w: Worker, phase: str, ctype: bytes = b"application/json"
) -> GatewayError:
    if status >= 500 or status in (408, 429):
        # the engine's own words as text (a bytes repr would show b'...' and escapes to clients)
        said = body[:200].decode("utf-8", "replace").strip()
        return UpstreamFailure(
            f"worker {w.id} answered HTTP {status}: {said}", phase=phase, worker=w.id, answered=True
        )
    return UpstreamRejected(status, body, ctype)


def _prefill_error(p: Worker, v: PrefillVerdict) -> GatewayError:
    if v.retryable:
        return PrefillFailed(f"prefill {p.id}: {v.reason}", phase="prefill", worker=p.id)
    if v.body and v.status < 500 and v.body.lstrip().startswith(b"{") and b'"error"' in v.body:
        return UpstreamRejected(v.status, v.body)
    return BadRequest(v.reason, status=v.status if 400 <= v.status < 500 else 400)


def texts_agree(got: str, want: str) -> bool:
    """Does an answer's text agree with a shadow re-run's? One is a prefix of the other (the
    shadow generates a few tokens, the answer as many as it asked for). A trailing U+FFFD is
    left out: a finished SGLang answer whose last token ends inside a character shows that
    character's bytes so far as U+FFFD (its detokenizer holds them back only while unfinished),
    which the shadow's few tokens often do where the answer goes on with the whole character."""
    want, got = want.rstrip("\ufffd"), got.rstrip("\ufffd")
    return got.startswith(want) or want.startswith(got)


class _DecodeGuard:
    """Decode-consistency checks of one handoff, against what its prefill said."""

    __slots__ = ("adapter", "context_length", "ctx", "on_tie", "prefill", "req", "tied", "verify")

    def __init__(self, ctx: HandoffCtx, adapter: EngineAdapter, req: ParsedRequest, prefill: Summary) -> None:
        self.ctx = ctx
        self.adapter = adapter
        self.req = req
        self.prefill = prefill
        self.context_length = ctx.decode.context_length
        # a colocated re-run whose answer must agree before this one is delivered, or None
        self.verify: asyncio.Future[bytes | None] | None = None
        # told once when the decode's first token is a near tie of the prefill's, not its own
        self.on_tie: Callable[[_DecodeGuard, Summary], None] | None = None
        self.tied = False

    def drop_verification(self) -> None:
        """The attempt ended without consuming its verification run: stop it."""
        if self.verify is not None:
            self.verify.cancel()
            self.verify = None

    def summarize(self, payloads: list[bytes]) -> Summary:
        return self.adapter.summarize(self.req, payloads)

    def check_first(self, first: Summary) -> str | None:
        """On the first token: its identity (greedy or seeded) and the prompt size, when the event
        says it."""
        early = Summary(
            prompt_tokens=first.prompt_tokens,
            first_token_id=first.first_token_id,
            first_text=first.first_text,
            parsed=first.parsed,
        )
        why = check_decode(
            self.prefill, early, max_tokens=None, context_length=None, greedy=self.req.same_first_token
        )
        if early.tied:
            self._tie(early)
        return why

    def check_end(self, whole: Summary) -> str | None:
        why = check_decode(
            self.prefill,
            whole,
            max_tokens=self.req.max_tokens,
            context_length=self.context_length,
            greedy=self.req.same_first_token,
        )
        if whole.tied:
            self._tie(whole)
        return why

    def _tie(self, decode: Summary) -> None:
        if not self.tied:
            self.tied = True
            if self.on_tie is not None:
                self.on_tie(self, decode)


class _Choice0(msgspec.Struct):
    text: str | None = None
    message: dict[str, object] | None = None


class _Answer(msgspec.Struct):
    choices: list[_Choice0] = []
    text: str | None = None  # SGLang's /generate


_answer = msgspec.json.Decoder(_Answer)


class _StreamChoice(msgspec.Struct):
    text: str | None = None
    delta: dict[str, object] | None = None


class _StreamEvent(msgspec.Struct):
    choices: list[_StreamChoice] = []
    text: str | None = None  # SGLang's /generate: the text so far


_stream_event = msgspec.json.Decoder(_StreamEvent)


def _stream_text(raw: bytes) -> str | None:
    """The text of a one-answer completions, chat or `/generate` stream (its SSE bytes)."""
    parts: list[str] = []
    for payload in iter_sse_data(raw):
        try:
            ev = _stream_event.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        if ev.text is not None:  # /generate: each event has the whole text so far
            parts = [ev.text]
            continue
        for c in ev.choices:
            if c.text is not None:
                parts.append(c.text)
            elif c.delta is not None:
                content = c.delta.get("content")
                if isinstance(content, str):
                    parts.append(content)
    return "".join(parts)


def _answer_text(body: bytes) -> str | None:
    """Choice 0's text of a completions or chat answer, or a `/generate` answer's text."""
    try:
        a = _answer.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if a.text is not None:
        return a.text
    if not a.choices:
        return None
    c = a.choices[0]
    if c.text is not None:
        return c.text
    content = (c.message or {}).get("content")
    return content if isinstance(content, str) else None
