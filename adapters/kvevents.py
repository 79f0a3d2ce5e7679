"""The engines' KV-cache events on the wire: ZMQ frames and msgpack payloads, both engines.

Wire (vLLM 0.33.0 `vllm/distributed/kv_events.py` `ZmqEventPublisher`; SGLang 0.5.23
`sglang/srt/disaggregation/kv_events.py`, the same publisher): a PUB socket sends multipart
`(topic, seq, payload)` with `seq` an 8-byte big-endian integer counting from 0 in each engine
process. A ROUTER socket (`replay_endpoint`) answers a request `(b"", start seq as 8 bytes)`
with every batch it still buffers from that seq on, `(b"", topic, seq, payload)` each, then
`(b"", b"", -1 as 8 bytes, b"")`; older publishers (and this project's emulator) leave the
topic frame out of the replies: `(b"", seq, payload)` and `(b"", -1, b"")`.

Payload: `[ts, events, dp_rank]` (an array). Events are tagged msgpack **maps** in both engines'
current versions (`{"type": "BlockStored", "block_hashes": [...], ...}`, fields at their defaults
left out), **arrays** in older ones and in the emulator (`["BlockStored", block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium, ...]`, the same first six fields in
both engines). Kinds: `BlockStored`, `BlockRemoved`, `AllBlocksCleared`. vLLM hashes are 32
bytes or (by default) ints; SGLang's are signed int64. `decode_batch` reads every spelling into
the neutral structs below; what an event carries beyond the cache key (LoRA, extra keys, cache
salt) is reported as `keyed`, since those blocks' hashes depend on more than the token ids.
"""

from __future__ import annotations

from typing import Any

import msgspec

END_SEQ = -1


class KvEventError(ValueError):
    """A message that is not a KV event batch in any known spelling."""


class Stored(msgspec.Struct, frozen=True, gc=False):
    hashes: list[int | bytes]
    parent: int | bytes | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    group: int | None = None
    keyed: bool = False  # LoRA, extra keys or cache salt: the hash covers more than the tokens


class Removed(msgspec.Struct, frozen=True, gc=False):
    hashes: list[int | bytes]
    medium: str | None = None
    group: int | None = None


class Cleared(msgspec.Struct, frozen=True, gc=False):
    pass


KvEvent = Stored | Removed | Cleared


class Batch(msgspec.Struct, frozen=True, gc=False):
    ts: float
    events: list[KvEvent]
    dp_rank: int | None = None


_decode = msgspec.msgpack.Decoder()


def _hashes(v: Any) -> list[int | bytes]:
    if not isinstance(v, list) or not all(isinstance(h, int | bytes) for h in v):
        raise KvEventError(f"block hashes must be a list of ints or bytes, got {v!r:.80}")
    return v


def _opt_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _stored_from_map(m: dict[str, Any]) -> Stored:
    tokens = m.get("token_ids")
    if not isinstance(tokens, list):
        raise KvEventError("BlockStored without token_ids")
    parent = m.get("parent_block_hash")
    return Stored(
        hashes=_hashes(m.get("block_hashes")),
        parent=parent if isinstance(parent, int | bytes) else None,
        token_ids=tokens,
        block_size=int(m.get("block_size") or 0),
        medium=m.get("medium"),
        group=_opt_int(m.get("group_idx")),
        keyed=_any_extra(m.get("extra_keys"), m),
    )


def _any_extra(extra: Any, m: dict[str, Any]) -> bool:
    # vLLM publishes extra_keys as a list with one entry per block: all None means none
    if any(m.get(k) is not None for k in ("lora_id", "lora_name", "cache_salt")):
        return True
    return isinstance(extra, list) and any(x is not None for x in extra)


