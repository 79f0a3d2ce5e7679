"""The approximate prefix index: what the gateway sent to each worker, bounded and aged out.

One `BlockIndex` per model (requests of different models never share a cache). A request is
keyed by `PromptKey.approx_chain`: blocks of `block_tokens` token ids, or of
`block_tokens * chars_per_token` bytes of (canonically rendered) text. When a request is routed,
its whole chain is recorded for the worker that prefills it.

Bounds, both enforced as entries are added (the index never grows past them, unlike a periodic
sweep that lets it burst between sweeps):

- **a model of each worker's KV capacity**: a worker holds at most `capacity_tokens /
  block_tokens` entries (its engine's KV size where the snapshot reports it, else the configured
  `worker_cache_tokens`), its least recently used ones are forgotten first, as the engine's LRU
  evicts them (the policy passes the part of the pool its requests in flight leave evictable,
  policies/cache_state.py, and records a prompt when its prefill ends). The capacity is
  corrected from what engines report: a request predicted to find
  `P` tokens cached that found fewer means the engine holds less than modelled, so that worker's
  capacity shrinks (x0.9, and its oldest entries go); accurate predictions let it grow back
  (x1.02) to the configured size;
- **a budget for the whole index** (`max_tree_size` tokens per model, sglang-router's knob): past
  it, the worker with the most entries loses its oldest ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.block_index import BlockIndex
from policies.prefix_source import IndexLookup, Lookup
from policies.prompt_key import PromptKey


@dataclass(slots=True)
class _ModelIndex:
    index: BlockIndex
    slot_of: dict[str, int]
    ids: list[str | None]


class ApproxIndex:
    """The approximate `PrefixSource` (see the module docstring)."""

    name = "approx"

    def __init__(
        self,
        *,
        block_tokens: int = 16,
        chars_per_token: float = 4.0,
        budget_tokens: int = 1 << 24,
        min_capacity_fraction: float = 0.05,
    ) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        self.block_tokens = block_tokens
        self.block_bytes = max(1, round(block_tokens * chars_per_token))
        self.budget_entries = max(1, budget_tokens // block_tokens)
        self.min_capacity_fraction = min_capacity_fraction
        self._models: dict[str, _ModelIndex] = {}
        # worker -> capacity scale in (min_capacity_fraction, 1], corrected by feedback
        self._scale: dict[str, float] = {}
        self.evicted_capacity = 0  # entries forgotten because a worker's cache is full
        self.evicted_budget = 0  # entries forgotten because the index is at its budget

    # -- keys ---------------------------------------------------------------------------------

    def units(self, key: PromptKey) -> int:
        return self.block_tokens if key.kind == "tokens" else self.block_bytes

    def chain(self, key: PromptKey) -> tuple[int, ...]:
        return key.approx_chain(self.units(key))

    # -- PrefixSource ---------------------------------------------------------------------------

    def lookup(self, model: str, key: PromptKey, max_candidates: int) -> Lookup | None:
        m = self._models.get(model)
        if m is None:
            return None
        units = self.block_tokens if key.kind == "tokens" else self.block_bytes  # (`chain`, inlined)
        return IndexLookup(
            m.index, key.approx_chain(units), m.slot_of, m.ids, self.block_tokens, max_candidates
        )

    def cached_tokens(self, model: str, worker_id: str, key: PromptKey) -> int:
        m = self._models.get(model)
        slot = None if m is None else m.slot_of.get(worker_id)
        if m is None or slot is None:
            return 0
        return m.index.depth(self.chain(key), 1 << slot) * self.block_tokens

    # -- updates ------------------------------------------------------------------------------

    def _slot(self, model: str, worker_id: str) -> tuple[_ModelIndex, int]:
        m = self._models.get(model)
        if m is None:
            m = self._models[model] = _ModelIndex(BlockIndex(prefix_closed=True), {}, [])
        slot = m.slot_of.get(worker_id)
        if slot is None:
            slot = m.slot_of[worker_id] = m.index.new_slot()
            if slot == len(m.ids):
                m.ids.append(worker_id)
            else:
                m.ids[slot] = worker_id
        return m, slot

    def capacity_entries(self, worker_id: str, capacity_tokens: int | None) -> int | None:
        if capacity_tokens is None:
            return None
        scale = self._scale.get(worker_id, 1.0)
        return max(1, int(capacity_tokens * scale) // self.block_tokens)

    def insert(
        self, model: str, worker_id: str, key: PromptKey, capacity_tokens: int | None, upto: int | None = None
    ) -> None:
        """The worker holds this prompt's blocks (`upto`: its first `upto` tokens only)."""
        chain = self.chain(key)
        if upto is not None:
            chain = chain[: upto // self.block_tokens]
        if not chain:
            return
        m, slot = self._slot(model, worker_id)
        index = m.index
        index.add(slot, chain)
        cap = self.capacity_entries(worker_id, capacity_tokens)
        if cap is not None:
            over = index.slot_entries(slot) - cap
            if over > 0:
                self.evicted_capacity += index.evict(slot, over)
        if index.entries > self.budget_entries:
            self._trim(m, slot)

    def fit(self, model: str, worker_id: str, capacity_tokens: int | None) -> int:
        """Forget the worker's least recently used entries past `capacity_tokens` (what its
        engine can keep cached now); returns how many were forgotten."""
        m = self._models.get(model)
        slot = None if m is None else m.slot_of.get(worker_id)
        cap = self.capacity_entries(worker_id, capacity_tokens)
        if m is None or slot is None or cap is None:
            return 0
        over = m.index.slot_entries(slot) - cap
        if over <= 0:
            return 0
        dropped = m.index.evict(slot, over)
        self.evicted_capacity += dropped
        return dropped

    def _trim(self, m: _ModelIndex, keep: int) -> None:
        # down to a little under the budget (so that the pass over the slots to find the
        # largest is not paid on every insert): the oldest entries of the largest worker other
        # than the one just written to (`keep`: its newest prompt stays), then its own
        index = m.index
        target = self.budget_entries - self.budget_entries // 64
        while index.entries > target:
            others = [s for s in m.slot_of.values() if s != keep and index.slot_entries(s)]
            slot = max(others, key=index.slot_entries) if others else keep
            n = min(index.entries - target, max(1, index.slot_entries(slot) // 8))
            dropped = index.evict(slot, n)
            self.evicted_budget += dropped
            if not dropped:
                break

    def feedback(
        self,
        model: str,
        worker_id: str,
        predicted: int,
        reported: int,
        capacity_tokens: int | None,
        *,
        queued: bool = False,
    ) -> None:
        """An engine reported `reported` cached tokens where this index predicted `predicted`.

        `queued`: the worker had prefill work queued ahead of the request when it was routed. A
        shortfall is then no measure of its cache: the prefix predicted may have been one still
        being computed there (recorded when routed), which an engine that matched the request
        at admission computed again. Shrinking the modelled pool for it forgot the oldest
        prefixes the worker did hold (Mooncake replay, 4 colocated SGLang workers: 70 of 82
        over-predictions of a prefix in flight had a queue, 3 of 22 evictions the model missed
        had one), and each shortfall took 10 % off, so a burst of them on a busy worker took a
        third of its index, and turns away from it."""
        if capacity_tokens is None:
            return
        scale = self._scale.get(worker_id, 1.0)
        short = reported + self.block_tokens < predicted
        if short and queued:
            return
        if short:  # the engine holds less than modelled
            scale = max(self.min_capacity_fraction, scale * 0.9)
            self._scale[worker_id] = scale
            m = self._models.get(model)
            slot = None if m is None else m.slot_of.get(worker_id)
            if m is not None and slot is not None:
                cap = self.capacity_entries(worker_id, capacity_tokens)
                over = m.index.slot_entries(slot) - (cap or 0)
                if cap is not None and over > 0:
                    self.evicted_capacity += m.index.evict(slot, over)
        elif scale < 1.0:
            self._scale[worker_id] = min(1.0, scale * 1.02)

    def outcome(self, worker_id: str, predicted: int, reported: int) -> None:
        """(`PrefixSource`; the policy calls `feedback`, which also knows the model and capacity.)"""

    def forget(self, worker_id: str) -> int:
        """Drop everything known about a worker (removed, or restarted with an empty cache)."""
        dropped = 0
        for m in self._models.values():
            slot = m.slot_of.pop(worker_id, None)
            if slot is not None:
                dropped += m.index.free_slot(slot)
                m.ids[slot] = None
        self._scale.pop(worker_id, None)
        return dropped

    # -- stats --------------------------------------------------------------------------------

    @property
    def entries(self) -> int:
        return sum(m.index.entries for m in self._models.values())

    def worker_entries(self, worker_id: str) -> int:
        total = 0
        for m in self._models.values():
            slot = m.slot_of.get(worker_id)
            if slot is not None:
                total += m.index.slot_entries(slot)
        return total

    def memory_bytes(self) -> int:
        return sum(m.index.memory_bytes() for m in self._models.values())
