"""The precise index's pending overlay: prompts routed to a worker that has not yet ended them,
counted as that worker's.

The KV events say what an engine holds once it has stored a prompt's blocks (chunk by chunk as
its prefill runs). A conversation's next turn that arrives while its predecessor is still
prefilling would then see only the chunks done, and its cost would count the rest as work: on
the x3 replay that moved such a turn away from the worker computing its prefix, which then
computed all of it again (docs/benchmarks.md, "Why the precise index trailed"). The
approximate index, recording a prompt when it is routed, kept it there. The overlay keeps,
per worker, the token ids of each request routed there (the routing tokenizer's, the ids the
engine block hashes are made of), and a lookup reads the deeper of the engine's blocks and the
longest common prefix, in whole blocks, of the prompt with a pending prompt of that worker
(`WithPending`). Comparing ids costs a `memcmp` per pending prompt compared (a bisection over
the prompts' bytes: ~15 us for 22,000 emulator ids); hashing every routed prompt into engine
keys, as this overlay first did, cost ~1 ms of SHA-256 per 22,000 tokens and more in Python. A
lookup compares only the pending prompts that share its first block (`by_head`), and of those
at most the newest `scan_limit` (64): its cost stays bounded however many requests are in
flight, also when all of them share a system prompt (a conversation's predecessor, the prompt
the overlay is for, is recent).

A request's entry is dropped when:

- the request ends, completed or failed (its blocks were pinned in the engine until then, so
  the events say at least as much from then on);
- it is older than the horizon (a request whose end never came: `policies.pending.expire`);
- or memory runs short: at most `max_entries` requests and `max_blocks` pending blocks, the
  oldest dropped first.

The outcome check (`KvEventIndex.outcome`) verifies the index's hashes against the cached tokens
engines report: it must compare what the events alone predicted, not the overlay's credit (a turn
the engine admits before its predecessor's prefill ends finds less). So the overlay keeps, per
routed request, what the engine's blocks alone gave it (`predicted`).
"""

from __future__ import annotations

import sys
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from policies.pending import expire
from policies.prefix_source import IndexLookup
from policies.prompt_key import PromptKey

PENDING_HORIZON_S = 120.0  # the cache-aware policy's default eviction_interval
_LITTLE = sys.byteorder == "little"


def packed_ids(key: PromptKey) -> tuple[bytes, int] | None:
    """The prompt's token ids as bytes to compare with `memcmp`, and the bytes per id: the
    emulator tokenizer's ids are bytes already (1); a prompt given as ids is packed as int64 in
    its key already (8); others are packed so."""
    ids = key.token_ids
    if ids is None:
        return None
    if isinstance(ids, bytes):
        return ids, 1
    if key.kind == "tokens" and _LITTLE:  # (`PromptKey.data`: little-endian int64, as array's here)
        return key.data, 8
    return array("q", ids).tobytes(), 8


def _widen(data: bytes) -> bytes:
    return array("q", list(data)).tobytes()  # (each byte an id)


def common_blocks(a: bytes, b: bytes, width: int, block_size: int, limit: int) -> int:
    """Whole blocks of `block_size` ids that `a` and `b` share from the start, at most `limit`."""
    step = width * block_size
    n = min(len(a), len(b)) // step
    if n > limit:
        n = limit
    if n <= 0 or a[:step] != b[:step]:
        return 0
    if a[: n * step] == b[: n * step]:
        return n
    lo, hi = 1, n  # a and b share lo blocks, not hi
    while hi - lo > 1:
        m = (lo + hi) // 2
        if a[: m * step] == b[: m * step]:
            lo = m
        else:
            hi = m
    return lo


def head_of(ids: tuple[bytes, int], block_size: int) -> bytes | None:
    """The prompt's first block as int64 bytes (one form for both widths; None: no whole block):
    the overlay's bucket, so a lookup compares only the pending prompts it can share a block with."""
    data, width = ids
    if len(data) < width * block_size:
        return None
    return data[: 8 * block_size] if width == 8 else _widen(data[:block_size])


def shared_blocks(ids: tuple[bytes, int], e: Entry, block_size: int, limit: int) -> int:
    """`common_blocks` of a prompt's `packed_ids` and a pending entry's, whatever their widths."""
    a, width = ids
    b = e.ids
    if e.width != width:  # (ids kept as bytes against packed ones: compare as int64)
        a, b, width = (_widen(a), b, 8) if width == 1 else (a, _widen(b), 8)
    return common_blocks(a, b, width, block_size, limit)


@dataclass(slots=True)
class Entry:
    at: float  # when routed
    worker: str
    ids: bytes  # `packed_ids`
    width: int
    blocks: int  # whole blocks of its prompt a lookup can match (counted against `max_blocks`)
    head: bytes  # `head_of`: its bucket in `PendingBlocks.by_head`


