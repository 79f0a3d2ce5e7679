"""`bench/bare_pd.py` and `bench/callback_pd.py`, the overhead benchmark's floors, really do the
P/D handoff: their answers through an emulated prefill + decode pair equal a colocated server's,
token for token, streamed and not, over one keep-alive connection."""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import pytest

from bench import bare_pd, callback_pd
from tests.integration.conftest import Cluster


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _post(url: str, body: dict[str, object]) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, await r.read()


@pytest.mark.parametrize("floor", ["bare_pd", "callback_pd"])
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_the_floor_answers_like_a_colocated_server(cluster: Cluster, engine: str, floor: str) -> None:
    serve = {"bare_pd": bare_pd.serve, "callback_pd": callback_pd.serve}[floor]
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
        _, want = await _post(cluster.reference[model].url + "/v1/completions", body)
        wanted = json.loads(want)["choices"][0]["text"]
        url = f"http://127.0.0.1:{port}/v1/completions"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
            for stream in (False, True, False, True):  # one keep-alive connection, answer after answer
                async with s.post(url, json={**body, "stream": stream}) as r:
                    status, got = r.status, await r.read()
                assert status == 200
                if not stream:
                    assert json.loads(got)["choices"][0]["text"] == wanted
                    continue
                assert got.rstrip().endswith(b"data: [DONE]")
                text = "".join(
                    json.loads(line[5:])["choices"][0]["text"]
                    for line in got.decode().splitlines()
                    if line.startswith("data:") and "[DONE]" not in line
                )
                assert text == wanted
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
