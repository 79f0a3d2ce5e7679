"""What `cache_aware` keeps across decisions is what it would build from scratch.

A large pool's decision reads state kept from the decisions before it, brought up to date with
what changed since: the exact search's sorted lists (`PoolOrder.sync`: workers whose state,
queue or rate changed, queues that emptied), the positions of workers in the candidate lists
(`PositionMemo`), the sampled draws (`narrow`), and the depth guesses of the approximate
index (`BlockIndex` with `prefix_closed`). Random sequences of changes check each against a
rebuild (or the plain computation) after every step: a change the catch-up misses shows as a
difference.
"""

from __future__ import annotations

import random

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.block_index import BlockIndex
from policies.cache_aware import PositionMemo
from policies.cache_aware_orders import PoolOrder, PoolOrders
from policies.cache_narrow import narrow
from policies.prefill_cost import PrefillQueues
from policies.prefix_source import IndexLookup
from policies.snapshot import WorkerLoad
from policies.testing import make_worker

ORDER_FIELDS = ("a_key", "b_key", "busy", "by_drain", "by_b_busy", "by_b_idle", "by_b_unmeasured")


def lists_of(order: PoolOrder) -> dict[str, object]:
    return {f: list(getattr(order, f)) for f in ORDER_FIELDS}


class ShortLog(PrefillQueues):
    """Its change log is reset often (a reader then rebuilds)."""

    LOG_LIMIT = 8


@settings(max_examples=120, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([0.0, 1.0, 2.5]))
def test_the_kept_order_equals_a_rebuild(seed: int, factor: float) -> None:
    rng = random.Random(seed)
    n = rng.randrange(1, 150)
    pool = [make_worker(f"w{i}", inflight=rng.randrange(0, 6)) for i in range(n)]
    queues = rng.choice([PrefillQueues, ShortLog])()
    now = 100.0
    orders = PoolOrders(factor)
    for _ in range(30):
        for _ in range(rng.randrange(0, 5)):  # the snapshot: new states, some equal to the old
            i = rng.randrange(n)
            pool[i] = msgspec.structs.replace(
                pool[i],
                inflight=rng.choice([pool[i].inflight, rng.randrange(0, 6)]),
                load=WorkerLoad(waiting=rng.randrange(0, 3)),
            )
        for _ in range(rng.randrange(0, 4)):  # the policy: queues, rates, forgotten workers
            wid = f"w{rng.randrange(n)}"
            what = rng.random()
            if what < 0.6:
                queues.add(wid, rng.choice([100.0, 5000.0, 40_000.0]), now)
            elif what < 0.9:
                queues.learn(wid, rng.choice([5000.0, 20_000.0]), rng.choice([0.5, 1.0, 2.0]))
            else:
                queues.forget(wid)
        now += rng.choice([0.0, 0.001, 0.2, 1.0, 5.0])
        kept = orders.get(pool, queues, now)
        assert lists_of(kept) == lists_of(PoolOrder(pool, queues, factor, now))


