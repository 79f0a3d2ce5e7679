"""Hypothesis: the prefix indexes.

- `BlockIndex` against a plain model (sets and lists) under adds, removals, evictions, clears;
  with adds and LRU evictions only, every worker's blocks stay prefix-closed and the galloping
  depth search equals a walk;
- `ApproxIndex`: bounded (per worker and in total) whatever is inserted, the most recent prompt
  kept, a match never longer than the prompt;
- the KV-event index fed by an engine (the emulator's own block pool and event structs) through
  a stream that drops batches, restarts the engine and clears its cache: with a replay buffer
  that holds the missed batches the index equals the engine's block set; with a short buffer it
  holds a subset (it under-counts, never over).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque

import msgspec
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapters.blockhash import HashSpec, make_hasher
from emulator.kvcache import BlockPool
from emulator.kvevents import (
    AllBlocksCleared,
    SglBlockRemoved,
    SglBlockStored,
    VllmBlockRemoved,
    VllmBlockStored,
)
from emulator.model import chain_hashes, hash_to_int
from gateway.kvevents.index import KvEventIndex
from gateway.kvevents.subscriber import KvEventSubscriber
from policies.approx_index import ApproxIndex
from policies.block_index import BlockIndex
from policies.prompt_key import PromptKey

# ---- BlockIndex against a model ----------------------------------------------------------------

KEYS = st.integers(0, 40)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 3), st.lists(KEYS, max_size=8)),
        st.tuples(st.just("remove"), st.integers(0, 3), st.lists(KEYS, max_size=6)),
        st.tuples(st.just("evict"), st.integers(0, 3), st.integers(0, 5)),
        st.tuples(st.just("clear"), st.integers(0, 3), st.just(0)),
    ),
    max_size=60,
)


@given(OPS)
@settings(max_examples=300, deadline=None)
def test_block_index_matches_a_model(ops: list[tuple[str, int, object]]) -> None:
    index = BlockIndex()
    slots = [index.new_slot() for _ in range(4)]
    lru: list[list[int]] = [[] for _ in slots]  # oldest first
    for op, s, arg in ops:
        if op == "add":
            keys = list(dict.fromkeys(arg))  # type: ignore[call-overload]
            index.add(s, keys)
            for k in reversed(keys):
                if k in lru[s]:
                    lru[s].remove(k)
                lru[s].append(k)
        elif op == "remove":
            index.remove(s, arg)  # type: ignore[arg-type]
            lru[s] = [k for k in lru[s] if k not in arg]  # type: ignore[operator]
        elif op == "evict":
            index.evict(s, arg)  # type: ignore[arg-type]
            lru[s] = lru[s][arg:]  # type: ignore[misc]
        else:
            index.clear_slot(s)
            lru[s] = []
        for slot in slots:
            assert index.slot_keys(slot) == lru[slot]
        assert index.entries == sum(len(x) for x in lru)
        every = {k for x in lru for k in x}
        assert index.blocks == len(every)
        for k in every:
            assert index.holders(k) == sum(1 << s for s in slots if k in lru[s])


# prompts: paths in a small tree, so that chains share prefixes
CHAINS = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=12), min_size=1, max_size=40)


def as_keys(path: list[int]) -> list[int]:
    return [hash(tuple(path[: i + 1])) for i in range(len(path))]


@given(CHAINS, st.lists(st.integers(0, 3), min_size=40, max_size=40), st.integers(1, 20))
@settings(max_examples=200, deadline=None)
def test_lru_keeps_prefixes_closed_and_depth_is_exact(
    paths: list[list[int]], slots_for: list[int], capacity: int
) -> None:
    index = BlockIndex()
    slots = [index.new_slot() for _ in range(4)]
    for path, s in zip(paths, slots_for, strict=False):
        index.add(s, as_keys(path))
        over = index.slot_entries(s) - capacity
        if over > 0:
            index.evict(s, over)
        for slot in slots:
            held = set(index.slot_keys(slot))
            for p in paths:
                keys = as_keys(p)
                walk = 0
                while walk < len(keys) and keys[walk] in held:
                    walk += 1
                assert index.depth(keys, 1 << slot) == walk
                # prefix-closed: a held block's parents are held
                assert all(
                    k in held
                    for k in keys[: max((i + 1 for i, k in enumerate(keys) if k in held), default=0)]
                )
    for p in paths:
        keys = as_keys(p)
        for mask, depth in index.levels(keys, 8):
            for slot in slots:
                if mask >> slot & 1:
                    assert index.depth(keys, 1 << slot) == depth


# ---- ApproxIndex bounds -----------------------------------------------------------------------------

PROMPTS = st.lists(
    st.tuples(st.integers(0, 5), st.integers(0, 300), st.integers(0, 4)),  # family, suffix, worker
    min_size=1,
    max_size=60,
)


@given(PROMPTS, st.integers(16, 800), st.integers(64, 3000))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_approx_index_is_bounded_and_keeps_the_latest(
    prompts: list[tuple[int, int, int]], capacity: int, budget: int
) -> None:
    idx = ApproxIndex(block_tokens=16, budget_tokens=budget)
    families = [list(range(f * 1000, f * 1000 + 200)) for f in range(6)]
    for n, (family, suffix, worker) in enumerate(prompts):
        ids = families[family] + [n] * suffix
        key = PromptKey.from_token_ids(ids)
        assert key is not None
        idx.insert("m", f"w{worker}", key, capacity)
        for w in range(5):
            assert idx.worker_entries(f"w{w}") * 16 <= max(16, capacity)
        assert idx.entries <= idx.budget_entries
        look = idx.lookup("m", key, 8)
        assert look is not None
        for w in range(5):
            got = look.cached_tokens(f"w{w}")
            assert got is not None and 0 <= got <= len(ids)
        blocks = len(ids) // 16
        if blocks <= min(capacity // 16, idx.budget_entries - idx.budget_entries // 64):
            assert idx.cached_tokens("m", f"w{worker}", key) == blocks * 16  # the latest stays


# ---- the KV-event index against an engine ------------------------------------------------------

BS = 4


class Engine:
    """An engine's prefix cache (the emulator's block pool) publishing its events as batches
    with sequence numbers and a bounded replay buffer, as the engines' ZMQ publisher does."""

    def __init__(self, wire: str, buffer: int, num_blocks: int) -> None:
        self.wire = wire
        self.buffer_size = buffer
        self.num_blocks = num_blocks
        self.epoch = 0
        self._new_process()

    def _new_process(self) -> None:
        self.pool = BlockPool(self.num_blocks, BS)
        self.pool.on_stored = self._stored
        self.pool.on_removed = self._removed
        self.pool.on_cleared = lambda: self._pending.append(AllBlocksCleared())
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=self.buffer_size)
        self._pending: list[object] = []
        self.epoch += 1

    def _stored(self, hashes: list[bytes], parent: bytes | None, tokens: list[int]) -> None:
        if self.wire == "vllm":
            self._pending.append(VllmBlockStored(hashes, parent, tokens, BS, None, "GPU"))
        else:
            ints = [hash_to_int(h) for h in hashes]
            self._pending.append(
                SglBlockStored(ints, None if parent is None else hash_to_int(parent), tokens, BS, None, "GPU")
            )

    def _removed(self, hashes: list[bytes]) -> None:
        if self.wire == "vllm":
            self._pending.append(VllmBlockRemoved(hashes, "GPU"))
        else:
            self._pending.append(SglBlockRemoved([hash_to_int(h) for h in hashes], "GPU"))

    def run(self, ids: list[int]) -> None:
        """One request: reuse the cached prefix, compute and register the rest, free."""
        hashes = chain_hashes(ids, BS)
        cached = self.pool.match_prefix(hashes, (len(ids) - 1) // BS)
        rest = self.pool.allocate(len(hashes) - len(cached))
        if rest is None:
            self.pool.free(cached)
            return
        blocks = cached + rest
        first, full = len(cached), len(ids) // BS
        if full > first:
            parent = hashes[first - 1] if first else None
            self.pool.register(blocks[first:full], hashes[first:full], parent, ids[first * BS : full * BS])
        self.pool.free(blocks)

    def flush(self) -> tuple[int, bytes] | None:
        if not self._pending:
            return None
        events, self._pending = self._pending, []
        payload = msgspec.msgpack.encode([float(self.epoch * 1000 + self.seq), events, 0])
        seq, self.seq = self.seq, self.seq + 1
        self.buffer.append((seq, payload))
        return seq, payload

    def restart(self) -> None:
        self._new_process()

    async def replay(self, start: int) -> list[tuple[int, bytes]]:
        return [(s, p) for s, p in self.buffer if s >= start]

    def keys(self) -> set[int]:
        hasher = make_hasher(HashSpec(scheme="emulator", block_size=BS))
        return {hasher.event_key(h) for h in self.pool._by_hash}


STREAM = st.lists(
    st.one_of(
        st.tuples(st.just("req"), st.integers(0, 4), st.integers(0, 30)),
        st.tuples(st.just("drop"), st.integers(1, 4), st.just(0)),
        st.tuples(st.just("restart"), st.just(0), st.just(0)),
        st.tuples(st.just("flush_cache"), st.just(0), st.just(0)),
    ),
    min_size=1,
    max_size=50,
)


async def _drive(engine: Engine, ops: list[tuple[str, int, int]], seed: int) -> KvEventIndex:
    index = KvEventIndex()
    index.add_worker("w", endpoint="tcp://engine:1", scheme="emulator", block_size=BS)
    sub = KvEventSubscriber(
        index, "w", engine.wire, "tcp://engine:1", replayer=engine.replay, ctx=zmq.asyncio.Context.instance()
    )
    rng = random.Random(seed)
    families = [[rng.randrange(3, 250) for _ in range(rng.randrange(4, 40))] for _ in range(5)]
    drop = 0
    for op, a, b in ops:
        if op == "req":
            engine.run(families[a] + [rng.randrange(3, 250) for _ in range(b)])
        elif op == "drop":
            drop += a
            continue
        elif op == "restart":
            engine.restart()
            sub._connection_event({"event": zmq.EVENT_DISCONNECTED})  # the socket saw it go
            continue
        else:
            engine.pool.flush()
        msg = engine.flush()
        if msg is None:
            continue
        if drop:
            drop -= 1
            continue
        await sub.on_message(*msg)
    engine.run(families[0] + [rng.randrange(3, 250) for _ in range(40)])  # a last, delivered batch
    msg = engine.flush()
    assert msg is not None
    await sub.on_message(*msg)
    return index


@given(STREAM, st.sampled_from(["vllm", "sglang"]), st.integers(0, 10_000))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_kv_event_index_equals_the_engine_after_gaps_restarts_and_clears(
    ops: list[tuple[str, int, int]], wire: str, seed: int
) -> None:
    engine = Engine(wire, buffer=10_000, num_blocks=48)
    index = asyncio.run(_drive(engine, ops, seed))
    w = index.worker("w")
    assert w is not None and w.state == "live", w
    assert index.worker_keys("w") == engine.keys()
    assert w.restarts >= 0 and w.epoch == w.restarts


@given(STREAM, st.sampled_from(["vllm", "sglang"]), st.integers(0, 10_000), st.integers(1, 4))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_short_replay_buffer_only_under_counts(
    ops: list[tuple[str, int, int]], wire: str, seed: int, buffer: int
) -> None:
    engine = Engine(wire, buffer=buffer, num_blocks=48)
    index = asyncio.run(_drive(engine, ops, seed))
    assert index.worker_keys("w") <= engine.keys()


def test_the_engine_model_is_deterministic_enough() -> None:
    """Sanity for the property above: the stream's events do describe the pool's blocks."""
    engine = Engine("vllm", buffer=100, num_blocks=48)
    start = time.monotonic()
    index = asyncio.run(_drive(engine, [("req", i % 5, i) for i in range(30)], 1))
    assert index.worker_keys("w") == engine.keys() and engine.keys()
    assert index.worker("w").verified > 0  # type: ignore[union-attr]
    assert time.monotonic() - start < 30


def test_gaps_restarts_and_clears_are_seen_and_repaired() -> None:
    ops: list[tuple[str, int, int]] = [("req", i % 5, 3) for i in range(6)]
    ops += [("drop", 2, 0), ("req", 1, 9), ("req", 2, 9), ("req", 3, 9)]  # two batches lost
    ops += [("flush_cache", 0, 0), ("req", 4, 5)]
    ops += [("restart", 0, 0), ("req", 0, 7), ("req", 1, 7)]
    engine = Engine("sglang", buffer=100, num_blocks=48)
    index = asyncio.run(_drive(engine, ops, 3))
    w = index.worker("w")
    assert w is not None
    assert (w.gaps, w.clears, w.restarts, w.epoch) == (1, 1, 1, 1)
    assert w.replays == 1 and w.resyncs == 0  # the gap was filled; the restart began at seq 0
    assert index.worker_keys("w") == engine.keys()
