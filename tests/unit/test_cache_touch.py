"""`lru_touch = "done"`: the approximate index touches a colocated prompt again when its answer
ends (policies/cache_state.py), as an engine's prefix cache does: SGLang's radix cache and the
emulator's block pool (emulator/kvcache.py `BlockPool.free`) put a request's blocks into the LRU
when it finishes, and hold them (unevictable) while it runs. Touched only when routed, a long
answer's prompt was the index's oldest entry while its engine held it as the newest, and the
index forgot a conversation's prefix before its next turn came. Table-driven on `CacheState` with
an injected clock; no event loop."""

from __future__ import annotations

import pytest

from policies.base import Completed, routed_event
from policies.build import cache_aware_settings
from policies.cache_aware import CacheAwareSettings, CacheState
from policies.config import CacheAwareCfg, parse_policy
from policies.prompt_key import PromptKey
from policies.snapshot import Colocated, RequestView, RouteKind
from policies.testing import ManualClock as Clock
from policies.testing import make_worker

A = list(range(1000, 1800))  # 800 tokens = 50 blocks of 16: a long answer's prompt
B = list(range(3000, 3480))  # 480 tokens = 30 blocks: a short answer's prompt
C = list(range(5000, 5480))  # 480 tokens = 30 blocks: a new prompt that overflows the pool


def req(ids: list[int], rid: str) -> RequestView:
    return RequestView(
        rid, "m", RouteKind.COMPLETIONS, len(ids), 16, prompt_key=PromptKey.from_token_ids(ids)
    )


# A pool of 1,600 tokens (100 blocks). A is routed at 0 s and answers at 3 s; B is routed at 1 s
# and answers at 2 s; then C is routed at 4 s: 110 blocks, and C's 16-token answer pinned, so 11
# blocks go. An engine evicts the least recently freed: B's tail (A was freed last). `done`: the
# worker's ids on A's and B's completions (two: a P/D pair, whose prefill freed the prompt when
# its KV went to the decode, not at the answer's end: not touched).
@pytest.mark.parametrize(
    ("touch", "done", "expected_a", "expected_b"),
    [
        ("routed", ("a",), 800 - 11 * 16, 480),  # the old behaviour: A's tail forgotten
        ("done", ("a",), 800, 480 - 11 * 16),  # as the engine: B's tail
        ("done", ("a", "d"), 800 - 11 * 16, 480),  # not colocated: touched when routed only
    ],
)
def test_a_prompt_is_as_recent_as_its_answers_end(
    touch: str, done: tuple[str, ...], expected_a: int, expected_b: int
) -> None:
    cfg = parse_policy({"type": "cache_aware", "lru_touch": touch})
    assert isinstance(cfg, CacheAwareCfg)
    settings = cache_aware_settings(cfg)
    settings = CacheAwareSettings(
        worker_cache_tokens=1600, prefill_rate=1000.0, crossover_tokens=0.0, touch_done=settings.touch_done
    )
    clock = Clock()
    s = CacheState(settings, clock=clock)
    a = make_worker("a")
    s.observe(routed_event(req(A, "ra"), Colocated(a)))
    clock.t = 1.0
    s.observe(routed_event(req(B, "rb"), Colocated(a)))
    clock.t = 2.0
    s.observe(Completed("rb", done, cached_tokens=0))
    clock.t = 3.0
    s.observe(Completed("ra", done, cached_tokens=0))
    clock.t = 4.0
    s.observe(routed_event(req(C, "rc"), Colocated(a)))
    assert s.cached_tokens(req(A + [7] * 32, "next-a"), a) == expected_a
    assert s.cached_tokens(req(B + [7] * 32, "next-b"), a) == expected_b
    assert s.cached_tokens(req(C + [7] * 32, "next-c"), a) == 480  # the newest stays whole


def test_a_prompt_forgotten_while_it_ran_is_held_again_when_it_ends() -> None:
    """The engine cannot evict a running request's blocks; the index, touching only at routing,
    forgets them under later traffic. At the answer's end they are the engine's newest."""
    clock = Clock()
    s = CacheState(
        CacheAwareSettings(
            worker_cache_tokens=1600, prefill_rate=1000.0, crossover_tokens=0.0, touch_done=True
        ),
        clock=clock,
    )
    a = make_worker("a")
    s.observe(routed_event(req(A, "ra"), Colocated(a)))
    for i in range(4):  # 4 x 30 blocks of other prompts answered while A runs
        clock.t += 1.0
        other = list(range(10_000 + 1000 * i, 10_480 + 1000 * i))
        s.observe(routed_event(req(other, f"o{i}"), Colocated(a)))
        s.observe(Completed(f"o{i}", ("a",), cached_tokens=0))
    probe = req(A + [7] * 32, "next-a")
    assert s.cached_tokens(probe, a) < 800  # forgotten while it ran
    s.observe(Completed("ra", ("a",), cached_tokens=0))
    assert s.cached_tokens(probe, a) == 800


def test_the_knob_is_on_by_default_and_refuses_other_values() -> None:
    assert CacheAwareCfg().lru_touch == "done"
    assert CacheAwareSettings().touch_done
    assert not cache_aware_settings(parse_policy({"type": "cache_aware", "lru_touch": "routed"})).touch_done
    with pytest.raises(Exception, match="lru_touch"):
        parse_policy({"type": "cache_aware", "lru_touch": "never"})
