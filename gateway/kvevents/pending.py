"""The precise index's pending overlay: prompts routed to a worker that its engine has not yet
stored, counted as that worker's until it has.

The KV events say what an engine holds once it has stored a prompt's blocks, after the prefill.
A conversation's next turn that arrives while its predecessor is still prefilling would then see
no holder and be spread to another worker, where the approximate index (recording a prompt when
it is routed) draws it to the one computing its prefix (an engine matches a queued prefill's
prefix again as it schedules it). The overlay adds, per worker, the engine block keys (the
index's own exact hashes of the routing tokenizer's ids) of each request routed there, and a
lookup reads the deeper of the engine's blocks and the overlay's (`WithPending`). A request's
entry is dropped when:

- the engine's `BlockStored` names its last block (the events now say it);
- the request ends, completed or failed (the events are the truth from then on);
- it is older than the horizon (a request whose end never came: `policies.pending.expire`);
- or memory runs short: at most `max_entries` requests and `max_blocks` (block, worker) entries,
  the oldest dropped first.

Keys shared by several pending prompts (a conversation's turns, a system prompt) are counted per
worker, so the overlay of a worker is always the union of its pending chains: prefix-closed, as
the galloping search of `BlockIndex` needs.

The outcome check (`KvEventIndex.outcome`) verifies the index's hashes against the cached tokens
engines report: it must compare what the events alone predicted, not the overlay's credit (a turn
the engine admits before its predecessor's prefill ends finds less). So the overlay keeps, per
routed request, what the engine's blocks alone gave it (`engine_predicted`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from policies.block_index import BlockIndex
from policies.pending import expire
from policies.prefix_source import IndexLookup

PENDING_HORIZON_S = 120.0  # the cache-aware policy's default eviction_interval


class Overlay:
    """One hash group's pending chains: a `BlockIndex` with a count per (slot, key)."""

    __slots__ = ("ends", "index", "refs", "slots")

    def __init__(self) -> None:
        self.index = BlockIndex()
        self.slots = 0  # the index's slots: the group's slot numbers, made as first used
        self.refs: dict[int, dict[int, int]] = {}  # slot -> key -> pending chains holding it
        self.ends: dict[tuple[int, int], set[str]] = {}  # (slot, last key) -> request ids

    def add(self, slot: int, keys: Sequence[int], rid: str) -> None:
        while self.slots <= slot:
            self.index.new_slot()  # (never freed: the next one is made)
            self.slots += 1
        refs = self.refs.setdefault(slot, {})
        for k in keys:
            refs[k] = refs.get(k, 0) + 1
        self.index.add(slot, keys)
        self.ends.setdefault((slot, keys[-1]), set()).add(rid)

    def remove(self, slot: int, keys: Sequence[int], rid: str) -> None:
        refs = self.refs.get(slot)
        if refs is None:
            return
        gone = []
        for k in keys:
            n = refs.get(k, 0) - 1
            if n > 0:
                refs[k] = n
            else:
                refs.pop(k, None)
                gone.append(k)
        self.index.remove(slot, gone)
        if not refs:
            del self.refs[slot]
        end = (slot, keys[-1])
        rids = self.ends.get(end)
        if rids is not None:
            rids.discard(rid)
            if not rids:
                del self.ends[end]

    def stored(self, slot: int, keys: Sequence[int]) -> list[str]:
        """The requests whose last block is among `keys`, stored by the slot's engine."""
        ends = self.ends
        if not ends:
            return []
        out: list[str] = []
        for k in keys:
            rids = ends.get((slot, k))
            if rids:
                out += rids
        return out

    def clear_slot(self, slot: int) -> None:
        if slot < self.slots:
            self.index.clear_slot(slot)
        self.refs.pop(slot, None)
        for end in [e for e in self.ends if e[0] == slot]:
            del self.ends[end]


@dataclass(slots=True)
class Entry:
    at: float  # when routed
    worker: str
    overlay: Overlay
    slot: int
    keys: Sequence[int]


