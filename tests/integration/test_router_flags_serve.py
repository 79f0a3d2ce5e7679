"""A sglang-router command line, unchanged but for the addresses, runs `pd-gateway serve` in front
of emulated SGLang P/D servers (subprocesses), and the notes on what it ignored go to stderr."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from emulator.api import EmulatorSpec, spawn_emulator
from gateway.router_flags import registered_policy
from tests.integration.test_cli_serve import complete, free_port, wait_ready

BIN = Path(sys.executable).parent / "pd-gateway"


def test_sglang_router_command_line_serves() -> None:
    boot = free_port()
    p = spawn_emulator(EmulatorSpec(engine="sglang", role="prefill", model="drop-in", bootstrap_port=boot))
    d = spawn_emulator(EmulatorSpec(engine="sglang", role="decode", model="drop-in"))
    port = free_port()
    # the README's P/D line, with its ports and the retry, breaker and timeout flags users add
    argv = [
        "--pd-disaggregation",
        "--prefill", p.url, str(boot),
        "--decode", d.url,
        "--policy", "cache_aware",
        "--host", "127.0.0.1", "--port", str(port),
        "--retry-max-retries", "3", "--retry-initial-backoff-ms", "50",
        "--cb-failure-threshold", "10", "--cb-window-duration-secs", "120",
        "--request-timeout-secs", "1800", "--log-level", "warn",
        "--prometheus-port", "29000",
    ]  # fmt: skip
    proc = subprocess.Popen(
        [str(BIN), "serve", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url)
        except TimeoutError:
            proc.kill()
            raise AssertionError(proc.communicate()[1].decode()) from None
        out = complete(url, "drop-in")
        assert out["choices"], out  # type: ignore[index]
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        p.terminate()
        d.terminate()
    notes = [line for line in err.decode().splitlines() if line.startswith("pd-gateway serve: note:")]
    expected = ["--cb-window-duration-secs", "--prometheus-port"]
    if registered_policy("cache_aware") is None:  # least_load until this build has cache_aware
        expected.append("--policy")
    assert [n.split(": ")[2].split(" ")[0] for n in notes] == expected, notes
    assert proc.returncode == 0
