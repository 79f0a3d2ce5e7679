"""What clients are told of failures (issue #27, item 8), against real emulator servers: an
engine's failure reaches its client as a stable OpenAI-shaped error with the request id, never
the worker's address (a worker's id is its address unless configured) nor the engine's own
words (a traceback, a peer's address, a bootstrap room); those go to the gateway's log line of
the request. An engine's refusal of the request itself (a 4xx) is passed on, unless its text
names an address."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from structlog.testing import capture_logs

from emulator.api import EmulatorHandle, EmulatorSpec, start_emulator
from gateway.app import Gateway
from gateway.config import GatewayConfig, ListenConfig, RetriesConfig, TimeoutsConfig, WorkerConfig
from policies.snapshot import Engine, Role

# what an engine may say of a failure on its side (a peer's address, a room, a traceback)
LEAK = "Traceback (most recent call last): KV from 10.0.3.7:8998 bootstrap_room 4242 failed"
BODY = {"model": "m", "prompt": "hello", "max_tokens": 2}


async def one_worker(faults: list[str], **cfg: Any) -> tuple[EmulatorHandle, Gateway]:
    e = await start_emulator(EmulatorSpec(engine="vllm", role="both", model="m", faults=faults))
    # no id: the worker is known by its address, which no client may read
    worker = WorkerConfig(url=e.url, role=Role.COLOCATED, engine=Engine.VLLM)
    gw = Gateway(
        GatewayConfig(
            listen=ListenConfig(host="127.0.0.1", port=0),
            workers=(worker,),
            retries=RetriesConfig(max_attempts=1),
            **cfg,
        )
    )
    await gw.start()
    return e, gw


async def post(url: str, body: dict[str, Any]) -> tuple[int, str, str]:
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        return r.status, (await r.read()).decode(), r.headers["x-request-id"]


def assert_no_internals(raw: str, e: EmulatorHandle) -> None:
    host_port = e.url.split("//", 1)[1]
    for leak in (host_port, str(e.port), "10.0.3.7", "Traceback", "bootstrap_room", "4242"):
        assert leak not in raw, (leak, raw)


async def test_an_engine_failure_is_a_stable_error_with_the_request_id() -> None:
    e, gw = await one_worker([f"http_error,status=500,message={LEAK}"])
    try:
        with capture_logs() as logs:
            status, raw, rid = await post(gw.url, BODY)
        assert status in (502, 503), raw
        err = json.loads(raw)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "server_error"
        assert rid in err["message"], err  # the client can quote it; the log has the rest
        assert_no_internals(raw, e)
        done = next(x for x in logs if x["event"] == "request.done")
        assert done["request_id"] == rid and LEAK in done["error"] and e.url.split("//")[1] in done["error"]
    finally:
        await gw.stop()
        await e.stop()


async def test_a_timeout_names_no_worker_address() -> None:
    e, gw = await one_worker(
        ["hang_before_first_byte"], timeouts=TimeoutsConfig(prefill_s=0.3, per_token_s=0.01)
    )
    try:
        status, raw, rid = await post(gw.url, BODY)
        assert status in (503, 504), raw
        assert json.loads(raw)["error"]["code"] == "upstream_timeout" and rid in raw
        assert_no_internals(raw, e)
    finally:
        await gw.stop()
        await e.stop()


async def test_an_engine_refusal_is_passed_on_unless_it_names_an_address() -> None:
    e, gw = await one_worker(["http_error,status=400,message=max_tokens is too large for this model"])
    try:
        status, raw, _ = await post(gw.url, BODY)
        assert status == 400 and "max_tokens is too large" in json.loads(raw)["error"]["message"], raw
        for said in (LEAK, "Traceback (most recent call last): in tokenizer_manager.py"):
            await e.set_faults([f"http_error,status=400,message={said}"])
            status, raw, _ = await post(gw.url, BODY)
            assert status == 400 and json.loads(raw)["error"]["message"], raw
            assert_no_internals(raw, e)
    finally:
        await gw.stop()
        await e.stop()
