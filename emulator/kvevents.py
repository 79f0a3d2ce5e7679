"""KV cache events on ZMQ, in the engines' own msgpack format.

Wire (vLLM ``ZmqEventPublisher``, the same in SGLang): a PUB socket sends multipart
``(topic, seq as 8-byte big-endian, msgpack payload)``. A ROUTER replay socket (on the
publisher's port + 1 here) answers a request whose last frame is an 8-byte big-endian start
sequence with every buffered ``(b"", seq, payload)`` from there on, then ``(b"", -1, b"")``.

Payload: ``KVEventBatch`` encoded array-like ``[ts, events, dp_rank]``; events are msgspec
tagged array-like structs (``["BlockStored", block_hashes, parent_block_hash, token_ids,
block_size, lora_id, medium, ...]``, ``["BlockRemoved", block_hashes, medium]``,
``["AllBlocksCleared"]``). vLLM hashes are bytes (32-byte SHA-256 here), SGLang's are the
low 64 bits as ints.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from emulator.model import hash_to_int

log = logging.getLogger("emulator.kvevents")


class VllmBlockStored(msgspec.Struct, array_like=True, omit_defaults=True, tag="BlockStored"):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class VllmBlockRemoved(msgspec.Struct, array_like=True, omit_defaults=True, tag="BlockRemoved"):
    block_hashes: list[bytes]
    medium: str | None


class SglBlockStored(msgspec.Struct, array_like=True, omit_defaults=True, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class SglBlockRemoved(msgspec.Struct, array_like=True, omit_defaults=True, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, array_like=True, omit_defaults=True, tag="AllBlocksCleared"):
    pass


def replay_endpoint(endpoint: str) -> str:
    head, _, port = endpoint.rpartition(":")
    return f"{head}:{int(port) + 1}"


class KvEventPublisher:
    """Collects events during an engine step and publishes them as one batch."""

    def __init__(
        self, endpoint: str, engine: str, block_size: int, topic: str = "", buffer: int = 10000
    ) -> None:
        self.engine = engine
        self.block_size = block_size
        self.topic = topic.encode()
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100000)
        self._pub.setsockopt(zmq.LINGER, 0)
        bind = endpoint.replace("//localhost", "//127.0.0.1")
        self._pub.bind(bind)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind(replay_endpoint(bind))
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self._pending: list[Any] = []
        self._flush_scheduled = False
        self._encoder = msgspec.msgpack.Encoder()
        self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    # event constructors -------------------------------------------------------------------
    def stored(self, hashes: list[bytes], parent: bytes | None, tokens: list[int]) -> None:
        if self.engine == "vllm":
            self._add(VllmBlockStored(hashes, parent, tokens, self.block_size, None, "GPU"))
        else:
            self._add(
                SglBlockStored(
                    [hash_to_int(h) for h in hashes],
                    None if parent is None else hash_to_int(parent),
                    tokens,
                    self.block_size,
                    None,
                    "GPU",
                )
            )

    def removed(self, hashes: list[bytes]) -> None:
        if self.engine == "vllm":
            self._add(VllmBlockRemoved(hashes, "GPU"))
        else:
            self._add(SglBlockRemoved([hash_to_int(h) for h in hashes], "GPU"))

    def cleared(self) -> None:
        self._add(AllBlocksCleared())

    def _add(self, event: Any) -> None:
        self._pending.append(event)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._flush_scheduled = False
        if not self._pending:
            return
        events, self._pending = self._pending, []
        payload = self._encoder.encode([time.time(), events, 0])
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart(
                [self.topic, seq.to_bytes(8, "big", signed=True), payload], flags=zmq.NOBLOCK
            )

    async def _serve_replay(self) -> None:
        try:
            while True:
                frames = await self._router.recv_multipart()
                ident, start_frame = frames[0], frames[-1]
                start = int.from_bytes(start_frame, "big", signed=True) if len(start_frame) == 8 else 0
                for seq, payload in list(self._buffer):
                    if seq >= start:
                        await self._router.send_multipart(
                            [ident, b"", seq.to_bytes(8, "big", signed=True), payload]
                        )
                await self._router.send_multipart([ident, b"", (-1).to_bytes(8, "big", signed=True), b""])
        except asyncio.CancelledError:
            raise
        except zmq.ZMQError as e:  # socket closed
            log.debug("replay socket closed: %s", e)

    async def close(self) -> None:
        self._replay_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._replay_task
        self._pub.close(0)
        self._router.close(0)
        self._ctx.term()
