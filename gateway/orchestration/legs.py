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

import msgspec

from common.errors import GatewayError, ShortOfResources
from common.outcomes import VERDICTS, LegOutcome, LegRecord
from common.workers import Role
from gateway.breaker import CircuitBreaker
from gateway.http.client import UpstreamResponse
from gateway.orchestration.blame import LegShape, held_against, leg_outcome, pair_outcome
from gateway.orchestration.context import RequestContext
from gateway.orchestration.services import Services
from gateway.orchestration.verify import DecodeCheck
from gateway.registry import Worker

# Enum members as module constants on the request path: on Python 3.11 a class attribute of an
# Enum goes through EnumType.__getattr__'s slot hook, unspecialised; a global does not
# (gateway/breaker.py)
_DONE = LegOutcome.DONE


class Leg(msgspec.Struct, eq=False):
    """One engine request of an attempt (see the module docstring). (A Struct: built in C, as
    each request makes one to three.)"""

    s: Services
    ctx: RequestContext
    worker: Worker
    tokens: int  # what the leg adds to the worker's in-flight token count
    role: Role  # in the plan: prefill, decode or colocated
    shape: LegShape
    held: bool = False  # its load counters are taken (on entry: `async with`)
    released: bool = False  # and given back
    done: bool = False  # it did its part
    stopped: bool = False
    call: asyncio.Future[Any] | None = None  # the engine call, when started as a future
    resp: UpstreamResponse | None = None  # the engine's response, once its head is in
    outcome: LegOutcome | None = None  # set once, when reported

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
        if self.done:  # (the usual end, in a few steps)
            self.outcome = _DONE
            self.s.registry.record(w, True)
            ctx.attempt.legs.append(LegRecord(w.id, self.role, _DONE))  # (a Role is a str)
            return _DONE
        if isinstance(error, ShortOfResources):
            ctx.attempt.cut = True  # the gateway's own shortage: no verdict on any worker
        outcome = self.outcome = leg_outcome(
            done=False,
            error=error,
            blamed=held_against(w.id, error, self.shape),
            unjudged=ctx.unjudged,
        )
        self.s.registry.record(w, VERDICTS[outcome])
        code = error.code.value if isinstance(error, GatewayError) else None
        ctx.attempt.legs.append(LegRecord(w.id, self.role, outcome, code))
        return outcome

    def close(self, error: BaseException | None) -> None:
        """Stop, free and report the leg (each once)."""
        if not self.done:
            self.stop()
        if self.held:
            self.free()
        self.report(error)

    async def __aenter__(self) -> Leg:
        # (a new leg: its counters are taken on entry)
        self.held = True
        self.s.registry.acquire(self.worker, self.tokens)
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        # (close(), spelt out: a guard per leg of every request)
        if not self.done:
            self.stop()
        if self.held:
            self.held = False
            self.released = True
            self.s.registry.release(self.worker, self.tokens)
        self.report(e)


class Handoff(msgspec.Struct, eq=False):
    """A P/D handoff's two legs as one guard (see the module docstring). `check`: the decode's
    consistency check, whose verification run (if any) is dropped first on the way out."""

    s: Services
    ctx: RequestContext
    prefill: Leg
    decode: Leg
    concurrent: bool
    check: DecodeCheck | None = None
    pair: CircuitBreaker | None = None  # the pair's breaker (`Registry.pair_breaker`), on entry

    async def __aenter__(self) -> Handoff:
        p, d = self.prefill, self.decode
        registry = self.s.registry
        self.pair = registry.pair_breaker(p.worker.id, d.worker.id)
        if p.outcome is None:  # (a vLLM prefill ended, and reported, before its decode started)
            p.held = True
            registry.acquire(p.worker, p.tokens)
        d.held = True
        registry.acquire(d.worker, d.tokens)
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        check = self.check
        if check is not None and check.verify is not None:
            check.drop_verification()
        p, d = self.prefill, self.decode
        if not d.done:  # (both did their part otherwise: nothing to stop)
            p.stop()  # (a leg that did its part is left alone)
            d.stop()
        if p.held:  # (an SGLang prefill's are given back at its verdict)
            p.free()
        if d.held:
            d.free()
        # each worker is judged only on what it did: a leg cut short by the other's failure,
        # or a handoff that failed between them, is no verdict on it (the pair breaker counts);
        # a request that ended without a verdict (the client left) counts for no one
        if p.outcome is None:
            p.report(e)
        d.report(e)
        suspects: tuple[Worker, ...] = ()
        if d.done:
            outcome = _DONE
        else:
            outcome, between = pair_outcome(
                decode_done=False, error=e, unjudged=self.ctx.unjudged, concurrent=self.concurrent
            )
            if between:
                suspects = tuple(leg.worker for leg in (p, d) if not leg.done)
        assert self.pair is not None
        self.s.registry.record_pair(
            p.worker, d.worker, self.pair, VERDICTS[outcome], suspects=suspects, request=self.ctx.echo[1]
        )
