"""The compose stack's emulated engines listen on every interface (`--host 0.0.0.0`), as they
must in containers: what they tell peers to connect to (an SGLang prefill's rank address on its
bootstrap server, a vLLM prefill's `remote_host`) is then the machine's own address, never
0.0.0.0, which a peer in another container would take for itself. And a P/D request still
works through the gateway."""

from __future__ import annotations

import aiohttp

from emulator.api import EmulatorSpec, start_emulator
from gateway.app import Gateway
from gateway.config import GatewayConfig, ListenConfig, WorkerConfig
from policies.snapshot import Role

ROUTE = "prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"


async def test_sglang_prefill_on_every_interface_advertises_a_reachable_address() -> None:
    p = await start_emulator(
        EmulatorSpec(engine="sglang", role="prefill", host="0.0.0.0", model="m", bootstrap_port=0)
    )
    d = await start_emulator(EmulatorSpec(engine="sglang", role="decode", host="0.0.0.0", model="m"))
    gw = Gateway(
        GatewayConfig(
            listen=ListenConfig(host="127.0.0.1", port=0),
            workers=(
                WorkerConfig(
                    url=f"http://127.0.0.1:{p.port}", role=Role.PREFILL, bootstrap_port=p.bootstrap_port
                ),
                WorkerConfig(url=f"http://127.0.0.1:{d.port}", role=Role.DECODE),
            ),
        )
    )
    await gw.start()
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{p.bootstrap_port}/route?{ROUTE}") as r:
                rank = await r.json(content_type=None)
            assert rank["rank_ip"] not in ("0.0.0.0", "::", ""), rank
            body = {"model": "m", "prompt": "hi", "max_tokens": 4}
            async with s.post(gw.url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
    finally:
        await gw.stop(grace_s=1.0)
        await p.stop()
        await d.stop()


async def test_vllm_prefill_on_every_interface_names_a_reachable_host() -> None:
    p = await start_emulator(
        EmulatorSpec(engine="vllm", role="prefill", host="0.0.0.0", model="m", kv_port=0)
    )
    try:
        body = {
            "model": "m",
            "prompt": "hi",
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
        }
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"http://127.0.0.1:{p.port}/v1/completions", json=body) as r,
        ):
            out = await r.json()
        assert out["kv_transfer_params"]["remote_host"] not in ("0.0.0.0", "::", ""), out
    finally:
        await p.stop()