def _stored_from_array(a: list[Any], engine: str) -> Stored:
    if len(a) < 5 or not isinstance(a[3], list):
        raise KvEventError(f"BlockStored array too short or malformed: {a!r:.80}")
    rest = a[5:] + [None] * 4
    if engine == "sglang":  # lora_id, medium, cache_salt, session_id, lora_name
        keyed = rest[0] is not None or rest[2] is not None or rest[4] is not None
    else:  # vLLM: lora_id, medium, lora_name, extra_keys, group_idx, ...
        extra = rest[3]
        keyed = (
            rest[0] is not None
            or rest[2] is not None
            or (isinstance(extra, list) and any(x is not None for x in extra))
        )
    parent = a[2]
    return Stored(
        hashes=_hashes(a[1]),
        parent=parent if isinstance(parent, int | bytes) else None,
        token_ids=a[3],
        block_size=int(a[4] or 0),
        medium=rest[1] if isinstance(rest[1], str) else None,
        group=_opt_int(rest[4]) if engine != "sglang" else None,
        keyed=keyed,
    )


def _event(e: Any, engine: str) -> KvEvent:
    if isinstance(e, dict):
        kind = e.get("type")
        if kind == "BlockStored":
            return _stored_from_map(e)
        if kind == "BlockRemoved":
            return Removed(_hashes(e.get("block_hashes")), e.get("medium"), _opt_int(e.get("group_idx")))
        if kind == "AllBlocksCleared":
            return Cleared()
        raise KvEventError(f"unknown event type {kind!r}")
    if isinstance(e, list) and e and isinstance(e[0], str):
        kind = e[0]
        if kind == "BlockStored":
            return _stored_from_array(e, engine)
        if kind == "BlockRemoved":
            if len(e) < 2:
                raise KvEventError("BlockRemoved without hashes")
            medium = e[2] if len(e) > 2 and isinstance(e[2], str) else None
            group = _opt_int(e[3]) if len(e) > 3 and engine != "sglang" else None
            return Removed(_hashes(e[1]), medium, group)
        if kind == "AllBlocksCleared":
            return Cleared()
        raise KvEventError(f"unknown event type {kind!r}")
    raise KvEventError(f"not an event: {e!r:.80}")


def decode_batch(payload: bytes, engine: str) -> Batch:
    """A payload as `Batch`; `engine` ("vllm" or "sglang") disambiguates the array spelling.
    Raises `KvEventError`."""
    try:
        raw = _decode.decode(payload)
    except msgspec.DecodeError as e:
        raise KvEventError(f"not msgpack: {e}") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise KvEventError(f"not an event batch: {raw!r:.80}")
    ts = raw[0] if isinstance(raw[0], int | float) else 0.0
    dp = _opt_int(raw[2]) if len(raw) > 2 else None
    return Batch(float(ts), [_event(e, engine) for e in raw[1]], dp)


def parse_seq(frame: bytes) -> int:
    """An 8-byte big-endian sequence number (-1 ends a replay)."""
    if len(frame) != 8:
        raise KvEventError(f"sequence frame of {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big", signed=True)


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def split_live(frames: list[bytes]) -> tuple[int, bytes]:
    """(seq, payload) of a PUB message `(topic, seq, payload)`."""
    if len(frames) != 3:
        raise KvEventError(f"a KV event message has 3 frames, got {len(frames)}")
    return parse_seq(frames[1]), frames[2]


def split_replay(frames: list[bytes]) -> tuple[int, bytes]:
    """(seq, payload) of a replay reply, with or without its topic frame; seq -1 ends it."""
    if frames and frames[0] == b"":
        frames = frames[1:]
    if len(frames) == 3:
        return parse_seq(frames[1]), frames[2]
    if len(frames) == 2:
        return parse_seq(frames[0]), frames[1]
    raise KvEventError(f"a replay reply has 2 or 3 frames after the delimiter, got {len(frames)}")


def replay_request(start: int) -> list[bytes]:
    """The frames a DEALER sends to ask a replay from `start`."""
    return [b"", seq_frame(start)]
