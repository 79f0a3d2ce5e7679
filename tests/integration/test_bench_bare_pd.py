"""`bench/bare_pd.py`, the overhead benchmark's floor, really does the P/D handoff: its answers
through an emulated prefill + decode pair equal a colocated server's, token for token."""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import pytest

from bench.bare_pd import serve
from tests.integration.conftest import Cluster


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _post(url: str, body: dict[str, object]) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, await r.read()


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_bare_pd_answers_like_a_colocated_server(cluster: Cluster, engine: str) -> None:
    pre = cluster.emulators["sgl-p" if engine == "sglang" else "vllm-p"]
    dec = cluster.emulators["sgl-d" if engine == "sglang" else "vllm-d"]
    port = _free_port()
    task = asyncio.ensure_future(serve(engine, port, pre.url, dec.url, pre.bootstrap_port))
    try:
        for _ in range(100):
            try:
                async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/health") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                await asyncio.sleep(0.05)
        model = f"m-{engine}"
        body = {"model": model, "prompt": "the bare proxy", "max_tokens": 12, "temperature": 0}
        status, got = await _post(f"http://127.0.0.1:{port}/v1/completions", body)
        _, want = await _post(cluster.reference[model].url + "/v1/completions", body)
        assert status == 200
        assert json.loads(got)["choices"][0]["text"] == json.loads(want)["choices"][0]["text"]
        status, streamed = await _post(f"http://127.0.0.1:{port}/v1/completions", {**body, "stream": True})
        assert status == 200 and streamed.rstrip().endswith(b"data: [DONE]")
        text = "".join(
            json.loads(line[5:])["choices"][0]["text"]
            for line in streamed.decode().splitlines()
            if line.startswith("data:") and "[DONE]" not in line
        )
        assert text == json.loads(want)["choices"][0]["text"]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
