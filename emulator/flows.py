"""The request flows both engine surfaces share: colocated, P/D prefill and P/D decode.

A flow admits the sequence, obtains its prompt KV (computed here, or received over the KV
transfer), and then yields output tokens, applying the per-token faults (``slow``,
``hang_mid_stream``, ``crash_mid_stream``). Protocol formatting stays in the API modules.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING

from emulator.faults import Fault
from emulator.kvtransfer import TransferError, abort_room, notify_done, pull_blocks, wait_room
from emulator.scheduler import Seq
from emulator.stops import StopSpec

if TYPE_CHECKING:
    from emulator.app import EmulatorServer


class MidStreamFault(Exception):
    """A per-token fault fired: ``kind`` is hang_mid_stream, crash_mid_stream or error_mid_stream."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


def env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


async def admit_and_compute(
    server: EmulatorServer, seq: Seq, *, truncate_to: int | None = None, read_cache: bool = True
) -> None:
    await server.engine.admit(seq, read_cache=read_cache)
    await server.engine.prefill(seq, truncate_to=truncate_to)


async def tokens(
    server: EmulatorServer, seq: Seq, n: int, hit: dict[str, Fault], stop: StopSpec | None = None
) -> AsyncGenerator[int, None]:
    """Output tokens with the per-token faults applied; `stop`'s minimum length masks its stop
    token ids out of the first tokens (`StopSpec.drawn`). Each call draws from output position 0:
    a P/D decode generates its whole answer, the prefill's token included."""
    engine = server.engine
    held = stop.min_tokens if stop is not None and stop.ids else 0
    slow = hit.get("slow")
    mid = hit.get("hang_mid_stream") or hit.get("crash_mid_stream") or hit.get("error_mid_stream")
    after = mid.get_int("after", 2) if mid is not None else -1
    i = 0
    steps = engine.decode(seq, n)
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


async def sglang_fetch_kv(
    server: EmulatorServer, seq: Seq, host: str, port: int, room: int, hit: dict[str, Fault]
) -> list[bytes]:
    """SGLang decode: find the prefill rank via its bootstrap server, then wait for the room's KV."""
    from emulator.bootstrap import resolve_rank

    spec = server.spec
    timeout = spec.waiting_timeout_s or env_float("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300.0)
    key = (host, port)
    if "transfer_stall" in hit:
        # the KV never comes; when the decode gives up (its timeout, an abort, its client gone) it
        # notifies the prefill rank, as SGLang's receiver does, so the prefill's room goes too
        addr = server.rank_cache.get(key)
        if addr is None and server.session is not None:
            with contextlib.suppress(Exception):
                addr = await resolve_rank(server.session, host, port)
        try:
            await asyncio.sleep(timeout)
        finally:
            if addr is not None:
                server.notify_in_background(abort_room(addr[0], addr[1], room, spec.handshake_timeout_s))
        raise TransferError("timeout", f"Request {room} timed out after {timeout}s in KVPoll.WaitingForInput")
    addr = server.rank_cache.get(key)
    if addr is None:
        deadline = time.monotonic() + spec.handshake_timeout_s
        assert server.session is not None
        while True:
            try:
                addr = await resolve_rank(server.session, host, port)
                break
            except Exception as e:
                if time.monotonic() >= deadline:
                    raise TransferError(
                        "handshake",
                        f"Failed to get prefill server info from bootstrap server {host}:{port}: {e}",
                    ) from e
                await asyncio.sleep(0.1)
        server.rank_cache[key] = addr
    c = server.engine.counters
    c.in_transfer += 1
    try:
        fail = "transfer_fail" in hit or server.concurrency_fault(c.in_transfer)
        try:
            contents = await wait_room(addr[0], addr[1], room, timeout)
        except TransferError as e:
            if e.kind == "timeout":
                raise TransferError(
                    "timeout", f"Request {room} timed out after {timeout}s in KVPoll.WaitingForInput"
                ) from e
            if e.kind in ("lost", "connect"):
                server.rank_cache.pop(key, None)
                raise TransferError(
                    "lost", f"Lost connection with prefill instance (bootstrap_addr: {host}:{port})"
                ) from e
            raise
        # decode-side faults act after the prefill has shipped (so the prefill is not left waiting)
        if fail:
            raise TransferError("failed", "Failed to get kvcache from prefill instance, it might be dead")
        if "abort_during_transfer" in hit:
            raise TransferError("aborted", "aborted during transfer")
        return contents
    finally:
        c.in_transfer -= 1


async def vllm_pull_kv(
    server: EmulatorServer, seq: Seq, params: dict[str, object], hit: dict[str, Fault]
) -> list[bytes]:
    """vLLM decode: read the prefill's blocks from ``remote_host:remote_port``."""
    c = server.engine.counters
    c.in_transfer += 1
    try:
        if "transfer_stall" in hit:
            await asyncio.Event().wait()
        if "transfer_fail" in hit or server.concurrency_fault(c.in_transfer):
            raise TransferError("failed", "KV transfer failed (injected)")
        groups = params.get("remote_block_ids") or [[]]
        assert isinstance(groups, list)
        ids = [int(b) for b in groups[0]]
        needed = seq.n_prompt_blocks
        return await pull_blocks(
            str(params.get("remote_host") or "127.0.0.1"),
            int(str(params.get("remote_port") or 0)),
            engine_id=str(params.get("remote_engine_id")),
            request_id=str(params.get("remote_request_id")),
            block_ids=ids[:needed],
            num_tokens=len(seq.prompt) - seq.cached_tokens,
            connect_retry_s=server.spec.handshake_timeout_s,
        )
    finally:
        c.in_transfer -= 1


async def vllm_skip_remote_kv(server: EmulatorServer, params: dict[str, object]) -> None:
    """vLLM decode computing the prompt itself (prompt logprobs skip reading any cache): nothing
    is pulled, the prefill is only notified so that it frees the blocks it holds. A failed
    notification is only logged by vLLM (the blocks then wait for their lease)."""
    with contextlib.suppress(TransferError):
        await notify_done(
            str(params.get("remote_host") or "127.0.0.1"),
            int(str(params.get("remote_port") or 0)),
            engine_id=str(params.get("remote_engine_id")),
            request_id=str(params.get("remote_request_id")),
            wait_s=server.spec.handshake_timeout_s,
        )
