"""The KV-event index's checks and bounds, fed batches as the engines' publishers encode them
(the emulator's event structs), and the policy reading it."""

from __future__ import annotations

import asyncio

import msgspec
import zmq.asyncio
from structlog.testing import capture_logs

from adapters.blockhash import HashSpec, make_hasher
from adapters.kvevents import decode_batch
from emulator.kvevents import AllBlocksCleared, SglBlockStored, VllmBlockRemoved, VllmBlockStored
from emulator.model import chain_hashes
from gateway.kvevents.index import KvEventIndex, payload_digest
from gateway.kvevents.subscriber import KvEventSubscriber
from policies.base import Completed, routed_event
from policies.cache_aware import CacheAwareSettings, CacheState
from policies.prompt_key import PromptKey
from policies.snapshot import Colocated, RequestView, RouteKind
from policies.testing import make_worker

BS = 4
IDS = list(range(10, 50))  # 10 blocks of 4


def stored(ids: list[int], first: int = 0, medium: str = "GPU") -> VllmBlockStored:
    hashes = chain_hashes(ids, BS)[: len(ids) // BS]
    parent = hashes[first - 1] if first else None
    return VllmBlockStored(hashes[first:], parent, ids[first * BS : len(hashes) * BS], BS, None, medium)


def payload(*events: object) -> bytes:
    return msgspec.msgpack.encode([0.0, list(events), 0])


def apply(index: KvEventIndex, seq: int, *events: object) -> None:
    p = payload(*events)
    index.apply("w", seq, payload_digest(p), decode_batch(p, "vllm"))


def live_index(**kw: object) -> KvEventIndex:
    index = KvEventIndex()
    index.add_worker("w", endpoint="tcp://e:1", scheme="emulator", **kw)  # type: ignore[arg-type]
    index.set_state("w", "live")
    return index


def cached(index: KvEventIndex, ids: list[int]) -> int | None:
    key = PromptKey.from_token_ids(ids)
    assert key is not None
    look = index.lookup("m", key, 4)
    return None if look is None else look.cached_tokens("w")


def test_block_size_is_taken_from_the_first_event_and_verified() -> None:
    index = live_index()
    apply(index, 0, stored(IDS))
    assert cached(index, [*IDS, 1]) == 40 and cached(index, IDS) == 36  # never the last token
    w = index.worker("w")
    assert w is not None and w.block_size == BS and w.verified == 1
    apply(index, 1, stored(IDS[:20] + [99] * 8, first=5))  # a child of a known block: ints can't chain
    assert cached(index, IDS[:20] + [99] * 8 + [1]) == 28


def test_other_tiers_groups_and_removals() -> None:
    index = live_index(block_size=BS)
    apply(index, 0, stored(IDS, medium="CPU"))
    assert cached(index, [*IDS, 1]) == 0 and index.worker("w").skipped == 1  # type: ignore[union-attr]
    apply(index, 1, stored(IDS))
    h = chain_hashes(IDS, BS)
    apply(index, 2, VllmBlockRemoved(h[6:], "GPU"))
    assert cached(index, [*IDS, 1]) == 24
    apply(index, 3, AllBlocksCleared())
    assert cached(index, [*IDS, 1]) == 0 and index.worker("w").clears == 1  # type: ignore[union-attr]


def test_max_blocks_bounds_a_worker() -> None:
    index = live_index(block_size=BS, max_blocks=6)
    apply(index, 0, stored(IDS))
    w = index.worker("w")
    assert w is not None and index.blocks("w") == 6 and w.evicted == 4
    assert cached(index, [*IDS, 1]) == 24  # the first blocks (the most recent) stay


def test_a_wrong_scheme_is_misaligned_until_the_engine_restarts() -> None:
    index = KvEventIndex()
    index.add_worker("w", endpoint="tcp://e:1", scheme="vllm")  # the engine is the emulator
    index.set_state("w", "live")
    with capture_logs() as logs:
        apply(index, 0, stored(IDS))
        apply(index, 1, stored(IDS))
    w = index.worker("w")
    assert w is not None and w.state == "misaligned" and not w.usable
    assert w.reason is not None and "block hash" in w.reason and "PYTHONHASHSEED" in w.reason
    assert [e["event"] for e in logs] == ["kv_events.misaligned"]  # once
    assert cached(index, [*IDS, 1]) is None and index.blocks("w") == 0
    index.set_state("w", "live")  # a reconnect does not re-arm it
    assert index.worker("w").state == "misaligned"  # type: ignore[union-attr]
    index.clear("w", "restart")  # a new engine process does: checked again
    assert index.worker("w").state == "resyncing"  # type: ignore[union-attr]


def test_sglang_events_are_verified_at_the_root_of_a_prefix() -> None:
    index = KvEventIndex()
    index.add_worker("w", endpoint="tcp://e:1", scheme="sglang", block_size=BS)
    index.set_state("w", "live")
    hasher = make_hasher(HashSpec(scheme="sglang", block_size=BS))
    keys = [k for k, _ in hasher.chain(None, IDS)]
    p = payload(SglBlockStored(keys, None, IDS, BS, None, "GPU"))
    index.apply("w", 0, payload_digest(p), decode_batch(p, "sglang"))
    assert index.worker("w").verified == 1 and cached(index, [*IDS, 1]) == 40  # type: ignore[union-attr]
    bad = payload(SglBlockStored([k + 1 for k in keys], None, IDS, BS, None, "GPU"))
    index.apply("w", 1, payload_digest(bad), decode_batch(bad, "sglang"))
    assert index.worker("w").state == "misaligned"  # type: ignore[union-attr]


def test_outcomes_that_keep_disagreeing_misalign_the_index() -> None:
    index = live_index(block_size=BS)
    apply(index, 0, stored(IDS))
    for _ in range(7):
        index.outcome("w", 40, 0)  # the engine keeps finding nothing
    assert index.worker("w").state == "live"  # type: ignore[union-attr]
    index.outcome("w", 40, 0)
    w = index.worker("w")
    assert w is not None and w.state == "misaligned" and "predictions disagree" in (w.reason or "")


def test_close_outcomes_do_not() -> None:
    index = live_index(block_size=BS)
    for i in range(40):
        index.outcome("w", 400, 400 - (i % 3) * 4)  # within two blocks
    assert index.worker("w").state == "live"  # type: ignore[union-attr]


def test_the_policy_reads_the_precise_index_and_feeds_it_outcomes() -> None:
    index = live_index(block_size=BS)
    apply(index, 0, stored(IDS))
    st = CacheState(CacheAwareSettings(), precise=index)
    key = PromptKey.from_token_ids([*IDS, 1, 2])
    req = RequestView("r", "m", RouteKind.COMPLETIONS, 42, 4, prompt_key=key)
    w, other = make_worker("w"), make_worker("x")
    est = {e.worker: e for e in st.estimates(req, [w, other])}
    assert (est["w"].cached_tokens, est["w"].source) == (40, "kv_events")
    assert (est["x"].cached_tokens, est["x"].source) == (0, "approx")  # unknown to the events
    for i in range(8):
        r = RequestView(f"r{i}", "m", RouteKind.COMPLETIONS, 42, 4, prompt_key=key)
        st.observe(routed_event(r, Colocated(w)))
        st.observe(Completed(f"r{i}", ("w",), cached_tokens=0))
    assert index.worker("w").state == "misaligned"  # type: ignore[union-attr]
    est = {e.worker: e for e in st.estimates(req, [w])}
    assert est["w"].source == "approx"  # the policy no longer trusts it


async def test_initial_sync_and_overlapping_replays() -> None:
    index = KvEventIndex()
    index.add_worker("w", endpoint="tcp://e:1", scheme="emulator", block_size=BS)
    buffer = [(0, payload(stored(IDS[:8]))), (1, payload(stored(IDS[:16], first=2)))]

    async def replay(start: int) -> list[tuple[int, bytes]]:
        return [(s, p) for s, p in buffer if s >= start]

    sub = KvEventSubscriber(
        index, "w", "vllm", "tcp://e:1", replayer=replay, ctx=zmq.asyncio.Context.instance()
    )
    await sub.initial_sync()
    assert index.worker("w").state == "live" and index.worker("w").last_seq == 1  # type: ignore[union-attr]
    assert cached(index, [*IDS[:16], 1]) == 16
    await sub.on_message(*buffer[1])  # the live stream repeats what the replay gave: ignored
    assert index.worker("w").restarts == 0  # type: ignore[union-attr]
    buffer.append((2, payload(stored(IDS[:24], first=4))))
    await sub.on_message(*buffer[2])
    assert cached(index, [*IDS[:24], 1]) == 24
    fresh = KvEventIndex()
    fresh.add_worker("w", endpoint="tcp://e:1", scheme="emulator")

    async def nothing(start: int) -> list[tuple[int, bytes]]:
        return []  # a fresh engine: an empty buffer

    sub2 = KvEventSubscriber(
        fresh, "w", "vllm", "tcp://e:1", replayer=nothing, ctx=zmq.asyncio.Context.instance()
    )
    await asyncio.wait_for(sub2.initial_sync(), 1)
    assert fresh.worker("w").state == "live" and cached(fresh, IDS) == 0  # type: ignore[union-attr]
