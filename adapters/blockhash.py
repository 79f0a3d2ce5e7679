"""The engines' prefix-cache block hashes, computed exactly as each engine computes them.

The precise cache index keys a worker's blocks by the hashes its engine publishes in its KV
events; to look a request up, the gateway hashes the request's token ids the same way. Each
scheme below follows the engine's source (read, not copied):

**vLLM** (0.33.0 `vllm/v1/core/kv_cache_utils.py` `hash_block_tokens`, `init_none_hash`;
`vllm/utils/hashing.py`): block `j`'s hash is `H((parent, tuple(block j's token ids),
extra_keys))` with `parent` the previous block's hash, and for the first block `NONE_HASH =
H(seed)`. `H` is `--prefix-caching-hash-algo`: `sha256` (pickle, protocol 5, then SHA-256; the
default), `sha256_cbor` (canonical CBOR, then SHA-256), `xxhash` / `xxhash_cbor` (XXH3-128 of the
same; needs the `xxhash` package here). The seed is `PYTHONHASHSEED` when the engine has it set,
else the fixed `"vllm-none-hash"` for the SHA-256 algorithms; for xxhash without
`PYTHONHASHSEED` it is random per engine process and cannot be reproduced (refused here). Events
carry the 32-byte hash, or its low 64 bits as an int (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`,
default on): the index key is those low 64 bits either way. Blocks with extra keys (LoRA,
multimodal, cache salt) hash differently: such requests simply find no match.

**SGLang** (0.5.23 `sglang/srt/mem_cache/cpp_utils/hash_binding.cpp`, `mem_cache/utils.py`
`hash_str_to_int64`, `mem_cache/events.py`): page `j`'s digest is `SHA-256(digest(j-1) || token
ids as little-endian uint32)` (no prior digest for the first page; ids above 2^32 - 1 make a
"wide" page: a 0xff byte then little-endian uint64 words); events carry the first 8 bytes of
the digest as a signed big-endian int64, the index key. No seed. (LoRA or `extra_key`
namespaced hashes are not reproduced: such requests find no match.)

**emulator** (this project's engine emulator, `emulator/model.py`): `SHA-256(parent ||
little-endian uint32 ids)` with the root parent `SHA-256(b"pd-gateway-emulator-none-hash")`; the
index key is the digest's last 8 bytes, big-endian unsigned (what its events carry in both
engine modes). It is neither real engine's scheme, so a test that configures the wrong one sees
the mismatch caught.

`verify()` recomputes the hashes of a `BlockStored` event from its token ids where the chain's
state is known (the first blocks of a prefix, or a vLLM parent given as 32 bytes), so a wrong
block size, algorithm or seed shows up on the first events, before a request is routed on it.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Callable, Sequence
from typing import Any, Literal

import msgspec

MASK64 = (1 << 64) - 1
VLLM_DEFAULT_SEED = "vllm-none-hash"  # vLLM 0.33.0 kv_cache_utils.DEFAULT_NONE_HASH_SEED
EMULATOR_ROOT = hashlib.sha256(b"pd-gateway-emulator-none-hash").digest()

Scheme = Literal["vllm", "sglang", "emulator"]
VllmAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]


class HashSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How a worker's engine hashes blocks (`[workers.kv_events]` in the config)."""

    scheme: Scheme
    block_size: int
    algo: VllmAlgo = "sha256"  # vLLM's --prefix-caching-hash-algo
    seed: str | None = None  # vLLM: the engine's PYTHONHASHSEED, if it has one

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.scheme == "vllm" and self.algo.startswith("xxhash") and self.seed is None:
            raise ValueError(
                f"vLLM's {self.algo} block hashes use a random seed per engine process unless the "
                "engine runs with PYTHONHASHSEED: set that and give it as the seed"
            )


# ---- canonical CBOR for the few shapes vLLM hashes ----------------------------------------------


def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes((major << 5 | n,))
    if n < 0x100:
        return bytes((major << 5 | 24, n))
    if n < 0x10000:
        return bytes((major << 5 | 25,)) + n.to_bytes(2, "big")
    if n < 0x100000000:
        return bytes((major << 5 | 26,)) + n.to_bytes(4, "big")
    return bytes((major << 5 | 27,)) + n.to_bytes(8, "big")


def cbor(obj: Any) -> bytes:
    """Canonical CBOR (RFC 8949 core deterministic) of None, ints, bytes, str and tuples/lists."""
    if obj is None:
        return b"\xf6"
    if isinstance(obj, bool):
        return b"\xf5" if obj else b"\xf4"
    if isinstance(obj, int):
        if not -(1 << 64) <= obj < (1 << 64):
            raise ValueError(f"integer {obj} does not fit a CBOR head")
        return _cbor_head(0, obj) if obj >= 0 else _cbor_head(1, -1 - obj)
    if isinstance(obj, bytes):
        return _cbor_head(2, len(obj)) + obj
    if isinstance(obj, str):
        data = obj.encode("utf-8")
        return _cbor_head(3, len(data)) + data
    if isinstance(obj, tuple | list):
        return _cbor_head(4, len(obj)) + b"".join(cbor(x) for x in obj)
    raise TypeError(f"cannot encode {type(obj).__name__} as CBOR")


