"""The precise prefix index: each worker's blocks as its engine's KV events report them.

`KvEventIndex` is a `PrefixSource` (policies/prefix_source.py) that the cache-aware policy
reads; `gateway.kvevents.subscriber` feeds it. Workers whose engines hash alike (same scheme,
algorithm, seed and block size) share one `BlockIndex` keyed by the engine's own block hashes;
a request is looked up by hashing its token ids the same way (`adapters.blockhash`), lazily, as
far as the lookup reads.

The index is only used for a worker while it can be trusted (`WorkerIndex.usable`): its stream
is live (connected, no unfilled gap) and its hashes are verified. Otherwise the worker is unknown
to this source and the policy uses the approximate index for it. Verification, continuously:

- every `BlockStored` whose chain state is known (the first blocks of a prefix; a vLLM parent
  sent as 32 bytes) is hashed again from its token ids: a different hash means the configured
  scheme, algorithm, seed or block size is not the engine's;
- the block size an event carries must be the configured one (when none is configured, the
  first event's is taken);
- once requests report the cached tokens the engine found (`outcome`), predictions that keep
  disagreeing with the engine mean the index is wrong whatever the events say.

A failed check marks the worker **misaligned**: its entries are dropped, it is not indexed until
its engine restarts (a new epoch), and the reason is logged once at error level
(`kv_events.misaligned`) and shown in `status()` / the metrics.

Memory: `max_blocks` entries per worker (its least recently stored blocks are dropped beyond it,
`evicted` counts them: predictions then only under-count); `memory_bytes()` estimates the total.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from adapters.blockhash import BlockHasherBase, HashSpec, Scheme, VllmAlgo, make_hasher
from adapters.kvevents import Batch, Cleared, Removed, Stored
from gateway.kvevents.pending import Merged, PendingBlocks, PendingLookup, WithPending, packed_ids
from gateway.logging import get_logger
from policies.base import Completed, Failed, PolicyEvent, Routed
from policies.block_index import BlockIndex
from policies.prefix_source import IndexLookup, Lookup
from policies.prompt_key import PromptKey

log = get_logger("pd_gateway.kvevents")

VERIFY_BLOCKS = 4  # blocks of a verifiable event that are hashed again
OUTCOME_WINDOW = 16
OUTCOME_MIN = 8


class WorkerStatus(msgspec.Struct, frozen=True):
    """One worker's KV-event index, for the metrics, the logs and the admin API."""

    worker: str
    endpoint: str
    state: str  # "connecting", "live", "resyncing", "misaligned", "stopped"
    usable: bool
    reason: str | None
    scheme: str
    block_size: int | None
    epoch: int
    last_seq: int | None
    blocks: int
    events: int
    stored: int
    removed: int
    verified: int
    unverifiable: int
    gaps: int
    replays: int
    resyncs: int
    restarts: int
    clears: int
    evicted: int
    skipped: int  # events for other tiers / KV groups / malformed
    outcome_mismatches: int
    last_event_age_s: float | None
    lag_s: float | None = None  # the last batch's delay: applied here less published (wall clocks)
    max_lag_s: float = 0.0  # the longest such delay seen


@dataclass(eq=False)
class _Group:
    hasher: BlockHasherBase
    index: BlockIndex = field(default_factory=BlockIndex)
    slot_of: dict[str, int] = field(default_factory=dict)
    ids: list[str | None] = field(default_factory=list)


@dataclass(eq=False)
class WorkerIndex:
    """One worker's stream and index state."""

    worker: str
    endpoint: str
    scheme: Scheme
    algo: VllmAlgo
    seed: str | None
    configured_block_size: int | None
    max_blocks: int
    group: _Group | None = None
    state: str = "connecting"
    reason: str | None = None
    epoch: int = 0
    last_seq: int | None = None
    last_digest: bytes | None = None
    last_event_at: float | None = None
    events: int = 0
    stored: int = 0  # blocks stored (as events announced them)
    removed: int = 0  # blocks the engine evicted
    verified: int = 0
    unverifiable: int = 0
    gaps: int = 0
    replays: int = 0
    resyncs: int = 0
    restarts: int = 0
    clears: int = 0
    evicted: int = 0
    skipped: int = 0
    outcome_mismatches: int = 0
    lag_s: float | None = None
    max_lag_s: float = 0.0
    outcomes: deque[bool] = field(default_factory=lambda: deque(maxlen=OUTCOME_WINDOW))
    recent: OrderedDict[int, bytes] = field(default_factory=OrderedDict)  # seq -> digest, applied

    def seen(self, seq: int, digest: bytes) -> bool:
        """This very batch was applied already (a replay and the live stream overlapped)."""
        return self.recent.get(seq) == digest

    @property
    def usable(self) -> bool:
        """Live and verified (a worker that has stored nothing yet holds nothing: usable)."""
        return self.state == "live"

    @property
    def block_size(self) -> int | None:
        return self.group.hasher.block_size if self.group is not None else self.configured_block_size


