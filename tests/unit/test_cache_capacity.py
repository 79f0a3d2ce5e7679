"""The approximate index's model of what an engine holds (policies/cache_state.py): a prompt's
blocks count as cached once its prefill has ended, not when it is routed, and the KV pool a
worker can keep cached is its pool less what the requests in flight there pin. Table-driven on
`CacheState` with an injected clock; no event loop."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.base import Completed, Failed, routed_event
from policies.cache_aware import CacheAwareSettings, CacheState
from policies.prompt_key import PromptKey
from policies.snapshot import Colocated, RequestView, RouteKind, WorkerState
from policies.testing import ManualClock as Clock
from policies.testing import make_worker

PREFIX = list(range(1000, 1800))  # 800 tokens = 50 blocks of 16


def req(ids: list[int], rid: str, max_tokens: int = 16) -> RequestView:
    return RequestView(
        rid, "m", RouteKind.COMPLETIONS, len(ids), max_tokens, prompt_key=PromptKey.from_token_ids(ids)
    )


def new_state(clock: Clock, cache_tokens: int | None = None, prefilled: bool = True) -> CacheState:
    s = CacheAwareSettings(
        worker_cache_tokens=cache_tokens,
        prefill_rate=1000.0,
        crossover_tokens=0.0,
        record_prefilled=prefilled,
    )
    return CacheState(s, clock=clock)


def route(s: CacheState, r: RequestView, w: WorkerState) -> None:
    s.observe(routed_event(r, Colocated(w)))


def predicted(s: CacheState, ids: list[int], w: WorkerState) -> int:
    return s.cached_tokens(req(ids, "probe"), w)


# `record = "prefilled"`: what the first request's outcome is, and when the next one (same
# prefix) is looked up: its predicted cached tokens on the worker the first went to. The first's
# prefill (800 tokens at 1000/s, nothing queued) is predicted to end 0.8 s after it was routed.
# `record = "routed"` (the default) counts it at once, whatever comes.
@pytest.mark.parametrize(
    ("prefilled", "outcome", "after_s", "expected"),
    [
        (True, None, 0.0, 0),  # still prefilling: an engine admitting the next now computes it again
        (True, None, 0.5, 0),
        (True, None, 0.81, 800),  # its predicted prefill end has passed
        (True, "completed", 0.1, 800),  # it answered: its blocks are the engine's whenever that was
        (True, "failed", 0.1, 0),  # its prefill did not run (or its KV is lost)
        (True, "failed", 2.0, 0),
        (False, None, 0.0, 800),
        (False, "failed", 0.1, 800),
    ],
)
def test_a_prompt_counts_as_cached_once_its_prefill_ends(
    prefilled: bool, outcome: str | None, after_s: float, expected: int
) -> None:
    clock = Clock()
    s = new_state(clock, prefilled=prefilled)
    a = make_worker("a")
    route(s, req(PREFIX, "r1"), a)
    clock.t += after_s
    if outcome == "completed":
        s.observe(Completed("r1", ("a",), cached_tokens=0))
    elif outcome == "failed":
        s.observe(Failed("r1", ("a",), "prefill"))
    assert predicted(s, PREFIX + [7] * 32, a) == expected


# a worker with a 1,600-token pool holds PREFIX (800 tokens, answered); then a request of
# `other` unrelated prompt tokens and `max_tokens` is routed there. Until its prefill ends, the
# engine keeps at most 1600 - other - max_tokens tokens of what it had cached (the index's least
# recently used blocks, PREFIX's deepest first, go: the engine evicted them to admit it, and
# they stay forgotten once it has answered).
@pytest.mark.parametrize(
    ("other", "max_tokens", "answered", "expected"),
    [
        (400, 16, False, 800),  # 1,184 evictable: PREFIX fits
        (800, 16, False, 784),  # 784 evictable: 49 blocks of PREFIX
        (1000, 100, False, 496),  # 500: 31 blocks
        (1584, 16, False, 16),  # nothing evictable is left (one block at least is modelled)
        (1000, 100, True, 496),
    ],
)
def test_requests_in_flight_pin_part_of_the_pool(
    other: int, max_tokens: int, answered: bool, expected: int
) -> None:
    clock = Clock()
    s = new_state(clock, cache_tokens=1600)
    a = make_worker("a")
    route(s, req(PREFIX, "r1"), a)
    s.observe(Completed("r1", ("a",), cached_tokens=0))
    route(s, req(list(range(5000, 5000 + other)), "r2", max_tokens), a)
    if answered:
        s.observe(Completed("r2", ("a",), cached_tokens=0))
    got = predicted(s, PREFIX, a)
    assert got == min(expected, len(PREFIX) - 1)
    if answered:
        assert s._pinned.get("a", 0.0) == 0.0  # nothing left pinned


def test_a_matched_prefix_is_pinned_not_forgotten() -> None:
    """A request that finds PREFIX cached pins it in the engine: a request routed meanwhile that
    fills the rest of the pool takes what was cached after PREFIX, not PREFIX."""
    clock = Clock()
    s = new_state(clock, cache_tokens=2400)
    a = make_worker("a")
    route(s, req(PREFIX, "r1"), a)
    s.observe(Completed("r1", ("a",), cached_tokens=0))
    route(s, req(list(range(6000, 6400)), "r0"), a)  # 25 blocks, more recent than PREFIX's 50
    s.observe(Completed("r0", ("a",), cached_tokens=0))
    route(s, req(PREFIX + [3] * 160, "r2", 16), a)  # finds PREFIX, computes 160 more
    # 1,200 new tokens: 2400 - (160 + 16) - (1200 + 16) = 1,008 evictable, 63 of the 75 blocks
    route(s, req(list(range(9000, 10200)), "r3", 16), a)
    assert predicted(s, PREFIX, a) == 799  # r0's 25 went first
    assert predicted(s, list(range(6000, 6400)), a) == 13 * 16


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 5),
            st.integers(1, 120),
            st.integers(0, 64),
            st.sampled_from(["ok", "fail", "open"]),
        ),
        min_size=1,
        max_size=30,
    )
)
def test_pins_are_released_by_every_outcome(reqs: list[tuple[int, int, int, str]]) -> None:
    """Whatever the requests and their outcomes, a worker's pinned tokens are those of its
    requests still in flight, and the index never holds more of a worker than its pool."""
    clock = Clock()
    s = new_state(clock, cache_tokens=640)
    a = make_worker("a")
    open_pins = 0.0
    for i, (base, blocks, max_tokens, outcome) in enumerate(reqs):
        ids = list(range(base * 10_000, base * 10_000 + blocks * 16))
        route(s, req(ids, f"r{i}", max_tokens), a)
        clock.t += 0.05
        if outcome == "ok":
            s.observe(Completed(f"r{i}", ("a",), cached_tokens=0))
        elif outcome == "fail":
            s.observe(Failed(f"r{i}", ("a",), "prefill"))
        assert s.approx.worker_entries("a") * 16 <= 640
    open_pins = sum(p.pin for p in s._pending.values())
    assert s._pinned.get("a", 0.0) == pytest.approx(open_pins)
    for rid in list(s._pending):
        s.observe(Completed(rid, ("a",), cached_tokens=0))
    assert s._pinned.get("a", 0.0) == 0.0


# `record = "routed"`: a worker with a 1,300-token pool holds OLD (answered, 25 blocks), then
# PREFIX is routed there (r1) and a turn extending it (r2, predicted to find PREFIX) with r1's
# prefill still queued or not. r2's engine reports 0 cached. With a queue, the shortfall is a
# prefix still being computed (an engine that matched r2 at admission computed it again), no
# news about the pool: the model keeps its size and OLD. Without one it is: the pool is taken to
# be 10 % smaller and OLD's deepest blocks, the least recently used, are forgotten (77 blocks
# held, 73 fit).
@pytest.mark.parametrize(
    ("queued", "old_after", "scale"),
    [
        (True, 400, 1.0),
        (False, 336, 0.9),
    ],
)
def test_a_shortfall_behind_a_queue_does_not_shrink_the_pool(
    queued: bool, old_after: int, scale: float
) -> None:
    clock = Clock()
    s = new_state(clock, cache_tokens=1300, prefilled=False)
    a = make_worker("a")
    old = list(range(7000, 7400))
    route(s, req(old, "r0"), a)
    s.observe(Completed("r0", ("a",), cached_tokens=0))
    clock.t += 5.0  # its prefill has drained from the queue model
    route(s, req(PREFIX, "r1"), a)
    if not queued:
        clock.t += 5.0
    route(s, req(PREFIX + [3] * 32, "r2"), a)
    assert s._pending["r2"].predicted == 800
    s.observe(Completed("r2", ("a",), cached_tokens=0))
    assert predicted(s, old + [7] * 16, a) == old_after
    assert s.approx._scale.get("a", 1.0) == pytest.approx(scale)
