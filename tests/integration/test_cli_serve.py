"""`pd-gateway serve` as users run it: a subprocess with sglang-router-style flags in front of
emulator subprocesses (`pd-gateway emulate`), and a TOML config file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from emulator.api import EmulatorProcess, EmulatorSpec, spawn_emulator
from gateway.config import load_config

BIN = Path(sys.executable).parent / "pd-gateway"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_ready(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/readiness", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{url} not ready in {timeout}s")


def complete(url: str, model: str) -> dict[str, object]:
    body = json.dumps({"model": model, "prompt": "hello there", "max_tokens": 5, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        out: dict[str, object] = json.loads(r.read())
        return out


@pytest.fixture
def sglang_pair() -> Iterator[tuple[EmulatorProcess, EmulatorProcess]]:
    p = spawn_emulator(
        EmulatorSpec(engine="sglang", role="prefill", model="cli-model", bootstrap_port=free_port())
    )
    d = spawn_emulator(EmulatorSpec(engine="sglang", role="decode", model="cli-model"))
    try:
        yield p, d
    finally:
        p.terminate()
        d.terminate()


def run_gateway(args: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [str(BIN), "serve", "--port", str(port), "--log-level", "warning", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url)
    except TimeoutError:
        proc.kill()
        raise AssertionError(proc.communicate()[0].decode()) from None
    return proc, url


def stop(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_serve_with_sglang_router_style_flags(sglang_pair: tuple[EmulatorProcess, EmulatorProcess]) -> None:
    p, d = sglang_pair
    proc, url = run_gateway(
        ["--engine", "sglang", "--prefill", p.url, str(p.bootstrap_port), "--decode", d.url]
    )
    try:
        out = complete(url, "cli-model")
        assert out["choices"][0]["text"]  # type: ignore[index]
    finally:
        stop(proc)  # SIGTERM: graceful, exit status 0


def test_serve_from_toml(sglang_pair: tuple[EmulatorProcess, EmulatorProcess], tmp_path: Path) -> None:
    p, d = sglang_pair
    cfg = tmp_path / "gw.toml"
    cfg.write_text(
        f'policy = "least_load"\n\n[timeouts]\nprefill_s = 10.0\n\n'
        f'[[workers]]\nurl = "{p.url}"\nrole = "prefill"\nengine = "sglang"\nbootstrap_port = {p.bootstrap_port}\n\n'
        f'[[workers]]\nurl = "{d.url}"\nrole = "decode"\nengine = "sglang"\n'
    )
    assert load_config(cfg).timeouts.prefill_s == 10.0
    proc, url = run_gateway(["--config", str(cfg)])
    try:
        assert complete(url, "cli-model")["choices"]
    finally:
        stop(proc)


def test_serve_rejects_a_config_typo(tmp_path: Path) -> None:
    cfg = tmp_path / "gw.toml"
    cfg.write_text("[timeouts]\nprefil_s = 1.0\n")
    r = subprocess.run([str(BIN), "serve", "--config", str(cfg)], capture_output=True, timeout=30)
    assert r.returncode == 2 and b"prefil_s" in r.stderr
