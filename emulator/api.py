"""Python API: start emulated servers in-process (:func:`start_emulator`) or as subprocesses
(:func:`spawn_emulator`)."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Literal

import msgspec

from emulator.bootstrap import url_host
from emulator.profiles import DEFAULT_PROFILE


class EmulatorSpec(msgspec.Struct, kw_only=True):
    """The same fields as the ``pd-gateway emulate`` flags (plus a few emulator knobs)."""

    engine: Literal["sglang", "vllm"]
    role: Literal["prefill", "decode", "both"]
    host: str = "127.0.0.1"
    port: int = 0
    bootstrap_port: int | None = None
    kv_port: int | None = None
    model: str = "meta-llama/Meta-Llama-3-8B-Instruct"
    profile: str = DEFAULT_PROFILE
    time_scale: float = 0.0
    faults: list[str] = []
    kv_events: str | None = None
    max_model_len: int = 8192
    seed: int = 0
    # emulator knobs (flags --max-total-tokens, --block-size, --kv-scale, --waiting-timeout,
    # --handshake-timeout, --stream-interval)
    max_total_tokens: int | None = None
    block_size: int | None = None
    kv_scale: int = 1024
    waiting_timeout_s: float | None = None
    handshake_timeout_s: float = 5.0
    stream_interval: int = 1  # SGLang's --stream-interval: tokens per stream event
    # --stop-checks-first (vLLM): judge a sequence's stop token ids before its length cap, as
    # newer vLLM's check_stop does (0.32 caps length first), behind a connector that hands over KV
    # only for a prefill capped by length (Mooncake's rule): a P/D prefill (max_tokens 1) whose
    # one token is a stop id then ends "stop" and hands over no KV (kv_transfer_params null)
    stop_checks_first: bool = False
    max_logprobs: int = 20  # vLLM's --max-logprobs (its default): a request asking more is refused
    # --ssl-certfile / --ssl-keyfile (both engines' flags): the HTTP API over TLS (the bootstrap
    # and KV ports stay plain)
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    # --api-key (both engines' flag): requests must carry `Authorization: Bearer KEY` (emulator/auth.py)
    api_key: str | None = None

    def to_argv(self) -> list[str]:
        argv = ["--engine", self.engine, "--role", self.role, "--host", self.host, "--port", str(self.port)]
        if self.bootstrap_port is not None:
            argv += ["--bootstrap-port", str(self.bootstrap_port)]
        if self.kv_port is not None:
            argv += ["--kv-port", str(self.kv_port)]
        argv += ["--model", self.model, "--profile", self.profile, "--time-scale", repr(self.time_scale)]
        for f in self.faults:
            argv += ["--fault", f]
        if self.kv_events:
            argv += ["--kv-events", self.kv_events]
        argv += ["--max-model-len", str(self.max_model_len), "--seed", str(self.seed)]
        if self.max_total_tokens is not None:
            argv += ["--max-total-tokens", str(self.max_total_tokens)]
        if self.block_size is not None:
            argv += ["--block-size", str(self.block_size)]
        argv += ["--kv-scale", str(self.kv_scale), "--handshake-timeout", repr(self.handshake_timeout_s)]
        if self.waiting_timeout_s is not None:
            argv += ["--waiting-timeout", repr(self.waiting_timeout_s)]
        if self.stream_interval != 1:
            argv += ["--stream-interval", str(self.stream_interval)]
        if self.stop_checks_first:
            argv.append("--stop-checks-first")
        if self.max_logprobs != 20:
            argv += ["--max-logprobs", str(self.max_logprobs)]
        if self.ssl_certfile is not None:
            argv += ["--ssl-certfile", self.ssl_certfile]
        if self.ssl_keyfile is not None:
            argv += ["--ssl-keyfile", self.ssl_keyfile]
        if self.api_key is not None:
            argv += ["--api-key", self.api_key]
        return argv


class EmulatorHandle:
    """An emulated server running in this event loop."""

    def __init__(self, server: Any) -> None:
        self._server = server
        self._stopped = False

    @property
    def server(self) -> Any:
        return self._server

    @property
    def url(self) -> str:
        return str(self._server.url)

    @property
    def port(self) -> int:
        return int(self._server.port)

    @property
    def bootstrap_port(self) -> int | None:
        return self._server.bootstrap_port

    @property
    def kv_port(self) -> int | None:
        return self._server.kv_port

    @property
    def dead(self) -> bool:
        return bool(self._server.dead)

    async def stats(self) -> dict[str, Any]:
        return dict(self._server.stats())

    async def set_faults(self, specs: list[str]) -> None:
        self._server.faults.replace(specs)

    async def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            await self._server.stop()


async def start_emulator(spec: EmulatorSpec) -> EmulatorHandle:
    """Start an emulated server in the running event loop. ``port=0`` picks a free port; a prefill
    SGLang server gets a free bootstrap port too unless one is given."""
    from emulator.app import EmulatorServer, free_port

    if spec.engine == "sglang" and spec.role == "prefill" and spec.bootstrap_port is None:
        spec = msgspec.structs.replace(spec, bootstrap_port=free_port(spec.host))
    server = EmulatorServer(spec)
    handle = EmulatorHandle(server)

    async def on_death() -> None:
        await handle.stop()

    server.on_death = on_death
    await server.start()
    return handle


class EmulatorProcess:
    """An emulated server in a subprocess (``python -m emulator ...``)."""

    def __init__(self, proc: subprocess.Popen[bytes], spec: EmulatorSpec) -> None:
        self.proc = proc
        self.spec = spec
        self.port = spec.port
        self.bootstrap_port = spec.bootstrap_port
        self.kv_port = spec.kv_port
        self.url = f"{'https' if spec.ssl_certfile else 'http'}://{url_host(spec.host)}:{spec.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def terminate(self, timeout: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)

    def __enter__(self) -> EmulatorProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.terminate()


def spawn_emulator(spec: EmulatorSpec, *, ready_timeout: float = 20.0) -> EmulatorProcess:
    """Start an emulated server as a subprocess and wait until ``/health`` answers 200. Free ports
    are chosen here (HTTP, bootstrap for an SGLang prefill, KV for a prefill) so the caller knows them."""
    from emulator.app import free_port

    updates: dict[str, Any] = {}
    if spec.port == 0:
        updates["port"] = free_port(spec.host)
    if spec.engine == "sglang" and spec.role == "prefill" and spec.bootstrap_port is None:
        updates["bootstrap_port"] = free_port(spec.host)
    if spec.role in ("prefill", "both") and spec.kv_port is None:
        updates["kv_port"] = free_port(spec.host)
    spec = msgspec.structs.replace(spec, **updates)
    proc = subprocess.Popen(
        [sys.executable, "-m", "emulator", *spec.to_argv()],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    handle = EmulatorProcess(proc, spec)
    # readiness only: a TLS emulator's certificate is the caller's to check, not this loop's
    tls = ssl._create_unverified_context() if spec.ssl_certfile else None
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"emulator exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(handle.url + "/health", timeout=1.0, context=tls) as resp:
                if resp.status == 200:
                    return handle
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.05)
    handle.terminate()
    raise TimeoutError(f"emulator on {handle.url} not healthy after {ready_timeout}s")
