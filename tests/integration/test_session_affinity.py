"""`session_affinity` through a real gateway in front of three emulated colocated workers, with
the `openai` client: a conversation keyed by the `x-session-id` header (or, without it, the body's
`user`) lands on one worker every turn; different sessions spread."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest

from common.workers import Engine, Role
from emulator.api import EmulatorHandle, EmulatorSpec, start_emulator
from gateway.app import Gateway
from gateway.config import GatewayConfig, HealthConfig, ListenConfig, WorkerConfig
from policies.config import SessionAffinityCfg


@pytest.fixture
async def sticky() -> AsyncIterator[tuple[Gateway, dict[str, EmulatorHandle]]]:
    emus = {
        f"c{i}": await start_emulator(EmulatorSpec(engine="vllm", role="both", model="m")) for i in range(3)
    }
    workers = tuple(
        WorkerConfig(url=h.url, role=Role.COLOCATED, engine=Engine.VLLM, id=n) for n, h in emus.items()
    )
    cfg = GatewayConfig(
        listen=ListenConfig(host="127.0.0.1", port=0),
        workers=workers,
        policy=SessionAffinityCfg(),
        health=HealthConfig(interval_s=0.5, timeout_s=2.0),
    )
    gw = Gateway(cfg)
    await gw.start()
    try:
        yield gw, emus
    finally:
        await gw.stop(grace_s=1.0)
        for h in emus.values():
            await h.stop()


async def _received(emus: dict[str, EmulatorHandle]) -> dict[str, int]:
    return {n: (await h.stats())["received"] for n, h in emus.items()}


async def _turns(client: openai.AsyncOpenAI, n: int, **kw: object) -> None:
    for i in range(n):
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"turn {i}"}], max_tokens=2, **kw
        )  # type: ignore[call-overload]


async def test_a_session_sticks_to_one_worker(sticky: tuple[Gateway, dict[str, EmulatorHandle]]) -> None:
    gw, emus = sticky
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
    homes = set()
    for key in ("alpha", "beta", "gamma", "delta", "epsilon", "zeta"):
        before = await _received(emus)
        await _turns(client, 4, extra_headers={"x-session-id": key})
        after = await _received(emus)
        got = {n: after[n] - before[n] for n in emus if after[n] != before[n]}
        assert len(got) == 1 and next(iter(got.values())) == 4, (key, got)
        homes |= set(got)
    assert len(homes) >= 2  # sessions spread
    # OpenAI's `user` keys the session when no header does; the header comes first
    before = await _received(emus)
    await _turns(client, 3, user="user-7")
    after = await _received(emus)
    by_user = [n for n in emus if after[n] != before[n]]
    assert len(by_user) == 1
    before = await _received(emus)
    await _turns(client, 3, user="user-7", extra_headers={"x-session-id": "alpha"})
    await _turns(client, 1, extra_headers={"x-session-id": "alpha"})
    after = await _received(emus)
    assert len([n for n in emus if after[n] != before[n]]) == 1