def _vllm_fn(algo: str) -> Callable[[Any], bytes]:
    if algo == "sha256":
        return lambda x: hashlib.sha256(pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    if algo == "sha256_cbor":
        return lambda x: hashlib.sha256(cbor(x)).digest()
    try:
        import xxhash
    except ImportError:
        raise ValueError(f"vLLM's {algo} block hashes need the xxhash package installed") from None
    digest = xxhash.xxh3_128_digest
    if algo == "xxhash":
        return lambda x: bytes(digest(pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)))
    if algo == "xxhash_cbor":
        return lambda x: bytes(digest(cbor(x)))
    raise ValueError(f"unknown vLLM hash algorithm {algo!r}")


# ---- hashers ---------------------------------------------------------------------------------------


class BlockHasherBase:
    """Chains of one scheme. `extend` fills index keys (the `BlockHasher` protocol of
    policies/prompt_key.py); `chain` gives (key, chain state) pairs for verification.

    `extend` remembers the digests it computed (at most `memo_size`, keyed by a fast chained
    hash of the same token blocks), so prefixes many requests share (system prompts, earlier
    turns) are hashed the engine's way once, not once per request: a remembered block costs a
    dict lookup instead of a pickle and a SHA-256."""

    spec: HashSpec

    def __init__(self, spec: HashSpec, memo_size: int = 1 << 18) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.key = f"{spec.scheme}:{spec.algo if spec.scheme == 'vllm' else ''}:{spec.seed}:{spec.block_size}"
        self.memo_size = memo_size
        self._memo: dict[int, tuple[int, bytes]] = {}

    def digest(self, parent: bytes | None, tokens: Sequence[int]) -> bytes:
        raise NotImplementedError

    def to_key(self, digest: bytes) -> int:
        raise NotImplementedError

    def extend(self, token_ids: Sequence[int], keys: list[int], state: object, upto: int) -> object:
        parent, fast = state if isinstance(state, tuple) else (None, hash(self.key))
        bs = self.block_size
        digest, to_key, memo = self.digest, self.to_key, self._memo
        for j in range(len(keys), upto):
            block = token_ids[j * bs : (j + 1) * bs]
            fast = hash((fast, tuple(block)))
            got = memo.get(fast)
            if got is None:
                parent = digest(parent, block)
                got = (to_key(parent), parent)
                if len(memo) >= self.memo_size:
                    memo.clear()
                memo[fast] = got
            else:
                parent = got[1]
            keys.append(got[0])
        return (parent, fast)

    def chain(self, parent: bytes | None, tokens: Sequence[int]) -> list[tuple[int, bytes]]:
        """(key, digest) of each full block of `tokens` after the block whose digest is `parent`."""
        bs = self.block_size
        out: list[tuple[int, bytes]] = []
        for start in range(0, len(tokens) - bs + 1, bs):
            parent = self.digest(parent, tokens[start : start + bs])
            out.append((self.to_key(parent), parent))
        return out

    def event_key(self, h: int | bytes) -> int:
        """The index key of a hash as an event carries it."""
        raise NotImplementedError


class VllmHasher(BlockHasherBase):
    def __init__(self, spec: HashSpec, memo_size: int = 1 << 18) -> None:
        super().__init__(spec, memo_size)
        self._fn = _vllm_fn(spec.algo)
        self.none_hash = self._fn(spec.seed if spec.seed is not None else VLLM_DEFAULT_SEED)

    def digest(self, parent: bytes | None, tokens: Sequence[int]) -> bytes:
        return self._fn((parent or self.none_hash, tuple(tokens), None))

    def to_key(self, digest: bytes) -> int:
        return int.from_bytes(digest[-8:], "big")

    def event_key(self, h: int | bytes) -> int:
        return int.from_bytes(h[-8:], "big") if isinstance(h, bytes) else h & MASK64


class SglangHasher(BlockHasherBase):
    def digest(self, parent: bytes | None, tokens: Sequence[int]) -> bytes:
        h = hashlib.sha256()
        if parent is not None:
            h.update(parent)
        try:
            h.update(struct.pack(f"<{len(tokens)}I", *tokens))
        except struct.error:  # an id above 2^32 - 1 (or negative): SGLang's "wide" page
            h.update(b"\xff")
            h.update(struct.pack(f"<{len(tokens)}Q", *tokens))
        return h.digest()

    def to_key(self, digest: bytes) -> int:
        return int.from_bytes(digest[:8], "big", signed=True)

    def event_key(self, h: int | bytes) -> int:
        return int.from_bytes(h[:8], "big", signed=True) if isinstance(h, bytes) else h


class EmulatorHasher(BlockHasherBase):
    def digest(self, parent: bytes | None, tokens: Sequence[int]) -> bytes:
        return hashlib.sha256((parent or EMULATOR_ROOT) + struct.pack(f"<{len(tokens)}I", *tokens)).digest()

    def to_key(self, digest: bytes) -> int:
        return int.from_bytes(digest[-8:], "big")

    def event_key(self, h: int | bytes) -> int:
        return int.from_bytes(h[-8:], "big") if isinstance(h, bytes) else h & MASK64


def make_hasher(spec: HashSpec) -> BlockHasherBase:
    """The hasher of a scheme; ValueError if it cannot be computed here."""
    if spec.scheme == "vllm":
        return VllmHasher(spec)
    if spec.scheme == "sglang":
        return SglangHasher(spec)
    return EmulatorHasher(spec)
