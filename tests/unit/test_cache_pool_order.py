"""A large pool's `cache_aware` choice (policies/cache_pool_order.py) is the whole-pool loop's.

Random snapshots (workers in flight and waiting, measured and unmeasured rates, queues draining,
prefixes held by one, a few or most workers, thresholds, saturation) are decided twice: by the
selector's large-pool path, and by scoring every worker (`CacheAwareSelector._choose` over the
whole pool), each with a generator seeded alike. Between decisions the snapshot and the
policy's state change, so the kept orders are brought up to date, not rebuilt.
"""

from __future__ import annotations

import random

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapters.blockhash import HashSpec, make_hasher
from gateway.kvevents.index import KvEventIndex
from policies.base import routed_event
from policies.cache_aware import CacheAwareSelector, CacheAwareSettings, CacheState
from policies.cache_pool_order import DIRECT_GROUP
from policies.prompt_key import PromptKey
from policies.snapshot import Colocated, RequestView, RouteKind, WorkerLoad, WorkerState
from policies.testing import ManualClock, make_worker


def request(ids: list[int], rid: str) -> RequestView:
    return RequestView(
        rid, "m", RouteKind.COMPLETIONS, len(ids), 16, prompt_key=PromptKey.from_token_ids(ids)
    )


def brute(st_: CacheState, r: RequestView, pool: list[WorkerState], seed: int) -> WorkerState:
    ref = CacheAwareSelector("x", st_, rng=random.Random(seed), owner=False)
    return ref._choose(r, pool, st_.lookups(r))


def fill_precise(
    index: KvEventIndex, pool: list[WorkerState], rng: random.Random, prefixes: list[list[int]]
) -> None:
    for w in pool:
        index.add_worker(w.id, endpoint="tcp://t:1", scheme="emulator", block_size=16)
        if rng.random() < 0.8:
            index.set_state(w.id, "live")
    group = next(iter(index._groups.values()))
    hasher = make_hasher(HashSpec(scheme="emulator", block_size=16))
    for _ in range(rng.randrange(0, 30)):
        ids = rng.choice(prefixes)[: rng.randrange(16, 400)]
        key = PromptKey.from_token_ids(ids)
        assert key is not None
        w = rng.choice(pool)
        group.index.add(group.slot_of[w.id], key.engine_keys(hasher, len(ids) // 16))


def scenario(seed: int, precise: bool) -> int:
    """Runs one random history; returns how many decisions took the large-pool path."""
    rng = random.Random(seed)
    clock = ManualClock(1000.0)
    n = rng.randrange(5, 90)
    cfg = CacheAwareSettings(
        exact_large_pool=True,
        queue_externality=0.0,
        scan_limit=4,
        prefill_rate=rng.choice([1000.0, 20_000.0]),
        cache_threshold=rng.choice([0.0, 0.0, 0.3]),
        saturation_wait_s=rng.choice([0.2, 2.0, 10.0]),
        inflight_factor=rng.choice([0.0, 1.0, 1.0, 2.5]),
        crossover_tokens=rng.choice([0.0, 32_768.0]),
        balance_abs_threshold=rng.choice([2, 64]),
    )
    index = KvEventIndex() if precise else None
    state = CacheState(cfg, precise=index, clock=clock)
    inflight_values = rng.choice([[0], [0, 1], list(range(8))])
    pool = [
        make_worker(f"w{i}", inflight=rng.choice(inflight_values), waiting=rng.choice([0, 0, 0, 1, 3]))
        for i in range(n)
    ]
    prefixes = [[rng.randrange(50_000) for _ in range(rng.randrange(16, 600))] for _ in range(4)]
    if index is not None:
        fill_precise(index, pool, rng, prefixes)
    # a prefix most workers hold: a group too big to score one by one
    if rng.random() < 0.5 and n > DIRECT_GROUP + 1:
        for w in rng.sample(pool, rng.randrange(DIRECT_GROUP + 1, n)):
            state.approx.insert("m", w.id, PromptKey.from_token_ids(prefixes[0][:64]), None)  # type: ignore[arg-type]
    sel = CacheAwareSelector("x", state, rng=random.Random(0))
    fast = 0
    for step in range(12):
        # the policy's state moves: requests routed (queues, index), rates measured
        for k in range(rng.randrange(0, 6)):
            ids = rng.choice(prefixes)[: rng.randrange(1, 600)] + [step, k] * rng.randrange(0, 40)
            w = rng.choice(pool)
            state.observe(routed_event(request(ids, f"o{step}-{k}"), Colocated(w)))
        for _ in range(rng.randrange(0, 3)):
            w = rng.choice(pool)
            state.queues.learn(w.id, rng.choice([5000.0, 20_000.0, 40_000.0]), rng.choice([0.5, 1.0, 2.0]))
        clock.t += rng.choice([0.0, 0.01, 0.3, 2.0])
        # the snapshot moves: a few workers' counts change (new states), or none
        for _ in range(rng.randrange(0, 4)):
            i = rng.randrange(n)
            pool[i] = msgspec.structs.replace(
                pool[i],
                inflight=rng.choice(inflight_values),
                load=WorkerLoad(waiting=rng.choice([0, 0, 1, 3])),
            )
        ask_ids = rng.choice(prefixes)[: rng.randrange(1, 600)] + [99] * rng.randrange(0, 200)
        ask = request(ask_ids, f"q{step}")
        draw = rng.randrange(1 << 30)
        sel.rng = random.Random(draw)
        got = sel.select(ask, pool)
        want = brute(state, ask, pool, draw)
        assert got.id == want.id, (seed, step)
        fast += 1
        chosen, record = CacheAwareSelector("x", state, rng=random.Random(draw), owner=False).decide(
            ask, pool
        )
        assert chosen.id == want.id and record is not None and record.chosen == want.id
    return fast


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1))
def test_a_large_pool_chooses_as_scoring_every_worker(seed: int) -> None:
    scenario(seed, precise=False)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1))
def test_with_the_precise_index_too(seed: int) -> None:
    scenario(seed, precise=True)


def test_the_search_reads_few_workers_of_a_large_idle_pool() -> None:
    """1,000 measured workers, one holding the prompt: the search scores a handful."""
    clock = ManualClock(1000.0)
    state = CacheState(
        CacheAwareSettings(scan_limit=64, exact_large_pool=True, queue_externality=0.0), clock=clock
    )
    pool = [make_worker(f"w{i}", inflight=i % 4) for i in range(1000)]
    for i, w in enumerate(pool):
        state.queues.learn(w.id, 20_000.0, 1.0 + i / 10_000)
    prompt = list(range(2000))
    state.observe(routed_event(request(prompt, "o"), Colocated(pool[500])))
    clock.t += 60.0
    sel = CacheAwareSelector("x", state, rng=random.Random(1))
    ask = request(prompt + [1] * 100, "q")
    chosen, record = sel.decide(ask, pool)
    assert record is not None and len(record.candidates) <= 8
    assert chosen.id == brute(state, ask, pool, 1).id
