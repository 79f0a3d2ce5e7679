"""Workers are told apart by the server they reach, not by how their URL is spelled: one
server under two names (`localhost` and `127.0.0.1`) is refused at start and by the admin API
(it would take two shares of the traffic and count twice); and IPv6 workers (`http://[::1]:P`)
work, SGLang's `bootstrap_host` included."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from common.workers import Engine, Role
from emulator.api import EmulatorHandle, EmulatorSpec, start_emulator
from gateway.app import Gateway
from gateway.config import AdminConfig, ConfigError, GatewayConfig, HealthConfig, ListenConfig, WorkerConfig

TOKEN = "addresses-token"
BIN = Path(sys.executable).parent / "pd-gateway"


def config(*workers: WorkerConfig, **kw: Any) -> GatewayConfig:
    return GatewayConfig(
        listen=ListenConfig(host="127.0.0.1", port=0),
        workers=workers,
        health=HealthConfig(interval_s=3600.0, timeout_s=2.0),
        **kw,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


async def test_one_server_under_two_names_is_refused_at_start() -> None:
    port = _free_port()
    gw = Gateway(
        config(
            WorkerConfig(url=f"http://127.0.0.1:{port}", role=Role.PREFILL, engine=Engine.VLLM, id="a"),
            WorkerConfig(url=f"http://localhost:{port}", role=Role.DECODE, engine=Engine.VLLM, id="b"),
        )
    )
    with pytest.raises(
        ConfigError, match=rf"workers 'a' and 'b' are one server \(both reach 127\.0\.0\.1 port {port}\)"
    ):
        await gw.start()
    await gw.stop(grace_s=0.1)


async def test_same_host_other_ports_are_two_workers() -> None:
    ports = _free_port(), _free_port()
    gw = Gateway(
        config(
            WorkerConfig(url=f"http://127.0.0.1:{ports[0]}", role=Role.PREFILL, engine=Engine.VLLM),
            WorkerConfig(url=f"http://localhost:{ports[1]}", role=Role.DECODE, engine=Engine.VLLM),
        )
    )
    await gw.start()
    try:
        assert len(gw.registry) == 2
    finally:
        await gw.stop(grace_s=0.1)


def test_serve_says_so_in_one_line_and_exits_2() -> None:
    port = _free_port()
    p = subprocess.run(
        [
            str(BIN),
            "serve",
            "--worker",
            f"http://127.0.0.1:{port}",
            "--worker",
            f"http://localhost:{port}",
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "are one server" in lines[0] and "Traceback" not in p.stderr, p.stderr


@pytest.fixture
async def admin_gw() -> AsyncIterator[tuple[Gateway, EmulatorHandle, EmulatorHandle]]:
    col = await start_emulator(EmulatorSpec(engine="vllm", role="both", model="m-addr"))
    spare = await start_emulator(EmulatorSpec(engine="vllm", role="both", model="m-addr"))
    wc = WorkerConfig(url=col.url, role=Role.COLOCATED, engine=Engine.VLLM, id="col")
    gw = Gateway(config(wc, admin=AdminConfig(token=TOKEN)))
    await gw.start()
    try:
        yield gw, col, spare
    finally:
        await gw.stop(grace_s=1.0)
        await col.stop()
        await spare.stop()


async def add(gw: Gateway, body: dict[str, Any]) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw.url + "/admin/workers", data=json.dumps(body), headers=headers) as r,
    ):
        return r.status, json.loads(await r.read())


async def test_admin_add_of_a_known_server_under_another_name_is_a_409(
    admin_gw: tuple[Gateway, EmulatorHandle, EmulatorHandle],
) -> None:
    gw, col, spare = admin_gw
    status, out = await add(gw, {"url": f"http://localhost:{col.port}", "role": "colocated", "id": "twin"})
    assert status == 409, out
    err = out["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == "url", err
    assert "'col'" in err["message"] and "same server" in err["message"], err
    assert [w.id for w in gw.registry.workers()] == ["col"]
    # a different server on the same host is still welcome
    status, out = await add(gw, {"url": f"http://localhost:{spare.port}", "role": "colocated", "id": "spare"})
    assert status in (200, 201), out
    assert sorted(w.id for w in gw.registry.workers()) == ["col", "spare"]


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_ipv6_workers_serve_pd(engine: str) -> None:
    """Worker URLs with an IPv6 address in brackets: the gateway reaches them, and an SGLang
    decode is told the prefill's real host (`bootstrap_host` was 127.0.0.1 for any IPv6 URL)."""
    model = f"m6-{engine}"
    kind: Any = engine
    boot = 0 if engine == "sglang" else None  # 0: a free port
    pre = await start_emulator(
        EmulatorSpec(engine=kind, role="prefill", host="::1", model=model, bootstrap_port=boot)
    )
    dec = await start_emulator(EmulatorSpec(engine=kind, role="decode", host="::1", model=model))
    ref = await start_emulator(EmulatorSpec(engine=kind, role="both", model=model))
    assert pre.url.startswith("http://[::1]:"), pre.url
    eng = Engine(engine)
    gw = Gateway(
        config(
            WorkerConfig(
                url=pre.url,
                role=Role.PREFILL,
                engine=eng,
                bootstrap_port=pre.bootstrap_port if engine == "sglang" else None,
            ),
            WorkerConfig(url=dec.url, role=Role.DECODE, engine=eng),
        )
    )
    await gw.start()
    try:
        body = {"model": model, "prompt": "IPv6 all the way down", "max_tokens": 8, "temperature": 0}
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                got = json.loads(await r.read())
            async with s.post(ref.url + "/v1/completions", json=body) as r:
                want = json.loads(await r.read())
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        assert [w.url for w in gw.registry.workers()] == [pre.url, dec.url]
    finally:
        await gw.stop(grace_s=1.0)
        for e in (pre, dec, ref):
            await e.stop()


async def test_readiness_of_one_model() -> None:
    """`/readiness` is 503 while any model lacks a usable route; `?model=` (repeatable) asks only
    about the named models, so a load balancer for one model's traffic is not told "not ready"
    because another model is down."""
    col = await start_emulator(EmulatorSpec(engine="vllm", role="both", model="up"))
    gw = Gateway(
        config(
            WorkerConfig(url=col.url, role=Role.COLOCATED, engine=Engine.VLLM),
            WorkerConfig(
                url=f"http://127.0.0.1:{_free_port()}", role=Role.COLOCATED, engine=Engine.VLLM, model="down"
            ),
        )
    )
    await gw.start()
    try:
        async with aiohttp.ClientSession() as s:

            async def ready(query: str) -> tuple[int, Any]:
                async with s.get(gw.url + "/readiness" + query) as r:
                    return r.status, await r.json()

            assert await ready("") == (
                503,
                {"ready": False, "models": {"up": ["colocated:vllm"], "down": []}},
            )
            assert await ready("?model=up") == (200, {"ready": True, "models": {"up": ["colocated:vllm"]}})
            assert await ready("?model=down") == (503, {"ready": False, "models": {"down": []}})
            assert await ready("?model=nope") == (503, {"ready": False, "models": {"nope": []}})
            status, out = await ready("?model=up&model=down")
            assert status == 503 and set(out["models"]) == {"up", "down"}
    finally:
        await gw.stop(grace_s=1.0)
        await col.stop()
