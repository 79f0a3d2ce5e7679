"""`BlockIndex.add` of a chain its slot already holds (a prompt touched again when its answer
ends, `lru_touch = "done"`) takes a fast path; the LRU order after it is the plain loop's, whether
the slot holds the whole chain, part of it or none."""

from __future__ import annotations

import pytest

from policies.block_index import BlockIndex

X = [11, 12, 13, 14]  # a chain, parent first
Y = [21, 22, 23]


# (what the slot held, oldest first, as chains added in order; the chain added again) ->
# (new entries, the slot's keys after it, least recently used first)
@pytest.mark.parametrize(
    ("held", "again", "new", "order"),
    [
        ([X, Y], X, 0, [23, 22, 21, 14, 13, 12, 11]),  # whole chain held: moved, deepest first
        ([X, Y], X[:2], 0, [14, 13, 23, 22, 21, 12, 11]),  # a held prefix
        ([X[:2], Y], X, 2, [23, 22, 21, 14, 13, 12, 11]),  # its tail is new: the fast path fails
        ([Y], X, 4, [23, 22, 21, 14, 13, 12, 11]),  # none held
        ([X, Y], [], 0, [14, 13, 12, 11, 23, 22, 21]),  # nothing to touch
    ],
)
def test_adding_a_held_chain_again_moves_it_to_the_newest(
    held: list[list[int]], again: list[int], new: int, order: list[int]
) -> None:
    ix = BlockIndex(prefix_closed=True)
    s = ix.new_slot()
    for chain in held:
        ix.add(s, chain)
    before = ix.entries
    assert ix.add(s, again) == new
    assert ix.slot_keys(s) == order
    assert ix.entries == before + new
    assert all(ix.holders(k) == 1 for k in order)


def test_a_held_chain_evicts_its_tail_first_after_it_is_touched() -> None:
    ix = BlockIndex(prefix_closed=True)
    s = ix.new_slot()
    ix.add(s, X)
    ix.add(s, Y)
    ix.add(s, X)  # X is the newest now
    assert ix.evict(s, 3) == 3
    assert ix.slot_keys(s) == [14, 13, 12, 11]
