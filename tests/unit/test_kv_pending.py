"""The precise index's pending overlay (gateway/kvevents/pending.py): prompts routed to a worker
count as its until the request ends or the horizon passes; the overlay is bounded, a lookup reads
the longest prefix a pending prompt shares, and routing does not hash the prompt whole."""

from __future__ import annotations

from array import array

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.kvevents import decode_batch
from emulator.kvevents import VllmBlockRemoved, VllmBlockStored
from emulator.model import chain_hashes
from gateway.kvevents.index import KvEventIndex, payload_digest
from policies.base import Completed, Failed, routed_event
from policies.cache_aware import CacheAwareSettings, CacheState
from policies.config import CacheAwareCfg
from policies.prompt_key import PromptKey
from policies.snapshot import Colocated, RequestView, RouteKind
from policies.testing import make_worker

BS = 4
IDS = list(range(10, 50))  # 10 blocks of 4
WORKERS = ("w", "x")


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def index_of(clock: Clock | None = None) -> KvEventIndex:
    index = KvEventIndex(clock=clock) if clock is not None else KvEventIndex()
    for w in WORKERS:
        index.add_worker(w, endpoint=f"tcp://{w}:1", scheme="emulator", block_size=BS)
        index.set_state(w, "live")
    return index


_seq: dict[str, int] = {}


def apply(index: KvEventIndex, worker: str, *events: object) -> None:
    p = msgspec.msgpack.encode([0.0, list(events), 0])
    seq = _seq[worker] = _seq.get(worker, -1) + 1
    index.apply(worker, seq, payload_digest(p), decode_batch(p, "vllm"))


def stored(ids: list[int]) -> VllmBlockStored:
    n = len(ids) // BS
    return VllmBlockStored(chain_hashes(ids, BS)[:n], None, ids[: n * BS], BS, None, "GPU")


def request(rid: str, ids: list[int]) -> RequestView:
    return RequestView(rid, "m", RouteKind.COMPLETIONS, len(ids), 4, prompt_key=PromptKey.from_token_ids(ids))


def route(index: KvEventIndex | CacheState, rid: str, worker: str, ids: list[int]) -> None:
    index.observe(routed_event(request(rid, ids), Colocated(make_worker(worker))))


def cached(index: KvEventIndex, ids: list[int], worker: str = "w") -> int | None:
    key = PromptKey.from_token_ids(ids)
    assert key is not None
    look = index.lookup("m", key, 4)
    return None if look is None else look.cached_tokens(worker)


def test_a_routed_prompt_counts_until_it_ends_then_the_events_rule() -> None:
    index = index_of()
    turn = [*IDS, 1]
    assert cached(index, [*turn, 2]) == 0
    route(index, "r1", "w", turn)
    # its next turn, before the engine stored anything: the first turn's blocks, on its worker only
    assert cached(index, [*turn, 2, 3, 4, 5]) == 40 and cached(index, [*turn, 2], "x") == 0
    look = index.lookup("m", PromptKey.from_token_ids([*turn, 2]), 4)  # type: ignore[arg-type]
    assert look is not None and list(look.top) == [("w", 40)]
    apply(index, "w", stored(IDS[:16]))  # its first chunk stored: the overlay still counts the rest
    assert cached(index, [*turn, 2]) == 40
    apply(index, "w", stored(IDS))
    index.observe(Completed("r1", ("w",), cached_tokens=0))  # ended: the entry is the engine's now
    assert index.pending.dropped_ended == 1 and not index.pending.entries and index.pending.blocks == 0
    assert cached(index, [*turn, 2]) == 40
    apply(index, "w", VllmBlockRemoved(chain_hashes(IDS, BS)[6:], "GPU"))
    assert cached(index, [*turn, 2]) == 24  # the engine evicted: not held up by the overlay


def test_routing_does_not_hash_the_prompt_whole() -> None:
    """The overlay compares token ids: routing a long prompt hashes only the engine keys the
    search for its held prefix reads (it used to hash every block: ~1 ms a 22,000-token prompt)."""
    index = index_of()
    ids = [*range(3, 4003), 1]  # 1,000 blocks
    key = PromptKey.from_token_ids(ids)
    assert key is not None
    view = RequestView("r1", "m", RouteKind.COMPLETIONS, len(ids), 4, prompt_key=key)
    index.observe(routed_event(view, Colocated(make_worker("w"))))
    assert index.pending.blocks == 1000
    assert max((len(keys) for keys, _ in key._engine.values()), default=0) <= 2
    assert cached(index, [*ids[:-1], 7, 8]) == 4000 and cached(index, [*ids[:2001], 9]) == 2000


