"""A prefix index of chained block keys: which workers hold which blocks, with LRU order per worker.

Both cache indexes use it: the approximate one (what the gateway sent where) and the precise one
(what the engines' KV events say they hold). A block key identifies a whole prefix (block `j`'s
key is chained over blocks `0..j`), so "worker w holds key k_j" means w holds the prompt's
first `j + 1` blocks. The data structure (the one the anchors converge on: Dynamo, llm-d, not a
per-character radix tree):

- `holders: dict[key, int]`: a bit mask of the worker slots holding the block (one int per
  block, whatever the number of workers; an intersection is one `&`);
- one `OrderedDict[key, None]` per slot: that worker's blocks in LRU order (oldest first), so a
  worker's entries can be evicted, counted and cleared without scanning the others'.

A chain is inserted deepest block first, so a prefix's first blocks are always at least as
recent as its later ones and LRU eviction takes leaves before their parents. With that
invariant (a worker holding block `j` also holds blocks `0..j-1`) the deepest block a worker
holds is found by a galloping binary search over the request's chain: O(log blocks) dict
lookups, not a walk over every block. `levels()` returns the workers grouped by how deep they
match, deepest first, one galloping search per group.

Memory (measured by `bench/cache_decision.py`): one dict entry and one int per block, one
OrderedDict entry per (block, worker).
"""

from __future__ import annotations

import sys
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence


def iter_bits(mask: int) -> Iterator[int]:
    """The slots set in `mask`, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class BlockIndex:
    """Block key -> holder slots, with per-slot LRU. Not thread-safe (one event loop owns it)."""

    __slots__ = ("_branches", "_free", "_hints", "_holders", "_lru", "entries")

    HINTS = 4096  # first blocks whose levels' depths are remembered (`levels_rest`)
    BRANCHES = 1 << 16  # chains whose branch point and length are remembered (`add`)
    HOPS = 8  # branch hints followed per level before a galloping search

    def __init__(self, *, prefix_closed: bool = False) -> None:
        self._holders: dict[int, int] = {}
        self._lru: list[OrderedDict[int, None]] = []
        self._free: list[int] = []
        self.entries = 0  # (block, slot) pairs
        # `prefix_closed`: no slot ever loses a block before the blocks chained after it (only
        # `add` and LRU `evict`, never `remove`), so a level's depth can be guessed and checked
        # with two probes: first block -> the depth of its last lookup's shallowest level (a
        # prefix that requests share: a system prompt)
        self._hints: dict[int, int] | None = {} if prefix_closed else None
        # also: the first block a chain added that no slot held before (its branch point off
        # what the index held) -> the chain's length. A conversation's next turn extends its
        # last one: its own level is then checked with a hop and two probes per turn, not found
        # by a galloping search of a dozen probes (each a cache miss in an index of millions)
        self._branches: dict[int, int] | None = {} if prefix_closed else None

    # -- slots --------------------------------------------------------------------------------

    def new_slot(self) -> int:
        """A slot for a new worker (a freed one is reused: masks stay small)."""
        if self._free:
            return self._free.pop()
        self._lru.append(OrderedDict())
        return len(self._lru) - 1

    def free_slot(self, slot: int) -> int:
        """Drop the slot's entries and let the slot be reused; returns the entries dropped."""
        n = self.clear_slot(slot)
        self._free.append(slot)
        return n

    def slot_entries(self, slot: int) -> int:
        return len(self._lru[slot])

    @property
    def blocks(self) -> int:
        """Distinct blocks held by anyone."""
        return len(self._holders)

    # -- updates ------------------------------------------------------------------------------

    def add(self, slot: int, keys: Sequence[int]) -> int:
        """Record that `slot` holds `keys` (a chain, parent first): new entries are added and
        known ones refreshed, deepest first. Returns how many entries are new."""
        lru = self._lru[slot]
        move = lru.move_to_end
        try:  # the slot holds the whole chain (a prompt touched again): each moved, in C
            deque(map(move, reversed(keys)), maxlen=0)
            return 0
        except KeyError:  # (its deepest blocks were moved: the loop below moves them again)
            pass
        bit = 1 << slot
        holders = self._holders
        added = fresh = 0
        for k in reversed(keys):
            m = holders.get(k, 0)
            if m & bit:
                move(k)
            else:
                if not m:
                    fresh += 1
                holders[k] = m | bit
                lru[k] = None
                added += 1
        self.entries += added
        branches = self._branches
        if fresh and branches is not None:
            # prefix-closed: the blocks no slot held are the chain's last `fresh`
            if len(branches) >= self.BRANCHES:
                branches.clear()
            branches[keys[len(keys) - fresh]] = len(keys)
        return added

    def remove(self, slot: int, keys: Sequence[int]) -> int:
        """`slot` no longer holds `keys` (unknown ones are ignored); returns how many it held."""
        bit = 1 << slot
        lru = self._lru[slot]
        holders = self._holders
        removed = 0
        for k in keys:
            if lru.pop(k, 0) is None:  # present (its value is None)
                m = holders[k] & ~bit
                if m:
                    holders[k] = m
                else:
                    del holders[k]
                removed += 1
        self.entries -= removed
        return removed

    def evict(self, slot: int, n: int) -> int:
        """Drop the slot's `n` least recently used entries; returns how many were dropped."""
        lru = self._lru[slot]
        holders = self._holders
        bit = 1 << slot
        n = min(n, len(lru))
        pop = lru.popitem
        for _ in range(n):
            k, _ = pop(last=False)
            m = holders[k] & ~bit
            if m:
                holders[k] = m
            else:
                del holders[k]
        self.entries -= n
        return n

    def clear_slot(self, slot: int) -> int:
        lru = self._lru[slot]
        n = len(lru)
        holders = self._holders
        keep = ~(1 << slot)
        for k in lru:
            m = holders[k] & keep
            if m:
                holders[k] = m
            else:
                del holders[k]
        lru.clear()
        self.entries -= n
        return n

    # -- reads --------------------------------------------------------------------------------

    def holders(self, key: int) -> int:
        return self._holders.get(key, 0)

    def slot_keys(self, slot: int) -> list[int]:
        """The slot's keys, least recently used first."""
        return list(self._lru[slot])

    def depth(self, keys: Sequence[int], mask: int) -> int:
        """The deepest `d` (0..len(keys)) such that a slot of `mask` holds `keys[d - 1]`."""
        holders = self._holders
        if not keys or not holders.get(keys[0], 0) & mask:
            return 0
        return self._deepest(keys, mask)

    def deepest(self, keys: Sequence[int], mask: int) -> int:
        """`depth` where a slot of `mask` is known to hold `keys[0]`."""
        return self._deepest(keys, mask)

    def _deepest(self, keys: Sequence[int], mask: int, lo: int = 1, top: int = 0) -> int:
        # galloping from `lo` (known: a slot of mask holds keys[lo - 1]), then bisection; the
        # depth is at most `top` (0: the chain's length; else known: no slot holds keys[top])
        holders = self._holders
        n = top if top else len(keys)
        step = 1
        while True:
            probe = lo + step
            if probe >= n:
                if holders.get(keys[n - 1], 0) & mask:
                    return n
                hi = n - 1
                break
            if holders.get(keys[probe - 1], 0) & mask:
                lo = probe
                step <<= 1
            else:
                hi = probe - 1
                break
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            if holders.get(keys[mid - 1], 0) & mask:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def levels(self, keys: Sequence[int], max_levels: int) -> list[tuple[int, int]]:
        """Workers matching a prefix of `keys`, grouped by depth, deepest first: `(mask, depth)`
        pairs, at most `max_levels` of them (the shallowest groups are left out)."""
        return self.levels_rest(keys, max_levels)[0]

    def levels_rest(self, keys: Sequence[int], max_levels: int) -> tuple[list[tuple[int, int]], int]:
        """`levels`, and the mask of the slots holding `keys[0]` that no level lists (left out
        past `max_levels`, or where a slot broke the prefix invariant): 0 when the levels name
        every slot holding a prefix, each with its exact depth."""
        if not keys:
            return [], 0
        holders = self._holders
        remaining = holders.get(keys[0], 0)
        out: list[tuple[int, int]] = []
        hints = self._hints
        g = 0 if hints is None else hints.get(keys[0], 0)
        n = len(keys)
        branches = self._branches
        while remaining and len(out) < max_levels:
            # the guess `g` is the depth the search would find iff a slot of `remaining` holds
            # block g - 1 and none holds block g (the slots are prefix-closed)
            d = 0
            lo, top = 1, 0  # known: a slot of `remaining` holds block lo - 1, none block `top`
            hop = branches is not None
            if g and (not out or g < out[-1][1]) and g <= n:  # a level is shallower than the last
                if not holders.get(keys[g - 1], 0) & remaining:
                    top = g - 1
                elif g == n:
                    d = g
                else:
                    # a chain branched off at block g first (a conversation's next turn): its
                    # length checked before block g (held, where block h - 1 is)
                    h = 0 if branches is None else branches.get(keys[g], 0)
                    if g < h <= n and holders.get(keys[h - 1], 0) & remaining:
                        if h == n or not holders.get(keys[h], 0) & remaining:
                            d = h
                        else:
                            assert branches is not None
                            d, lo, top = self._hop(keys, remaining, branches, h + 1, top, keys[g])
                            hop = False
                    else:
                        if h > g:
                            top = h - 1 if h <= n else 0
                            hop = False  # the hint at block g was tried
                        if not holders.get(keys[g], 0) & remaining:
                            d = g
                        else:
                            lo = g + 1
            if not d and hop:
                assert branches is not None
                d, lo, top = self._hop(keys, remaining, branches, lo, top)
            if not d:
                d = self._deepest(keys, remaining, lo, top)
            m = holders.get(keys[d - 1], 0) & remaining
            if not m:  # a slot broke the prefix invariant: stop rather than loop
                break
            out.append((m, d))
            remaining &= ~m
        if hints is not None and out and not remaining and out[-1][1] != g:
            if len(hints) >= self.HINTS:
                hints.clear()
            hints[keys[0]] = out[-1][1]
        return out, remaining

    def _hop(
        self,
        keys: Sequence[int],
        remaining: int,
        branches: dict[int, int],
        lo: int,
        top: int,
        start: int | None = None,
    ) -> tuple[int, int, int]:
        """Follow the branch hints from block lo - 1 (held by a slot of `remaining`): each names
        the length `h` of a chain added off there; `h` is the depth iff block h - 1 is held and
        block h is not (prefix-closed slots). Returns (depth or 0, lo, top) narrowed. A level
        found after several hops is remembered at the first (path compression), so that a long
        conversation's next turn takes two hops, not one per turn."""
        holders = self._holders
        n = top if top else len(keys)
        first = start is None
        if start is None:
            start = keys[lo - 1]
        for hop in range(self.HOPS):
            h = branches.get(keys[lo - 1], 0)
            if h < lo or h > n:
                break
            if h > lo and not holders.get(keys[h - 1], 0) & remaining:
                return 0, lo, h - 1
            if h == n or not holders.get(keys[h], 0) & remaining:
                if hop or not first:  # the first hint now names the level found: the next
                    branches[start] = h  # turn hops twice
                return h, lo, top
            lo = h + 1
        return 0, lo, top

    def memory_bytes(self) -> int:
        """An estimate of the memory this index holds (dicts, keys, masks)."""
        total = sys.getsizeof(self._holders) + sum(sys.getsizeof(lru) for lru in self._lru)
        total += 32 * len(self._holders)  # one int object per block key (64-bit: 32 bytes)
        if self._branches is not None:
            total += sys.getsizeof(self._branches)  # (their keys are the holders')
        return total + 28 * len(self._holders) + self._mask_bytes()

    def _mask_bytes(self) -> int:
        slots = len(self._lru)
        return 0 if slots <= 30 else (slots // 8) * len(self._holders) // 2
