"""The KV transfer between emulated prefill and decode, over real TCP.

Framing: each message is ``4-byte big-endian header length, msgpack header, 8-byte big-endian
payload length, payload``. The payload carries the block contents (32 bytes each) followed by
filler bytes, so that its size is the profile's KV size for those tokens divided by
``kv_scale`` (a slow or cut link is therefore real). A prefill runs one :class:`KvServer` on its
KV port (SGLang: the ``rank_port`` it registers with its bootstrap server; vLLM: the NIXL side
channel ``remote_port``).

* vLLM (pull): the decode sends ``{"op": "read", engine_id, request_id, block_ids}``; the server
  answers with the content of those block ids *as they are now* (stale ids give other content),
  then treats the read as the completion notification and frees the request's held blocks. A
  decode that computes the prompt itself (prompt logprobs: vLLM's ``skip_reading_prefix_cache``)
  reads nothing and only notifies (``{"op": "notify", ...}``, NIXL's notify-only path of a full
  local hit): the held blocks are freed without a transfer.
* SGLang (rendezvous on the room): the decode sends ``{"op": "wait_room", room}``; the server
  answers when the prefill of that room has produced its KV (``offer``). A room whose prefill was
  rejected is never offered: the decode waits for its own timeout, as on SGLang 0.5.23. A room
  transfers once: a second decode request on a room already claimed (SGLang 0.5.23 gives every
  sample of an ``n > 1`` request its prompt's room) waits in ``WaitingForInput`` until its own
  timeout, and a second prefill offer on it is never taken (sglang PRs #26486, #30723).

A room lives while a request uses it, and goes when that ends in any way, as SGLang's sender and
receiver ``clear()`` their bootstrap room's entries on success, failure and abort:

* the transfer ends (sent, failed, or the decode's connection lost mid-send): taken, spent;
* the decode gives up before any prefill offered (its timeout, its abort, its client gone: the
  connection closes, which is SGLang's decode-side abort notification; a decode that never
  connected sends ``{"op": "abort_room", room}``): the room goes and is remembered as abandoned,
  so that a prefill offering it later finds its transfer failed at once instead of waiting for
  its bootstrap timeout;
* the prefill request ends without the room taken (cancelled, aborted, a fault, its bootstrap
  timeout): :meth:`KvServer.end_prefill` drops it (a decode waiting on it is told "aborted");
* a room kept past its prefill request (``silent_truncation``) expires after the bootstrap timeout.

A room whose KV never reached its decode (its decode gave up, or the send failed) carries a
:class:`RoomFailure`: the prefill's request ends with SGLang's 500 abort, not a 200.

vLLM's held blocks are freed by the read (or notification) of the decode, whatever the read's
outcome, and otherwise by their lease (vLLM's abort timeout): a decode aborted before it read
notifies the prefill, and a read that stalls (``transfer_stall``) never completes, so its blocks
wait for the lease, as on vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

log = logging.getLogger("emulator.kvtransfer")

HASH_BYTES = 32
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()


class TransferError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        # "connect", "handshake", "range", "failed", "lost", "timeout", "aborted"; a prefill's
        # failed room: "bootstrap" or "transfer" (the stage its request failed in)
        self.kind = kind


async def send_msg(writer: asyncio.StreamWriter, header: dict[str, Any], payload: bytes = b"") -> None:
    h = _enc.encode(header)
    writer.write(len(h).to_bytes(4, "big") + h + len(payload).to_bytes(8, "big"))
    if payload:
        writer.write(payload)
    await writer.drain()


async def recv_msg(reader: asyncio.StreamReader) -> tuple[dict[str, Any], bytes]:
    n = int.from_bytes(await reader.readexactly(4), "big")
    header: dict[str, Any] = _dec.decode(await reader.readexactly(n))
    m = int.from_bytes(await reader.readexactly(8), "big")
    payload = await reader.readexactly(m) if m else b""
    return header, payload


async def close_writer(writer: asyncio.StreamWriter) -> None:
    """Close a connection and wait for it, on a path that is not unwinding an exception: a
    coroutine cancelled or closed at collection must only `writer.close()` (an await there
    suspends a coroutine being closed: "coroutine ignored GeneratorExit")."""
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()


def pack_blocks(contents: list[bytes], pad: int) -> bytes:
    return b"".join(contents) + bytes(max(0, pad))


def unpack_blocks(payload: bytes, count: int) -> list[bytes]:
    return [payload[i * HASH_BYTES : (i + 1) * HASH_BYTES] for i in range(count)]


class Held(msgspec.Struct):
    """vLLM: blocks a finished prefill keeps for the decode to pull (until read or lease end)."""

    blocks: list[int]
    num_tokens: int
    fault: str | None
    expiry: asyncio.TimerHandle | None = None


# the prefill's KVTransferError reason when its decode aborted (the abort notification records
# no reason on the prefill: CommonKVSender.failure_exception, disaggregation/common/conn.py:2446-2456)
PEER_ABORTED = "Failed due to an unknown reason from another rank"


class RoomFailure(msgspec.Struct, frozen=True):
    """Why a room's KV never reached its decode, as the prefill's sender sees it: its request
    then ends with a 500 abort (SGLang's ``handle_bootstrap_failure`` /
    ``handle_inflight_transfer_failure``, disaggregation/prefill.py:1352-1378, 1282-1310)."""

    stage: str  # "bootstrap": its decode never bootstrapped it; "transfer": it failed after
    reason: str


class Room(msgspec.Struct):
    """SGLang: the rendezvous of one bootstrap room."""

    ready: asyncio.Future[tuple[list[bytes], int, str | None]]
    taken: asyncio.Future[bool]
    created: float
    claimed: bool = False  # a decode request is waiting on (or has had) this room's KV
    expiry: asyncio.TimerHandle | None = None  # a room kept past its prefill request
    failure: RoomFailure | None = None  # set with ``taken`` False, unless the failure is silent


class KvServer:
    """The prefill side. ``read_blocks`` returns block contents; ``pad_for`` the filler size."""

    def __init__(
        self,
        *,
        engine_id: str,
        read_blocks: Callable[[list[int]], list[bytes] | None],
        pad_for: Callable[[int], int],
        link_delay: Callable[[int], float],
        release: Callable[[list[int]], None],
        on_transfer: Callable[[bool, int, float], None],
        concurrency_fault: Callable[[int], bool],
    ) -> None:
        self.engine_id = engine_id
        self._read_blocks = read_blocks
        self._pad_for = pad_for
        self._link_delay = link_delay
        self._release = release
        self._on_transfer = on_transfer
        self._concurrency_fault = concurrency_fault
        self.held: dict[str, Held] = {}
        self.rooms: dict[int, Room] = {}
        # rooms whose KV went to a decode: they never transfer again (bounded, oldest dropped)
        self.spent: dict[int, None] = {}
        # rooms whose decode gave up before any prefill offered (bounded, oldest dropped)
        self.abandoned: dict[int, None] = {}
        self.active = 0
        self.last_contents: list[bytes] = []
        self.unrecognized_reads = 0
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._handle, host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
        for held in self.held.values():
            if held.expiry is not None:
                held.expiry.cancel()
        for room in self.rooms.values():
            if room.expiry is not None:
                room.expiry.cancel()
            if not room.taken.done():
                room.taken.cancel()

    # -- vLLM --------------------------------------------------------------------------
    def hold(self, request_id: str, held: Held, lease_s: float, on_expire: Callable[[], None]) -> None:
        loop = asyncio.get_running_loop()

        def expire() -> None:
            h = self.held.pop(request_id, None)
            if h is not None:
                self._release(h.blocks)
                on_expire()

        held.expiry = loop.call_later(lease_s, expire)
        self.held[request_id] = held

    # -- SGLang ------------------------------------------------------------------------
    def room(self, room: int) -> Room:
        r = self.rooms.get(room)
        if r is None:
            loop = asyncio.get_running_loop()
            r = Room(loop.create_future(), loop.create_future(), time.monotonic())
            if room in self.spent:  # a late joiner: nothing will ever pair with it
                r.claimed = True
                return r
            self.rooms[room] = r
        return r

    def _spend(self, room: int) -> None:
        self.spent[room] = None
        if len(self.spent) > 65536:
            del self.spent[next(iter(self.spent))]

    def _abandon(self, room: int) -> None:
        self.abandoned[room] = None
        if len(self.abandoned) > 65536:
            del self.abandoned[next(iter(self.abandoned))]

    def _forget(self, room: int, r: Room) -> None:
        """Remove `r` (if it is still the registered room `room`)."""
        if r.expiry is not None:
            r.expiry.cancel()
            r.expiry = None
        if self.rooms.get(room) is r:
            del self.rooms[room]

    def offer(self, room: int, contents: list[bytes], num_tokens: int, fault: str | None) -> Room:
        if room in self.abandoned and room not in self.rooms:
            # its decode is gone (it aborted or timed out first): the transfer fails at once
            loop = asyncio.get_running_loop()
            r = Room(loop.create_future(), loop.create_future(), time.monotonic(), claimed=True)
            r.ready.set_result((contents, num_tokens, fault))
            # the abort notification left the room Failed (terminal): the new request's sender
            # polls Failed while still in the bootstrap queue
            r.failure = RoomFailure("bootstrap", PEER_ABORTED)
            r.taken.set_result(False)
            return r
        r = self.room(room)
        if not r.ready.done():
            r.ready.set_result((contents, num_tokens, fault))
        return r

    def drop_room(self, room: int) -> None:
        r = self.rooms.get(room)
        if r is not None:
            self._forget(room, r)
            if not r.ready.done():
                r.ready.cancel()
            if not r.taken.done():
                r.taken.cancel()

    def end_prefill(self, room: int, offered: Room | None) -> None:
        """The prefill request of `room` ended (any way) with `offered` its offer (None: it never
        offered): the room goes unless it is no longer this request's (taken and spent, a later
        request's room of the same id, or a room another prefill request offered)."""
        r = self.rooms.get(room)
        if r is None or (offered is not None and r is not offered):
            return
        if offered is None and r.ready.done():
            return
        self.drop_room(room)

    def expire_room(self, room: int, r: Room, after_s: float) -> None:
        """Drop `r` after `after_s` unless a decode has taken it by then."""
        if self.rooms.get(room) is not r:
            return
        if r.expiry is not None:
            r.expiry.cancel()

        def expire() -> None:
            r.expiry = None
            if self.rooms.get(room) is r:
                self.drop_room(room)

        r.expiry = asyncio.get_running_loop().call_later(after_s, expire)

    # -- connection handler --------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            header, _ = await recv_msg(reader)
            op = header.get("op")
            if op == "read":
                await self._serve_read(header, reader, writer)
            elif op == "notify":
                await self._serve_notify(header, writer)
            elif op == "wait_room":
                await self._serve_room(header, reader, writer)
            elif op == "abort_room":
                await self._serve_abort_room(header, writer)
            else:
                await send_msg(writer, {"ok": False, "kind": "failed", "error": f"bad op {op!r}"})
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except Exception:
            log.exception("kv server connection failed")
        except BaseException:
            writer.close()  # cancelled or collected: no await while unwinding (close_writer)
            raise
        await close_writer(writer)

    async def _send_blocks(
        self,
        writer: asyncio.StreamWriter,
        contents: list[bytes],
        num_tokens: int,
        fault: str | None,
        gone: asyncio.Future[bytes],
    ) -> str | None:
        """Send the blocks; `gone` completes when the peer closes its connection. None when
        sent, else why not (the prefill sender's failure reason)."""
        self.active += 1
        t0 = time.monotonic()
        try:
            if fault is None and self._concurrency_fault(self.active):
                fault = "transfer_fail"
            if fault == "transfer_stall":
                await gone  # never completes: it ends when the decode gives up
                return PEER_ABORTED
            if fault in ("transfer_fail", "abort_during_transfer"):
                kind, error = (
                    ("failed", "KV transfer failed (injected)")
                    if fault == "transfer_fail"
                    else ("aborted", "prefill aborted during transfer")
                )
                await send_msg(writer, {"ok": False, "kind": kind, "error": error})
                self._on_transfer(False, 0, 0.0)
                return error
            if fault == "wrong_request_kv" and self.last_contents:
                other = self.last_contents
                contents = [other[i] if i < len(other) else other[-1] for i in range(len(contents))]
            elif fault == "bogus_kv_params":
                contents = [bytes(HASH_BYTES) for _ in contents]
            delay = self._link_delay(num_tokens)
            if delay > 0:
                await asyncio.sleep(delay)
            payload = pack_blocks(contents, self._pad_for(num_tokens))
            await send_msg(writer, {"ok": True, "count": len(contents)}, payload)
            self._on_transfer(True, len(payload), time.monotonic() - t0)
            return None
        finally:
            self.active -= 1

    async def _serve_read(
        self, header: dict[str, Any], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if header.get("engine_id") != self.engine_id:
            await send_msg(
                writer, {"ok": False, "kind": "handshake", "error": "handshake_failed: unknown engine id"}
            )
            self._on_transfer(False, 0, 0.0)
            return
        block_ids = [int(b) for b in header.get("block_ids", [])]
        contents = self._read_blocks(block_ids)
        if contents is None:
            await send_msg(writer, {"ok": False, "kind": "range", "error": "remote index out of range"})
            self._on_transfer(False, 0, 0.0)
            return
        request_id = str(header.get("request_id"))
        held = self.held.get(request_id)
        if held is None:
            self.unrecognized_reads += 1
            log.warning(
                "Potentially invalid KV blocks for unrecognized request %s were retrieved by a decode worker. "
                "They may have expired.",
                request_id,
            )
        fault = held.fault if held is not None else None
        num_tokens = int(header.get("num_tokens", len(block_ids) * 16))
        gone = asyncio.ensure_future(reader.read())
        try:
            if await self._send_blocks(writer, contents, num_tokens, fault, gone) is None:
                self.last_contents = contents
        finally:
            gone.cancel()
            # the read is over, whatever its outcome (the decode then notifies the prefill), except
            # a stalled one: it never completes, and the blocks wait for their lease
            if held is not None and fault != "transfer_stall" and self.held.get(request_id) is held:
                del self.held[request_id]
                if held.expiry is not None:
                    held.expiry.cancel()
                self._release(held.blocks)

    async def _serve_notify(self, header: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        if header.get("engine_id") != self.engine_id:
            await send_msg(
                writer, {"ok": False, "kind": "handshake", "error": "handshake_failed: unknown engine id"}
            )
            return
        held = self.held.pop(str(header.get("request_id")), None)
        if held is not None:
            if held.expiry is not None:
                held.expiry.cancel()
            self._release(held.blocks)
        await send_msg(writer, {"ok": True, "count": 0})

    async def _serve_room(
        self, header: dict[str, Any], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        room_id = int(header["room"])
        r = self.room(room_id)
        if r.claimed:
            # another decode request has this room: this one gets nothing and waits until its own
            # timeout (or abort) closes the connection
            await reader.read()
            return
        r.claimed = True
        self.abandoned.pop(room_id, None)
        gone = asyncio.ensure_future(reader.read())  # EOF: the decode gave up or went away
        try:
            await asyncio.wait((gone, r.ready), return_when=asyncio.FIRST_COMPLETED)
            if not r.ready.done():
                # the decode timed out or was aborted before any prefill offered: SGLang's decode
                # notifies the prefill, whose room then fails; the room goes now
                self._forget(room_id, r)
                self._abandon(room_id)
                return
            if r.ready.cancelled():  # the prefill request ended without the KV
                self._forget(room_id, r)
                await send_msg(writer, {"ok": False, "kind": "aborted", "error": "Aborted by AbortReq."})
                return
            contents, num_tokens, fault = r.ready.result()
            error: str | None = PEER_ABORTED  # unless sent: the decode's connection went mid-send
            try:
                error = await self._send_blocks(writer, contents, num_tokens, fault, gone)
                if error is None:
                    self.last_contents = contents
            finally:
                # sglang #33507 (abort_during_transfer): the failure goes unseen, the prefill's
                # request ends as if its KV were sent
                if error is not None and fault != "abort_during_transfer":
                    r.failure = RoomFailure("transfer", error)
                if not r.taken.done():
                    r.taken.set_result(error is None)
                self._forget(room_id, r)
                self._spend(room_id)
        finally:
            gone.cancel()

    async def _serve_abort_room(self, header: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        """SGLang decode's abort notification for a room it never waited on (its KV wait stalled):
        a room offered and not claimed fails; an unknown room is remembered as abandoned."""
        room_id = int(header["room"])
        r = self.rooms.get(room_id)
        if r is None:
            if room_id not in self.spent:
                self._abandon(room_id)
        elif not r.claimed:  # a claimed room's decode connection tells by closing
            self._forget(room_id, r)
            self._abandon(room_id)
            if not r.taken.done():
                r.failure = RoomFailure("bootstrap", PEER_ABORTED)
                r.taken.set_result(False)
        await send_msg(writer, {"ok": True, "count": 0})
