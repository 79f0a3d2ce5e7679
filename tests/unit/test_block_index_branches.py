"""Branch hints of a prefix-closed `BlockIndex` (`add` remembers where a chain branched off what
the index held and how long it was; `levels_rest` checks that length instead of searching):
the levels are always the plain galloping search's, through conversations that grow turn by
turn, LRU eviction, a worker's slot freed and reused, and the hint table overflowing; and a
continuing conversation's own level costs a few probes, not a search."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from policies.block_index import BlockIndex


class CountingDict(dict[int, int]):
    """The index's holders, counting the probes a lookup makes."""

    probes = 0

    def get(self, key: int, default: int = 0) -> int:  # type: ignore[override]
        CountingDict.probes += 1
        return super().get(key, default)


def conversation(system: int, conv: int, blocks: int) -> list[int]:
    """A system prompt's 8 blocks, then the conversation's own; turn k + 1 extends turn k."""
    return [hash(("sys", system, j)) if j < 8 else hash(("conv", system, conv, j)) for j in range(blocks)]


# (op, system, conversation, blocks, slot): "add" a turn, "evict" down to `blocks` entries,
# "free" a slot (a worker removed; the next new slot reuses it)
OPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "add", "add", "evict", "free"]),
        st.integers(0, 2),
        st.integers(0, 3),
        st.integers(1, 40),
        st.integers(0, 4),
    ),
    min_size=1,
    max_size=50,
)


@settings(max_examples=150, deadline=None)
@given(OPS, st.integers(0, 2**32 - 1), st.sampled_from([2, 5, 1 << 16]))
def test_hinted_levels_are_the_searched_ones(
    ops: list[tuple[str, int, int, int, int]], seed: int, branches: int
) -> None:
    rng = random.Random(seed)
    small = type("Small", (BlockIndex,), {"__slots__": (), "BRANCHES": branches})
    hinted, plain = small(prefix_closed=True), BlockIndex()  # a small table overflows (cleared)
    for index in (hinted, plain):
        for _ in range(5):
            index.new_slot()
    for op, system, conv, blocks, slot in ops:
        for index in (hinted, plain):
            if op == "add":
                index.add(slot, conversation(system, conv, blocks))
            elif op == "evict":
                over = index.slot_entries(slot) - blocks
                if over > 0:
                    index.evict(slot, over)
            else:
                index.free_slot(slot)
                assert index.new_slot() == slot  # re-added: the freed slot, empty
        for _ in range(3):
            ask = conversation(rng.randrange(3), rng.randrange(4), rng.randrange(1, 48))
            assert hinted.levels_rest(ask, 16) == plain.levels_rest(ask, 16)
            assert hinted.levels_rest(ask, 2) == plain.levels_rest(ask, 2)
            for slot in range(5):
                assert hinted.depth(ask, 1 << slot) == plain.depth(ask, 1 << slot)


def test_a_continuing_conversation_is_found_in_a_few_probes() -> None:
    """Ten turns of one conversation on worker 0 beside the system prompt on workers 1-3: each
    turn's lookup (the last turn plus a new message) finds the conversation's level by hopping
    along its turns' branch hints (two hops at most, two probes each), not a galloping search."""
    index = BlockIndex(prefix_closed=True)
    for _ in range(4):
        index.new_slot()
    for slot in (1, 2, 3):
        index.add(slot, conversation(0, 9 + slot, 12))  # other conversations: the system level
    index.levels_rest(conversation(0, 9, 10), 16)  # the system prompt's depth, remembered
    plain = BlockIndex()
    for _ in range(4):
        plain.new_slot()
    for slot in (1, 2, 3):
        plain.add(slot, conversation(0, 9 + slot, 12))
    holders = CountingDict(index._holders)
    index._holders = holders
    blocks = 8
    for turn in range(10):
        prompt = conversation(0, 0, blocks + 37)  # the history, then this turn's new blocks
        CountingDict.probes = 0
        got = index.levels_rest(prompt, 16)
        assert got == plain.levels_rest(prompt, 16)
        if turn > 0:
            assert got[0][0] == (1, blocks)  # worker 0 holds the conversation so far
            assert CountingDict.probes <= 12, (turn, CountingDict.probes)
        blocks += 37
        index.add(0, prompt)
        plain.add(0, prompt)


def test_without_hints_the_same_lookup_searches() -> None:
    """The probe count above is the hints' doing: an index that keeps none probes more."""
    index = BlockIndex(prefix_closed=True)
    for _ in range(4):
        index.new_slot()
    for slot in (1, 2, 3):
        index.add(slot, conversation(0, 9 + slot, 12))
    index.levels_rest(conversation(0, 9, 10), 16)
    index.add(0, conversation(0, 0, 8 + 37 * 3))
    index._branches = None
    index._holders = CountingDict(index._holders)
    CountingDict.probes = 0
    assert index.levels_rest(conversation(0, 0, 8 + 37 * 4), 16)[0][0] == (1, 8 + 37 * 3)
    assert CountingDict.probes > 12
