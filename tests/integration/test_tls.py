"""Workers behind TLS (`https://` URLs): the engines' own `--ssl-certfile`, or a TLS proxy in
front of them. Real TLS on loopback: emulators serving their HTTP API with a certificate from a
throwaway CA (trustme), the gateway checking it against that CA (`tls_ca_file`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import trustme

from common.workers import Engine, Role
from emulator.api import EmulatorHandle, EmulatorSpec, start_emulator
from gateway.app import Gateway
from gateway.config import (
    ConfigError,
    GatewayConfig,
    HealthConfig,
    ListenConfig,
    WorkerConfig,
    load_config,
)


class Tls:
    def __init__(self, tmp: Path) -> None:
        self.ca = trustme.CA()
        cert = self.ca.issue_cert("localhost", "127.0.0.1")
        self.certfile = tmp / "server.pem"
        self.keyfile = tmp / "server.key"
        self.cafile = tmp / "ca.pem"
        cert.cert_chain_pems[0].write_to_path(str(self.certfile))
        for pem in cert.cert_chain_pems[1:]:
            pem.write_to_path(str(self.certfile), append=True)
        cert.private_key_pem.write_to_path(str(self.keyfile))
        self.ca.cert_pem.write_to_path(str(self.cafile))


@pytest.fixture
async def tls_pairs(tmp_path: Path) -> AsyncIterator[tuple[Tls, dict[str, EmulatorHandle]]]:
    """An SGLang and a vLLM P/D pair whose HTTP APIs speak only TLS, and plain references."""
    tls = Tls(tmp_path)
    secure = {"ssl_certfile": str(tls.certfile), "ssl_keyfile": str(tls.keyfile)}
    specs = {
        "sgl-p": EmulatorSpec(engine="sglang", role="prefill", model="m-sglang", bootstrap_port=0, **secure),
        "sgl-d": EmulatorSpec(engine="sglang", role="decode", model="m-sglang", **secure),
        "vllm-p": EmulatorSpec(engine="vllm", role="prefill", model="m-vllm", **secure),
        "vllm-d": EmulatorSpec(engine="vllm", role="decode", model="m-vllm", **secure),
        "ref-sglang": EmulatorSpec(engine="sglang", role="both", model="m-sglang"),
        "ref-vllm": EmulatorSpec(engine="vllm", role="both", model="m-vllm"),
    }
    emus = {name: await start_emulator(spec) for name, spec in specs.items()}
    try:
        yield tls, emus
    finally:
        for h in emus.values():
            await h.stop()


def workers(emus: dict[str, EmulatorHandle], **tls: Any) -> tuple[WorkerConfig, ...]:
    out = []
    for name in ("sgl-p", "sgl-d", "vllm-p", "vllm-d"):
        h = emus[name]
        assert h.url.startswith("https://127.0.0.1:")
        out.append(
            WorkerConfig(
                url=h.url.replace("127.0.0.1", "localhost"),  # the name on the certificate
                role=Role.PREFILL if name.endswith("-p") else Role.DECODE,
                engine=Engine.SGLANG if name.startswith("sgl") else Engine.VLLM,
                id=name,
                bootstrap_port=h.bootstrap_port if name == "sgl-p" else None,
                **tls,
            )
        )
    return tuple(out)


async def start(ws: tuple[WorkerConfig, ...]) -> Gateway:
    cfg = GatewayConfig(
        listen=ListenConfig(host="127.0.0.1", port=0),
        workers=ws,
        health=HealthConfig(interval_s=0.3, timeout_s=2.0),
    )
    g = Gateway(cfg)
    await g.start()
    return g


async def post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, await r.read()


def body(model: str, stream: bool) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": "over the wire, sealed",
        "max_tokens": 9,
        "temperature": 0,
        "stream": stream,
    }


@pytest.mark.parametrize("verify", ["ca_file", "no_verify"])
async def test_pd_to_tls_workers(tls_pairs: tuple[Tls, dict[str, EmulatorHandle]], verify: str) -> None:
    tls, emus = tls_pairs
    opts = {"tls_ca_file": str(tls.cafile)} if verify == "ca_file" else {"tls_verify": False}
    g = await start(workers(emus, **opts))
    try:
        assert all(w.healthy for w in g.registry.workers())
        assert {w.url for w in g.registry.workers()} == {
            f"https://localhost:{emus[n].port}" for n in ("sgl-p", "sgl-d", "vllm-p", "vllm-d")
        }
        for model, ref in (("m-sglang", "ref-sglang"), ("m-vllm", "ref-vllm")):
            for stream in (False, True):
                status, raw = await post(f"http://127.0.0.1:{g.port}/v1/completions", body(model, stream))
                assert status == 200, raw
                _, want = await post(emus[ref].url + "/v1/completions", body(model, stream))
                if stream:
                    assert raw.rstrip().endswith(b"data: [DONE]")
                    texts = [
                        "".join(
                            c["text"]
                            for line in r.split(b"\n")
                            if line.startswith(b"data: {")
                            for c in json.loads(line[6:])["choices"]
                        )
                        for r in (raw, want)
                    ]
                    assert texts[0] == texts[1] and texts[0]
                else:
                    assert json.loads(raw)["choices"][0]["text"] == json.loads(want)["choices"][0]["text"]
        stats = await emus["sgl-d"].stats()
        assert stats["kv_transfers_ok"] >= 2  # a real handoff, over TLS to both legs
    finally:
        await g.stop(grace_s=1.0)


async def test_an_untrusted_certificate_keeps_the_worker_out(
    tls_pairs: tuple[Tls, dict[str, EmulatorHandle]],
) -> None:
    """Without the CA (the system's trust store only), the self-signed chain fails the check:
    the workers never become healthy and requests get a clear 503, not a silent plain-text retry."""
    _, emus = tls_pairs
    g = await start(workers(emus))
    try:
        await asyncio.sleep(0.5)
        assert not any(w.healthy for w in g.registry.workers())
        status, raw = await post(f"http://127.0.0.1:{g.port}/v1/completions", body("m-vllm", False))
        assert status in (404, 503), raw  # the model is not even known: nothing answered its probe
        assert json.loads(raw)["error"]["message"]
        assert (await emus["vllm-p"].stats())["received"] == 0
    finally:
        await g.stop(grace_s=1.0)


def test_tls_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="apply only to https"):
        WorkerConfig(url="http://a:1", role=Role.DECODE, tls_verify=False)
    path = tmp_path / "g.toml"
    path.write_text(
        '[[workers]]\nurl = "https://a:1"\nrole = "decode"\ntls_ca_file = "'
        + str(tmp_path / "nope.pem")
        + '"\n'
    )
    cfg = load_config(path)
    with pytest.raises(ConfigError, match="tls_ca_file"):
        Gateway(cfg)
