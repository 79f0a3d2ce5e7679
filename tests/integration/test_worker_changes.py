"""In process on loopback: a worker that comes back serving another model or context
length is known as it is now at its first good probe; a worker set that can never serve a model
is warned about at start and after admin changes; admin worker URLs with a path and non-finite
weights are clear 400s; the listening address is bound before any worker is probed."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from structlog.testing import capture_logs

from common.workers import Engine, Role
from emulator.api import EmulatorHandle, EmulatorSpec, start_emulator
from gateway.app import Gateway
from gateway.config import AdminConfig, GatewayConfig, HealthConfig, ListenConfig, WorkerConfig
from gateway.listen import ListenError
from tests.integration.conftest import serve_app

TOKEN = "ops-fixes-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def config(*workers: WorkerConfig, failure_threshold: int = 1, **kw: Any) -> GatewayConfig:
    # probes are driven by the tests (the loop's first round is an hour away)
    return GatewayConfig(
        listen=ListenConfig(host="127.0.0.1", port=0),
        workers=workers,
        health=HealthConfig(interval_s=3600.0, timeout_s=2.0, failure_threshold=failure_threshold),
        **kw,
    )


async def call(
    gw: Gateway, method: str, path: str, body: Any = None, raw: bytes | None = None
) -> tuple[int, Any]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, gw.url + path, data=data, headers=AUTH | {"content-type": "application/json"}) as r,
    ):
        text = await r.read()
        return r.status, json.loads(text) if text else None


async def models(gw: Gateway) -> list[tuple[str, int | None]]:
    status, out = await call(gw, "GET", "/v1/models")
    assert status == 200, out
    return [(m["id"], m.get("max_model_len")) for m in out["data"]]


async def restart(emu: EmulatorHandle, model: str, max_model_len: int) -> EmulatorHandle:
    port = emu.port
    await emu.stop()
    for _ in range(50):  # the port is free again at once (SO_REUSEADDR); retry a moment if not
        try:
            return await start_emulator(
                EmulatorSpec(engine="vllm", role="both", port=port, model=model, max_model_len=max_model_len)
            )
        except OSError:
            await asyncio.sleep(0.1)
    raise AssertionError(f"port {port} not free again")


# -- a worker restarted with another model / context length (defect 1) ----------------------


@pytest.mark.parametrize("seen_down", [True, False], ids=["marked-unhealthy", "one-failed-probe"])
async def test_restarted_worker_is_known_as_it_is_now_at_its_first_good_probe(seen_down: bool) -> None:
    emu = await start_emulator(
        EmulatorSpec(engine="vllm", role="both", model="model-old", max_model_len=8192)
    )
    wc = WorkerConfig(url=emu.url, role=Role.COLOCATED, engine=Engine.VLLM, id="a")
    # seen_down: one failed probe marks it unhealthy; else it stays healthy (threshold 3)
    gw = Gateway(config(wc, failure_threshold=1 if seen_down else 3))
    await gw.start()
    try:
        w = gw.registry.get("a")
        assert (w.model, w.info.context_length, w.healthy) == ("model-old", 8192, True)
        for _ in range(3):  # a few good probes: the next periodic info read is still far off
            assert await gw.health.probe(w)
        await emu.stop()
        assert not await gw.health.probe(w)
        assert w.healthy is not seen_down
        emu = await restart(emu, "model-new", 512)
        assert await gw.health.probe(w)
        assert (w.model, w.info.context_length, w.healthy) == ("model-new", 512, True)
        assert await models(gw) == [("model-new", 512)]
        body = {"model": "model-new", "prompt": "hi", "max_tokens": 4}
        status, out = await call(gw, "POST", "/v1/completions", body)
        assert status == 200, out
        status, out = await call(gw, "POST", "/v1/completions", body | {"model": "model-old"})
        assert status == 404, out
        # the length preflight uses the new context length (512), not the old one (8192)
        status, out = await call(gw, "POST", "/v1/completions", body | {"max_tokens": 1000})
        assert status == 400, out
    finally:
        await gw.stop(grace_s=1.0)
        await emu.stop()


# -- models a worker set can never serve (defect 5) ------------------------------------------


def unservable(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == "cluster.model_unservable"]


async def test_lone_sglang_decode_is_warned_about_at_start_and_after_admin_changes() -> None:
    decode = await start_emulator(EmulatorSpec(engine="sglang", role="decode", model="m-lone"))
    prefill = await start_emulator(EmulatorSpec(engine="sglang", role="prefill", model="m-lone"))
    wc = WorkerConfig(url=decode.url, role=Role.DECODE, engine=Engine.SGLANG, id="d0")
    gw = Gateway(config(wc, admin=AdminConfig(token=TOKEN)))
    try:
        with capture_logs() as logs:
            await gw.start()
        warned = unservable(logs)
        assert len(warned) == 1 and warned[0]["log_level"] == "warning", logs
        assert warned[0]["model"] == "m-lone"
        assert (
            warned[0]["missing"]
            == "a sglang prefill worker for the decode worker(s) ['d0'], or a colocated worker"
        )
        status, out = await call(
            gw, "POST", "/v1/completions", {"model": "m-lone", "prompt": "x", "max_tokens": 2}
        )
        assert status == 503, out

        with capture_logs() as logs:
            await gw.health.probe_all()  # the next round does not repeat it
        assert unservable(logs) == []

        add = {"url": prefill.url, "role": "prefill", "id": "p0", "bootstrap_port": prefill.bootstrap_port}
        with capture_logs() as logs:
            status, out = await call(gw, "POST", "/admin/workers", add)
        assert status == 201, out
        assert [e["model"] for e in logs if e["event"] == "cluster.model_servable"] == ["m-lone"]
        status, out = await call(
            gw, "POST", "/v1/completions", {"model": "m-lone", "prompt": "x", "max_tokens": 2}
        )
        assert status == 200, out

        with capture_logs() as logs:
            status, out = await call(gw, "DELETE", "/admin/workers/p0")
        assert status == 200, out
        assert [e["model"] for e in unservable(logs)] == ["m-lone"]
    finally:
        await gw.stop(grace_s=1.0)
        await decode.stop()
        await prefill.stop()


async def test_servable_pair_is_not_warned_about() -> None:
    decode = await start_emulator(EmulatorSpec(engine="sglang", role="decode", model="m-pair"))
    prefill = await start_emulator(EmulatorSpec(engine="sglang", role="prefill", model="m-pair"))
    gw = Gateway(
        config(
            WorkerConfig(url=decode.url, role=Role.DECODE, engine=Engine.SGLANG, id="d0"),
            WorkerConfig(
                url=prefill.url,
                role=Role.PREFILL,
                engine=Engine.SGLANG,
                id="p0",
                bootstrap_port=prefill.bootstrap_port,
            ),
        )
    )
    try:
        with capture_logs() as logs:
            await gw.start()
        assert unservable(logs) == []
    finally:
        await gw.stop(grace_s=1.0)
        await decode.stop()
        await prefill.stop()


# -- admin input errors (defect 4) -----------------------------------------------------------


@pytest.fixture
async def admin_gw() -> AsyncIterator[tuple[Gateway, EmulatorHandle]]:
    col = await start_emulator(EmulatorSpec(engine="vllm", role="both", model="m-admin"))
    spare = await start_emulator(EmulatorSpec(engine="vllm", role="both", model="m-admin"))
    wc = WorkerConfig(url=col.url, role=Role.COLOCATED, engine=Engine.VLLM, id="col")
    gw = Gateway(config(wc, admin=AdminConfig(token=TOKEN)))
    await gw.start()
    try:
        yield gw, spare
    finally:
        await gw.stop(grace_s=1.0)
        await col.stop()
        await spare.stop()


def openai_error(out: Any) -> dict[str, Any]:
    assert isinstance(out, dict) and set(out["error"]) == {"message", "type", "param", "code"}, out
    err: dict[str, Any] = out["error"]
    return err


@pytest.mark.parametrize(
    ("suffix", "needle"),
    [
        ("/v1", "without a path (/v1)"),
        ("/v1/chat/completions", "without a path"),
        ("?x=1", "without a query"),
    ],
)
async def test_admin_add_with_a_url_path_is_a_400_not_a_silent_cut(
    admin_gw: tuple[Gateway, EmulatorHandle], suffix: str, needle: str
) -> None:
    gw, spare = admin_gw
    status, out = await call(gw, "POST", "/admin/workers", {"url": spare.url + suffix, "role": "colocated"})
    assert status == 400, out
    err = openai_error(out)
    assert needle in err["message"] and err["type"] == "invalid_request_error", err
    assert len(gw.registry) == 1


@pytest.mark.parametrize("weight", [b"1e400", b"Infinity", b"-Infinity", b"NaN"])
async def test_admin_add_with_a_non_finite_weight_names_the_weight(
    admin_gw: tuple[Gateway, EmulatorHandle], weight: bytes
) -> None:
    gw, spare = admin_gw
    raw = b'{"url": "%s", "role": "colocated", "weight": %s}' % (spare.url.encode(), weight)
    status, out = await call(gw, "POST", "/admin/workers", raw=raw)
    assert status == 400, out
    err = openai_error(out)
    assert err["code"] != "invalid_json" and "weight" in err["message"], err
    assert len(gw.registry) == 1


async def test_admin_add_malformed_json_is_still_invalid_json(
    admin_gw: tuple[Gateway, EmulatorHandle],
) -> None:
    gw, _ = admin_gw
    for raw in (b"{not json", b'{"url": Infinity', b""):
        status, out = await call(gw, "POST", "/admin/workers", raw=raw)
        assert status == 400 and openai_error(out)["code"] == "invalid_json", (raw, out)


# -- the listening address is bound before any probe (defect 3) ------------------------------


async def test_a_taken_port_fails_start_before_any_worker_is_probed() -> None:
    # a worker that accepts connections and never answers: probing it takes the whole timeout
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    wc = WorkerConfig(
        url=f"http://127.0.0.1:{silent.getsockname()[1]}", role=Role.COLOCATED, engine=Engine.OPENAI
    )
    cfg = GatewayConfig(
        listen=ListenConfig(host="127.0.0.1", port=busy.getsockname()[1]),
        workers=(wc,),
        health=HealthConfig(timeout_s=30.0),
    )
    gw = Gateway(cfg)
    t0 = time.monotonic()
    try:
        with pytest.raises(ListenError, match="Address already in use"):
            await gw.start()
        assert time.monotonic() - t0 < 10.0
        with pytest.raises(ListenError, match=r"cannot listen on no-such-host\.invalid:0"):
            await Gateway(
                GatewayConfig(listen=ListenConfig(host="no-such-host.invalid", port=0), workers=(wc,))
            ).start()
    finally:
        await gw.stop(grace_s=0.1)
        silent.close()
        busy.close()


async def test_start_still_listens_where_configured() -> None:
    emu = await start_emulator(EmulatorSpec(engine="vllm", role="both", model="m-listen"))
    gw = Gateway(config(WorkerConfig(url=emu.url, role=Role.COLOCATED, engine=Engine.VLLM)))
    try:
        await gw.start()
        assert gw.port != 0
        assert await models(gw) == [("m-listen", 8192)]
    finally:
        await gw.stop(grace_s=1.0)
        await emu.stop()


async def test_a_partial_info_answer_after_a_failed_probe_keeps_what_is_known() -> None:
    """After a failed probe the info is read afresh, but only a whole answer replaces it: an
    SGLang server whose /server_info fails that once keeps its known input limit (the length
    preflight would be off for it until the next periodic read)."""
    from aiohttp import web

    up = {"health": True, "server_info": True}

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200 if up["health"] else 503)

    async def models_(_: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": 4096}]}
        )

    async def server_info(_: web.Request) -> web.Response:
        if not up["server_info"]:
            return web.Response(status=500)
        return web.json_response({"context_length": 4096, "max_req_input_len": 1000})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models_)
    app.router.add_get("/server_info", server_info)
    runner, url = await serve_app(app)
    wc = WorkerConfig(url=url, role=Role.COLOCATED, engine=Engine.SGLANG, id="s")
    gw = Gateway(config(wc, failure_threshold=3))
    await gw.start()
    try:
        w = gw.registry.get("s")
        assert (w.model, w.info.context_length, w.info.max_input_len) == ("m", 4096, 1000)
        up["health"] = False
        assert not await gw.health.probe(w)
        up["health"], up["server_info"] = True, False
        assert await gw.health.probe(w)
        assert (w.model, w.info.context_length, w.info.max_input_len) == ("m", 4096, 1000)
    finally:
        await gw.stop(grace_s=1.0)
        await runner.cleanup()
