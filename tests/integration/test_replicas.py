"""Two gateway replicas behind one load balancer, in front of one emulated SGLang P/D cluster.

Each replica keeps its own state (health, breakers, in-flight counts) and rebuilds it from the
engines alone: nothing is shared between them. Through a round-robin TCP balancer on loopback,
both serve, every answer is the one a single colocated server gives (their SGLang handoffs pick
independent random bootstrap rooms, so concurrent handoffs of both through one pair do not mix),
a prefill that dies is taken out by each replica's own probes while the other prefill serves,
its return is seen by both, and a third replica started afterwards knows the same from its
first probe round."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator

import aiohttp
import pytest

from emulator.api import EmulatorHandle, EmulatorSpec, start_emulator
from gateway.app import Gateway
from gateway.config import GatewayConfig, HealthConfig, ListenConfig, WorkerConfig
from policies.snapshot import Role

MODEL = "m-replicas"


class RoundRobinBalancer:
    """A TCP load balancer: each new client connection goes to the next backend in turn."""

    def __init__(self, backends: list[tuple[str, int]]) -> None:
        self._next = itertools.cycle(backends)
        self.server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = next(self._next)
        up_reader, up_writer = await asyncio.open_connection(host, port)
        a = asyncio.create_task(self._pipe(reader, up_writer))
        b = asyncio.create_task(self._pipe(up_reader, writer))
        self._pipes |= {a, b}
        await asyncio.gather(a, b, return_exceptions=True)
        self._pipes -= {a, b}

    @staticmethod
    async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        finally:
            with contextlib.suppress(Exception):
                dst.close()

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        for t in list(self._pipes):
            t.cancel()
        await self.server.wait_closed()


def prefill_spec(port: int = 0, bootstrap_port: int = 0) -> EmulatorSpec:
    return EmulatorSpec(
        engine="sglang", role="prefill", model=MODEL, port=port, bootstrap_port=bootstrap_port
    )


def gateway(emus: dict[str, EmulatorHandle]) -> Gateway:
    workers = []
    for name, emu in emus.items():
        role = Role.PREFILL if name.startswith("p") else Role.DECODE
        workers.append(
            WorkerConfig(
                url=emu.url,
                role=role,
                id=name,
                bootstrap_port=emu.bootstrap_port if role is Role.PREFILL else None,
            )
        )
    # probes are driven by the test: the periodic round is an hour away
    cfg = GatewayConfig(
        listen=ListenConfig(host="127.0.0.1", port=0),
        workers=tuple(workers),
        health=HealthConfig(interval_s=3600.0, timeout_s=2.0, failure_threshold=1),
    )
    return Gateway(cfg)


@pytest.fixture
async def emus() -> AsyncIterator[dict[str, EmulatorHandle]]:
    handles = {
        "p0": await start_emulator(prefill_spec()),
        "p1": await start_emulator(prefill_spec()),
        "d0": await start_emulator(EmulatorSpec(engine="sglang", role="decode", model=MODEL)),
        "d1": await start_emulator(EmulatorSpec(engine="sglang", role="decode", model=MODEL)),
        "ref": await start_emulator(EmulatorSpec(engine="sglang", role="both", model=MODEL)),
    }
    yield handles
    for h in handles.values():
        with contextlib.suppress(Exception):
            await h.stop()


async def answers(url: str, prompts: list[str]) -> list[tuple[int, str]]:
    # a new connection per request: the balancer spreads connections, not requests
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:

        async def one(prompt: str) -> tuple[int, str]:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
            async with s.post(url + "/v1/completions", json=body) as r:
                out = await r.json(content_type=None)
                return r.status, out["choices"][0]["text"] if r.status == 200 else str(out)

        return list(await asyncio.gather(*(one(p) for p in prompts)))


def served(gw: Gateway) -> float:
    return sum(
        c.value for (route, _, plan, outcome), c in gw.metrics.requests._children.items() if outcome == "ok"
    )


def healthy(gw: Gateway) -> dict[str, bool]:
    return {w.id: w.healthy for w in gw.registry.workers()}


async def test_two_replicas_behind_a_balancer_stay_correct(emus: dict[str, EmulatorHandle]) -> None:
    cluster = {k: v for k, v in emus.items() if k != "ref"}
    a, b = gateway(cluster), gateway(cluster)
    await a.start()
    await b.start()
    lb = RoundRobinBalancer([("127.0.0.1", a.port), ("127.0.0.1", b.port)])
    url = await lb.start()
    prompts = [f"prompt number {i}" for i in range(24)]
    try:
        expected = [text for _, text in await answers(emus["ref"].url, prompts)]
        got = await answers(url, prompts)
        assert got == [(200, t) for t in expected]
        assert served(a) == served(b) == len(prompts) / 2  # both replicas served, half each

        # a prefill dies: each replica finds out by its own probe, the other prefill serves
        port, boot = emus["p0"].port, emus["p0"].bootstrap_port
        await emus["p0"].stop()
        for gw in (a, b):
            await gw.health.probe_all()
            assert healthy(gw) == {"p0": False, "p1": True, "d0": True, "d1": True}
        got = await answers(url, prompts)
        assert got == [(200, t) for t in expected]

        # it comes back on its address: both replicas take it back, each from its own probe
        emus["p0"] = await start_emulator(prefill_spec(port, boot))
        for gw in (a, b):
            await gw.health.probe_all()
            assert all(healthy(gw).values())

        # a third replica, started now, knows the same from the engines alone
        c = gateway(cluster)
        await c.start()
        try:
            assert healthy(c) == healthy(a) == healthy(b)
            assert {w.id: w.model for w in c.registry.workers()} == {
                w.id: w.model for w in a.registry.workers()
            }
        finally:
            await c.stop(grace_s=1.0)
        got = await answers(url, prompts)
        assert got == [(200, t) for t in expected]
    finally:
        await lb.close()
        await a.stop(grace_s=1.0)
        await b.stop(grace_s=1.0)
