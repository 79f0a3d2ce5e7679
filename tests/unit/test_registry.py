"""The registry's snapshot: current to each call, cheap per request, and worker breakers that
recover by themselves (open -> half-open after `open_s`, closed after successes)."""

from __future__ import annotations

import time

from common.workers import Engine, Role
from gateway.config import BreakerConfig
from gateway.registry import Registry, Worker


def _registry(open_s: float = 30.0) -> tuple[Registry, Worker, Worker, Worker]:
    """Three workers, each alone in its pool: any share of a pool may be ejected here (the
    breaker's mechanics; the share cap has tests of its own, tests/unit/test_breaker.py)."""
    reg = Registry(
        BreakerConfig(failure_threshold=2, success_threshold=1, open_s=open_s, max_ejected_share=1.0)
    )
    ws = []
    for i, role in enumerate((Role.PREFILL, Role.DECODE, Role.COLOCATED)):
        w = Worker(f"w{i}", f"http://127.0.0.1:{9000 + i}", role, Engine.SGLANG, model="m")
        w.healthy = True
        reg.add(w)
        ws.append(w)
    return reg, ws[0], ws[1], ws[2]


def _state(reg: Registry, wid: str):  # type: ignore[no-untyped-def]
    s = reg.snapshot().get(wid)
    assert s is not None
    return s


def test_snapshot_follows_inflight_counts_and_copies_only_moved_workers() -> None:
    reg, p, d, _ = _registry()
    before = reg.snapshot()
    assert reg.snapshot() is before  # nothing changed: the same object
    reg.acquire(p, 100)
    reg.acquire(d, 300)
    after = reg.snapshot()
    assert after is not before and after.version != before.version
    assert (_state(reg, "w0").inflight, _state(reg, "w0").inflight_tokens) == (1, 100)
    assert (_state(reg, "w1").inflight, _state(reg, "w1").inflight_tokens) == (1, 300)
    assert after.get("w2") is before.get("w2")  # untouched worker: its state is not rebuilt
    reg.release(p, 100)
    reg.release(d, 300)
    assert _state(reg, "w0").inflight == 0 and _state(reg, "w1").inflight_tokens == 0


def test_a_snapshot_stands_when_the_counts_are_back_where_it_shows_them() -> None:
    """A request that ended before the next snapshot (acquired and released in between, the
    usual case at one connection) leaves the snapshot as it was: the same object, not a copy."""
    reg, p, d, _ = _registry()
    before = reg.snapshot()
    reg.acquire(p, 100)
    reg.acquire(d, 300)
    reg.release(p, 100)
    reg.release(d, 300)
    assert reg.snapshot() is before
    reg.acquire(d, 300)
    reg.acquire(p, 100)
    reg.release(p, 100)  # one back, one still in flight: a new snapshot with that one's count
    after = reg.snapshot()
    assert after is not before and after.version != before.version
    assert _state(reg, "w1").inflight == 1 and after.get("w0") is before.get("w0")


def test_snapshot_rebuilt_after_other_changes() -> None:
    reg, p, _, _ = _registry()
    reg.snapshot()
    p.draining = True
    reg.changed()
    assert _state(reg, "w0").draining


def test_open_worker_breaker_recovers_after_open_s() -> None:
    reg, p, _, _ = _registry(open_s=0.05)
    reg.record(p, False)
    reg.record(p, False)  # failure_threshold = 2: open
    assert not _state(reg, "w0").healthy
    time.sleep(0.06)
    assert _state(reg, "w0").healthy  # half-open: one trial request may go
    assert p.breaker.state.value == "half_open"
    reg.acquire(p, 1)
    assert not _state(reg, "w0").healthy  # the trial is in flight: no second request
    reg.release(p, 1)
    reg.record(p, True)  # success_threshold = 1: closed again
    assert p.breaker.state.value == "closed" and _state(reg, "w0").healthy