def test_ids_kept_as_bytes_match_packed_ones() -> None:
    """The emulator tokenizer's ids are bytes; a prompt given as ids is a tuple: the same ids match."""
    index = index_of()
    text_ids = bytes([1, *range(10, 90)])  # (81 ids: 20 blocks a lookup reads)
    key = PromptKey.from_text("t")
    key.token_ids = text_ids
    view = RequestView("r1", "m", RouteKind.COMPLETIONS, len(text_ids), 4, prompt_key=key)
    index.observe(routed_event(view, Colocated(make_worker("w"))))
    assert cached(index, [*text_ids[:41], 200, 201, 202, 203]) == 40
    route(index, "r2", "x", [*text_ids[:30], 1])
    by_text = PromptKey.from_text("u")
    by_text.token_ids = bytes([*text_ids[:33], 5])
    look = index.lookup("m", by_text, 4)
    assert look is not None and look.cached_tokens("x") == 28 and look.cached_tokens("w") == 32
    by_list = PromptKey.from_text("v")  # (a text prompt with ids not bytes: packed here)
    by_list.token_ids = [*text_ids[:29], 5, 5, 5, 5]
    look = index.lookup("m", by_list, 4)
    assert look is not None and look.cached_tokens("x") == 28 and look.cached_tokens("w") == 28


def test_a_lookup_compares_only_pending_prompts_that_share_its_first_block() -> None:
    """However many requests are in flight, a lookup compares its prompt with the pending prompts
    of its first block only, the newest `scan_limit` of them (a bound on its cost)."""
    index = index_of()
    pending = index.pending
    pending.scan_limit = 8
    for i in range(50):  # 50 prompts with other first blocks
        route(index, f"o{i}", "x", [1000 + i, *IDS, 1])
    route(index, "old", "w", [*IDS, 1])  # the one sharing the probe's prefix, then 20 newer
    for i in range(20):  # that share only its first block, on "x"
        route(index, f"n{i}", "x", [*IDS[:4], 2000 + i, *IDS[5:], 1])
    probe = (bytes(array("q", [*IDS, 7])), 8)
    seen = pending.candidates(probe, BS)
    assert len(seen) == 8 and {e.worker for e in seen} == {"x"}
    assert cached(index, [*IDS, 7], "w") == 0  # (beyond the newest 8 of its bucket)
    assert cached(index, [*IDS, 7], "x") == BS
    pending.scan_limit = 64
    assert len(pending.candidates(probe, BS)) == 21
    assert cached(index, [*IDS, 7], "w") == 40


def test_an_ended_or_failed_request_is_dropped() -> None:
    index = index_of()
    route(index, "r1", "w", [*IDS, 1])
    route(index, "r2", "x", [*IDS[:20], 7, 7, 7, 7, 1])
    index.observe(Completed("r1", ("w",), cached_tokens=0))
    assert cached(index, [*IDS, 1]) == 0
    assert cached(index, [*IDS, 1], "x") == 20
    index.observe(Failed("r2", ("x",), "prefill"))
    assert cached(index, [*IDS, 1], "x") == 0
    assert index.pending.dropped_ended == 2 and index.pending.blocks == 0


def test_prefixes_pending_twice_are_counted_per_request() -> None:
    index = index_of()
    a, b = [*IDS[:20], 5, 5, 5, 5, 1], [*IDS[:20], 6, 6, 6, 6, 1]
    route(index, "a", "w", a)
    route(index, "b", "w", b)
    index.observe(Completed("a", ("w",)))
    assert cached(index, a) == 20 and cached(index, b) == 24  # b still holds the shared prefix
    index.observe(Completed("b", ("w",)))
    assert cached(index, b) == 0 and index.pending.blocks == 0


def test_the_horizon_and_the_bounds() -> None:
    clock = Clock()
    index = index_of(clock)
    route(index, "old", "w", [*IDS, 1])
    clock.t = index.pending.horizon_s + 1
    route(index, "new", "x", [*IDS[:8], 1])  # (each routing sweeps what is past the horizon)
    assert cached(index, [*IDS, 1]) == 0 and index.pending.dropped_expired == 1
    index.pending.max_entries = 2
    for i in range(5):
        route(index, f"r{i}", "w", [i + 100, *IDS, 1])
        assert len(index.pending.entries) <= 2
    index.pending.max_blocks = 15
    route(index, "big", "w", [*IDS, *IDS, 1])  # 20 blocks: more than fits, the others go first
    assert list(index.pending.entries) == ["big"] and index.pending.blocks == 20


def test_a_worker_that_leaves_takes_its_entries_along() -> None:
    index = index_of()
    route(index, "r1", "w", [*IDS, 1])
    index.remove_worker("w")
    assert not index.pending.entries and index.pending.blocks == 0
    index.add_worker("y", endpoint="tcp://y:1", scheme="emulator", block_size=BS)  # w's slot again
    index.set_state("y", "live")
    assert cached(index, [*IDS, 1], "y") == 0


