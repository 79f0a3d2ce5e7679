"""`pd-gateway serve --workers 2`: two real gateway processes on one port (SO_REUSEPORT), run as
a user runs them (a subprocess with a TOML file), in front of OpenAI-compatible engines that
count what reaches them (each request held for a while, so that many are in flight at once).

Clients open a fresh connection per request, so the kernel spreads them over both processes;
the access log's `process` field shows that both served."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest
from aiohttp import web

from gateway.logging import FLUSH_AFTER_S

BIN = Path(sys.executable).parent / "pd-gateway"
TOKEN = "mp-admin-token"
MODEL = "m-count"


class CountingEngine:
    """An OpenAI-compatible server (colocated) in a thread of its own: it holds each completion
    `hold_s` and counts requests received, in flight, and the most ever in flight at once.
    `fail`: completions answer 500 (its /health stays 200)."""

    def __init__(self, hold_s: float = 0.0, fail: bool = False) -> None:
        self.hold_s = hold_s
        self.fail = fail
        self.received = 0
        self.active = 0
        self.peak = 0
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._complete)
        self._runner = web.AppRunner(app, access_log=None)
        loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._ready.set()
        loop.run_forever()

    async def _health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 4096}]}
        )

    async def _complete(self, req: web.Request) -> web.Response:
        await req.read()
        with self._lock:
            self.received += 1
            self.active += 1
            self.peak = max(self.peak, self.active)
        try:
            await asyncio.sleep(self.hold_s)
        finally:
            with self._lock:
                self.active -= 1
        if self.fail:
            return web.json_response({"error": {"message": "boom", "type": "server_error"}}, status=500)
        return web.json_response(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "created": 0,
                "model": MODEL,
                "choices": [{"index": 0, "text": " ok", "logprobs": None, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
            }
        )

    def close(self) -> None:
        loop = self._loop
        if loop is None:
            return
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(10)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Served:
    """A `pd-gateway serve --workers 2` subprocess and its log."""

    def __init__(self, toml: str, tmp: Path, processes: int = 2) -> None:
        self.port = free_port()
        cfg = tmp / "gw.toml"
        cfg.write_text(toml)
        self.log_path = tmp / "gw.log"
        self._log = self.log_path.open("wb")
        env = {**os.environ, "MP_ADMIN_TOKEN": TOKEN}
        self.proc = subprocess.Popen(
            [str(BIN), "serve", "--config", str(cfg), "--port", str(self.port), "--workers", str(processes)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while "gateway.processes_started" not in self.log():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"the gateway did not start:\n{self.log()}")
            time.sleep(0.05)

    def log(self) -> str:
        if self.proc.poll() is None:  # a running process's lines leave within FLUSH_AFTER_S
            time.sleep(FLUSH_AFTER_S * 4)
        return self.log_path.read_text(errors="replace")

    def events(self, name: str) -> list[dict[str, Any]]:
        out = []
        for line in self.log().splitlines():
            if line.startswith("{") and f'"{name}"' in line:
                with_event = json.loads(line)
                if with_event.get("event") == name:
                    out.append(with_event)
        return out

    def children(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._log.close()


def toml(
    *engines: CountingEngine,
    cap: int = 0,
    threshold: int = 5,
    admin: bool = False,
    admin_port: int | None = None,
    max_connections: int = 0,
    kubernetes: str | None = None,
) -> str:
    """`admin_port`: the admin API on its own listener; `kubernetes`: the fake API server's URL,
    for discovery of colocated OpenAI-compatible pods labelled app=engine in namespace "ml"."""
    out = [
        'log_level = "info"',
        "shutdown_grace_s = 10.0",
        "",
        "[limits]",
        f"max_inflight_per_worker = {cap}",
        f"max_connections = {max_connections}",
        "retry_after_s = 1.0",
        "",
        "[breaker]",
        f"failure_threshold = {threshold}",
        "open_s = 120.0",
        "",
        "[retries]",
        "max_attempts = 2",
        "backoff_initial_s = 0.001",
        "backoff_max_s = 0.001",
        "",
        "[health]",
        "interval_s = 0.5",
    ]
    if admin:
        out += ["", "[admin]", 'token_env = "MP_ADMIN_TOKEN"']
        if admin_port is not None:
            out += [f"listen_port = {admin_port}"]
    if kubernetes is not None:
        out += [
            "",
            "[kubernetes]",
            'namespace = "ml"',
            'colocated_selector = "app=engine"',
            'engine = "openai"',
            f'api_url = "{kubernetes}"',
            "retry_s = 0.05",
            "drain_timeout_s = 5.0",
        ]
    for i, e in enumerate(engines):
        out += [
            "",
            "[[workers]]",
            f'id = "e{i}"',
            f'url = "{e.url}"',
            'role = "colocated"',
            'engine = "openai"',
        ]
    return "\n".join(out) + "\n"


def complete(url: str, timeout: float = 30.0) -> tuple[int, dict[str, Any]]:
    """One completion on a connection of its own."""
    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 1}).encode()
    req = urllib.request.Request(
        url + "/v1/completions", body, {"content-type": "application/json", "connection": "close"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def admin(url: str, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        url + path,
        data,
        {"authorization": f"Bearer {TOKEN}", "content-type": "application/json", "connection": "close"},
        method=method,
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def get_text(url: str) -> str:
    req = urllib.request.Request(url, headers={"connection": "close"})
    with urllib.request.urlopen(req, timeout=10) as r:
        text: str = r.read().decode()
        return text


def processes_that_served(gw: Served) -> set[int]:
    return {e["process"] for e in gw.events("request.done") if e.get("outcome") == "ok"}


@pytest.fixture
def engines() -> Iterator[list[CountingEngine]]:
    made: list[CountingEngine] = []
    yield made
    for e in made:
        e.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[list[Served]]:
    made: list[Served] = []
    yield made
    for g in made:
        g.kill()


def test_two_processes_do_not_book_a_worker_beyond_its_limit(
    engines: list[CountingEngine], served: list[Served], tmp_path: Path
) -> None:
    """limits.max_inflight_per_worker = 3, one worker, 16 clients at once (the kernel spreads
    their connections over both processes): the engine never has more than 3 of them at once;
    the others are shed (503), as with one process. Two gateways that each counted only their
    own requests would put up to 6 on it. Rounds go on (4 at least, 12 at most) until both
    processes have booked the worker: which process's requests win a round's 3 slots is the
    kernel's and the scheduler's choice, and on a loaded 2-core machine one process can win the
    first rounds."""
    e = CountingEngine(hold_s=0.4)
    engines.append(e)
    gw = Served(toml(e, cap=3), tmp_path)
    served.append(gw)
    statuses: list[int] = []
    with ThreadPoolExecutor(16) as pool:
        for round_ in range(12):
            statuses += [s for s, _ in pool.map(lambda _: complete(gw.url), range(16))]
            if round_ >= 3 and processes_that_served(gw) == {0, 1}:
                break
    assert e.peak == 3, (e.peak, statuses)
    assert statuses.count(200) >= 4 and set(statuses) <= {200, 503}
    assert processes_that_served(gw) == {0, 1}  # both processes booked the worker


def test_sigterm_drains_every_process(
    engines: list[CountingEngine], served: list[Served], tmp_path: Path
) -> None:
    """SIGTERM to the supervisor (as systemd or Kubernetes sends it): every process stops
    accepting, finishes the requests it has in flight, and the gateway exits 0."""
    e = CountingEngine(hold_s=1.5)
    engines.append(e)
    gw = Served(toml(e), tmp_path)
    served.append(gw)
    with ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(complete, gw.url) for _ in range(12)]
        deadline = time.monotonic() + 10
        while e.active < 12 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert e.active == 12
        gw.proc.send_signal(signal.SIGTERM)
        results = [f.result() for f in futures]
    assert [s for s, _ in results] == [200] * 12
    assert gw.proc.wait(20) == 0
    assert {ev["process"] for ev in gw.events("gateway.stopping") if "process" in ev} == {0, 1}
    assert processes_that_served(gw) == {0, 1}
    with pytest.raises(OSError):
        complete(gw.url, timeout=2)


def test_a_dead_process_stops_the_gateway_cleanly(
    engines: list[CountingEngine], served: list[Served], tmp_path: Path
) -> None:
    """A process killed (SIGKILL) is not restarted: the supervisor logs it, lets the other
    process finish what it has in flight, and exits 1 (for systemd / Kubernetes to restart the
    gateway whole). The killed process's clients lose their connections."""
    e = CountingEngine(hold_s=1.5)
    engines.append(e)
    gw = Served(toml(e), tmp_path)
    served.append(gw)
    children = gw.children()
    assert len(children) == 2
    victim = children[0]
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(lambda: _status_or_error(gw.url)) for _ in range(16)]
        deadline = time.monotonic() + 10
        while e.active < 16 and time.monotonic() < deadline:
            time.sleep(0.02)
        victim.kill()
        outcomes = [f.result() for f in futures]
    assert gw.proc.wait(20) == 1
    died = gw.events("gateway.process_died")
    assert len(died) == 1 and died[0]["pid"] == victim.pid
    assert 0 < outcomes.count(200) < 16  # the survivor's requests finished, the victim's did not
    assert all(o in (200, "error") for o in outcomes)
    assert not any(psutil.pid_exists(c.pid) for c in children)  # the survivor stopped and was reaped


