from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from emulator import timing
from emulator.api import EmulatorSpec, spawn_emulator
from emulator.ports import free_port
from emulator.profiles import PROFILES, get_profile
from tests.emulator.conftest import Factory


def free_port_pair() -> int:
    """A port whose successor is free too (the replay socket binds PORT+1)."""
    import socket

    for _ in range(50):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair")


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_kv_events(emu: Factory, http: aiohttp.ClientSession, engine: str) -> None:
    port = free_port_pair()
    endpoint = f"tcp://127.0.0.1:{port}"
    s = await emu(engine, "both", kv_events=endpoint, max_total_tokens=64)
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    await asyncio.sleep(0.3)  # slow joiner
    path = "/v1/completions"
    async with http.post(s.url + path, json={"prompt": "a" * 40, "max_tokens": 2}) as r:
        assert r.status == 200
    _topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 5)
    assert len(seq) == 8
    _ts, events, _dp = msgpack.unpackb(payload)
    assert events[0][0] == "BlockStored" and len(events[0][1]) == 2 and events[0][4] == 16
    assert events[0][3] == [1] + [ord("a") + 3] * 31
    if engine == "vllm":
        assert isinstance(events[0][1][0], bytes)
    else:
        assert isinstance(events[0][1][0], int)
    # fill the tiny pool so cached blocks are evicted -> BlockRemoved
    async with http.post(s.url + path, json={"prompt": "b" * 40, "max_tokens": 2}) as r:
        assert r.status == 200
    kinds: list[str] = []
    while "BlockRemoved" not in kinds:
        _, _, payload = await asyncio.wait_for(sub.recv_multipart(), 5)
        kinds += [e[0] for e in msgpack.unpackb(payload)[1]]
    # replay: everything from seq 0, terminated by seq -1
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port + 1}")
    await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    seqs = []
    while True:
        frames = await asyncio.wait_for(dealer.recv_multipart(), 5)
        n = int.from_bytes(frames[-2], "big", signed=True)
        if n == -1:
            break
        seqs.append(n)
    assert seqs[:2] == [0, 1]
    if engine == "sglang":
        async with http.post(s.url + "/flush_cache") as r:
            assert r.status == 200
        _, _, payload = await asyncio.wait_for(sub.recv_multipart(), 5)
        assert msgpack.unpackb(payload)[1][-1][0] == "AllBlocksCleared"
    sub.close(0)
    dealer.close(0)
    ctx.term()


def test_timing_shape() -> None:
    p = get_profile("llama-3-8b-h100")
    # prefill grows with uncached tokens; a cached prefix cuts it
    assert timing.prefill_time(p, 2000) > timing.prefill_time(p, 1000) > timing.prefill_time(p, 100)
    assert timing.prefill_time(p, 200, cached_tokens=1800) < timing.prefill_time(p, 2000) / 5
    # decode step grows with the batch's KV
    assert timing.decode_step_time(p, 32, 32 * 4000) > timing.decode_step_time(p, 32, 32 * 100)
    assert timing.decode_step_time(p, 1, 100) == pytest.approx(
        p.step_overhead_s + 16.06e9 / (3.35e12 * 0.75), rel=0.01
    )
    # chunked prefill interferes with decodes in the same step
    assert timing.mixed_step_time(p, [(2048, 0)], 32, 32000) > timing.mixed_step_time(p, [], 32, 32000)
    # 70B slower than 8B; H200 decode faster than H100; A100 prefill slower
    assert timing.prefill_time(PROFILES["llama-3-70b-h100"], 1000) > timing.prefill_time(p, 1000)
    assert timing.decode_step_time(PROFILES["llama-3-8b-h200"], 8, 8000) < timing.decode_step_time(p, 8, 8000)
    assert timing.prefill_time(PROFILES["llama-3-8b-a100"], 1000) > timing.prefill_time(p, 1000)
    assert timing.transfer_time(p, 1000) == pytest.approx(1000 * 131072 / (50e9 * 0.8))
    assert p.kv_capacity_tokens > 300_000


async def test_cached_prefix_shortens_prefill_wall_clock(emu: Factory, http: aiohttp.ClientSession) -> None:
    # time_scale 1 on a 70B/A100 profile: a 6000-token prefill takes ~0.25 s, cached ~0.0x s
    s = await emu(
        "vllm", "both", profile="llama-3-70b-a100", time_scale=1.0, enable_prompt_tokens_details=True
    )
    loop = asyncio.get_running_loop()
    body = {"prompt": [1] + [9] * 6000, "max_tokens": 1}
    t0 = loop.time()
    async with http.post(s.url + "/v1/completions", json=body) as r:
        assert r.status == 200
    cold = loop.time() - t0
    t0 = loop.time()
    async with http.post(s.url + "/v1/completions", json=body) as r:
        assert (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 6000
    warm = loop.time() - t0
    assert warm < cold / 2


def test_spawn_and_cli(tmp_path: object) -> None:
    p = spawn_emulator(EmulatorSpec(engine="sglang", role="prefill", time_scale=0.0))
    d = spawn_emulator(EmulatorSpec(engine="sglang", role="decode", time_scale=0.0))
    # the ports spawn_emulator picked (HTTP, bootstrap, KV) are three, not two or one
    assert len({p.spec.port, p.spec.bootstrap_port, p.spec.kv_port}) == 3, p.spec
    try:
        import urllib.request

        body = {
            "text": "hi there",
            "sampling_params": {"max_new_tokens": 5},
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": p.bootstrap_port,
            "bootstrap_room": 5,
        }

        def post(url: str) -> dict[str, object]:
            req = urllib.request.Request(
                url + "/generate",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=10) as r:
                return dict(json.loads(r.read()))

        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            fp, fd = ex.submit(post, p.url), ex.submit(post, d.url)
            assert len(fd.result()["output_ids"]) == 5  # type: ignore[arg-type]
            assert fp.result()["meta_info"]["completion_tokens"] == 1  # type: ignore[index]
        assert p.pid > 0
    finally:
        p.terminate()
        d.terminate()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "emulator",
            "--engine",
            "vllm",
            "--role",
            "both",
            "--port",
            "1",
            "--fault",
            "nope",
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "unknown fault kind" in out.stderr
