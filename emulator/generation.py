"""Output tokens as both engine surfaces draw them: the engine's decode steps with the
per-token faults applied (``slow``, ``hang_mid_stream``, ``crash_mid_stream``,
``error_mid_stream``). Obtaining the prompt's KV and protocol formatting stay in the engines'
packages (:mod:`emulator.sglang`, :mod:`emulator.vllm`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING

from emulator.faults import Fault
from emulator.scheduler import Seq
from emulator.stops import StopSpec

if TYPE_CHECKING:
    from emulator.server import EmulatorServer


class MidStreamFault(Exception):
    """A per-token fault fired: ``kind`` is hang_mid_stream, crash_mid_stream or error_mid_stream."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


async def tokens(
    server: EmulatorServer,
    seq: Seq,
    n: int,
    hit: dict[str, Fault],
    stop: StopSpec | None = None,
    *,
    first_ready: bool = False,
) -> AsyncGenerator[int, None]:
    """Output tokens with the per-token faults applied; `stop`'s minimum length masks its stop
    token ids out of the first tokens (`StopSpec.drawn`). Each call draws from output position 0:
    a P/D decode generates its whole answer, the prefill's token included. `first_ready`: the
    first token is out without a decode step (``Engine.decode``)."""
    engine = server.engine
    held = stop.min_tokens if stop is not None and stop.ids else 0
    slow = hit.get("slow")
    mid = hit.get("hang_mid_stream") or hit.get("crash_mid_stream") or hit.get("error_mid_stream")
    after = mid.get_int("after", 2) if mid is not None else -1
    i = 0
    steps = engine.decode(seq, n, first_ready=first_ready)
    try:
        async for tok in steps:
            if i == after and mid is not None:
                raise MidStreamFault(mid.kind)
            if i < held:
                assert stop is not None
                tok = stop.drawn(tok, i)
            if i == 0:
                seq.t_first = time.time()
            engine.counters.generation_tokens_total += 1
            yield tok
            i += 1
            if slow is not None:
                await asyncio.sleep((slow.get_float("factor", 5.0) - 1.0) * engine.token_interval())
    finally:
        await steps.aclose()  # a consumer that stops early (a stop string) leaves the batch now
    if i == after and mid is not None:
        raise MidStreamFault(mid.kind)
