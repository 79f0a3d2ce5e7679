"""The SGLang decode's side of the KV handoff: find the prefill rank through its bootstrap
server, then wait for the bootstrap room's KV (Mooncake's receiver, emulated)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import NoReturn

from emulator.bootstrap import resolve_rank
from emulator.faults import Fault
from emulator.kvclient import abort_room, wait_room
from emulator.kvtransfer import TransferError
from emulator.scheduler import Seq
from emulator.server import EmulatorServer


def env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


def waiting_timeout(server: EmulatorServer) -> float:
    """The decode's KV wait (``--waiting-timeout``, else SGLang's environment variable)."""
    return server.spec.waiting_timeout_s or env_float("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300.0)


def bootstrap_timeout(server: EmulatorServer) -> float:
    """The prefill's wait for its decode (``--waiting-timeout``, else SGLang's variable)."""
    return server.spec.waiting_timeout_s or env_float("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300.0)


async def fetch_kv(
    server: EmulatorServer, seq: Seq, host: str, port: int, room: int, hit: dict[str, Fault]
) -> list[bytes]:
    """SGLang decode: find the prefill rank via its bootstrap server, then wait for the room's KV."""
    timeout = waiting_timeout(server)
    if "transfer_stall" in hit:
        await _stall(server, host, port, room)
    addr = await _rank(server, host, port)
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
                server.rank_cache.pop((host, port), None)
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


async def _stall(server: EmulatorServer, host: str, port: int, room: int) -> NoReturn:
    """``transfer_stall``: the KV never comes; when the decode gives up (its timeout, an abort,
    its client gone) it notifies the prefill rank, as SGLang's receiver does, so the prefill's
    room goes too."""
    timeout = waiting_timeout(server)
    addr = server.rank_cache.get((host, port))
    if addr is None and server.session is not None:
        with contextlib.suppress(Exception):
            addr = await resolve_rank(server.session, host, port)
    try:
        await asyncio.sleep(timeout)
    finally:
        if addr is not None:
            wait = server.spec.handshake_timeout_s
            server.notify_in_background(abort_room(addr[0], addr[1], room, wait))
    raise TransferError("timeout", f"Request {room} timed out after {timeout}s in KVPoll.WaitingForInput")


async def _rank(server: EmulatorServer, host: str, port: int) -> tuple[str, int]:
    """The prefill rank's KV address, from the cache or its bootstrap server (retried until
    the handshake timeout)."""
    key = (host, port)
    addr = server.rank_cache.get(key)
    if addr is not None:
        return addr
    deadline = time.monotonic() + server.spec.handshake_timeout_s
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
    return addr
