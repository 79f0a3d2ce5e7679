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
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from policies.block_index import BlockIndex, iter_bits
from policies.prompt_key import PromptKey

if TYPE_CHECKING:
    from policies.base import PolicyEvent


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


@runtime_checkable
class PendingSink(Protocol):
    """A source that also counts the prompts routed to a worker until its engine reports them
    stored (the precise index's pending overlay, gateway/kvevents/pending.py): told, after the
    policy's own bookkeeping, what was routed and what ended."""

    def observe(self, event: PolicyEvent) -> None: ...


class IndexLookup:
    """A `Lookup` over one `BlockIndex` for one request's chain of block keys."""

    __slots__ = (
        "_groups",
        "_ids",
        "_index",
        "_keys",
        "_known",
        "_max",
        "_slot_of",
        "_tokens",
        "_tokens_per_block",
        "_top",
    )

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
        self._ids = ids_of_slot
        self._max = max_candidates
        # the deepest matches, found when first asked for (a large pool's search reads
        # `groups` instead, and never pays for them)
        self._tokens: dict[str, int] | None = None  # worker id -> cached tokens, of `_top`
        self._top: list[tuple[str, int]] = []
        # every level found (`BlockIndex.levels_rest`), where they are exact (no `known`: the
        # approximate index, whose slots are prefix-closed) and name every holder: a worker's
        # depth is then its level's, read with a bit test rather than a search of the chain
        self._groups: list[tuple[int, int]] | None = None

    def _levels(self) -> dict[str, int]:
        tokens_of: dict[str, int] = {}
        top = self._top
        known = self._known
        ids_of_slot = self._ids
        max_candidates = self._max
        levels, rest = self._index.levels_rest(self._keys, max_candidates)
        if not rest and known is None:
            self._groups = levels
        for mask, depth in levels:
            bits = mask.bit_count()
            if len(tokens_of) + bits > max_candidates:
                break  # a group too big to list (a prefix everyone holds): asked per worker
            tokens = int(depth * self._tokens_per_block)
            while mask:  # its slots, lowest first (`iter_bits`, without a generator's frame)
                if bits > 1:
                    low = mask & -mask
                    mask ^= low
                    bits -= 1
                else:  # the last one (often the only one): no big-int arithmetic
                    low, mask = mask, 0
                wid = ids_of_slot[low.bit_length() - 1]
                if wid is None or (known is not None and not known(wid)):
                    continue
                tokens_of[wid] = tokens
                top.append((wid, tokens))
        self._tokens = tokens_of
        return tokens_of

    @property
    def top(self) -> Sequence[tuple[str, int]]:
        if self._tokens is None:
            self._levels()
        return self._top

    def listed(self) -> Mapping[str, int]:
        """The cached tokens of the workers `top` lists: what `cached_tokens` answers for them
        (a decision's loop reads this dict, not a method call per candidate)."""
        tokens_of = self._tokens
        return tokens_of if tokens_of is not None else self._levels()

    def cached_tokens(self, worker_id: str) -> int | None:
        tokens_of = self._tokens
        if tokens_of is None:
            tokens_of = self._levels()
        got = tokens_of.get(worker_id)
        if got is not None:  # listed: a worker the source knows
            return got
        if self._known is not None and not self._known(worker_id):
            return None
        slot = self._slot_of.get(worker_id)
        if slot is None:
            return 0
        groups = self._groups
        if groups is None:
            depth = self._index.depth(self._keys, 1 << slot)
        else:
            depth = 0
            for mask, d in groups:
                if (mask >> slot) & 1:
                    depth = d
                    break
        return int(depth * self._tokens_per_block)

    def groups(self) -> list[tuple[int, int]] | None:
        """Every worker slot holding a prefix of the chain, grouped by how deep: `(slot mask,
        cached tokens)` pairs, deepest first, each slot in one group (its `cached_tokens`: a slot
        in no group holds none). None where a slot breaks the index's prefix invariant (the
        groups would not be exact) or the source knows only some workers (`known`)."""
        if self._known is not None:
            return None
        keys = self._keys
        if not keys:
            return []
        levels, rest = self._index.levels_rest(keys, len(keys) + 1)
        if rest:
            return None
        tpb = self._tokens_per_block
        return [(m, int(d * tpb)) for m, d in levels]

    def named(self, limit: int) -> list[str] | None:
        """The workers this lookup may say hold some of the prompt (those it knows and whose slot
        holds its first block); None when more than `limit`."""
        keys = self._keys
        if not keys:
            return []
        mask = self._index.holders(keys[0])
        if mask.bit_count() > limit:
            return None
        ids = self._ids
        return [wid for slot in iter_bits(mask) if (wid := ids[slot]) is not None]

    @property
    def slot_of(self) -> Mapping[str, int]:
        return self._slot_of


class NoLookup:
    """The `Lookup` of a request without a key: nothing is known to be cached anywhere."""

    top: Sequence[tuple[str, int]] = ()

    def cached_tokens(self, worker_id: str) -> int | None:
        return 0

    def groups(self) -> list[tuple[int, int]] | None:
        return []

    def named(self, limit: int) -> list[str] | None:
        return []

    @property
    def slot_of(self) -> Mapping[str, int]:
        return {}


NO_LOOKUP = NoLookup()  # a request without a key
EMPTY_LOOKUP = NoLookup()  # a keyed request where nothing is indexed yet
