"""The admission controller on its own: slots, FIFO hand-off, the races at wake-up, close()."""

from __future__ import annotations

import asyncio

import pytest

from common.errors import ErrorCode, GatewayError
from gateway.admission import Admission


async def enter(a: Admission, client: str = "c", tokens: int = 0) -> None:
    if not a.admit_now(client, tokens):
        await a.wait(client, tokens)


async def test_fast_path_and_fifo_handoff() -> None:
    a = Admission(2, 4, 5.0)
    await enter(a)
    await enter(a)
    assert a.active == 2 and a.admitted == 2
    order: list[int] = []

    async def queued(i: int) -> None:
        await enter(a)
        order.append(i)

    tasks = [asyncio.create_task(queued(i)) for i in range(3)]
    await asyncio.sleep(0)
    assert a.queued == 3
    a.leave("c")
    a.leave("c")
    await asyncio.sleep(0)
    assert order == [0, 1] and a.active == 2 and a.queued == 1
    a.leave("c")
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2] and a.admitted_after_queue == 3


async def test_queue_full_and_no_queue() -> None:
    a = Admission(1, 0, 5.0)
    await enter(a)
    with pytest.raises(GatewayError) as e:
        await enter(a)
    assert e.value.status == 503 and e.value.code is ErrorCode.OVERLOADED and e.value.retry_after_s
    assert a.shed["queue_full"] == 1 and a.queued == 0


async def test_timeout_gives_503_and_leaves_no_waiter() -> None:
    a = Admission(1, 4, 0.05)
    await enter(a)
    with pytest.raises(GatewayError) as e:
        await enter(a)
    assert e.value.code is ErrorCode.QUEUE_TIMEOUT and e.value.status == 503
    assert a.queued == 0
    a.leave("c")
    assert a.active == 0 and not a._waiters


async def test_cancelled_right_after_being_granted_passes_the_slot_on() -> None:
    a = Admission(1, 4, 5.0)
    await enter(a)
    b = asyncio.create_task(enter(a, "b"))
    c = asyncio.create_task(enter(a, "c"))
    await asyncio.sleep(0)
    a.leave("c")  # grants b's future; b has not run yet
    b.cancel()
    with pytest.raises(asyncio.CancelledError):
        await b
    await c  # the slot went on to c
    assert a.active == 1 and a.queued == 0


async def test_cancelled_waiter_is_skipped() -> None:
    a = Admission(1, 4, 5.0)
    await enter(a)
    b = asyncio.create_task(enter(a))
    c = asyncio.create_task(enter(a))
    await asyncio.sleep(0)
    b.cancel()
    await asyncio.sleep(0)
    assert a.queued == 1
    a.leave("c")
    await c
    assert a.active == 1 and a.queued == 0


async def test_per_client_cap_counts_queued_requests() -> None:
    a = Admission(1, 4, 5.0, per_client_max_concurrent=2)
    await enter(a, "x")
    t = asyncio.create_task(enter(a, "x"))
    await asyncio.sleep(0)
    with pytest.raises(GatewayError) as e:
        await enter(a, "x")
    assert e.value.status == 429 and e.value.code is ErrorCode.CLIENT_CONCURRENCY
    assert a.admit_now("y") is False  # another client queues (no slot), it is not capped
    a._forget_client("y")
    a.leave("x")
    await t
    a.leave("x")
    assert a.active == 0 and not a._clients


async def test_token_budget_and_a_request_larger_than_it() -> None:
    a = Admission(10, 4, 5.0, max_inflight_tokens=100)
    await enter(a, tokens=60)
    assert not a.admit_now("c", 60)
    t = asyncio.create_task(a.wait("c", 60))
    await asyncio.sleep(0)
    assert a.queued == 1
    a.leave("c", 60)
    await t
    assert a.active_tokens == 60
    a.leave("c", 60)
    await enter(a, tokens=500)  # alone: allowed
    assert a.active == 1
    assert not a.admit_now("c", 1)


async def test_close_releases_the_queue_and_refuses_new_requests() -> None:
    a = Admission(1, 4, 5.0)
    await enter(a)
    waiters = [asyncio.create_task(enter(a)) for _ in range(2)]
    await asyncio.sleep(0)
    a.close()
    for w in waiters:
        with pytest.raises(GatewayError) as e:
            await w
        assert e.value.code is ErrorCode.SHUTTING_DOWN and e.value.status == 503
    with pytest.raises(GatewayError):
        await enter(a)
    assert a.queued == 0 and a.shed["shutting_down"] == 3
    a.leave("c")
    assert a.active == 0


async def test_abandoned_waiters_do_not_pile_up() -> None:
    a = Admission(1, 1000, 0.001)
    await enter(a)
    for _ in range(200):  # each times out behind the running request
        with pytest.raises(GatewayError):
            await enter(a)
    assert a.queued == 0 and len(a._waiters) <= 64 and a.shed["queue_timeout"] == 200


async def test_a_head_that_gives_up_lets_the_next_waiter_in() -> None:
    a = Admission(10, 4, 0.05, max_inflight_tokens=100)
    await enter(a, tokens=50)
    big = asyncio.create_task(enter(a, "big", 90))  # does not fit: waits at the head
    await asyncio.sleep(0.01)
    small = asyncio.create_task(enter(a, "small", 10))  # fits, but FIFO: waits behind it
    await asyncio.sleep(0)
    assert a.queued == 2
    with pytest.raises(GatewayError):
        await big  # times out ...
    await asyncio.wait_for(small, 0.03)  # ... and the small one gets in at once, not at its own timeout
    assert a.active == 2 and a.active_tokens == 60
