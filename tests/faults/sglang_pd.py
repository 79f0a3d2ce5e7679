"""An in-process gateway in front of emulated SGLang prefills and one decode, for tests that need
their own topology or faults (tests/integration/conftest.py's `build_cluster` has one fixed pair
per engine)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from common.workers import Engine, Role
from emulator.api import EmulatorHandle, EmulatorSpec, start_emulator
from gateway.app import Gateway
from gateway.config import GatewayConfig, HealthConfig, ListenConfig, WorkerConfig


class SGLangPD:
    """The gateway, its emulated prefills (worker ids "p", or "p1".."pN" for several) and its
    decode (worker id "d")."""

    def __init__(self, gateway: Gateway, prefills: list[EmulatorHandle], decode: EmulatorHandle) -> None:
        self.gateway = gateway
        self.prefills = prefills
        self.decode = decode

    @property
    def url(self) -> str:
        return self.gateway.url


@asynccontextmanager
async def sglang_pd(
    prefills: list[EmulatorSpec] | int = 1,
    decode: EmulatorSpec | None = None,
    *,
    time_scale: float = 0.0,
    **config: Any,
) -> AsyncIterator[SGLangPD]:
    """`prefills`: their specs, or how many plain ones; `decode`: its spec (plain by default),
    all serving model "m". `config`: GatewayConfig fields (the health loop is idle unless given)."""
    if isinstance(prefills, int):
        prefills = [
            EmulatorSpec(engine="sglang", role="prefill", model="m", time_scale=time_scale)
        ] * prefills
    decode = decode or EmulatorSpec(engine="sglang", role="decode", model="m", time_scale=time_scale)
    ps = [await start_emulator(spec) for spec in prefills]
    d = await start_emulator(decode)
    ids = ["p"] if len(ps) == 1 else [f"p{k + 1}" for k in range(len(ps))]
    config.setdefault("health", HealthConfig(interval_s=3600.0, timeout_s=2.0))
    gw = Gateway(
        GatewayConfig(
            listen=ListenConfig(host="127.0.0.1", port=0),
            workers=(
                *(
                    WorkerConfig(
                        url=p.url,
                        role=Role.PREFILL,
                        engine=Engine.SGLANG,
                        id=i,
                        bootstrap_port=p.bootstrap_port,
                    )
                    for i, p in zip(ids, ps, strict=True)
                ),
                WorkerConfig(url=d.url, role=Role.DECODE, engine=Engine.SGLANG, id="d"),
            ),
            **config,
        )
    )
    await gw.start()
    try:
        yield SGLangPD(gw, ps, d)
    finally:
        await gw.stop(grace_s=0.5)
        for e in (*ps, d):
            await e.stop()