def _status_or_error(url: str) -> int | str:
    try:
        return complete(url)[0]
    except OSError:
        return "error"


def test_admin_changes_hold_in_every_process(
    engines: list[CountingEngine], served: list[Served], tmp_path: Path
) -> None:
    a, b = CountingEngine(), CountingEngine()
    engines += [a, b]
    gw = Served(toml(a, admin=True), tmp_path)
    served.append(gw)
    status, out = admin(
        gw.url, "POST", "/admin/workers", {"id": "e1", "url": b.url, "role": "colocated", "engine": "openai"}
    )
    assert status == 201 and out["processes"] == {"count": 2, "applied": 2, "failed": []}
    status, out = admin(gw.url, "POST", "/admin/workers/e0/drain")
    assert status == 200 and out["draining"] and out["processes"]["applied"] == 2
    before = a.received
    for _ in range(20):
        assert complete(gw.url)[0] == 200
    assert a.received == before and b.received == 20  # drained everywhere, added everywhere
    status, out = admin(gw.url, "DELETE", "/admin/workers/e0")
    assert status == 200 and out["removed"] and out["drained"] and out["processes"]["applied"] == 2
    for _ in range(6):  # whichever process answers
        assert [w["id"] for w in admin(gw.url, "GET", "/admin/workers")[1]["workers"]] == ["e1"]
    assert processes_that_served(gw) == {0, 1}


