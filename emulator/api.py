"""Python API: start emulated servers in-process (:func:`start_emulator`) or as subprocesses
(:func:`spawn_emulator`).

This is the top of the emulator's import graph: it puts an :class:`~emulator.server.EmulatorServer`
together with the engine's HTTP surface (:class:`~emulator.sglang.api.SglangApi` or
:class:`~emulator.vllm.api.VllmApi`); nothing below imports it back."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import msgspec

from emulator.bootstrap import url_host
from emulator.ports import free_ports
from emulator.server import EmulatorServer
from emulator.sglang.api import SglangApi
from emulator.spec import EmulatorSpec
from emulator.vllm.api import VllmApi

__all__ = [
    "EmulatorHandle",
    "EmulatorProcess",
    "EmulatorSpec",
    "build_server",
    "spawn_emulator",
    "start_emulator",
]


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


def build_server(spec: EmulatorSpec) -> EmulatorServer:
    """An emulated server (not started) serving `spec.engine`'s HTTP surface."""
    server = EmulatorServer(spec)
    surface = SglangApi(server) if spec.engine == "sglang" else VllmApi(server)
    surface.register(server.app.router)
    return server


async def start_emulator(spec: EmulatorSpec) -> EmulatorHandle:
    """Start an emulated server in the running event loop. ``port=0`` picks a free port; a prefill
    SGLang server gets a free bootstrap port too unless one is given: bound at once (port 0), not
    picked first and bound later, which another socket could take in between."""
    if spec.engine == "sglang" and spec.role == "prefill" and spec.bootstrap_port is None:
        spec = msgspec.structs.replace(spec, bootstrap_port=0)
    server = build_server(spec)
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
    wanted = []
    if spec.port == 0:
        wanted.append("port")
    if spec.engine == "sglang" and spec.role == "prefill" and spec.bootstrap_port is None:
        wanted.append("bootstrap_port")
    if spec.role in ("prefill", "both") and spec.kv_port is None:
        wanted.append("kv_port")
    # picked together, so distinct: one by one, the bootstrap and KV ports once came back equal
    updates: dict[str, Any] = dict(zip(wanted, free_ports(len(wanted), spec.host), strict=True))
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
