"""Pass an engine's answer to the client: errors mapped, bodies and streams as bytes.

With a `DecodeCheck` (a disaggregated decode), nothing reaches the client before the answer's
first token agrees with the prefill, and a stream's end is checked before it is sent
(gateway/streamwatch.py holds those two places and passes the rest through as it arrives).
With a `PrefillGate` (an SGLang stream relayed before its prefill's verdict), the check is not
known until the verdict is in: the first token is checked against it if it is in by then, and
the stream's end waits for it (gate.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec

from common.errors import UpstreamFailure, UpstreamTimeout
from common.summary import Summary
from common.workers import RouteKind
from gateway.guards import Guard
from gateway.http.client import UpstreamResponse
from gateway.http.errors import UpstreamProtocolError
from gateway.orchestration.blame import upstream_status_error
from gateway.orchestration.context import Header, Phase, RequestContext
from gateway.orchestration.gate import PrefillGate
from gateway.orchestration.public import EventScreen
from gateway.orchestration.services import Services
from gateway.orchestration.shadow import maybe_shadow, verified, verify_late
from gateway.orchestration.verify import DecodeCheck, integrity
from gateway.registry import Worker
from gateway.streamwatch import StreamStopped, StreamWatch

_EVENT_STREAM = b"text/event-stream"
_STREAMING = Phase.STREAMING  # a module constant: see gateway/breaker.py on Enum look-ups

Transform = Callable[[bytes], bytes]


def relay(
    s: Services,
    ctx: RequestContext,
    resp: UpstreamResponse,
    w: Worker,
    *,
    phase: str,
    transform: Transform | None = None,
    check: DecodeCheck | None = None,
    gate: PrefillGate | None = None,
) -> Coroutine[Any, Any, None]:
    """Relay `resp`, worker `w`'s answer, to the client (see the module docstring); to be
    awaited (a plain function that picks the coroutine: one frame less per request)."""
    ctype = resp.header(b"content-type") or b"application/json"
    if resp.status != 200:
        return _refusal(resp, w, phase, ctype)
    if not ctype.startswith(_EVENT_STREAM):
        if gate is not None:
            return _whole_gated(s, ctx, resp, w, ctype, gate)
        return _whole(s, ctx, resp, w, ctype, transform, check)
    if gate is not None:
        kept: list[bytes] | None = [] if gate.keep else None
    else:
        kept = [] if check is not None and check.verify is not None else None
    return _Stream(s, ctx, resp, w, phase, transform, check, kept, gate).run(ctype)


async def _whole_gated(
    s: Services, ctx: RequestContext, resp: UpstreamResponse, w: Worker, ctype: bytes, gate: PrefillGate
) -> None:
    """A whole answer where a stream was expected: nothing goes out before the verdict."""
    check = await gate.settle(gate)
    await _whole(s, ctx, resp, w, ctype, None, check)


async def _refusal(resp: UpstreamResponse, w: Worker, phase: str, ctype: bytes) -> None:
    """An answer other than 200: the engine's failure (5xx, 408, 429) or its refusal (4xx)."""
    body = await resp.read()
    resp.release()
    raise upstream_status_error(resp.status, body, w.id, phase, ctype)


async def _whole(
    s: Services,
    ctx: RequestContext,
    resp: UpstreamResponse,
    w: Worker,
    ctype: bytes,
    transform: Transform | None,
    check: DecodeCheck | None,
) -> None:
    """A whole answer: read, checked, then sent in one piece."""
    body = await resp.read()
    resp.release()
    if check is not None:
        summary = check.summarize([body])
        ctx.attempt.output_tokens = summary.completion_tokens
        why = check.check_end(summary)
        if why is not None:
            raise integrity(s, check, why, w, "before_first_byte")
        if check.verify is None and check.epoch != s.registry.suspect_epoch:
            verify_late(s, check)
        if check.verify is not None:
            why = await verified(s, check, body)
            if why is not None:
                raise integrity(s, check, why, w, "before_first_byte", Guard.SHADOW)
        elif s.sample_after_delivery:
            maybe_shadow(s, check, body)
    if transform is not None:
        body = transform(body)
    ctx.attempt.first_byte_at = time.monotonic()
    ctx.res.send(200, [(b"content-type", ctype), ctx.echo, *ctx.extra], body)


