"""gateway.deadlines: asyncio.timeout's semantics on a coarse timer wheel."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from gateway.deadlines import DeadlineWheel


def _me() -> asyncio.Task[object]:
    t = asyncio.current_task()
    assert t is not None
    return t


async def test_fires_as_timeout_error() -> None:
    wheel = DeadlineWheel(asyncio.get_running_loop())
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(TimeoutError):
        with wheel.after(0.05, _me()):
            await asyncio.sleep(5)
    took = loop.time() - t0
    assert 0.045 <= took < 0.5
    assert len(wheel) == 0


async def test_leaving_early_disarms() -> None:
    wheel = DeadlineWheel(asyncio.get_running_loop())
    with wheel.after(0.05, _me()) as d:
        await asyncio.sleep(0)
    assert len(wheel) == 0
    await asyncio.sleep(0.1)  # its bucket fires with nothing in it: no cancel arrives
    assert not d.expired


async def test_reschedule_moves_the_deadline() -> None:
    loop = asyncio.get_running_loop()
    wheel = DeadlineWheel(loop)
    t0 = loop.time()
    with pytest.raises(TimeoutError):
        with wheel.after(0.05, _me()) as d:
            d.reschedule(loop.time() + 0.25)
            await asyncio.sleep(5)
    assert 0.24 <= loop.time() - t0 < 0.8


async def test_nested_inner_fires_outer_goes_on() -> None:
    wheel = DeadlineWheel(asyncio.get_running_loop())
    me = _me()
    with wheel.after(5, me) as outer:
        with pytest.raises(TimeoutError):
            with wheel.after(0.03, me):
                await asyncio.sleep(5)
        await asyncio.sleep(0.01)  # still fine: the cancellation was consumed
    assert not outer.expired
    assert me.cancelling() == 0


async def test_outside_cancel_is_not_turned_into_timeout() -> None:
    wheel = DeadlineWheel(asyncio.get_running_loop())
    entered = asyncio.Event()

    async def body() -> None:
        with wheel.after(5, _me()):
            entered.set()
            await asyncio.sleep(5)

    task = asyncio.ensure_future(body())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(wheel) == 0


async def test_deadline_and_outside_cancel_together_stay_a_cancel() -> None:
    """Both cancelled the task (the deadline fired as the client went away): the outside
    cancellation must not be swallowed into a TimeoutError."""
    wheel = DeadlineWheel(asyncio.get_running_loop())

    async def body() -> None:
        me = _me()
        with wheel.after(5, me) as d:
            d.expired = True  # what the wheel does when it fires: mark, then cancel
            me.cancel()
            me.cancel()  # the outside one
            await asyncio.sleep(5)

    with pytest.raises(asyncio.CancelledError):
        await asyncio.ensure_future(body())


async def test_met_deadlines_hold_nothing_and_wake_once() -> None:
    """Deadlines met in time leave no bucket behind, and at most the one timer that finds
    nothing to do (and then sets none): no wake-up per tick."""
    wheel = DeadlineWheel(asyncio.get_running_loop())
    me = _me()
    for _ in range(200):
        with wheel.after(60, me), wheel.after(600, me):
            await asyncio.sleep(0)
    assert len(wheel) == 0 and wheel.buckets == 0
    wheel._fire()  # what the one armed timer does when it comes due
    assert not wheel.armed


async def test_earliest_bucket_is_armed_across_durations() -> None:
    loop = asyncio.get_running_loop()
    wheel = DeadlineWheel(loop)
    me = _me()
    t0 = loop.time()
    with wheel.after(600, me):  # armed for 600 s ...
        with pytest.raises(TimeoutError):
            with wheel.after(0.05, me):  # ... then re-armed for the earlier one
                await asyncio.sleep(5)
        assert wheel.armed  # back to the 600 s one
    assert loop.time() - t0 < 0.5
    assert wheel.buckets == 0


async def test_fired_deadline_takes_its_cancel_back_when_the_block_ends_anyway() -> None:
    """The deadline fired in the loop turn the block finished in: no TimeoutError (nothing was
    interrupted), but the cancellation count is restored, as asyncio.timeout does, so later
    `cancelling()` checks do not mistake it for the client going away."""
    wheel = DeadlineWheel(asyncio.get_running_loop())

    seen: list[int] = []

    async def body() -> None:
        me = _me()
        with wheel.after(5, me) as d:
            d.expired = True  # what the wheel does when it fires: mark, then cancel
            me.cancel()
            seen.append(me.cancelling())
        seen.append(me.cancelling())

    with contextlib.suppress(asyncio.CancelledError):  # the request itself is still pending
        await asyncio.ensure_future(body())
    assert seen == [1, 0]
