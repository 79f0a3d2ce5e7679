"""An SGLang P/D stream relayed before its prefill's verdict is in (`guards.prefill_verdict =
"before_end"`, docs/guards.md "When the prefill's verdict is checked").

A busy SGLang prefill answers its HTTP request only between its own forward steps, after its
decode may have streamed for a while; waiting for that answer before the first byte holds every
token the decode made meanwhile. With a `PrefillGate` the relay passes the decode's tokens on at
once and holds only the stream's end (finish event, usage, `[DONE]`) until the verdict is in
(`settle`). A bad verdict stops the stream when it arrives: before the client saw a byte it is a
failed handoff as usual (retry, fallback); after, the stream ends with an error event, never a
clean `[DONE]`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import msgspec

from gateway.orchestration.verify import DecodeCheck

# A prefill's 4xx waits this long before it stops the decode's stream: a decode that refuses
# the same body too ends its stream first, and the refusal is the request's, not a guard's
# catch (concurrent.py's `_AGREEMENT_S`)
_AGREEMENT_S = 0.25


class PrefillGate(msgspec.Struct, eq=False):
    """The prefill's pending answer beside a decode stream already relayed."""

    call: asyncio.Future[tuple[int, bytes]]  # the prefill's (status, body)
    # awaits and judges the verdict: raises the handoff's error on a bad one, else returns the
    # decode-consistency check built from the prefill's answer (None where none applies)
    settle: Callable[[PrefillGate], Awaitable[DecodeCheck | None]]
    # the prefill's adapter's quick verdict on (status, body): True when it is a sound basis
    sound: Callable[[int, bytes], bool]
    drop_usage: bool  # the decode was asked for a usage chunk the client did not ask for
    # the stream is kept for a verification run, which only the verdict says is due (a suspect
    # pair, a sampled `shadow_before_delivery`): its end then waits for the run too
    keep: bool
    check: DecodeCheck | None = None  # once settled
    stopped: bool = False  # a bad verdict cancelled the relay's pipe
    decode_refused: bool = False  # the decode's stream was its refusal of the request (set by the relay)
    _timer: asyncio.TimerHandle | None = None

    def stop_on_failure(self, piped: asyncio.Future[None]) -> None:
        """Cancel `piped` (which aborts the decode's connection) as soon as the prefill fails:
        the relay then `settle`s, which raises that failure."""

        def stop() -> None:
            if not piped.done():
                self.stopped = True
                piped.cancel()

        def on_verdict(f: asyncio.Future[tuple[int, bytes]]) -> None:
            if piped.done():
                return
            if f.cancelled() or f.exception() is not None:
                stop()
                return
            status, body = f.result()
            if self.sound(status, body):
                return
            if 400 <= status < 500:
                self._timer = asyncio.get_running_loop().call_later(_AGREEMENT_S, stop)
            else:
                stop()

        self.call.add_done_callback(on_verdict)
        piped.add_done_callback(lambda _: self._cancel_timer())

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
