"""The decode's side of the emulated KV transfer (:mod:`emulator.kvtransfer` has the framing
and the prefill's server): one TCP request per read, notification or room wait."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from emulator.kvtransfer import TransferError, close_writer, recv_msg, send_msg, unpack_blocks


async def _request(
    host: str, port: int, header: dict[str, Any], wait_s: float | None
) -> tuple[dict[str, Any], bytes]:
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5.0)
    except (OSError, TimeoutError) as e:
        raise TransferError("connect", f"cannot connect to {host}:{port}: {e}") from e
    try:
        await send_msg(writer, header)
        try:
            answer = await asyncio.wait_for(recv_msg(reader), wait_s)
        except TimeoutError as e:
            raise TransferError("timeout", "timed out") from e
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            raise TransferError("lost", "Lost connection with prefill instance") from e
    except BaseException:
        # No await while unwinding: a cancelled read, or a coroutine closed at collection
        # (GeneratorExit), must not suspend again ("coroutine ignored GeneratorExit").
        writer.close()
        raise
    await close_writer(writer)
    return answer


async def pull_blocks(
    host: str,
    port: int,
    *,
    engine_id: str,
    request_id: str,
    block_ids: list[int],
    num_tokens: int,
    connect_retry_s: float,
    wait_s: float | None = None,
) -> list[bytes]:
    """vLLM decode: read ``block_ids`` from the prefill's side channel."""
    deadline = time.monotonic() + connect_retry_s
    header = {
        "op": "read",
        "engine_id": engine_id,
        "request_id": request_id,
        "block_ids": block_ids,
        "num_tokens": num_tokens,
    }
    while True:
        try:
            reply, payload = await _request(host, port, header, wait_s)
            break
        except TransferError as e:
            if e.kind != "connect" or time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.05)
    if not reply.get("ok"):
        raise TransferError(str(reply.get("kind", "failed")), str(reply.get("error", "transfer failed")))
    return unpack_blocks(payload, int(reply["count"]))


async def notify_done(host: str, port: int, *, engine_id: str, request_id: str, wait_s: float) -> None:
    """vLLM decode: tell the prefill it needs none of its blocks (they are freed there)."""
    reply, _ = await _request(
        host, port, {"op": "notify", "engine_id": engine_id, "request_id": request_id}, wait_s
    )
    if not reply.get("ok"):
        raise TransferError(str(reply.get("kind", "failed")), str(reply.get("error", "notify failed")))


async def abort_room(host: str, port: int, room: int, wait_s: float) -> None:
    """SGLang decode: tell the prefill rank that this decode request gave up on ``room``."""
    await _request(host, port, {"op": "abort_room", "room": room}, wait_s)


async def wait_room(host: str, port: int, room: int, wait_s: float | None) -> list[bytes]:
    """SGLang decode: wait for the KV of ``room`` from the prefill rank at ``host:port``."""
    reply, payload = await _request(host, port, {"op": "wait_room", "room": room}, wait_s)
    if not reply.get("ok"):
        raise TransferError(str(reply.get("kind", "failed")), str(reply.get("error", "transfer failed")))
    return unpack_blocks(payload, int(reply["count"]))
