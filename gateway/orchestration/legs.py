"""Engine legs as guards: whatever way a leg ends, its worker's load counters are given back, its
engine stops working on it, and its outcome is reported exactly once.

    async with Leg(s, ctx, worker, tokens, Role.COLOCATED, LegShape.ALONE) as leg:
        leg.resp = await worker.pool.request(...)
        await relay(...)
        leg.complete()             # it did its part: nothing to abort

On the way out, a leg that did not `complete()` is stopped (its pending call cancelled, its
connection closed, the engine's abort call sent where it has one), its counters are freed (a
leg may `free()` them earlier: an SGLang prefill counts as in flight only until its verdict),
and its `LegOutcome` (gateway/orchestration/blame.py) goes to the worker's breaker and, as a
`LegRecord`, to its attempt's records, which the policy's events carry.

A P/D handoff's two legs are one guard, `Handoff`: it stops, frees and reports both legs in the
order prefill then decode, and then the pair's breaker gets the handoff's verdict. A vLLM
handoff's prefill leg has ended (and reported) before its decode leg starts: the `Handoff` of
each decode try skips what is done.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Any

from common.errors import GatewayError, ShortOfResources
from common.outcomes import LegOutcome, LegRecord
from common.workers import Role
from gateway.breaker import CircuitBreaker
from gateway.http.client import UpstreamResponse
from gateway.orchestration.blame import LegShape, held_against, leg_outcome, pair_outcome
from gateway.orchestration.context import RequestContext
from gateway.orchestration.services import Services
from gateway.orchestration.verify import DecodeCheck
from gateway.registry import Worker


class Leg:
    """One engine request of an attempt (see the module docstring)."""

    __slots__ = (
        "call",
        "ctx",
        "done",
        "held",
        "outcome",
        "released",
        "resp",
        "role",
        "s",
        "shape",
        "stopped",
        "tokens",
        "worker",
    )

    def __init__(
        self, s: Services, ctx: RequestContext, worker: Worker, tokens: int, role: Role, shape: LegShape
    ) -> None:
        self.s = s
        self.ctx = ctx
        self.worker = worker
        self.tokens = tokens  # what the leg adds to the worker's in-flight token count
        self.role = role
        self.shape = shape
        self.held = False  # its load counters are taken
        self.released = False  # and given back
        self.done = False  # it did its part
        self.stopped = False
        self.call: asyncio.Future[Any] | None = None  # the engine call, when started as a future
        self.resp: UpstreamResponse | None = None  # the engine's response, once its head is in
        self.outcome: LegOutcome | None = None  # set once, when reported

    def hold(self) -> None:
        """Take the worker's load counters (once: a leg given back is not taken again)."""
        if not self.held and not self.released:
            self.held = True
            self.s.registry.acquire(self.worker, self.tokens)

    def free(self) -> None:
        """Give the worker's load counters back (once)."""
        if self.held:
            self.held = False
            self.released = True
            self.s.registry.release(self.worker, self.tokens)

    def complete(self) -> None:
        """The leg did its part: nothing of it is aborted, and its worker did well."""
        self.done = True

    def stop(self) -> None:
        """Stop the engine's work on a leg that did not complete (once): cancel its pending call,
        close its connection, send the engine's abort call."""
        if self.done or self.stopped:
            return
        self.stopped = True
        call = self.call
        if call is not None:
            if not call.done():
                call.cancel()
            elif not call.cancelled() and call.exception() is None and self.resp is None:
                result = call.result()
                if isinstance(result, UpstreamResponse):
                    self.resp = result
        self.s.abort_leg(self.worker, self.resp, self.ctx.req, self.ctx.request_id)

    def report(self, error: BaseException | None) -> LegOutcome:
        """The leg's outcome to its worker's breaker and its attempt's records (once)."""
        if self.outcome is not None:
            return self.outcome
        ctx, w = self.ctx, self.worker
        if self.done:
            outcome = LegOutcome.DONE
        else:
            if isinstance(error, ShortOfResources):
                ctx.attempt.cut = True  # the gateway's own shortage: no verdict on any worker
            outcome = leg_outcome(
                done=False,
                error=error,
                blamed=held_against(w.id, error, self.shape),
                unjudged=ctx.unjudged,
            )
        self.outcome = outcome
        self.s.registry.record(w, outcome.verdict)
        code = error.code.value if isinstance(error, GatewayError) else None
        ctx.attempt.legs.append(LegRecord(w.id, self.role.value, outcome, code))
        return outcome

    def close(self, error: BaseException | None) -> None:
        self.stop()
        self.free()
        self.report(error)

    async def __aenter__(self) -> Leg:
        self.hold()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(e)


class Handoff:
    """A P/D handoff's two legs as one guard (see the module docstring). `check`: the decode's
    consistency check, whose verification run (if any) is dropped first on the way out."""

    __slots__ = ("check", "concurrent", "ctx", "decode", "pair", "prefill", "s")

    def __init__(
        self, s: Services, ctx: RequestContext, prefill: Leg, decode: Leg, *, concurrent: bool
    ) -> None:
        self.s = s
        self.ctx = ctx
        self.prefill = prefill
        self.decode = decode
        self.concurrent = concurrent
        self.check: DecodeCheck | None = None
        self.pair: CircuitBreaker = s.registry.pair_breaker(prefill.worker.id, decode.worker.id)

    async def __aenter__(self) -> Handoff:
        self.prefill.hold()
        self.decode.hold()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.check is not None:
            self.check.drop_verification()
        p, d = self.prefill, self.decode
        p.stop()  # (a leg that did its part is left alone)
        d.stop()
        p.free()
        d.free()
        # each worker is judged only on what it did: a leg cut short by the other's failure,
        # or a handoff that failed between them, is no verdict on it (the pair breaker counts);
        # a request that ended without a verdict (the client left) counts for no one
        p.report(e)
        d.report(e)
        suspects: tuple[Worker, ...] = ()
        if d.done:
            outcome = LegOutcome.DONE
        else:
            outcome, between = pair_outcome(
                decode_done=False, error=e, unjudged=self.ctx.unjudged, concurrent=self.concurrent
            )
            if between:
                suspects = tuple(leg.worker for leg in (p, d) if not leg.done)
        self.s.registry.record_pair(
            p.worker, d.worker, self.pair, outcome.verdict, suspects=suspects, request=self.ctx.echo[1]
        )
