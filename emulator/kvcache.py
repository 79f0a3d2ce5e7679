"""The KV block pool: block ids, their content, a prefix cache with LRU eviction.

Each block holds ``content[block_id]`` (32 bytes standing in for the block's K/V tensors; see
:mod:`emulator.model`). A block is *free* (on the free list), *owned* (refcount > 0) or
*cached* (refcount 0, registered under its hash, evictable in LRU order). Freeing does not
erase content: a block read after it was freed returns whatever it still holds, which is how
stale ``kv_transfer_params`` produce wrong tokens on real engines.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Callable

StoredCallback = Callable[[list[bytes], bytes | None, list[int]], None]
RemovedCallback = Callable[[list[bytes]], None]


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._content: dict[int, bytes] = {}
        self._ref: dict[int, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.on_stored: StoredCallback | None = None
        self.on_removed: RemovedCallback | None = None
        self.on_cleared: Callable[[], None] | None = None
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # prompt tokens found

    # -- accounting
    @property
    def used_blocks(self) -> int:
        return len(self._ref)

    @property
    def cached_blocks(self) -> int:
        return len(self._lru)

    @property
    def available_blocks(self) -> int:
        return len(self._free) + len(self._lru)

    def usage(self) -> float:
        return self.used_blocks / self.num_blocks if self.num_blocks else 0.0

    # -- content
    def content(self, block_id: int) -> bytes:
        c = self._content.get(block_id)
        if c is None:
            c = hashlib.sha256(b"uninitialised-kv-%d" % block_id).digest()
        return c

    def write(self, block_id: int, data: bytes) -> None:
        self._content[block_id] = data

    def in_range(self, block_id: int) -> bool:
        return 0 <= block_id < self.num_blocks

    # -- allocation
    def allocate(self, n: int) -> list[int] | None:
        if n > self.available_blocks:
            return None
        out: list[int] = []
        evicted: list[bytes] = []
        for _ in range(n):
            if self._free:
                bid = self._free.popleft()
            else:
                bid, _ = self._lru.popitem(last=False)
                h = self._hash_of.pop(bid)
                del self._by_hash[h]
                evicted.append(h)
            self._ref[bid] = 1
            out.append(bid)
        if evicted and self.on_removed is not None:
            self.on_removed(evicted)
        return out

    def match_prefix(self, hashes: list[bytes], max_blocks: int) -> list[int]:
        """Take references on the longest cached prefix (at most ``max_blocks`` blocks)."""
        out: list[int] = []
        for h in hashes[:max_blocks]:
            bid = self._by_hash.get(h)
            if bid is None:
                break
            if bid in self._lru:
                del self._lru[bid]
                self._ref[bid] = 1
            else:
                self._ref[bid] += 1
            out.append(bid)
        return out

    def register(
        self, block_ids: list[int], hashes: list[bytes], parent: bytes | None, tokens: list[int]
    ) -> None:
        """Register full, valid blocks under their hashes (a KV event ``BlockStored``)."""
        new_hashes: list[bytes] = []
        first_parent = parent
        for bid, h in zip(block_ids, hashes, strict=True):
            if h in self._by_hash or bid in self._hash_of:
                continue
            self._by_hash[h] = bid
            self._hash_of[bid] = h
            new_hashes.append(h)
        if new_hashes and self.on_stored is not None:
            self.on_stored(new_hashes, first_parent, tokens)

    def free(self, block_ids: list[int]) -> None:
        """Drop a reference on each of a sequence's blocks (given in chain order, parent first).

        Freed last block first, as vLLM does (v1 `SingleTypeKVCacheManager.free`: "Free blocks
        in reverse order so that the tail blocks are freed first"), so that LRU eviction takes a
        prefix's tail before its head, as SGLang's radix cache evicts leaves before their
        parents. Freed parent first, the first eviction under pressure took a prompt's first
        block and with it every block chained after it: a 191k-token prefix lost whole to make
        room for a few thousand tokens, while every block of it still held memory."""
        for bid in reversed(block_ids):
            r = self._ref.get(bid)
            if r is None:
                continue
            if r > 1:
                self._ref[bid] = r - 1
                continue
            del self._ref[bid]
            if bid in self._hash_of:
                self._lru[bid] = None
            else:
                self._free.append(bid)

    def flush(self) -> None:
        """Drop every cached (unreferenced) block from the prefix cache (``/flush_cache``)."""
        for bid in list(self._lru):
            h = self._hash_of.pop(bid)
            del self._by_hash[h]
            self._free.append(bid)
        self._lru.clear()
        if self.on_cleared is not None:
            self.on_cleared()
