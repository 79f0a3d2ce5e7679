"""Where the cache-aware policy learns which workers hold a prompt's prefix.

A `PrefixSource` answers, for one request, with a `Lookup`: the workers holding the deepest
matches (`top`) and, for any worker, the prompt tokens it is predicted to hold
(`cached_tokens`, None when the source knows nothing about that worker). Two sources exist:

- `policies.approx_index.ApproxIndex`: what the gateway itself sent where (always available);
- the precise index built from the engines' KV events (`gateway.kvevents`), which knows only
  the workers whose event stream is live and verified, and says None for the others, so the
  policy falls back to the approximate index per worker, never routing on a stale or
  misaligned precise index.

`IndexLookup` is the `Lookup` of one `BlockIndex` for one chain of block keys.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from policies.block_index import BlockIndex, iter_bits
from policies.prompt_key import PromptKey


class Lookup(Protocol):
    @property
    def top(self) -> Sequence[tuple[str, int]]:
        """(worker id, cached tokens) of the deepest matches, deepest first (bounded)."""
        ...

    def cached_tokens(self, worker_id: str) -> int | None:
        """Prompt tokens the worker is predicted to hold; None: this source does not know it."""
        ...


class PrefixSource(Protocol):
    @property
    def name(self) -> str: ...

    def lookup(self, model: str, key: PromptKey, max_candidates: int) -> Lookup | None:
        """None when the source has nothing for this model or kind of prompt."""
        ...

    def outcome(self, worker_id: str, predicted: int, reported: int) -> None:
        """A request this source predicted `predicted` cached tokens for on the worker found
        `reported` (the engine's own count): how the source checks itself."""
        ...


class IndexLookup:
    """A `Lookup` over one `BlockIndex` for one request's chain of block keys."""

    __slots__ = ("_depths", "_index", "_keys", "_known", "_slot_of", "_tokens_per_block", "top")

    def __init__(
        self,
        index: BlockIndex,
        keys: Sequence[int],
        slot_of: Mapping[str, int],
        ids_of_slot: Sequence[str | None],
        tokens_per_block: float,
        max_candidates: int,
        known: Callable[[str], bool] | None = None,
    ) -> None:
        self._index = index
        self._keys = keys
        self._slot_of = slot_of
        self._tokens_per_block = tokens_per_block
        self._known = known
        depths: dict[str, int] = {}
        top: list[tuple[str, int]] = []
        for mask, depth in index.levels(keys, max_candidates):
            if len(depths) + mask.bit_count() > max_candidates:
                break  # a group too big to list (a prefix everyone holds): asked per worker
            tokens = int(depth * tokens_per_block)
            for slot in iter_bits(mask):
                wid = ids_of_slot[slot]
                if wid is None or (known is not None and not known(wid)):
                    continue
                depths[wid] = depth
                top.append((wid, tokens))
        self._depths = depths
        self.top: Sequence[tuple[str, int]] = top

    def cached_tokens(self, worker_id: str) -> int | None:
        if self._known is not None and not self._known(worker_id):
            return None
        depth = self._depths.get(worker_id)
        if depth is None:
            slot = self._slot_of.get(worker_id)
            if slot is None:
                return 0
            depth = self._index.depth(self._keys, 1 << slot)
        return int(depth * self._tokens_per_block)


class NoLookup:
    """The `Lookup` of a request without a key: nothing is known to be cached anywhere."""

    top: Sequence[tuple[str, int]] = ()

    def cached_tokens(self, worker_id: str) -> int | None:
        return 0


NO_LOOKUP = NoLookup()  # a request without a key
EMPTY_LOOKUP = NoLookup()  # a keyed request where nothing is indexed yet
