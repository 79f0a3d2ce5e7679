"""A gateway in front of emulated engines, all in this process on 127.0.0.1 (real sockets).

The cluster: an SGLang prefill + decode pair (`m-sglang`), a vLLM prefill + decode pair
(`m-vllm`), and a colocated vLLM-protocol worker (`m-colocated`), all behind one gateway. Each
P/D model also has a colocated reference emulator *outside* the gateway: P/D answers through the
gateway must equal its answers token for token.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
from aiohttp import web

from common.workers import Engine, Role
from emulator.api import EmulatorHandle, EmulatorSpec, start_emulator
from gateway.app import Gateway
from gateway.config import GatewayConfig, HealthConfig, ListenConfig, WorkerConfig
from policies.base import PolicyEvent


@dataclass
class Cluster:
    gateway: Gateway
    emulators: dict[str, EmulatorHandle]
    reference: dict[str, EmulatorHandle] = field(default_factory=dict)  # model -> colocated reference

    @property
    def url(self) -> str:
        return self.gateway.url


async def build_cluster(
    time_scale: float = 0.0,
    faults: dict[str, list[str]] | None = None,
    prefill_max_model_len: int = 8192,
    colocated_fallback: bool = False,
    sglang_stream_interval: int = 1,
    vocab_size: int | None = None,
    api_key: str | None = None,
    vllm_stop_checks_first: bool = False,
    vllm_prefill_max_logprobs: int = 20,
    **gw: object,
) -> Cluster:
    """`colocated_fallback` adds a colocated worker for each P/D model to the gateway (the
    fallback ladder's second rung); `sglang_stream_interval` is the SGLang decode's (and its
    reference's) `--stream-interval`; `api_key`: the gateway's engines (not the references) run
    with `--api-key`, and the gateway is given it (`api_key_env`); `vllm_stop_checks_first`: the
    vLLM prefill judges stop token ids before its length cap (newer vLLM, `--stop-checks-first`); `vllm_prefill_max_logprobs`: its `--max-logprobs`."""
    faults = faults or {}
    specs = {
        "sgl-p": EmulatorSpec(
            engine="sglang",
            role="prefill",
            model="m-sglang",
            bootstrap_port=0,
            time_scale=time_scale,
            faults=faults.get("sgl-p", []),
            max_model_len=prefill_max_model_len,
        ),
        "sgl-d": EmulatorSpec(
            engine="sglang",
            role="decode",
            model="m-sglang",
            time_scale=time_scale,
            faults=faults.get("sgl-d", []),
            stream_interval=sglang_stream_interval,
        ),
        "vllm-p": EmulatorSpec(
            engine="vllm",
            role="prefill",
            model="m-vllm",
            kv_port=0,
            time_scale=time_scale,
            faults=faults.get("vllm-p", []),
            max_model_len=prefill_max_model_len,
            stop_checks_first=vllm_stop_checks_first,
            max_logprobs=vllm_prefill_max_logprobs,
        ),
        "vllm-d": EmulatorSpec(
            engine="vllm",
            role="decode",
            model="m-vllm",
            time_scale=time_scale,
            faults=faults.get("vllm-d", []),
        ),
        "col": EmulatorSpec(engine="vllm", role="both", model="m-colocated", time_scale=time_scale),
    }
    if colocated_fallback:
        specs["sgl-c"] = EmulatorSpec(engine="sglang", role="both", model="m-sglang", time_scale=time_scale)
        specs["vllm-c"] = EmulatorSpec(engine="vllm", role="both", model="m-vllm", time_scale=time_scale)
    refs = {
        "m-sglang": EmulatorSpec(
            engine="sglang",
            role="both",
            model="m-sglang",
            time_scale=time_scale,
            stream_interval=sglang_stream_interval,
        ),
        "m-vllm": EmulatorSpec(engine="vllm", role="both", model="m-vllm", time_scale=time_scale),
    }
    if api_key is not None:
        specs = {name: msgspec.structs.replace(spec, api_key=api_key) for name, spec in specs.items()}
    emus = {name: await start_emulator(spec) for name, spec in specs.items()}
    reference = {model: await start_emulator(spec) for model, spec in refs.items()}
    roles = {"prefill": Role.PREFILL, "decode": Role.DECODE, "both": Role.COLOCATED}
    workers = []
    for name, spec in specs.items():
        engine, role = Engine(spec.engine), roles[spec.role]
        workers.append(
            WorkerConfig(
                url=emus[name].url,
                role=role,
                engine=engine,
                id=name,
                bootstrap_port=emus[name].bootstrap_port
                if engine is Engine.SGLANG and role is Role.PREFILL
                else None,
                vocab_size=vocab_size,
                api_key_env=None if api_key is None else "PDGW_TEST_ENGINE_KEY",
            )
        )
    gw.setdefault("health", HealthConfig(interval_s=0.5, timeout_s=2.0))
    cfg = GatewayConfig(listen=ListenConfig(host="127.0.0.1", port=0), workers=tuple(workers), **gw)  # type: ignore[arg-type]
    gateway = Gateway(cfg, environ=None if api_key is None else {"PDGW_TEST_ENGINE_KEY": api_key})
    await gateway.start()
    return Cluster(gateway, emus, reference)


async def stop_cluster(c: Cluster) -> None:
    await c.gateway.stop(grace_s=1.0)
    for h in [*c.emulators.values(), *c.reference.values()]:
        await h.stop()


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    c = await build_cluster()
    try:
        yield c
    finally:
        await stop_cluster(c)


async def stop_started(started: list[Any]) -> None:
    """Stop what a test fixture started (gateways and emulators), the last started first."""
    for part in reversed(started):
        if isinstance(part, Gateway):
            await part.stop(grace_s=1.0)
        else:
            await part.stop()


async def start_cached_sglang(model: str, time_scale: float) -> EmulatorHandle:
    """A colocated SGLang emulator that reports cached tokens (16-token blocks, a 32k context), as
    the cache-aware integration tests route to."""
    return await start_emulator(
        EmulatorSpec(
            engine="sglang",
            role="both",
            model=model,
            block_size=16,
            enable_cache_report=True,
            time_scale=time_scale,
            max_model_len=32_768,
        )
    )


def cached_tokens_of(usage: Any) -> int:
    """The prompt tokens an OpenAI client's `usage` reports read from the engine's cache (0: none)."""
    d = getattr(usage, "prompt_tokens_details", None)
    return int(getattr(d, "cached_tokens", None) or 0)


async def serve_app(app: web.Application) -> tuple[web.AppRunner, str]:
    """An aiohttp app (a stand-in worker) on an ephemeral loopback port: (runner, base URL)."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


class RecordingPolicy:
    """The gateway's own policy with every event it is sent kept in order (a wrapper: the policy
    still routes and learns as it would). `observes` as given (`policies.base.wants`): None, the
    default, observes every event type whatever the policy inside observes."""

    def __init__(self, policy: Any, observes: tuple[type, ...] | None = None) -> None:
        self._policy = policy
        self.observes = observes
        self.events: list[PolicyEvent] = []

    def observe(self, event: PolicyEvent) -> None:
        self.events.append(event)
        self._policy.observe(event)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._policy, name)
