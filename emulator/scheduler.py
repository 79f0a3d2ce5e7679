"""The engine: admission against KV capacity, prefix cache, prefill, continuous-batching decode.

Two execution modes share the same state (block pool, prefix cache, counters):

* timed (``time_scale > 0``): one engine loop runs steps. A step takes prefill work (chunked:
  at most the :class:`StepPolicy`'s token budget) and one token for every decoding sequence,
  sleeps ``timing.mixed_step_time(...) x time_scale``, then hands out the results: a sequence's
  first token when its prefill's last chunk ends (it is sampled in that forward pass), one more
  token per decode step. :class:`StepPolicy` is how each engine's scheduler builds a step:

  - vLLM 0.32 (``Scheduler.schedule``, v1/core/sched/scheduler.py: the RUNNING requests first,
    then the WAITING ones, under ``max_num_batched_tokens``, 8192 on H100/H200 for the API
    server, engine/arg_utils.py): every step decodes every running sequence and prefills a chunk
    with the budget left;
  - SGLang 0.5.23 (``get_next_batch_to_run``, managers/scheduler.py, with ``enable_mixed_chunk``
    off and ``prefill_decode_interval`` 0 by default): a step with prefill work (at most
    ``chunked_prefill_size`` tokens, 8192 on 80-141 GB GPUs, arg_groups/memory_hook.py) is a
    prefill step only; the running decodes wait until no prefill is left (a chunked request in
    progress keeps the next step a prefill step), on a colocated server as on a prefill server;

  a prompt's full blocks enter the prefix cache as its chunks are computed, not only when its
  prefill ends (:class:`StepPolicy` ``cache_at_schedule``), so that a prompt sharing the prefix
  and scheduled later (a conversation's next turn queued behind its predecessor) reads them;
* zero-delay (``time_scale == 0``): prefill completes at once and tokens are produced directly by
  the consumer, with no sleeps and no per-token task switches - the mode for overhead benchmarks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable
from typing import TypeVar

from emulator import model, timing
from emulator.kvcache import BlockPool
from emulator.profiles import Profile

T = TypeVar("T")


class StepPolicy:
    """How a step is built: `chunk_tokens` of prefill at most per step; `prefill_first`: a step
    with prefill work decodes nothing (SGLang), else the decodes ride along and take their
    tokens out of the budget first (vLLM).

    When an unfinished prefill's full blocks enter the prefix cache: `cache_at_schedule` as its
    chunk is scheduled, so that a prompt scheduled after it in the same step reads them (vLLM
    v1: ``KVCacheManager.allocate_slots`` ends with ``cache_blocks(request, min(computed + new,
    num_tokens))``, v1/core/kv_cache_manager.py), else once the chunk is computed, before the
    next step is formed (SGLang: the scheduler calls ``tree_cache.cache_unfinished_req`` on the
    chunked request as it builds the next batch, managers/scheduler.py, and
    ``RadixCache.cache_unfinished_req`` inserts the filled, page-aligned tokens into the radix
    tree, mem_cache/radix_cache.py)."""

    __slots__ = ("cache_at_schedule", "chunk_tokens", "prefill_first")

    def __init__(self, chunk_tokens: int, prefill_first: bool, cache_at_schedule: bool = False) -> None:
        self.chunk_tokens = chunk_tokens
        self.prefill_first = prefill_first
        self.cache_at_schedule = cache_at_schedule

    @classmethod
    def of(cls, engine: str, profile: Profile) -> StepPolicy:
        if engine == "sglang":
            return cls(profile.chunk_tokens, prefill_first=True)
        return cls(profile.batched_tokens, prefill_first=False, cache_at_schedule=True)


class EngineDead(Exception):
    """The emulated engine core died (vLLM's fatal path); every request fails from now on."""


class Aborted(Exception):
    pass


class TooLarge(Exception):
    """The request can never fit in the KV pool."""


class Counters:
    def __init__(self) -> None:
        self.received = 0
        self.completed = 0
        self.aborted = 0
        self.errors = 0
        self.kv_transfers_ok = 0
        self.kv_transfers_failed = 0
        self.kv_bytes_transferred = 0
        self.kv_transfer_seconds = 0.0
        self.cached_tokens_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.external_kv_tokens = 0
        self.local_compute_tokens = 0
        self.bootstrap_failed = 0
        self.kv_expired = 0
        self.in_flight = 0
        self.in_transfer = 0


class Seq:
    __slots__ = (
        "aborted",
        "blocks",
        "cached_tokens",
        "chunk_blocks",
        "chunk_cache",
        "credits",
        "event",
        "finished",
        "hashes",
        "kv_valid",
        "max_cached",
        "max_new",
        "n_prompt_blocks",
        "prefill_future",
        "prefill_left",
        "prompt",
        "rid",
        "sample_seed",
        "state",
        "t_first",
        "t_received",
        "t_started",
    )

    def __init__(self, rid: str, prompt: list[int], max_new: int, sample_seed: int | None) -> None:
        self.rid = rid
        self.prompt = prompt
        self.max_new = max_new
        self.sample_seed = sample_seed
        self.hashes: list[bytes] = []
        self.blocks: list[int] = []
        self.n_prompt_blocks = 0
        self.cached_tokens = 0
        self.max_cached = 0  # prompt blocks it may read from the prefix cache
        self.chunk_cache = False  # its chunks' full blocks enter the prefix cache as computed
        self.chunk_blocks = 0  # prompt blocks written and registered by its chunks so far
        self.kv_valid = True
        self.state = 0
        self.aborted = False
        self.finished = False
        self.credits = 0
        self.event: asyncio.Event | None = None
        self.prefill_future: asyncio.Future[None] | None = None
        self.prefill_left = 0
        self.t_received = time.time()
        self.t_started = 0.0
        self.t_first = 0.0

    @property
    def prompt_blocks(self) -> list[int]:
        return self.blocks[: self.n_prompt_blocks]

    @property
    def last_block(self) -> int:
        return self.blocks[self.n_prompt_blocks - 1]


class Engine:
    def __init__(
        self,
        profile: Profile,
        *,
        role: str,
        time_scale: float,
        seed: int,
        num_blocks: int,
        block_size: int,
        max_running: int | None = None,
        policy: StepPolicy | None = None,
    ) -> None:
        self.profile = profile
        self.role = role
        self.policy = policy or StepPolicy(profile.batched_tokens, prefill_first=False)
        self.time_scale = time_scale
        self.seed = seed
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, block_size)
        self.max_running = max_running or profile.max_running
        self.counters = Counters()
        self.seqs: dict[str, Seq] = {}
        self.waiting = 0
        self.decoding: list[Seq] = []
        self.prefill_queue: list[Seq] = []
        self.dead = False
        self._freed = asyncio.Event()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._step: asyncio.Future[None] | None = None  # the step running now (timed mode)
        self.last_step_s = 0.0
        self.steps = 0  # steps run (timed mode)

    @property
    def zero_delay(self) -> bool:
        return self.time_scale <= 0.0

    def start(self) -> None:
        if not self.zero_delay and self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
            self._loop_task = None

    # ------------------------------------------------------------------ admission
    @property
    def num_running(self) -> int:
        return len(self.seqs)

    def check_fits(self, prompt_len: int, max_new: int) -> None:
        """Raise :class:`TooLarge` when a sequence could never fit in the KV pool."""
        if model.num_blocks(prompt_len + max_new, self.block_size) > self.pool.num_blocks:
            raise TooLarge(
                f"Request requires too many KV tokens: {prompt_len + max_new} > "
                f"{self.pool.num_blocks * self.block_size} (max_total_num_tokens)"
            )

    async def admit(self, seq: Seq, *, read_cache: bool = True) -> None:
        """Reserve KV blocks for prompt + max_new, reusing the cached prefix (unless not
        `read_cache`: a request scoring its prompt computes all of it). Waits when full."""
        if self.dead:
            raise EngineDead()
        bs = self.block_size
        self.check_fits(len(seq.prompt), seq.max_new)
        seq.hashes = model.chain_hashes(seq.prompt, bs)
        n_prompt = len(seq.hashes)
        total = model.num_blocks(len(seq.prompt) + seq.max_new, bs)
        max_cached = (len(seq.prompt) - 1) // bs if read_cache else 0
        self.waiting += 1
        try:
            while True:
                if self.dead:
                    raise EngineDead()
                if seq.aborted:
                    raise Aborted()
                if len(self.seqs) < self.max_running:
                    cached = self.pool.match_prefix(seq.hashes, max_cached)
                    rest = self.pool.allocate(total - len(cached))
                    if rest is not None:
                        break
                    self.pool.free(cached)
                self._freed.clear()
                await self._freed.wait()
        finally:
            self.waiting -= 1
        self.pool.queries += len(seq.prompt)
        self.pool.hits += len(cached) * bs
        seq.blocks = cached + rest
        seq.n_prompt_blocks = n_prompt
        seq.cached_tokens = len(cached) * bs
        seq.max_cached = max_cached
        seq.t_started = time.time()
        self.seqs[seq.rid] = seq
        self.counters.cached_tokens_total += seq.cached_tokens
        self.counters.prompt_tokens_total += len(seq.prompt)

    def release(self, seq: Seq, *, keep_prompt: bool = False) -> list[int]:
        """Free the sequence's blocks (or all but the prompt blocks, returned to the caller)."""
        if self.seqs.pop(seq.rid, None) is None and not seq.blocks:
            return []
        kept: list[int] = []
        if keep_prompt:
            kept = seq.prompt_blocks
            self.pool.free(seq.blocks[seq.n_prompt_blocks :])
        else:
            self.pool.free(seq.blocks)
        seq.blocks = []
        self._freed.set()
        return kept

    def free_blocks(self, blocks: list[int]) -> None:
        self.pool.free(blocks)
        self._freed.set()

    # ------------------------------------------------------------------ prefill
    async def prefill(self, seq: Seq, *, truncate_to: int | None = None) -> None:
        """Compute the prompt's KV locally (only the uncached part costs time)."""
        new_tokens = len(seq.prompt) - seq.cached_tokens
        self.counters.local_compute_tokens += new_tokens
        if not self.zero_delay and new_tokens > 0:
            seq.prefill_left = new_tokens
            # a prefill that computes only part of its prompt's KV (the truncation fault)
            # registers nothing before its end shows what it wrote
            seq.chunk_cache = truncate_to is None
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            seq.prefill_future = fut
            self.prefill_queue.append(seq)
            self._wake.set()
            try:
                await fut
            finally:
                seq.prefill_future = None
                if seq in self.prefill_queue:
                    self.prefill_queue.remove(seq)
        if self.dead:
            raise EngineDead()
        self.write_prompt_kv(seq, truncate_to=truncate_to)

    def write_prompt_kv(self, seq: Seq, *, truncate_to: int | None = None) -> None:
        bs = self.block_size
        first = max(seq.cached_tokens // bs, seq.chunk_blocks)
        if truncate_to is not None:
            # only the first ``truncate_to`` tokens' KV is computed (SGLang #30233 shape)
            partial = model.chain_hashes(seq.prompt[:truncate_to], bs)
            for i, h in enumerate(partial):
                if i >= first:
                    self.pool.write(seq.blocks[i], h)
            seq.kv_valid = False
        else:
            for i in range(first, seq.n_prompt_blocks):
                self.pool.write(seq.blocks[i], seq.hashes[i])
            self.register_full_blocks(seq, first)
        self.set_state(seq)

    def cache_chunks(self, seq: Seq, computed: int) -> None:
        """Write and register the full prompt blocks among the first `computed` tokens of a
        prefill still running (see :class:`StepPolicy`)."""
        if not seq.chunk_cache or not seq.kv_valid or seq.aborted:
            return
        bs = self.block_size
        first = max(seq.cached_tokens // bs, seq.chunk_blocks)
        full = min(computed, len(seq.prompt)) // bs
        if full <= first or full > len(seq.blocks):
            return
        for i in range(first, full):
            self.pool.write(seq.blocks[i], seq.hashes[i])
        parent = seq.hashes[first - 1] if first > 0 else None
        tokens = seq.prompt[first * bs : full * bs]
        self.pool.register(seq.blocks[first:full], seq.hashes[first:full], parent, tokens)
        seq.chunk_blocks = full

    def register_full_blocks(self, seq: Seq, first: int) -> None:
        full = len(seq.prompt) // self.block_size
        if full > first and seq.kv_valid:
            parent = seq.hashes[first - 1] if first > 0 else None
            tokens = seq.prompt[first * self.block_size : full * self.block_size]
            self.pool.register(seq.blocks[first:full], seq.hashes[first:full], parent, tokens)

    def load_remote_kv(self, seq: Seq, contents: list[bytes]) -> None:
        """Write KV received from a prefill into this sequence's (uncached) prompt blocks."""
        first = seq.cached_tokens // self.block_size
        for i in range(first, min(seq.n_prompt_blocks, len(contents))):
            self.pool.write(seq.blocks[i], contents[i])
        ok = len(contents) >= seq.n_prompt_blocks and all(
            contents[i] == seq.hashes[i] for i in range(first, seq.n_prompt_blocks)
        )
        seq.kv_valid = ok
        if ok:
            self.register_full_blocks(seq, first)
        self.counters.external_kv_tokens += len(seq.prompt) - seq.cached_tokens
        self.set_state(seq)

    def set_state(self, seq: Seq) -> None:
        kv = self.pool.content(seq.last_block)
        seq.state = model.stream_state(kv, len(seq.prompt), self.seed, seq.sample_seed)

    # ------------------------------------------------------------------ decode
    async def decode(self, seq: Seq, n: int, *, first_ready: bool = False) -> AsyncGenerator[int, None]:
        """Yield ``n`` output tokens; one per engine step in timed mode, except the first when
        `first_ready`: it was sampled by the step that computed the prompt (the prefill's last
        chunk), or it came with the KV (an SGLang decode's prebuilt request), and is out at once."""
        state = seq.state
        if self.zero_delay:
            for _ in range(n):
                if seq.aborted:
                    raise Aborted()
                if self.dead:
                    raise EngineDead()
                state = model.next_state(state)
                seq.state = state
                yield model.token_from_state(state)
            return
        produced = 0
        if first_ready and n > 0:
            if seq.aborted:
                raise Aborted()
            if self.dead:
                raise EngineDead()
            state = model.next_state(state)
            seq.state = state
            produced = 1
            yield model.token_from_state(state)
            if n == 1:
                return
        seq.event = asyncio.Event()
        seq.credits = 0
        self.decoding.append(seq)
        self._wake.set()
        try:
            while produced < n:
                while seq.credits == 0:
                    if seq.aborted:
                        raise Aborted()
                    if self.dead:
                        raise EngineDead()
                    seq.event.clear()
                    await seq.event.wait()
                if seq.aborted:
                    raise Aborted()
                seq.credits -= 1
                produced += 1
                state = model.next_state(state)
                seq.state = state
                yield model.token_from_state(state)
        finally:
            if seq in self.decoding:
                self.decoding.remove(seq)

    def abort(self, rid: str) -> bool:
        seq = self.seqs.get(rid)
        if seq is None:
            return False
        self.abort_seq(seq)
        return True

    async def abortable(self, seq: Seq, aw: Awaitable[T]) -> T:
        """Await `aw` (a KV wait, say) unless the request is aborted first (then `Aborted`)."""
        task = asyncio.ensure_future(aw)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        seq.prefill_future = waiter
        try:
            await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if seq.prefill_future is waiter:
                seq.prefill_future = None
            if not task.done():
                task.cancel()
        if not task.done() or task.cancelled():
            if waiter.done() and not waiter.cancelled() and waiter.exception() is not None:
                raise waiter.exception()  # type: ignore[misc]
            raise Aborted()
        waiter.cancel()
        return task.result()

    def abort_seq(self, seq: Seq) -> None:
        seq.aborted = True
        if seq.event is not None:
            seq.event.set()
        if seq.prefill_future is not None and not seq.prefill_future.done():
            seq.prefill_future.set_exception(Aborted())
        self._freed.set()

    def die(self) -> None:
        """vLLM's EngineCore fatal error: fail everything in flight and refuse new work."""
        self.dead = True
        for seq in list(self.seqs.values()):
            if seq.prefill_future is not None and not seq.prefill_future.done():
                seq.prefill_future.set_exception(EngineDead())
            if seq.event is not None:
                seq.event.set()
        self._freed.set()

    def token_interval(self) -> float:
        """Nominal seconds per output token now (for the ``slow`` fault)."""
        if self.zero_delay:
            return 0.001
        return max(self.last_step_s, 0.0005)

    # ------------------------------------------------------------------ timed loop
    async def step_boundary(self) -> None:
        """Return when the step running now (if any) ends: what a scheduler polls between its
        forward steps (an SGLang prefill's finished transfers, say) is seen only then."""
        step = self._step
        if step is not None and not step.done():
            await asyncio.shield(step)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.prefill_queue and not self.decoding:
                self._wake.clear()
                await self._wake.wait()
                continue
            work, chunks, batch = self._plan_step()
            kv_tokens = sum(len(s.prompt) + s.credits for s in batch)
            dt = timing.mixed_step_time(self.profile, chunks, len(batch), kv_tokens)
            self.last_step_s = dt * self.time_scale
            self._step = step = loop.create_future()
            finished = False
            try:
                await asyncio.sleep(self.last_step_s)
                finished = self._end_step(work, batch)
            finally:
                self.steps += 1
                step.set_result(None)
            if finished:
                # the prefills just done write and register their KV (their tasks resume first)
                # before the next step is planned: SGLang caches a prefill's prefix as it
                # processes the batch's result, before it forms the next batch
                await asyncio.sleep(0)

    def _plan_step(self) -> tuple[list[tuple[Seq, int]], list[tuple[int, int]], list[Seq]]:
        """The next step's prefill chunks ``(seq, tokens)``, their ``(new, cached)`` sizes for the
        timing model, and the sequences it decodes a token for (see :class:`StepPolicy`)."""
        policy = self.policy
        batch = [s for s in self.decoding if not s.aborted]
        budget = policy.chunk_tokens if policy.prefill_first else policy.chunk_tokens - len(batch)
        budget = max(budget, self.block_size)
        work: list[tuple[Seq, int]] = []
        chunks: list[tuple[int, int]] = []
        for seq in self.prefill_queue:
            if budget <= 0:
                break
            if seq.aborted:
                continue
            if seq.prefill_left == len(seq.prompt) - seq.cached_tokens:
                self._match_when_scheduled(seq)  # its first chunk
            n = min(seq.prefill_left, budget)
            work.append((seq, n))
            chunks.append((n, len(seq.prompt) - seq.prefill_left))
            budget -= n
            if policy.cache_at_schedule:
                self.cache_chunks(seq, len(seq.prompt) - seq.prefill_left + n)
        if work and policy.prefill_first:
            batch = []  # SGLang: a prefill step, the decodes wait
        return work, chunks, batch

    def _match_when_scheduled(self, seq: Seq) -> None:
        """Match a waiting prefill's prefix again as its first chunk is scheduled: blocks cached
        since it was admitted (the prefill of its own conversation's earlier turn, queued ahead
        of it) are read, not computed again. Real engines match at this point, not at arrival:
        SGLang's scheduler matches the waiting queue against the radix cache as it forms the
        next prefill batch (managers/scheduler.py ``get_new_batch_prefill`` through
        managers/schedule_policy.py ``SchedulePolicy.calc_priority`` /
        ``_compute_prefix_matches`` and ``match_prefix_for_req``), vLLM v1's as it schedules a
        waiting request (v1/core/sched/scheduler.py ``Scheduler.schedule``:
        ``kv_cache_manager.get_computed_blocks``)."""
        bs = self.block_size
        have = seq.cached_tokens // bs
        if seq.max_cached <= have:
            return
        more = self.pool.match_prefix(seq.hashes[have:], seq.max_cached - have)
        if not more:
            return
        k = len(more)
        own = seq.blocks[have : have + k]  # allocated at admission, nothing written yet
        seq.blocks[have : have + k] = more
        self.pool.free(own)
        gain = k * bs
        seq.cached_tokens += gain
        seq.prefill_left -= gain
        self.pool.hits += gain
        self.counters.cached_tokens_total += gain
        self.counters.local_compute_tokens -= gain
        self._freed.set()

    def _end_step(self, work: list[tuple[Seq, int]], batch: list[Seq]) -> bool:
        """Count the step's work done; True when a prefill finished."""
        finished = False
        for seq, n in work:
            seq.prefill_left -= n
            if seq.prefill_left > 0:
                self.cache_chunks(seq, len(seq.prompt) - seq.prefill_left)
            else:
                finished = True
                if seq in self.prefill_queue:
                    self.prefill_queue.remove(seq)
                fut = seq.prefill_future
                if fut is not None and not fut.done():
                    fut.set_result(None)
        for seq in batch:
            seq.credits += 1
            if seq.event is not None:
                seq.event.set()
        return finished