@dataclass(eq=False)
class PendingBlocks:
    """The routed, not yet stored prompts of every worker (the module docstring)."""

    clock: Callable[[], float] = time.monotonic
    horizon_s: float = PENDING_HORIZON_S
    max_entries: int = 1 << 16
    max_blocks: int = 1 << 21
    entries: OrderedDict[str, Entry] = field(default_factory=OrderedDict)
    # request -> (worker, prompt tokens the engine's blocks alone held there when it was routed,
    # and with the overlay)
    predicted: OrderedDict[str, tuple[str, int, int]] = field(default_factory=OrderedDict)
    blocks: int = 0  # (block, worker) entries held, counted per pending chain
    added: int = 0  # requests added
    dropped_stored: int = 0  # dropped as their engine stored them
    dropped_ended: int = 0  # ... as they ended
    dropped_expired: int = 0  # ... past the horizon or for room
    fed: bool = False  # a policy tells this overlay what it routes

    def routed(
        self,
        rid: str,
        worker: str,
        held: tuple[int, int],
        overlay: Overlay,
        slot: int,
        keys: Sequence[int],
    ) -> None:
        """A request routed to `worker`, where it was predicted `held` prompt tokens (the engine's
        blocks alone, and with the overlay): its chain `keys` (empty: the engine holds it all) is
        the worker's until dropped."""
        self.fed = True
        self._pop(rid)
        predicted = self.predicted
        predicted[rid] = (worker, *held)
        if len(predicted) > self.max_entries:
            predicted.popitem(last=False)
        if not keys:
            return
        now = self.clock()
        self.expire(now - self.horizon_s)
        entries = self.entries
        while entries and (len(entries) >= self.max_entries or self.blocks + len(keys) > self.max_blocks):
            self._pop(next(iter(entries)))
            self.dropped_expired += 1
        overlay.add(slot, keys, rid)
        entries[rid] = Entry(now, worker, overlay, slot, keys)
        self.blocks += len(keys)
        self.added += 1

    def _pop(self, rid: str) -> Entry | None:
        e = self.entries.pop(rid, None)
        if e is not None:
            e.overlay.remove(e.slot, e.keys, rid)
            self.blocks -= len(e.keys)
        return e

    def ended(self, rid: str) -> tuple[str, int, int] | None:
        """The request ended: its entry, gone; (worker, the engine's blocks' prediction, the
        overlay's) where it was routed to a worker this index knew."""
        if self._pop(rid) is not None:
            self.dropped_ended += 1
        return self.predicted.pop(rid, None)

    def stored(self, overlay: Overlay, slot: int, keys: Sequence[int]) -> None:
        """The slot's engine stored `keys`: the requests whose last block they hold are the
        engine's now."""
        for rid in overlay.stored(slot, keys):
            if self._pop(rid) is not None:
                self.dropped_stored += 1

    def expire(self, horizon: float) -> None:
        for rid, e in expire(self.entries, horizon):
            e.overlay.remove(e.slot, e.keys, rid)
            self.blocks -= len(e.keys)
            self.dropped_expired += 1

    def forget_worker(self, worker: str) -> None:
        """The worker left its slot (or its hash group): its entries, gone."""
        for rid in [rid for rid, e in self.entries.items() if e.worker == worker]:
            e = self.entries.pop(rid)
            self.blocks -= len(e.keys)
            self.dropped_expired += 1


class WithPending:
    """A worker's cached tokens: the deeper of the engine's blocks (`engine`) and its pending
    prompts' (`pending`), both lookups of the same chain over the same slots."""

    __slots__ = ("_engine", "_max", "_pending", "_top")

    def __init__(self, engine: IndexLookup, pending: IndexLookup, max_candidates: int) -> None:
        self._engine = engine
        self._pending = pending
        self._max = max_candidates
        self._top: list[tuple[str, int]] | None = None

    @property
    def top(self) -> Sequence[tuple[str, int]]:
        top = self._top
        if top is None:
            best: dict[str, int] = {}
            for part in (self._engine.top, self._pending.top):
                for wid, tokens in part:
                    if tokens > best.get(wid, -1):
                        best[wid] = tokens
            top = self._top = sorted(best.items(), key=lambda t: -t[1])[: self._max]
        return top

    def cached_tokens(self, worker_id: str) -> int | None:
        got = self._engine.cached_tokens(worker_id)
        if got is None:
            return None
        pending = self._pending.cached_tokens(worker_id)
        return got if pending is None or pending <= got else pending

    def named(self, limit: int) -> list[str] | None:
        a = self._engine.named(limit)
        b = self._pending.named(limit)
        if a is None or b is None:
            return None
        both = list(dict.fromkeys([*a, *b]))
        return None if len(both) > limit else both


class Merged:
    """The lookups of several hash groups (or none yet) as one."""

    __slots__ = ("_known", "_parts", "top")

    def __init__(self, parts: Sequence[IndexLookup | WithPending], known: Callable[[str], bool]) -> None:
        self._parts = parts
        self._known = known
        merged = [t for p in parts for t in p.top]
        merged.sort(key=lambda t: -t[1])
        self.top: Sequence[tuple[str, int]] = merged

    def named(self, limit: int) -> list[str] | None:
        """Every part's `named`, together (None when more than `limit`)."""
        out: list[str] = []
        for p in self._parts:
            got = p.named(limit)
            if got is None or len(out) + len(got) > limit:
                return None
            out += got
        return out

    def cached_tokens(self, worker_id: str) -> int | None:
        if not self._known(worker_id):
            return None
        for p in self._parts:
            got = p.cached_tokens(worker_id)
            if got:
                return got
        return 0
