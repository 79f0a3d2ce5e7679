"""Fixtures for the peer checks: emulated P/D pairs plus a colocated twin, behind a real Rust router.

Every process is a subprocess in its own process group (bench/procs.py) and is killed in
teardown, whatever happened. Startup waits are generous (a loaded 2-core CI machine), each
test is bounded by a pytest-timeout marker in its module.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from bench import procs
from tests.peer.helpers import MODEL, SEED, PeerCluster

STARTUP_TIMEOUT_S = 60.0


def _start_upstreams(group: procs.ProcessGroup, engine: str, log_dir: str) -> list[procs.Upstream]:
    kw: dict[str, Any] = {"model": MODEL, "seed": SEED, "time_scale": 0.0, "log_dir": log_dir, "wait": False}
    ups = [procs.start_emulator(group, engine, role, **kw) for role in ("prefill", "decode", "both")]
    for up in ups:  # started together, waited for together
        procs.wait_upstream(up, STARTUP_TIMEOUT_S)
    return ups


def _wait_router(router: procs.ManagedProcess, url: str) -> None:
    router.wait_http(f"{url}/readiness", STARTUP_TIMEOUT_S)


@pytest.fixture(scope="module")
def sglang_pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PeerCluster]:
    if not procs.router_available("sglang-router"):
        pytest.skip("sglang-router is not installed (pip install sglang-router==0.3.2, in the dev extra)")
    log_dir = str(tmp_path_factory.mktemp("peer-sglang"))
    with procs.process_group() as group:
        prefill, decode, both = _start_upstreams(group, "sglang", log_dir)
        port, prom = procs.free_ports(2)
        argv = procs.sglang_router_argv(
            port,
            [(prefill.url, prefill.bootstrap_port)],
            [decode.url],
            prometheus_port=prom,
            log_level="info",
        )
        router = group.add(procs.start_process("sglang-router", argv, log_dir=log_dir))
        url = f"http://{procs.HOST}:{port}"
        _wait_router(router, url)
        yield PeerCluster("sglang", router, url, both.url, prefill, decode)


@pytest.fixture(scope="module")
def vllm_pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PeerCluster]:
    if not procs.router_available("vllm-router"):
        pytest.skip("vllm-router is not installed (pip install vllm-router==0.1.17, in the dev extra)")
    log_dir = str(tmp_path_factory.mktemp("peer-vllm"))
    with procs.process_group() as group:
        prefill, decode, both = _start_upstreams(group, "vllm", log_dir)
        port, prom = procs.free_ports(2)
        argv = procs.vllm_router_argv(
            port, [prefill.url], [decode.url], prometheus_port=prom, log_level="info"
        )
        router = group.add(procs.start_process("vllm-router", argv, log_dir=log_dir))
        url = f"http://{procs.HOST}:{port}"
        _wait_router(router, url)
        yield PeerCluster("vllm", router, url, both.url, prefill, decode)
