"""The emulator's KV pool evicts a prefix's tail before its head, as the engines do.

vLLM frees a request's blocks last block first (v1 `SingleTypeKVCacheManager.free`), and
SGLang's radix cache evicts leaves before their parents, so an engine under memory pressure
keeps the head of an old prompt and loses its tail. The emulator once freed blocks parent
first: the first eviction took a prompt's first block, and every block chained after it was
lost with it (a 191k-token prompt recomputed whole in the Mooncake replay, docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio

from emulator.profiles import PROFILES
from emulator.scheduler import Engine, Seq

BS = 16


def _engine(blocks: int) -> Engine:
    # zero delay: admission, prefill and release run without the step loop
    return Engine(
        PROFILES["llama-3-8b-h100"], role="both", time_scale=0.0, seed=0, num_blocks=blocks, block_size=BS
    )


async def _serve(engine: Engine, rid: str, prompt: list[int]) -> int:
    """Admit, prefill and release one request (no output); its cached prompt tokens."""
    seq = Seq(rid, prompt, 1, None)
    await engine.admit(seq)
    await engine.prefill(seq)
    engine.release(seq)
    return seq.cached_tokens


def test_a_full_pool_loses_an_old_prompts_tail_not_its_head() -> None:
    async def run() -> int:
        engine = _engine(blocks=12)
        old = list(range(1, 8 * BS + 1))  # 8 blocks, + 1 for its answer
        await _serve(engine, "old", old)
        # 4 new blocks (+ 1 for the answer) into a pool of 12 whose cache holds 8: 1 evicted
        await _serve(engine, "new", list(range(1000, 1000 + 4 * BS)))
        return await _serve(engine, "again", [*old, 5])

    again = asyncio.run(run())
    # the old prompt's first 7 blocks are still cached (its last one went): parent first, the
    # first block went and nothing of the prompt could be matched
    assert again == 7 * BS


def test_freed_blocks_stay_evictable_tail_first_across_requests() -> None:
    async def run() -> list[int]:
        engine = _engine(blocks=40)
        a = list(range(1, 10 * BS + 1))
        b = list(range(5000, 5000 + 10 * BS))
        await _serve(engine, "a", a)
        await _serve(engine, "b", b)
        # 34 blocks for c where 20 are free: a's 10 cached blocks go (the oldest), then the
        # last 4 of b's
        await _serve(engine, "c", list(range(9000, 9000 + 33 * BS)))
        return [await _serve(engine, "b2", [*b, 1]), await _serve(engine, "a2", [*a, 1])]

    b_again, a_again = asyncio.run(run())
    assert a_again == 0
    assert b_again == 6 * BS
