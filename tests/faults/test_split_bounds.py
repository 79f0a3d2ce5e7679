"""One request split into many handoffs (`n > 1` or a batch on SGLang P/D: one handoff per prompt
and sample, two upstream connections each) must not take the gateway down. A batch of 100 prompts
with `n` = 128 was 12,800 handoffs started at once: the gateway ran out of file descriptors, and
the connect failures were held against the workers, whose breakers opened, so one request took
the model off the gateway for every client. Now at most `limits.split_concurrency` units of a
request are in flight, and a connect that fails for the gateway's own want of descriptors or
ports is a 503 to retry, blamed on no worker."""

from __future__ import annotations

import asyncio
import json
import resource
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from emulator.api import EmulatorProcess
from gateway.config import LimitsConfig
from tests.faults.sglang_pd import sglang_pd
from tests.integration.test_cli_serve import BIN, complete, free_port, sglang_pair, wait_ready

__all__ = ["sglang_pair"]  # the fixture, used below


async def test_a_split_request_keeps_at_most_split_concurrency_handoffs_in_flight() -> None:
    async with sglang_pd(time_scale=0.05, limits=LimitsConfig(split_concurrency=4)) as c:
        decode = c.gateway.registry.get("d")
        peak = 0
        stop = asyncio.Event()

        async def watch() -> None:
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, decode.inflight)
                await asyncio.sleep(0.0005)

        async with aiohttp.ClientSession() as s:
            for stream in (False, True):
                peak = 0
                stop.clear()
                watcher = asyncio.ensure_future(watch())
                body = {
                    "model": "m",
                    "prompt": [f"prompt number {k}" for k in range(6)],
                    "n": 5,
                    "max_tokens": 6,
                    "stream": stream,
                }
                async with s.post(c.url + "/v1/completions", json=body) as r:
                    raw = await r.read()
                    assert r.status == 200, raw
                stop.set()
                await watcher
                if stream:
                    events = [
                        json.loads(line[6:])
                        for line in raw.decode().splitlines()
                        if line.startswith("data: {")
                    ]
                    indices = {ch["index"] for ev in events for ch in ev["choices"]}
                else:
                    indices = {ch["index"] for ch in json.loads(raw)["choices"]}
                assert indices == set(range(30))
                assert 2 <= peak <= 4, peak  # the units overlapped, four at a time at most
        assert decode.inflight == 0


def _post(url: str, body: dict[str, object]) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_out_of_file_descriptors_is_a_503_that_blames_no_worker(
    sglang_pair: tuple[EmulatorProcess, EmulatorProcess], tmp_path: Path, host: str
) -> None:
    """By address, and by host name: there the shortage shows as a failed name lookup (the
    resolver cannot open its socket), which is no fault of the worker either."""
    p, d = sglang_pair
    conf = tmp_path / "gateway.toml"
    conf.write_text(
        f"""
[health]
interval_s = 3600.0

[breaker]
failure_threshold = 1          # one failure held against a worker would open its breaker

[retries]
max_attempts = 1

[limits]
split_concurrency = 400        # 800 connections wanted, under a limit of 96 descriptors

[[workers]]
url = "{p.url.replace("127.0.0.1", host)}"
role = "prefill"
engine = "sglang"
bootstrap_port = {p.bootstrap_port}

[[workers]]
url = "{d.url.replace("127.0.0.1", host)}"
role = "decode"
engine = "sglang"
"""
    )
    port = free_port()

    def few_descriptors() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (96, 96))

    proc = subprocess.Popen(
        [str(BIN), "serve", "--port", str(port), "--log-level", "error", "--config", str(conf)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=few_descriptors,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url)
        status, headers, raw = _post(
            url, {"model": "cli-model", "prompt": [f"p{k}" for k in range(40)], "n": 10, "max_tokens": 2}
        )
        assert status == 503, raw
        err = json.loads(raw)["error"]
        # the system's words ("Too many open files") and the worker go to the log, not the client
        assert "short of resources" in err["message"] and "request id" in err["message"], err
        assert err["type"] == "server_error"
        assert headers.get("retry-after") == "1"
        # no breaker opened (one failure would open one): after the Retry-After, while the
        # request's other units are cancelled and their connections closed, the model is still
        # served and an ordinary request is answered
        time.sleep(1.0)
        with urllib.request.urlopen(url + "/readiness", timeout=5) as r:
            assert json.loads(r.read())["ready"] is True
        assert complete(url, "cli-model")["choices"]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_serve_lifts_its_soft_limit_on_open_files_to_the_hard_one(
    sglang_pair: tuple[EmulatorProcess, EmulatorProcess],
) -> None:
    """A soft limit of 1024 (a common default) would refuse upstream connections from a few
    hundred P/D requests in flight on; the hard limit is what the operator granted."""
    p, d = sglang_pair
    port = free_port()

    def low_soft_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (96, 4096))

    proc = subprocess.Popen(
        [
            str(BIN),
            *("serve", "--port", str(port), "--log-level", "error", "--engine", "sglang"),
            *("--prefill", p.url, str(p.bootstrap_port), "--decode", d.url),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=low_soft_limit,
    )
    try:
        wait_ready(f"http://127.0.0.1:{port}")
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
        line = next(x for x in limits.splitlines() if x.startswith("Max open files"))
        assert line.split()[3:5] == ["4096", "4096"], line
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def test_a_batch_with_a_bad_prompt_is_a_400_before_any_unit_starts() -> None:
    """Every unit is built and checked before the first starts: with units built as runners
    reached them, a stream had sent two prompts' tokens before its fourth prompt (empty) ended
    it with an error event (found by review)."""
    async with sglang_pd(time_scale=0.05, limits=LimitsConfig(split_concurrency=2)) as c:
        async with aiohttp.ClientSession() as s:
            for stream in (False, True):
                body = {
                    "model": "m",
                    "prompt": [[1, 2, 3], [4, 5, 6], [7, 8], []],
                    "max_tokens": 8,
                    "stream": stream,
                }
                async with s.post(c.url + "/v1/completions", json=body) as r:
                    raw = await r.read()
                    assert r.status == 400, raw
                    assert json.loads(raw)["error"]["type"] == "invalid_request_error"
        assert (await c.prefills[0].stats())["received"] == 0 and (await c.decode.stats())["received"] == 0
