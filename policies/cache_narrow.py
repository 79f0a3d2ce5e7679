"""How `cache_aware` narrows a large pool to its matched workers plus a random sample, without a
pass over the pool (`PositionMemo`, `narrow`; policies/cache_aware.py uses them)."""

from __future__ import annotations

import random as _random
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from policies.snapshot import WorkerState


class PositionMemo:
    """Where the workers sit in the candidate lists a selector is handed, so that a large pool is
    narrowed to its matched workers without a pass over it (a cache that never changes a result
    it is checked for).

    A layout is recognised by its length and its first and last worker ids (a worker's state
    changes with every request it starts or ends; its place does not); a position is used only
    after checking that the worker is there. A worker the layout did not have when it was
    mapped is taken as absent without a check: the one case a changed layout could go unnoticed
    (two retries excluding different workers of equal count in turn), which can only leave a
    matched worker out of one decision's candidates, never admit an invalid one. So that this
    cannot last, each use checks a few more positions of the layout against its map, round the
    whole layout every `refresh_every` uses, and maps it again where one moved (the cost spread
    over the uses: no decision pays for a pass over the pool). Up to `layouts` layouts are kept
    (a prefill role sees one per decode engine)."""

    __slots__ = ("_maps", "layouts", "refresh_every")

    def __init__(self, refresh_every: int = 256, layouts: int = 8) -> None:
        self.refresh_every = refresh_every
        self.layouts = layouts
        # (len, first id, last id) -> [position by id, ids by position, next position to check,
        # the states seen by position]
        self._maps: OrderedDict[tuple[int, str, str], list[Any]] = OrderedDict()

    def find(self, cands: Sequence[WorkerState], wanted: Iterable[str]) -> list[WorkerState]:
        """The candidates whose id is in `wanted`, in `wanted`'s order (`narrow` without a
        sample)."""
        return narrow(cands, [(wid, 0) for wid in wanted], 0, None, self)

    def _map(self, cands: Sequence[WorkerState], shape: tuple[int, str, str]) -> list[Any]:
        ids = [w.id for w in cands]
        entry = [{wid: i for i, wid in enumerate(ids)}, ids, 0, list(cands)]
        maps = self._maps
        maps[shape] = entry
        maps.move_to_end(shape)
        if len(maps) > self.layouts:
            maps.popitem(last=False)
        return entry


def narrow(
    cands: Sequence[WorkerState],
    wanted: Iterable[tuple[str, int]],
    sample: int,
    rng: _random.Random | None,
    memo: PositionMemo,
) -> list[WorkerState]:
    """Of a large pool, the workers of `wanted` (a lookup's `top` rows) in order, then `sample`
    random others. One function, layout check included: it runs cold, every frame counts."""
    n = len(cands)
    shape = (n, cands[0].id, cands[-1].id)
    entry = memo._maps.get(shape)
    if entry is None:
        entry = memo._map(cands, shape)
    else:
        at = entry[2]
        upto = min(at + n // memo.refresh_every + 1, n)
        ids, states = entry[1], entry[3]  # states last seen there: same object, same worker
        for k in range(at, upto):
            w = cands[k]
            if w is not states[k]:
                if w.id != ids[k]:
                    entry = memo._map(cands, shape)
                    break
                states[k] = w
        else:
            entry[2] = upto if upto < n else 0
    pos: dict[str, int] = entry[0]
    pool: list[WorkerState] = []
    seen: set[str] = set()
    for wid, _ in wanted:
        i = pos.get(wid)
        if i is None:
            continue
        w = cands[i]
        if w.id != wid:  # moved: map this layout again
            pos = memo._map(cands, shape)[0]
            i = pos.get(wid)
            if i is None:
                continue
            w = cands[i]
        seen.add(wid)
        pool.append(w)
    if not sample or rng is None:
        return pool
    if type(rng) is _random.Random:
        # `rng.randrange(n)`'s draws (CPython's `_randbelow_with_getrandbits`, which a test
        # compares), without its two Python frames per draw
        getrandbits = rng.getrandbits
        bits = n.bit_length()
        for _ in range(sample):
            i = getrandbits(bits)
            while i >= n:
                i = getrandbits(bits)
            w = cands[i]
            if w.id not in seen:
                seen.add(w.id)
                pool.append(w)
        return pool
    return _draw(cands, sample, rng, seen, pool)


def _draw(
    cands: Sequence[WorkerState],
    sample: int,
    rng: _random.Random,
    seen: set[str],
    pool: list[WorkerState],
) -> list[WorkerState]:
    """`pool` with `sample` draws of `rng.randrange` added that are not in `seen` (any rng)."""
    n = len(cands)
    for _ in range(sample):
        w = cands[rng.randrange(n)]
        if w.id not in seen:
            seen.add(w.id)
            pool.append(w)
    return pool