def payload_digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


class KvEventIndex:
    """The precise `PrefixSource` (see the module docstring)."""

    name = "kv_events"

    def __init__(
        self,
        model_of: Callable[[str], str | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._workers: dict[str, WorkerIndex] = {}
        self._groups: dict[str, _Group] = {}
        self._model_of = model_of or (lambda wid: None)
        self._clock = clock
        self.pending = PendingBlocks(clock)  # fed by a policy's `observe`, if any

    # -- membership -----------------------------------------------------------------------------

    def add_worker(
        self,
        worker_id: str,
        *,
        endpoint: str,
        scheme: Scheme,
        block_size: int | None = None,
        algo: VllmAlgo = "sha256",
        seed: str | None = None,
        max_blocks: int = 1 << 20,
    ) -> WorkerIndex:
        """Register a worker; ValueError when its scheme cannot be computed here."""
        if worker_id in self._workers:
            raise ValueError(f"worker {worker_id!r} already has a KV-event index")
        w = WorkerIndex(worker_id, endpoint, scheme, algo, seed, block_size, max_blocks)
        if block_size is not None:
            self._join(w, block_size)  # raises ValueError for an impossible scheme
        else:
            HashSpec(scheme=scheme, block_size=1, algo=algo, seed=seed)  # validate now
        self._workers[worker_id] = w
        return w

    def remove_worker(self, worker_id: str) -> None:
        w = self._workers.pop(worker_id, None)
        if w is not None and w.group is not None:
            self._leave(w)

    def worker(self, worker_id: str) -> WorkerIndex | None:
        return self._workers.get(worker_id)

    def _join(self, w: WorkerIndex, block_size: int) -> None:
        hasher = make_hasher(HashSpec(scheme=w.scheme, block_size=block_size, algo=w.algo, seed=w.seed))
        g = self._groups.get(hasher.key)
        if g is None:
            g = self._groups[hasher.key] = _Group(hasher)
        slot = g.index.new_slot()
        g.slot_of[w.worker] = slot
        if slot == len(g.ids):
            g.ids.append(w.worker)
        else:
            g.ids[slot] = w.worker
        w.group = g

    def _leave(self, w: WorkerIndex) -> None:
        g = w.group
        assert g is not None
        slot = g.slot_of.pop(w.worker)
        g.index.free_slot(slot)
        self.pending.forget_worker(w.worker)
        g.ids[slot] = None
        w.group = None

    # -- stream state (the subscriber calls these) -----------------------------------------------

    def set_state(self, worker_id: str, state: str, reason: str | None = None) -> None:
        w = self._workers.get(worker_id)
        if w is None:  # removed from the gateway: its subscription is ending
            return
        if w.state == "misaligned" and state != "stopped":
            return  # only a new epoch (clear(restart=True)) re-arms a misaligned worker
        w.state = state
        if reason is not None:
            w.reason = reason

    def clear(self, worker_id: str, why: str) -> None:
        """Forget the worker's blocks: AllBlocksCleared, a restart or a gap that cannot be
        filled. `why`: "cleared", "restart", "resync"."""
        w = self._workers[worker_id]
        if w.group is not None:
            w.group.index.clear_slot(w.group.slot_of[worker_id])
        if why == "restart":
            w.restarts += 1
            w.epoch += 1
            w.last_seq = None
            w.last_digest = None
            w.recent.clear()
            w.outcomes.clear()
            if w.state == "misaligned":  # a new engine process: check it again
                w.state, w.reason = "resyncing", None
                if w.configured_block_size is None and w.group is not None:
                    self._leave(w)
        elif why == "resync":
            w.resyncs += 1
        else:
            w.clears += 1

    def misalign(self, worker_id: str, reason: str) -> None:
        w = self._workers[worker_id]
        if w.state == "misaligned":
            return
        w.state = "misaligned"
        w.reason = reason
        if w.group is not None:
            w.group.index.clear_slot(w.group.slot_of[worker_id])
        log.error("kv_events.misaligned", worker=worker_id, endpoint=w.endpoint, reason=reason)

    def apply(self, worker_id: str, seq: int, payload_digest_: bytes, batch: Batch) -> None:
        """Apply one batch (in sequence order) to the worker's index."""
        w = self._workers[worker_id]
        w.last_seq = seq
        w.last_digest = payload_digest_
        w.last_event_at = self._clock()
        w.lag_s = lag = time.time() - batch.ts  # (one host's clock, or synchronised ones)
        if lag > w.max_lag_s:
            w.max_lag_s = lag
        w.recent[seq] = payload_digest_
        if len(w.recent) > 256:
            w.recent.popitem(last=False)
        for event in batch.events:
            w.events += 1
            if w.state == "misaligned":
                continue
            if isinstance(event, Stored):
                self._stored(w, event)
            elif isinstance(event, Removed):
                if event.group not in (None, 0) or (event.medium not in (None, "GPU")):
                    w.skipped += 1
                    continue
                g = w.group
                if g is not None:
                    w.removed += g.index.remove(
                        g.slot_of[worker_id], [g.hasher.event_key(h) for h in event.hashes]
                    )
            elif isinstance(event, Cleared):
                self.clear(worker_id, "cleared")

    def _stored(self, w: WorkerIndex, ev: Stored) -> None:
        if ev.group not in (None, 0) or ev.medium not in (None, "GPU"):
            w.skipped += 1
            return
        if w.configured_block_size is not None and ev.block_size != w.configured_block_size:
            self.misalign(
                w.worker,
                f"block size: the engine's events say {ev.block_size} tokens per block, the "
                f"configuration says {w.configured_block_size} (kv_events.block_size)",
            )
            return
        if w.group is None:
            if ev.block_size < 1:
                w.skipped += 1
                return
            self._join(w, ev.block_size)
        g = w.group
        assert g is not None
        hasher = g.hasher
        if ev.block_size != hasher.block_size:
            self.misalign(
                w.worker,
                f"block size: the engine's events say {ev.block_size} tokens per block, this "
                f"index hashes blocks of {hasher.block_size}",
            )
            return
        keys = [hasher.event_key(h) for h in ev.hashes]
        if not ev.keyed and len(ev.token_ids) == len(keys) * hasher.block_size:
            parent = ev.parent
            if parent is None or (isinstance(parent, bytes) and len(parent) == 32):
                n = min(VERIFY_BLOCKS, len(keys))
                computed = hasher.chain(parent, ev.token_ids[: n * hasher.block_size])
                if [k for k, _ in computed] != keys[:n]:
                    self.misalign(w.worker, _hash_mismatch(w, hasher, keys[0], computed[0][0]))
                    return
                w.verified += 1
            else:
                w.unverifiable += 1
        else:
            w.unverifiable += 1
        slot = g.slot_of[w.worker]
        w.stored += g.index.add(slot, keys)
        over = g.index.slot_entries(slot) - w.max_blocks
        if over > 0:
            w.evicted += g.index.evict(slot, over)

    # -- outcomes ---------------------------------------------------------------------------------

    def outcome(self, worker_id: str, predicted: int, reported: int) -> None:
        """A request this index predicted `predicted` cached tokens for found `reported`. Where a
        policy feeds the pending overlay, the prediction checked is the engine's blocks' alone,
        from the request's end (`observe`), not this one (its overlay's credit may be in it)."""
        if not self.pending.fed:
            self._check(worker_id, predicted, reported)

    def _check(self, worker_id: str, predicted: int, reported: int, pending: int | None = None) -> None:
        """`pending`: the prediction with the overlay's credit (the engine may have stored the
        pending prefix by the time it scheduled the request: either may be right)."""
        w = self._workers.get(worker_id)
        if w is None or not w.usable:
            return
        bs = w.block_size or 1
        off = abs(predicted - reported) > max(2 * bs, 0.1 * max(predicted, reported))
        if off and pending is not None:
            off = abs(pending - reported) > max(2 * bs, 0.1 * max(pending, reported))
        w.outcomes.append(off)
        if off:
            w.outcome_mismatches += 1
        if len(w.outcomes) >= OUTCOME_MIN and sum(w.outcomes) * 2 > len(w.outcomes):
            self.misalign(
                worker_id,
                f"predictions disagree with the engine: {sum(w.outcomes)} of the last "
                f"{len(w.outcomes)} requests found a different number of cached tokens than "
                f"the index predicted (last: predicted {predicted}, engine reported {reported})",
            )

    # -- the pending overlay (gateway/kvevents/pending.py) -----------------------------------------

    def observe(self, event: PolicyEvent) -> None:
        """What a policy routed and saw end: the pending overlay's entries (`PendingSink`)."""
        if isinstance(event, Routed):
            self._routed(event)
        elif isinstance(event, Completed | Failed):
            got = self.pending.ended(event.request_id)
            if got is not None and isinstance(event, Completed) and event.cached_tokens is not None:
                self._check(got[0], got[1], event.cached_tokens, got[2])

    def _routed(self, ev: Routed) -> None:
        key, wid = ev.prompt_key, ev.worker_ids[0]
        w = self._workers.get(wid)
        g = None if w is None else w.group
        if key is None or key.token_ids is None or g is None or not self.known(ev.model)(wid):
            self.pending.fed = True
            return
        bs = g.hasher.block_size
        n = (len(key.token_ids) - 1) // bs  # the blocks a lookup reads (an engine matches)
        # (the engine's keys hashed only as far as the search reads: the lookup hashed them)
        held = g.index.depth(key.engine_chain(g.hasher, n), 1 << g.slot_of[wid])
        ids = packed_ids(key)
        assert ids is not None  # (it has token ids)
        both = max(held, self.pending.depth(wid, ids, bs, n))
        self.pending.routed(ev.request_id, wid, (held * bs, both * bs), ids if held < n else None, n, bs)

    # -- PrefixSource -------------------------------------------------------------------------------

    def known(self, model: str) -> Callable[[str], bool]:
        workers = self._workers
        model_of = self._model_of

        def known(worker_id: str) -> bool:
            w = workers.get(worker_id)
            if w is None or not w.usable:
                return False
            m = model_of(worker_id)
            return m is None or m == model

        return known

    def lookup(self, model: str, key: PromptKey, max_candidates: int) -> Lookup | None:
        if key.token_ids is None or not self._workers:
            return None
        known = self.known(model)
        parts: list[IndexLookup | WithPending] = []
        ids = packed_ids(key) if self.pending.entries else None
        for g in self._groups.values():
            if not g.slot_of:
                continue
            bs = g.hasher.block_size
            chain = key.engine_chain(g.hasher, (len(key.token_ids) - 1) // bs)
            got = IndexLookup(g.index, chain, g.slot_of, g.ids, bs, max_candidates, known)
            if ids is not None:
                pending = PendingLookup(self.pending, ids, bs, len(chain), g.slot_of, known)
                parts.append(WithPending(got, pending, max_candidates))
            else:
                parts.append(got)
        if len(parts) == 1:
            return parts[0]
        return Merged(parts, known)

    # -- stats ------------------------------------------------------------------------------------

    def blocks(self, worker_id: str) -> int:
        w = self._workers[worker_id]
        g = w.group
        return 0 if g is None else g.index.slot_entries(g.slot_of[worker_id])

    def worker_keys(self, worker_id: str) -> set[int]:
        """The worker's indexed block keys (tests compare them with an engine's block set)."""
        w = self._workers[worker_id]
        g = w.group
        return set() if g is None else set(g.index.slot_keys(g.slot_of[worker_id]))

    def memory_bytes(self) -> int:
        return sum(g.index.memory_bytes() for g in self._groups.values())

    def status(self) -> list[WorkerStatus]:
        now = self._clock()
        return [
            WorkerStatus(
                worker=w.worker,
                endpoint=w.endpoint,
                state=w.state,
                usable=w.usable,
                reason=w.reason,
                scheme=w.scheme if w.scheme != "vllm" else f"vllm/{w.algo}",
                block_size=w.block_size,
                epoch=w.epoch,
                last_seq=w.last_seq,
                blocks=self.blocks(w.worker),
                events=w.events,
                stored=w.stored,
                removed=w.removed,
                verified=w.verified,
                unverifiable=w.unverifiable,
                gaps=w.gaps,
                replays=w.replays,
                resyncs=w.resyncs,
                restarts=w.restarts,
                clears=w.clears,
                evicted=w.evicted,
                skipped=w.skipped,
                outcome_mismatches=w.outcome_mismatches,
                last_event_age_s=None if w.last_event_at is None else now - w.last_event_at,
                lag_s=w.lag_s,
                max_lag_s=w.max_lag_s,
            )
            for w in self._workers.values()
        ]


def _hash_mismatch(w: WorkerIndex, hasher: BlockHasherBase, got: int, computed: int) -> str:
    spec = hasher.spec
    what = {
        "vllm": f"vLLM {spec.algo}, seed {spec.seed or 'vllm-none-hash (no PYTHONHASHSEED)'}",
        "sglang": "SGLang sha256",
        "emulator": "the emulator's sha256",
    }[spec.scheme]
    return (
        f"block hash: the engine published {got} for a block this gateway hashes to {computed} "
        f"({what}, {spec.block_size} tokens per block): check the engine's "
        "--prefix-caching-hash-algo, PYTHONHASHSEED and block size against kv_events.hash, "
        "hash_algo, hash_seed and block_size"
    )