def test_metrics_and_admission_count_every_process(
    engines: list[CountingEngine], served: list[Served], tmp_path: Path
) -> None:
    e = CountingEngine()
    engines.append(e)
    gw = Served(toml(e, admin=True), tmp_path)
    served.append(gw)
    for _ in range(20):
        assert complete(gw.url)[0] == 200
    assert processes_that_served(gw) == {0, 1}
    for _ in range(6):  # whichever process answers the scrape
        page = get_text(gw.url + "/metrics")
        ok = [
            float(line.rsplit(" ", 1)[1])
            for line in page.splitlines()
            if line.startswith("pdgw_requests_total{") and 'outcome="ok"' in line
        ]
        assert sum(ok) == 20, page
        assert "pdgw_processes_scraped 2.0" in page
        assert (
            'pdgw_worker_inflight{engine="openai",model="m-count",role="colocated",worker="e0"} 0.0' in page
        )
        stats = admin(gw.url, "GET", "/admin/admission")[1]
        assert stats["admitted"] == 20 and stats["processes"] == {"count": 2, "answered": 2}
        assert stats["max_concurrent"] == 4096  # each process holds half of limits.max_concurrent


def test_a_worker_breaker_is_one_for_every_process(
    engines: list[CountingEngine], served: list[Served], tmp_path: Path
) -> None:
    """A worker that fails every request: its breaker (failure_threshold 3) opens after 3
    failures in all, whichever process saw them; each failed attempt is retried on the other
    worker, so every client gets its answer. With a breaker per process it would take 3 failures
    in each."""
    bad, good = CountingEngine(fail=True), CountingEngine()
    engines += [bad, good]
    gw = Served(toml(bad, good, threshold=3), tmp_path)
    served.append(gw)
    for _ in range(30):
        assert complete(gw.url)[0] == 200
    assert bad.received == 3
    assert processes_that_served(gw) == {0, 1}


def test_a_port_in_use_is_refused_before_any_process_starts(tmp_path: Path) -> None:
    import socket

    e = CountingEngine()
    try:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            cfg = tmp_path / "gw.toml"
            cfg.write_text(toml(e))
            out = subprocess.run(
                [str(BIN), "serve", "--config", str(cfg), "--port", str(port), "--workers", "2"],
                capture_output=True,
                text=True,
                timeout=60,
            )
    finally:
        e.close()
    assert out.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr
    assert "supervisor_started" not in out.stderr + out.stdout


def _refusals(gw: Served, stage: str) -> list[dict[str, Any]]:
    return [e for e in gw.events("request.done") if e.get("stage") == stage]