class _Stream(msgspec.Struct, eq=False):
    """One streamed answer on its way to the client."""

    s: Services
    ctx: RequestContext
    resp: UpstreamResponse
    w: Worker
    phase: str
    transform: Transform | None
    check: DecodeCheck | None
    # a stream verified before its clean end: its bytes are kept for the comparison
    kept: list[bytes] | None
    gate: PrefillGate | None = None
    watch: StreamWatch | None = None

    async def run(self, ctype: bytes) -> None:
        ctx, resp = self.ctx, self.resp
        head = [(b"content-type", ctype), (b"cache-control", b"no-cache"), ctx.echo, *ctx.extra]
        sink = self._writer(head)
        if self.kept is not None or self.transform is not None:
            sink = self._sink(sink)
        # Per upstream read the sink is the watch's feed (or the client's write) itself; the
        # response counts the reads and keeps the last one's time, and a failed first-token
        # check raises out of the feed, which stops the pipe and closes the upstream connection.
        await self._pipe(resp.pipe(sink, flow=ctx.res, batch=ctx.res))
        gate = self.gate
        if gate is not None:  # the end is held until the prefill's verdict is in
            gate.decode_refused = not ctx.res.started and self.w.adapter.refused_in_stream(resp.last_bytes())
            self.check = await gate.settle(gate)
        if ctx.res.started:
            ctx.res.cork()  # the held end of the stream and its last chunk go out in one send
        if self.watch is not None:
            await self._end(self.watch)
        resp.release()
        end = time.monotonic()
        a, m = ctx.attempt, self.s.metrics
        a.chunks = resp.reads
        watch = self.watch
        if watch is not None:  # checked: the stream started with its first token
            a.first_token_at = a.first_byte_at
            if watch.summary is not None:
                a.output_tokens = watch.summary.completion_tokens
        else:  # started with the response head: the first token came with the first read, or
            # (a chat stream, whose first event is role-only) with the second
            chat = ctx.req.route is RouteKind.CHAT
            a.first_token_at = resp.second_read_at if chat else resp.first_read_at
        m.phase_decode.observe(end - a.first_byte_at)
        if resp.reads > 1:
            m.child(m.itl, ctx.req.route.value, a.plan_kind).observe(
                (end - a.first_byte_at) / (resp.reads - 1)
            )
        ctx.res.end()

    def _writer(self, head: list[Header]) -> Callable[[bytes], None]:
        """Where the upstream's bytes go: the client's stream, or (checked) the watch, which
        starts the client's stream once the first token passed."""
        ctx, check = self.ctx, self.check
        res, a = ctx.res, ctx.attempt
        if check is None and self.gate is not None:
            return self._gated_watch(head)
        if check is None:
            res.start_stream(200, head)
            a.first_byte_at = time.monotonic()
            a.phase = _STREAMING
            # unwatched: an engine's error or abort event is screened on its way (public.py)
            return EventScreen(res.write, self.s.registry.addresses(), ctx.request_id, self.w.id)

        def started_write(data: bytes) -> None:
            # the first token passed its check: the stream starts now, head and first bytes
            # in one send; from here on the watch writes to the client directly
            res.start_stream(200, head, data)
            a.first_byte_at = time.monotonic()
            a.phase = _STREAMING
            watch.write_to(res.write)

        watch = self.watch = StreamWatch(
            started_write,
            check.summarize,
            check.check_first,
            check.check_end,
            ends=check.adapter.stream_end_markers,
            drop_usage=check.adapter.without_usage_chunk if check.ctx.stream_usage else None,
        )
        return watch.feed

    def _gated_watch(self, head: list[Header]) -> Callable[[bytes], None]:
        """The watch of a stream relayed before its prefill's verdict: its first token checked
        if the verdict is in by then, its end held until it is (`run`)."""
        gate, res, a, w, req = self.gate, self.ctx.res, self.ctx.attempt, self.w, self.ctx.req
        assert gate is not None

        def started_write(data: bytes) -> None:
            res.start_stream(200, head, data)
            a.first_byte_at = time.monotonic()
            a.phase = _STREAMING
            watch.write_to(res.write)

        def first(summary: Summary) -> str | None:
            # (the verdict is not in yet: the first token is compared at the end, `check_end`)
            return None if gate.check is None else gate.check.check_first(summary)

        def end(summary: Summary) -> str | None:
            return None if gate.check is None else gate.check.check_end(summary)

        watch = self.watch = StreamWatch(
            started_write,
            lambda payloads: w.adapter.summarize(req, payloads),
            first,
            end,
            ends=w.adapter.stream_end_markers,
            drop_usage=w.adapter.without_usage_chunk if gate.drop_usage else None,
        )
        return watch.feed

    def _sink(self, write: Callable[[bytes], None]) -> Callable[[bytes], None]:
        """`write`, keeping the bytes for a verification and rewriting them for the client."""
        kept, transform = self.kept, self.transform

        def sink(data: bytes) -> None:
            if kept is not None:
                kept.append(data)
            write(data if transform is None else transform(data))

        return sink

    async def _pipe(self, piped: asyncio.Future[None]) -> None:
        """Await the pipe, under the stream's idle deadline."""
        resp, w = self.resp, self.w
        loop, seconds = self.ctx.wheel.loop, self.s.cfg.timeouts.idle_s
        idle = _IdleDeadline(loop, resp, piped, seconds)
        idle.timer = loop.call_at(resp.last_read_at + seconds, idle.check)
        gate = self.gate
        if gate is not None:
            gate.stop_on_failure(piped)
        try:
            await piped
        except StreamStopped:
            watch, check = self.watch, self.check
            assert check is not None and watch is not None and watch.violation is not None
            resp.abort()
            raise integrity(self.s, check, watch.violation, w, "before_first_byte") from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the client went away or an outer deadline expired: not ours
            if gate is not None and gate.stopped:
                resp.abort()
                await gate.settle(gate)  # raises the prefill's failure
                raise UpstreamFailure(  # (a verdict that stopped the stream is a bad one)
                    f"the prefill's verdict stopped worker {w.id}'s stream", phase="prefill", worker=w.id
                ) from None
            if not idle.fired:
                raise
            resp.abort()
            where = "mid-stream" if resp.reads else "after its response headers"
            raise UpstreamTimeout(
                f"worker {w.id} sent nothing for {idle.seconds:g}s {where}",
                phase="idle",
                worker=w.id,
                public=f"the engine sent nothing for {idle.seconds:g}s {where}",
            ) from None
        except UpstreamProtocolError as e:
            raise UpstreamFailure(
                f"worker {w.id} broke the stream: {e}", phase=self.phase, worker=w.id, dropped=True
            ) from None
        finally:
            timer = idle.timer
            if timer is not None:
                timer.cancel()

    async def _end(self, watch: StreamWatch) -> None:
        """The upstream stream ended: its held end is released only if the answer passes."""
        check, resp, w, res = self.check, self.resp, self.w, self.ctx.res
        if (
            self.kept is not None
            and check is not None
            and check.verify is not None
            and watch.violation is None
        ):
            # the end (finish event, usage, [DONE]) is still held: release it only if the
            # stream agrees with its verification run
            why = await verified(self.s, check, b"".join(self.kept), stream=True)
            if why is not None:
                resp.release()
                stage = "mid_stream" if res.started else "before_first_byte"
                raise integrity(self.s, check, why, w, stage, Guard.SHADOW)
        why = watch.finish()
        if watch.failed is not None:
            resp.release()
            raise UpstreamFailure(
                f"worker {w.id} failed the request: {watch.failed}",
                phase=self.phase,
                worker=w.id,
                answered=True,
                held=True,
            )
        if why is not None:
            assert check is not None  # (only a check finds a violation)
            resp.release()
            raise integrity(self.s, check, why, w, "mid_stream" if res.started else "before_first_byte")


class _IdleDeadline(msgspec.Struct, eq=False):
    """The idle deadline of a stream, checked lazily: one timer that re-arms itself at the last
    read + idle when it finds the stream has moved, instead of a new timer per chunk. When the
    upstream is silent that long, the pipe is cancelled (which aborts the upstream connection)."""

    loop: asyncio.AbstractEventLoop
    resp: UpstreamResponse
    piped: asyncio.Future[None]
    seconds: float
    fired: bool = False
    timer: asyncio.TimerHandle | None = None

    def check(self) -> None:
        """Its timer fired: re-armed where the stream moved or the client is not reading."""
        loop, resp, idle = self.loop, self.resp, self.seconds
        due = resp.last_read_at + idle
        if resp.held_back:  # the client is not reading: no upstream silence to judge
            self.timer = loop.call_at(loop.time() + idle, self.check)
        elif loop.time() < due:
            self.timer = loop.call_at(due, self.check)
        else:
            self.fired = True
            self.piped.cancel()  # aborts the upstream connection
