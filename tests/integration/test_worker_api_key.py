"""A worker's API key (`api_key_env`) goes with every request the gateway makes to it: its health
probes, model listing and metrics scrapes too, not only the clients' requests. A hosted endpoint
that asks for the key on every path (as OpenAI-compatible services do) was never healthy."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from common.workers import Engine, Role
from gateway.app import Gateway
from gateway.config import GatewayConfig, HealthConfig, ListenConfig, WorkerConfig
from tests.integration.conftest import build_cluster, serve_app, stop_cluster
from tests.integration.test_gateway import body_for, post

KEY = "hosted-secret"


async def start_hosted(
    seen: list[tuple[str, str | None]], *, probes_too: bool = True
) -> tuple[web.AppRunner, str]:
    """An OpenAI-compatible server that answers 401 to anything without `Bearer KEY` (with
    `probes_too` false: only to completions)."""

    @web.middleware
    async def auth(request: web.Request, handler: object) -> web.StreamResponse:
        got = request.headers.get("Authorization")
        seen.append((request.path, got))
        if got != f"Bearer {KEY}" and (probes_too or request.path == "/v1/completions"):
            return web.json_response(
                {"error": {"message": "bad key", "type": "invalid_request_error", "code": "invalid_api_key"}},
                status=401,
            )
        return await handler(request)  # type: ignore[operator, no-any-return]

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(_: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": "hosted", "object": "model", "max_model_len": 4096}]}
        )

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "created": 0,
                "model": body["model"],
                "choices": [{"index": 0, "text": " fine", "finish_reason": "length", "logprobs": None}],
                "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
            }
        )

    app = web.Application(middlewares=[auth])
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", completions)
    return await serve_app(app)


async def test_probes_and_requests_carry_the_workers_key_and_never_the_clients() -> None:
    seen: list[tuple[str, str | None]] = []
    runner, url = await start_hosted(seen)
    cfg = GatewayConfig(
        listen=ListenConfig(host="127.0.0.1", port=0),
        workers=(
            WorkerConfig(
                url=url, role=Role.COLOCATED, engine=Engine.OPENAI, id="hosted", api_key_env="PDGW_TEST_KEY"
            ),
        ),
        health=HealthConfig(interval_s=0.2, timeout_s=2.0, scrape_interval_s=0.05),
    )
    gw = Gateway(cfg, environ={"PDGW_TEST_KEY": KEY})
    await gw.start()
    try:
        status, _, raw = await post(
            gw.url + "/v1/completions",
            {"model": "hosted", "prompt": "hi", "max_tokens": 1},
            headers={"Authorization": "Bearer the-clients-own"},
        )
        assert status == 200, raw
        assert json.loads(raw)["choices"][0]["text"] == " fine"
        for _ in range(100):  # the load scrape runs on its own clock
            if any(p == "/metrics" for p, _ in seen):
                break
            await asyncio.sleep(0.02)
        paths = {p for p, _ in seen}
        assert {"/health", "/v1/models", "/metrics", "/v1/completions"} <= paths, seen
        assert all(got == f"Bearer {KEY}" for _, got in seen), seen
        w = gw.registry.get("hosted")
        assert w.healthy and w.info.context_length == 4096
    finally:
        await gw.stop(grace_s=0.5)
        await runner.cleanup()


async def test_the_clients_authorization_is_passed_on_only_with_forward_authorization() -> None:
    seen: list[tuple[str, str | None]] = []
    runner, url = await start_hosted(seen, probes_too=False)
    try:
        for forward in (False, True):
            cfg = GatewayConfig(
                listen=ListenConfig(host="127.0.0.1", port=0),
                workers=(WorkerConfig(url=url, role=Role.COLOCATED, engine=Engine.OPENAI, id="hosted"),),
                health=HealthConfig(interval_s=3600.0, timeout_s=2.0),
                forward_authorization=forward,
            )
            gw = Gateway(cfg, environ={})
            await gw.start()
            try:
                seen.clear()
                status, _, raw = await post(
                    gw.url + "/v1/completions",
                    {"model": "hosted", "prompt": "hi", "max_tokens": 1},
                    headers={"Authorization": f"Bearer {KEY}"},
                )
                sent = [got for path, got in seen if path == "/v1/completions"]
                if forward:
                    assert status == 200, raw
                    assert sent == [f"Bearer {KEY}"]
                else:
                    assert status == 401, raw  # the worker's refusal, told in OpenAI's shape
                    assert json.loads(raw)["error"]["message"]
                    assert sent == [None]
            finally:
                await gw.stop(grace_s=0.5)
    finally:
        await runner.cleanup()


async def test_engines_run_with_api_key_refuse_nothing_the_gateway_sends() -> None:
    """Every engine of the cluster runs with `--api-key` (the emulator checks the paths each
    engine checks: SGLang all but /health and /metrics, vLLM those under /v1). Probes, info,
    load scrapes, both legs of each handoff, and the aborts of failed and abandoned requests all
    carry the key: no engine turns one away, and every request's work ends on the engines."""
    c = await build_cluster(
        time_scale=1.0,  # real delays: a stream is still running when its client leaves
        api_key=KEY,
        faults={"sgl-d": ["http_error:0.5"], "vllm-d": ["http_error:0.5"]},
        health=HealthConfig(interval_s=0.2, timeout_s=2.0, scrape_interval_s=0.05),
    )
    try:
        for name in c.emulators:
            for _ in range(100):
                if c.gateway.registry.get(name).healthy:
                    break
                await asyncio.sleep(0.02)
            assert c.gateway.registry.get(name).healthy, name
        for model in ("m-sglang", "m-vllm", "m-colocated"):
            for i in range(6):
                body = body_for("/v1/completions", model, f"keyed {i}", False, max_tokens=3)
                status, _, raw = await post(c.url + "/v1/completions", body)
                assert status in (200, 502, 503), raw  # the decode faults may exhaust the ladder
            body = body_for("/v1/completions", model, "a long keyed story", True, max_tokens=2000)
            async with aiohttp.ClientSession() as s:
                async with s.post(c.url + "/v1/completions", json=body) as r:
                    if r.status == 200:
                        await r.content.readany()  # then leave mid-stream
        for _ in range(200):
            stats = {n: await h.stats() for n, h in c.emulators.items()}
            if all(st["in_flight"] == 0 for st in stats.values()):
                break
            await asyncio.sleep(0.05)
        assert all(st["in_flight"] == 0 for st in stats.values()), stats
        assert {n: st["unauthorized"] for n, st in stats.items()} == dict.fromkeys(c.emulators, 0)
        assert sum(st["received"] for st in stats.values()) > 0
    finally:
        await stop_cluster(c)