def test_half_open_lets_one_trial_at_a_time_until_closed() -> None:
    reg = Registry(
        BreakerConfig(failure_threshold=1, success_threshold=2, open_s=0.05, max_ejected_share=1.0)
    )
    w = Worker("w", "http://127.0.0.1:9100", Role.DECODE, Engine.SGLANG, model="m")
    w.healthy = True
    reg.add(w)
    reg.record(w, False)
    time.sleep(0.06)
    for _ in range(2):  # two successful trials, one after the other
        assert _state(reg, "w").healthy
        reg.acquire(w, 1)
        assert not _state(reg, "w").healthy
        reg.release(w, 1)
        reg.record(w, True)
    assert w.breaker.state.value == "closed" and _state(reg, "w").healthy


def test_half_open_failure_reopens() -> None:
    reg, p, _, _ = _registry(open_s=0.05)
    reg.record(p, False)
    reg.record(p, False)
    time.sleep(0.06)
    assert _state(reg, "w0").healthy
    reg.record(p, False)  # the trial failed: ejected again, for twice as long
    assert not _state(reg, "w0").healthy
    assert p.breaker.ejection_s == 0.1
    time.sleep(0.06)
    assert not _state(reg, "w0").healthy
    time.sleep(0.05)
    assert _state(reg, "w0").healthy


def test_an_outcome_without_a_verdict_counts_nothing_and_frees_a_half_open_trial() -> None:
    """`record(w, None)`: the request ended without a verdict on `w` (its other leg failed
    first). A closed breaker's failure count is neither raised nor reset; a half-open worker's
    trial slot is freed for the next request without closing or reopening the breaker."""
    reg, p, _, _ = _registry(open_s=0.05)
    reg.record(p, False)
    reg.record(p, None)
    reg.record(p, False)  # still consecutive: None did not reset the count
    assert p.breaker.state.value == "open"
    time.sleep(0.06)
    assert _state(reg, "w0").healthy
    reg.acquire(p, 1)  # the one trial request
    assert not _state(reg, "w0").healthy
    reg.release(p, 1)
    reg.record(p, None)
    assert p.breaker.state.value == "half_open" and _state(reg, "w0").healthy  # the next may go


def test_a_worker_removed_while_its_requests_run_leaves_snapshots_whole() -> None:
    """Admin remove does not cut requests in flight: their release and outcome arrive after the
    worker has left. They must not reach snapshots (a KeyError there failed every request), nor a
    new worker added since under the same id."""
    import asyncio

    reg, p, d, _ = _registry()
    reg.acquire(p, 100)
    reg.acquire(d, 100)
    reg.snapshot()
    asyncio.run(reg.remove("w0"))
    assert reg.snapshot().get("w0") is None
    reg.release(p, 100)
    snap = reg.snapshot()
    assert snap.get("w0") is None and _state(reg, "w1").inflight == 1
    reg.record(p, False)
    reg.record(p, False)  # its own breaker opens; the registry does not track it any more
    assert reg.snapshot() is snap
    again = Worker("w0", "http://127.0.0.1:9000", Role.PREFILL, Engine.SGLANG, model="m")
    again.healthy = True
    reg.add(again)
    reg.acquire(again, 7)
    reg.snapshot()
    asyncio.run(reg.remove("w0"))
    reg.add(p2 := Worker("w0", "http://127.0.0.1:9000", Role.PREFILL, Engine.SGLANG, model="m"))
    p2.healthy = True
    reg.snapshot()
    reg.release(again, 7)  # the replaced worker's release: not the new one's count
    assert (_state(reg, "w0").inflight, _state(reg, "w0").inflight_tokens) == (0, 0)
    assert _state(reg, "w0").healthy


