"""`pd-gateway serve` start-up errors are one line on stderr and exit status 2, never a
traceback, and a listening port that is taken is found before any worker is probed."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent / "pd-gateway"


def _listening() -> Iterator[int]:
    """A port held by a socket that accepts connections (the kernel's backlog) and never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    try:
        yield s.getsockname()[1]
    finally:
        s.close()


@pytest.fixture
def silent_worker() -> Iterator[str]:
    """A worker that accepts connections and never answers: probing it takes the whole timeout."""
    for port in _listening():
        yield f"http://127.0.0.1:{port}"


@pytest.fixture
def busy_port() -> Iterator[int]:
    yield from _listening()


def serve(args: list[str], timeout: float = 60.0) -> tuple[int, str, float]:
    t0 = time.monotonic()
    p = subprocess.run([str(BIN), "serve", *args], capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stderr, time.monotonic() - t0


def one_line_error(rc: int, err: str, needle: str) -> None:
    assert rc == 2, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pd-gateway serve: ") and needle in lines[0], err


def test_unknown_policy_plugin(silent_worker: str) -> None:
    rc, err, _ = serve(["--worker", silent_worker, "--port", "0", "--policy", "plugin:nope"])
    one_line_error(rc, err, "unknown policy plugin 'nope'")


def test_taken_port_fails_before_the_workers_are_probed(
    silent_worker: str, busy_port: int, tmp_path: Path
) -> None:
    cfg = tmp_path / "gw.toml"
    cfg.write_text("[health]\ntimeout_s = 60.0\n")  # probing the silent worker would take a minute
    rc, err, took = serve(
        ["--config", str(cfg), "--worker", silent_worker, "--port", str(busy_port), "--log-level", "error"],
        timeout=50.0,
    )
    one_line_error(rc, err, f"cannot listen on 127.0.0.1:{busy_port}: Address already in use")
    assert took < 30.0


def test_unresolvable_listen_host(silent_worker: str) -> None:
    rc, err, _ = serve(["--worker", silent_worker, "--port", "0", "--host", "no-such-host.invalid"])
    one_line_error(rc, err, "cannot listen on no-such-host.invalid:0")


@pytest.mark.parametrize("value", ["-1", "0"])
def test_bad_request_timeout_names_the_flag(silent_worker: str, value: str) -> None:
    rc, err, _ = serve(["--worker", silent_worker, "--port", "0", "--request-timeout-s", value])
    one_line_error(rc, err, "--request-timeout-s must be a positive number")


def test_worker_url_with_a_path(silent_worker: str) -> None:
    rc, err, _ = serve(["--worker", silent_worker + "/v1", "--port", "0"])
    one_line_error(rc, err, "without a path (/v1)")


def test_ctrl_c_while_probing_the_workers_exits_quietly(tmp_path: Path) -> None:
    """SIGINT while `serve` probes its workers, before it listens: no traceback, one log line,
    exit status 0 as for a Ctrl-C once it serves (tests/integration/test_cli_serve.py)."""
    worker = socket.socket()
    worker.bind(("127.0.0.1", 0))
    worker.listen(16)
    worker.settimeout(30.0)
    cfg = tmp_path / "gw.toml"
    cfg.write_text("[health]\ntimeout_s = 60.0\n")  # the probe would wait a minute
    url = f"http://127.0.0.1:{worker.getsockname()[1]}"
    proc = subprocess.Popen(
        [str(BIN), "serve", "--config", str(cfg), "--worker", url, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        conn, _ = worker.accept()  # the probe has connected: the gateway is starting
        with conn:
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        worker.close()
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert proc.returncode == 0, err
    lines = [json.loads(line) for line in err.strip().splitlines()]
    assert [e["event"] for e in lines] == ["gateway.interrupted"], err