def test_admin_on_its_own_listener_is_served_by_every_process(
    engines: list[CountingEngine], served: list[Served], tmp_path: Path
) -> None:
    """admin.listen_port with two processes: both listen on it (the supervisor holds the port),
    a change made there holds in both, /admin/ is a 404 on the gateway's listener, and each
    process refuses the gateway itself as a worker, on either of its ports."""
    a, b = CountingEngine(), CountingEngine()
    engines += [a, b]
    admin_port = free_port()
    gw = Served(toml(a, admin=True, admin_port=admin_port), tmp_path)
    served.append(gw)
    admin_url = f"http://127.0.0.1:{admin_port}"
    assert admin(gw.url, "GET", "/admin/workers")[0] == 404
    status, out = admin(
        admin_url,
        "POST",
        "/admin/workers",
        {"id": "e1", "url": b.url, "role": "colocated", "engine": "openai"},
    )
    assert status == 201 and out["processes"] == {"count": 2, "applied": 2, "failed": []}
    for i in range(12):  # fresh connections: the kernel hands them to both processes
        port = (gw.port, admin_port)[i % 2]
        worker = {
            "id": f"self{i}",
            "url": f"http://127.0.0.1:{port}",
            "role": "colocated",
            "engine": "openai",
        }
        status, out = admin(admin_url, "POST", "/admin/workers", worker)
        assert status == 400 and "this gateway itself" in out["error"]["message"], out
    assert {e["process"] for e in _refusals(gw, "admin")} == {0, 1}
    for _ in range(6):
        assert [w["id"] for w in admin(admin_url, "GET", "/admin/workers")[1]["workers"]] == ["e0", "e1"]
    for _ in range(20):
        assert complete(gw.url)[0] == 200
    assert a.received + b.received == 20 and b.received > 0
    assert processes_that_served(gw) == {0, 1}


def test_a_configured_connection_limit_is_split_between_the_processes(
    engines: list[CountingEngine], served: list[Served], tmp_path: Path
) -> None:
    """limits.max_connections = 100 is the gateway's: each of two processes holds 50 (the
    merged /metrics adds their limits up to 100, not 200)."""
    e = CountingEngine()
    engines.append(e)
    gw = Served(toml(e, max_connections=100), tmp_path)
    served.append(gw)
    for _ in range(6):  # whichever process answers the scrape
        page = get_text(gw.url + "/metrics")
        assert "pdgw_processes_scraped 2.0" in page
        assert "pdgw_max_connections 100.0" in page, page


class KubeAPIThread:
    """tests/integration/fake_kube.py's API server in a thread of its own (the gateway under
    test is a subprocess); `do` runs a change in that thread's loop."""

    def __init__(self) -> None:
        from tests.integration.fake_kube import FakeKubeAPI

        self.api = FakeKubeAPI()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self.api.start(), self._loop).result(10)

    def do(self, change: Any, *args: Any, **kw: Any) -> None:
        async def run() -> None:
            change(*args, **kw)

        asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.api.stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def test_kubernetes_discovery_runs_in_every_process(
    engines: list[CountingEngine], served: list[Served], tmp_path: Path
) -> None:
    """Each process lists and watches the pods and converges its own registry: a pod ready at
    start is a worker of both, one added later joins both, and a deleted one is drained and
    removed by both (drain_and_remove in each), after which neither sends it anything."""
    a, b = CountingEngine(), CountingEngine()
    engines += [a, b]
    kube = KubeAPIThread()
    try:
        pod = {"labels": {"app": "engine"}}
        kube.do(kube.api.add_pod, "ml", "pod-a", annotations={"pd-gateway/port": str(a.port)}, **pod)
        gw = Served(toml(admin=True, kubernetes=kube.url), tmp_path)
        served.append(gw)
        assert len(kube.api.lists) == 2  # one list per process (one role selected)
        for _ in range(20):
            assert complete(gw.url)[0] == 200
        assert a.received == 20 and processes_that_served(gw) == {0, 1}

        kube.do(kube.api.add_pod, "ml", "pod-b", annotations={"pd-gateway/port": str(b.port)}, **pod)
        deadline = time.monotonic() + 20
        while {e["process"] for e in gw.events("discovery.worker_added") if e["worker"] == "ml/pod-b"} != {
            0,
            1,
        }:
            assert time.monotonic() < deadline, gw.log()
            time.sleep(0.05)

        kube.do(kube.api.delete_pod, "ml", "pod-a", graceful=False)
        deadline = time.monotonic() + 20
        while {e["process"] for e in gw.events("discovery.worker_removed") if e["worker"] == "ml/pod-a"} != {
            0,
            1,
        }:
            assert time.monotonic() < deadline, gw.log()
            time.sleep(0.05)
        before, seen = a.received, b.received
        for _ in range(20):
            assert complete(gw.url)[0] == 200
        assert a.received == before and b.received == seen + 20
        for _ in range(6):  # whichever process answers
            assert [w["id"] for w in admin(gw.url, "GET", "/admin/workers")[1]["workers"]] == ["ml/pod-b"]
    finally:
        for g in served:
            g.kill()
        kube.close()