@settings(max_examples=120, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_the_position_memo_finds_what_a_pass_finds(seed: int) -> None:
    """Never a worker that is not there; and every one that is, once a layout has been used
    `refresh_every` times (a layout changed in its middle is noticed by then)."""
    rng = random.Random(seed)
    everyone = [make_worker(f"w{i}") for i in range(120)]
    memo = PositionMemo(refresh_every=8, layouts=2)
    layout = everyone[:100]
    for step in range(40):
        what = rng.random()
        if what < 0.3:  # new states for some (a request started or ended)
            layout = list(layout)
            for _ in range(rng.randrange(1, 4)):
                i = rng.randrange(len(layout))
                layout[i] = msgspec.structs.replace(layout[i], inflight=rng.randrange(9))
        elif what < 0.5:  # the middle moves, the ends and the length stay
            middle = layout[1:-1]
            rng.shuffle(middle)
            layout = [layout[0], *middle, layout[-1]]
        elif what < 0.6:  # a worker replaced by another, same place
            i = rng.randrange(1, len(layout) - 1)
            spare = [w for w in everyone if w.id not in {x.id for x in layout}]
            layout = [*layout[:i], rng.choice(spare), *layout[i + 1 :]]
        present = {w.id: w for w in layout}
        for use in range(memo.refresh_every + 1):
            wanted = [f"w{rng.randrange(120)}" for _ in range(rng.randrange(0, 6))]
            got = iter(memo.find(layout, wanted))
            # each one found is the layout's own state of a wanted worker, in `wanted`'s order
            truth = iter([present[wid] for wid in wanted if wid in present])
            assert all(any(w is t for t in truth) for w in got), (step, use)
        # a whole round of checks later: exactly a pass's answer
        wanted = [w.id for w in rng.sample(everyone, 20)]
        assert [w.id for w in memo.find(layout, wanted)] == [wid for wid in wanted if wid in present]


class _OwnRandom(random.Random):
    """Not `random.Random` itself: `narrow` draws with `randrange` (the reference)."""


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(65, 3000), st.integers(1, 8))
def test_the_sample_draws_are_randranges(seed: int, n: int, sample: int) -> None:
    pool = [make_worker(f"w{i}") for i in range(n)]
    fast, ref = random.Random(seed), _OwnRandom(seed)
    for _ in range(5):
        a = narrow(pool, [("w3", 16)], sample, fast, PositionMemo())
        b = narrow(pool, [("w3", 16)], sample, ref, PositionMemo())
        assert [w.id for w in a] == [w.id for w in b]


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(65, 400), st.integers(0, 8))
def test_narrow_is_the_wanted_workers_then_new_draws(seed: int, n: int, sample: int) -> None:
    """Against the plain computation (a pass over the pool, `randrange` draws), one memo kept
    over changing layouts and wanted lists (a worker replaced at its place, the ends moved)."""
    rng = random.Random(seed)
    pool = [make_worker(f"w{i}") for i in range(n)]
    memo = PositionMemo(refresh_every=1)  # each use checks the whole layout: exact
    for step in range(6):
        if step % 2:
            i = rng.randrange(n)
            pool = [*pool[:i], make_worker(f"x{seed}-{step}"), *pool[i + 1 :]]
        if step == 4:
            pool = pool[1:] + pool[:1]
        wanted = [(f"w{rng.randrange(n + 20)}", 16 * k) for k in range(rng.randrange(0, 17))]
        wanted = list({wid: (wid, t) for wid, t in wanted}.values())  # one row per worker
        draw = rng.getrandbits(32)
        got = narrow(pool, wanted, sample, random.Random(draw), memo)
        by_id = {w.id: w for w in pool}
        want = [by_id[wid] for wid, _ in wanted if wid in by_id]
        ref = _OwnRandom(draw)
        for _ in range(sample):
            w = pool[ref.randrange(n)]
            if all(x.id != w.id for x in want):
                want.append(w)
        assert [w.id for w in got] == [w.id for w in want]
        assert all(a is b for a, b in zip(got, want, strict=True))


IDS = [f"w{i}" for i in range(6)]
SLOT_OF = {wid: i for i, wid in enumerate(IDS)}
CHAINS = st.lists(
    st.tuples(st.integers(0, 3), st.integers(1, 40), st.integers(0, 5)),  # family, blocks, slot
    min_size=1,
    max_size=40,
)


def chain(family: int, blocks: int, tail: int = 0) -> list[int]:
    """Block keys: `family`'s shared first 12 blocks, then blocks of its own (`tail`)."""
    return [hash((family, j if j < 12 else (tail, j))) for j in range(blocks)]


@settings(max_examples=150, deadline=None)
@given(CHAINS, st.integers(1, 30), st.integers(0, 2**32 - 1))
def test_guessed_levels_are_the_searched_ones(ops: list[tuple[int, int, int]], cap: int, seed: int) -> None:
    """A prefix-closed index guesses each level's depth from the last lookup of the same first
    block and checks the guess; the levels are those of the plain search."""
    rng = random.Random(seed)
    guessing, plain = BlockIndex(prefix_closed=True), BlockIndex()
    for index in (guessing, plain):
        for _ in range(6):
            index.new_slot()
    for family, blocks, slot in ops:
        keys = chain(family, blocks, rng.randrange(3))
        for index in (guessing, plain):
            index.add(slot, keys)
            over = index.slot_entries(slot) - cap
            if over > 0:
                index.evict(slot, over)
        for _ in range(3):
            ask = chain(rng.randrange(4), rng.randrange(1, 45), rng.randrange(3))
            assert guessing.levels_rest(ask, 16) == plain.levels_rest(ask, 16)
            assert guessing.levels_rest(ask, 1) == plain.levels_rest(ask, 1)
            # a worker's cached tokens, read from the levels a lookup found, are its depth's
            lookup = IndexLookup(guessing, ask, SLOT_OF, IDS, 16, rng.choice([1, 2, 16]))
            assert lookup.top is not None
            for wid, slot in SLOT_OF.items():
                assert lookup.cached_tokens(wid) == 16 * plain.depth(ask, 1 << slot)