@dataclass(eq=False)
class PendingBlocks:
    """The routed, not yet ended prompts of every worker (the module docstring)."""

    clock: Callable[[], float] = time.monotonic
    horizon_s: float = PENDING_HORIZON_S
    max_entries: int = 1 << 16
    max_blocks: int = 1 << 21
    entries: OrderedDict[str, Entry] = field(default_factory=OrderedDict)
    by_worker: dict[str, dict[str, Entry]] = field(default_factory=dict)  # worker -> request -> entry
    # first block (`head_of`) -> request -> entry, oldest first
    by_head: dict[bytes, dict[str, Entry]] = field(default_factory=dict)
    # a lookup compares its prompt with at most this many pending prompts of its bucket, the
    # newest first (a conversation's predecessor is recent): a bound on the lookup's cost however
    # many requests in flight share a first block (a system prompt)
    scan_limit: int = 64
    # request -> (worker, prompt tokens the engine's blocks alone held there when it was routed,
    # and with the overlay)
    predicted: OrderedDict[str, tuple[str, int, int]] = field(default_factory=OrderedDict)
    blocks: int = 0  # whole blocks of the pending prompts
    added: int = 0  # requests added
    dropped_ended: int = 0  # dropped as they ended
    dropped_expired: int = 0  # ... past the horizon or for room
    fed: bool = False  # a policy tells this overlay what it routes

    def routed(
        self,
        rid: str,
        worker: str,
        held: tuple[int, int],
        ids: tuple[bytes, int] | None,
        blocks: int,
        block_size: int,
    ) -> None:
        """A request routed to `worker`, where it was predicted `held` prompt tokens (the engine's
        blocks alone, and with the overlay): its `packed_ids` (None: the engine holds it all),
        `blocks` whole blocks of `block_size` a lookup can match, are the worker's until dropped."""
        self.fed = True
        self._pop(rid)
        predicted = self.predicted
        predicted[rid] = (worker, *held)
        if len(predicted) > self.max_entries:
            predicted.popitem(last=False)
        head = None if ids is None or blocks <= 0 else head_of(ids, block_size)
        if ids is None or head is None:
            return
        now = self.clock()
        self.expire(now - self.horizon_s)
        entries = self.entries
        while entries and (len(entries) >= self.max_entries or self.blocks + blocks > self.max_blocks):
            self._pop(next(iter(entries)))
            self.dropped_expired += 1
        e = entries[rid] = Entry(now, worker, ids[0], ids[1], blocks, head)
        self.by_worker.setdefault(worker, {})[rid] = e
        self.by_head.setdefault(head, {})[rid] = e
        self.blocks += blocks
        self.added += 1

    def _pop(self, rid: str) -> Entry | None:
        e = self.entries.pop(rid, None)
        if e is not None:
            self._unlink(rid, e)
        return e

    def _unlink(self, rid: str, e: Entry) -> None:
        mine = self.by_worker.get(e.worker)
        if mine is not None:
            mine.pop(rid, None)
            if not mine:
                del self.by_worker[e.worker]
        bucket = self.by_head.get(e.head)
        if bucket is not None:
            bucket.pop(rid, None)
            if not bucket:
                del self.by_head[e.head]
        self.blocks -= e.blocks

    def ended(self, rid: str) -> tuple[str, int, int] | None:
        """The request ended: its entry, gone; (worker, the engine's blocks' prediction, the
        overlay's) where it was routed to a worker this index knew."""
        if self._pop(rid) is not None:
            self.dropped_ended += 1
        return self.predicted.pop(rid, None)

    def expire(self, horizon: float) -> None:
        for rid, e in expire(self.entries, horizon):
            self._unlink(rid, e)
            self.dropped_expired += 1

    def forget_worker(self, worker: str) -> None:
        """The worker left its slot (or its hash group): its entries, gone."""
        for rid in list(self.by_worker.get(worker, ())):
            e = self.entries.pop(rid)
            self._unlink(rid, e)
            self.dropped_expired += 1

    def candidates(self, ids: tuple[bytes, int], block_size: int) -> list[Entry]:
        """The pending prompts a lookup compares with: those sharing the prompt's first block,
        the newest `scan_limit` of them."""
        head = head_of(ids, block_size)
        bucket = self.by_head.get(head) if head is not None else None
        if not bucket:
            return []
        got = list(bucket.values())
        return got[-self.scan_limit :] if len(got) > self.scan_limit else got

    def depth(self, worker: str, ids: tuple[bytes, int], block_size: int, limit: int) -> int:
        """The most whole blocks (at most `limit`) a pending prompt of the worker shares with
        the prompt of `packed_ids` `ids`."""
        if worker not in self.by_worker:
            return 0
        best = 0
        for e in self.candidates(ids, block_size):
            if e.worker == worker:
                got = shared_blocks(ids, e, block_size, limit)
                if got > best:
                    best = got
                    if best >= limit:
                        break
        return best


class PendingLookup:
    """The overlay's answer for one prompt over one hash group's workers (`members`)."""

    __slots__ = ("_bs", "_ids", "_known", "_limit", "_members", "_pending", "_tokens")

    def __init__(
        self,
        pending: PendingBlocks,
        ids: tuple[bytes, int],
        block_size: int,
        limit: int,
        members: Mapping[str, int],
        known: Callable[[str], bool],
    ) -> None:
        self._pending = pending
        self._ids = ids
        self._bs = block_size
        self._limit = limit
        self._members = members
        self._known = known
        self._tokens: dict[str, int] | None = None

    def _all(self) -> dict[str, int]:
        got = self._tokens
        if got is None:
            got = self._tokens = {}
            members, known, bs, limit = self._members, self._known, self._bs, self._limit
            for e in self._pending.candidates(self._ids, bs):
                wid = e.worker
                if wid in members and known(wid):
                    d = shared_blocks(self._ids, e, bs, limit) * bs
                    if d > got.get(wid, 0):
                        got[wid] = d
        return got

    @property
    def top(self) -> Sequence[tuple[str, int]]:
        return sorted(self._all().items(), key=lambda t: -t[1])

    def cached_tokens(self, worker_id: str) -> int | None:
        if not self._known(worker_id):
            return None
        return self._all().get(worker_id, 0)

    def named(self, limit: int) -> list[str] | None:
        got = list(self._all())
        return None if len(got) > limit else got


class WithPending:
    """A worker's cached tokens: the deeper of the engine's blocks (`engine`) and its pending
    prompts' (`pending`), both for the same prompt over the same workers."""

    __slots__ = ("_engine", "_max", "_pending", "_top")

    def __init__(self, engine: IndexLookup, pending: PendingLookup, max_candidates: int) -> None:
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