def test_a_queued_turn_the_overlay_predicted_does_not_misalign_the_index() -> None:
    index = index_of()
    for i in range(13):  # each turn is routed during its predecessor's prefill
        if i < 12:
            route(index, f"r{i}", "w", [*IDS, *range(100, 100 + 4 * i), 1])
        if i:  # the engine scheduled it after its predecessor's: it found the overlay's count
            index.observe(Completed(f"r{i - 1}", ("w",), cached_tokens=40 + 4 * (i - 2) if i > 1 else 0))
    w = index.worker("w")
    assert w is not None and w.state == "live" and w.outcome_mismatches == 0
    for i in range(12):  # but found nothing, where the events said it would: misaligned
        apply(index, "w", stored([*IDS, 1]))
        route(index, f"s{i}", "w", [*IDS, 1])
        index.observe(Completed(f"s{i}", ("w",), cached_tokens=0))
    assert w.state == "misaligned"


def test_the_policy_feeds_it_unless_told_the_events_alone() -> None:
    for pending, want in ((True, 40), (False, 0)):
        index = index_of()
        st = CacheState(CacheAwareSettings(precise_pending=pending), precise=index)
        route(st, "r1", "w", [*IDS, 1])
        assert cached(index, [*IDS, 1, 2]) == want
        (e,) = st.estimates(request("r2", [*IDS, 1, 2]), [make_worker("w")])
        assert (e.cached_tokens, e.source) == (want, "kv_events")
        assert st.accuracy.summary() == {}  # (nothing ended yet)


def test_the_overlay_is_on_by_default() -> None:
    """It won over the events alone on the x3 replay (docs/benchmarks.md, "Why the precise index
    trailed"), at no CPU cost once it compared ids: `precise_record = "routed"` is the default."""
    assert CacheAwareCfg().precise_record == "routed"
    index = index_of()
    st = CacheState(CacheAwareSettings(), precise=index)
    route(st, "r1", "w", [*IDS, 1])
    assert cached(index, [*IDS, 1, 2]) == 40


# -- property: the overlay is the union of the pending chains, bounded -------------------------

PROMPTS = st.lists(st.integers(0, 1), min_size=1, max_size=5).map(tuple)  # a path in a binary tree
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("route"), st.integers(0, 5), st.sampled_from(WORKERS), PROMPTS),
        st.tuples(st.just("store"), st.sampled_from(WORKERS), PROMPTS),
        st.tuples(st.just("end"), st.integers(0, 5)),
    ),
    max_size=40,
)


def ids_of(path: tuple[int, ...]) -> list[int]:
    return [t for i, c in enumerate(path) for t in (10 + c, 20 + i, 30, 40)]


def common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=150, deadline=None)
@given(OPS, st.integers(1, 4))
def test_the_overlay_is_the_union_of_the_pending_prompts(ops: list[tuple], max_entries: int) -> None:
    index = index_of()
    index.pending.max_entries = max_entries
    engine: dict[str, set[tuple[int, ...]]] = {w: set() for w in WORKERS}  # stored prefixes
    pending: dict[int, tuple[str, tuple[int, ...]]] = {}  # request -> (worker, prompt), routing order
    for op in ops:
        if op[0] == "route":
            _, r, w, path = op
            route(index, f"r{r}", w, [*ids_of(path), 1])
            pending.pop(r, None)
            if path not in engine[w]:
                pending[r] = (w, path)
                while len(pending) > max_entries:
                    del pending[next(iter(pending))]
        elif op[0] == "store":  # (a pending prompt stays until its request ends)
            _, w, path = op
            apply(index, w, stored(ids_of(path)))
            engine[w] |= {path[:i] for i in range(1, len(path) + 1)}
        else:
            index.observe(Completed(f"r{op[1]}", ("w",)))
            pending.pop(op[1], None)
        assert set(index.pending.entries) == {f"r{r}" for r in pending}
        assert index.pending.blocks == sum(len(p) for _, p in pending.values())
        for w in WORKERS:
            for probe in [(0,) * 5, (1,) * 5, (0, 1, 0, 1, 0), (1, 0, 1, 0, 1), (0, 0, 1, 1, 0)]:
                held = max([common(probe, p) for p in engine[w]] + [0])
                queued = max([common(probe, p) for pw, p in pending.values() if pw == w] + [0])
                assert cached(index, [*ids_of(probe), 1], w) == BS * max(held, queued)
    for r in list(pending):
        index.observe(Completed(f"r{r}", ("w",)))
    assert index.pending.blocks == 0 and not index.pending.entries and not index.pending.by_worker
    assert not index.pending.by_head
