"""`cache_aware` told the SLOs behind a real gateway (emulated SGLang workers, real sockets, the
real `openai` client): the streams' outcomes reach its decode model, which learns each worker's
time per token from them and lets go of every answer once it has come."""

from __future__ import annotations

import asyncio
import math

from openai import AsyncOpenAI

from common.workers import Engine, Role
from emulator.api import EmulatorSpec, start_emulator
from gateway.app import Gateway
from gateway.config import GatewayConfig, HealthConfig, ListenConfig, WorkerConfig
from policies.cache_aware import CacheState
from policies.config import CacheAwareCfg

MODEL = "m-sgl"


async def test_streams_teach_the_time_per_token_and_leave_nothing_held() -> None:
    # timed (tokens a step apart, not in one burst), so each stream measures its time per token
    emus = [
        await start_emulator(EmulatorSpec(engine="sglang", role="both", model=MODEL, time_scale=1.0))
        for _ in range(2)
    ]
    workers = tuple(
        WorkerConfig(url=e.url, role=Role.COLOCATED, engine=Engine.SGLANG, id=f"w{i}")
        for i, e in enumerate(emus)
    )
    ids = [f"w{i}" for i in range(len(emus))]
    cfg = GatewayConfig(
        listen=ListenConfig(host="127.0.0.1", port=0),
        workers=workers,
        policy=CacheAwareCfg(index="approximate", seed=1, tpot_slo_x=5.0),
        health=HealthConfig(interval_s=0.5, timeout_s=2.0),
    )
    gw = Gateway(cfg)
    await gw.start()
    try:
        st: CacheState = gw.policy.prefill.state  # type: ignore[attr-defined]
        assert st.slo is not None
        client = AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)

        async def one(i: int) -> int:
            got = await client.completions.create(
                model=MODEL,
                prompt=list(range(3 + i, 203 + i)),
                max_tokens=40,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            return sum([1 async for _ in got])

        assert all(n > 0 for n in await asyncio.gather(*(one(i) for i in range(8))))
        await client.close()
        async with asyncio.timeout(5):  # an outcome is told just after the answer's last byte
            while True:
                if not any(st.slo._held.get(wid) for wid in ids) and st.slo._best:
                    break
                await asyncio.sleep(0.01)
        for wid in ids:  # its own streams', or (none routed there) its peer's
            best = st.slo.best(wid)
            assert math.isfinite(best) and 0 < best < 1.0
    finally:
        await gw.stop(grace_s=1.0)
        for e in emus:
            await e.stop()