def test_a_worker_removed_at_its_cap_or_under_suspicion_leaves_nothing_to_its_successor() -> None:
    import asyncio

    reg = Registry(
        BreakerConfig(failure_threshold=1, success_threshold=1, open_s=30.0, max_ejected_share=1.0),
        inflight_cap=1,
    )
    p = Worker("p", "http://127.0.0.1:9200", Role.PREFILL, Engine.SGLANG, model="m")
    d = Worker("d", "http://127.0.0.1:9201", Role.DECODE, Engine.SGLANG, model="m")
    for w in (p, d):
        w.healthy = True
        reg.add(w)
    reg.acquire(p, 1)  # at its cap
    assert reg.full() == {"p"}
    asyncio.run(reg.remove("p"))
    reg.release(p, 1)
    # what its last request reports after it left: a failed pair, a KV-integrity suspicion
    reg.pair_breaker("p", "d").record(False)
    reg.mark_suspect("p|d", 60.0)
    again = Worker("p", "http://127.0.0.1:9200", Role.PREFILL, Engine.SGLANG, model="m")
    again.healthy = True
    reg.add(again)
    assert reg.full() == set()
    assert reg.open_pairs() == frozenset() and reg.suspect_pairs() == frozenset()


class _Clock:
    """`time` as the registry reads it, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_a_pair_failing_again_soon_after_its_suspicion_is_suspected_longer(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A suspicion is renewed by each failure; a pair failing again within one window of its
    suspicion's end (a corruption that comes and goes) gets twice its last window, up to 32
    times the configured one; after a clean window it starts again at the configured one."""
    import gateway.registry as registry_module

    clock = _Clock()
    monkeypatch.setattr(registry_module, "time", clock)
    reg, p, d, _ = _registry()
    pair = f"{p.id}|{d.id}"

    def suspect_after(dt: float) -> bool:
        clock.now += dt
        return pair in reg.suspect_pairs()

    reg.mark_suspect(pair, 10.0)
    assert suspect_after(5.0)
    reg.mark_suspect(pair, 10.0)  # renewed while suspect: the same window, from now
    assert suspect_after(9.0) and not suspect_after(2.0)
    reg.mark_suspect(pair, 10.0)  # 1 s after the end: twice as long
    assert suspect_after(19.0) and not suspect_after(2.0)
    for window in (40.0, 80.0, 160.0, 320.0, 320.0):  # capped at 32 x 10 s
        reg.mark_suspect(pair, 10.0)
        assert suspect_after(window - 1.0) and not suspect_after(2.0)
    clock.now += 320.0  # a clean window after the end: back to 10 s
    reg.mark_suspect(pair, 10.0)
    assert suspect_after(9.0) and not suspect_after(2.0)


def test_exclusions_are_what_failed_open_pairs_full_workers_and_those_without_the_route() -> None:
    """`Registry.exclusions`, the plan's one call: every source, and a shared empty set when
    there is nothing to leave out."""
    from common.workers import RouteKind

    reg = Registry(
        BreakerConfig(failure_threshold=1, success_threshold=1, open_s=30.0, max_ejected_share=1.0),
        inflight_cap=1,
    )
    p = Worker("p", "http://127.0.0.1:9000", Role.PREFILL, Engine.VLLM, model="m")
    d = Worker("d", "http://127.0.0.1:9001", Role.DECODE, Engine.VLLM, model="m")
    for w in (p, d):
        w.healthy = True
        reg.add(w)
    route = RouteKind.GENERATE  # SGLang's /generate: no vLLM worker serves it
    chat = RouteKind.CHAT
    assert reg.exclusions(chat, set()) is reg.exclusions(chat, set()) == frozenset()
    assert reg.exclusions(route, set()) == {"p", "d"}
    assert reg.exclusions(chat, {"x"}) == {"x"}
    reg.pair_breaker("p", "d").record(False)  # opened (threshold 1)
    assert reg.exclusions(chat, set()) == {"p|d"} == reg.open_pairs()
    reg.acquire(d, 10)  # at its cap of one
    assert reg.exclusions(chat, {"x"}) == {"x", "p|d", "d"}
