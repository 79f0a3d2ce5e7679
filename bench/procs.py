"""Starting, watching and stopping the processes a peer test or a benchmark needs.

Shared by `tests/peer/` and the benchmark harness: free ports, subprocesses in their own
process group with a log file, readiness waits that fail fast when the process dies, the
command lines of the emulator, the gateway and the two Rust routers (sglang-router,
vllm-router), and the CPU time of a process tree.

Everything here is synchronous (subprocess + urllib) so that pytest fixtures and the
benchmark driver can use it without an event loop.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from emulator.ports import free_port as free_port  # (re-exported: bench modules call procs.*)
from emulator.ports import free_ports as free_ports

HOST = "127.0.0.1"
REPO_ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- ports


def port_open(port: int, host: str = HOST, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


# --------------------------------------------------------------------------- HTTP probes


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """GET `url` (http://host:port/path); returns (status, body). Raises OSError on failure."""
    host, port, path = split_url(url)
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path, headers={"Connection": "close"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    except http.client.HTTPException as exc:  # garbage or a closed connection: not ready
        raise OSError(str(exc)) from exc
    finally:
        conn.close()


def split_url(url: str) -> tuple[str, int, str]:
    rest = url.split("://", 1)[-1]
    hostport, _, path = rest.partition("/")
    host, _, port = hostport.rpartition(":")
    return host.strip("[]"), int(port), "/" + path


# --------------------------------------------------------------------------- processes


class ProcessDied(RuntimeError):
    pass


@dataclass
class ManagedProcess:
    """A subprocess in its own session/process group with stdout+stderr in a log file."""

    name: str
    argv: list[str]
    popen: subprocess.Popen[bytes]
    log_path: Path
    _log_file: object = field(repr=False, default=None)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, n_bytes: int = 4000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-n_bytes:].decode("utf-8", "replace")

    def lost_port_race(self) -> bool:
        """Whether it exited because a port picked for it (`free_ports`: free a moment before)
        was taken by another process before it could bind it."""
        return not self.alive() and "address already in use" in self.log_tail()

    def check_alive(self) -> None:
        if not self.alive():
            raise ProcessDied(
                f"{self.name} exited with code {self.popen.returncode}\n"
                f"command: {' '.join(self.argv)}\n--- log tail ---\n{self.log_tail()}"
            )

    def stop(self, timeout: float = 5.0) -> int | None:
        """SIGTERM the whole process group, SIGKILL it after `timeout`. Idempotent."""
        if self.popen.poll() is None:
            _signal_group(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        # Kill whatever is left in the group (the leader may be gone but children not).
        _signal_group(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5.0)
        f = self._log_file
        if f is not None:
            with contextlib.suppress(Exception):
                f.close()  # type: ignore[attr-defined]
            self._log_file = None
        return self.popen.returncode

    def wait_http(self, url: str, timeout: float = 60.0, *, expect: int = 200) -> None:
        wait_http(url, timeout, expect=expect, proc=self)

    def wait_port(self, port: int, timeout: float = 60.0, host: str = HOST) -> None:
        deadline = time.monotonic() + timeout
        while not port_open(port, host):
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.name}: port {port} not open after {timeout:.0f}s\n{self.log_tail()}"
                )
            time.sleep(0.05)


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def start_process(
    name: str,
    argv: Sequence[str],
    *,
    cpus: str | None = None,
    env: Mapping[str, str] | None = None,
    log_dir: str | os.PathLike[str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> ManagedProcess:
    """Start `argv` in a new process group; `cpus` (e.g. "0") pins it with `taskset -c`."""
    argv = list(argv)
    if cpus is not None:
        argv = pin_argv(argv, cpus)
    log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.gettempdir()) / "pd-gateway-procs"
    log_dir.mkdir(parents=True, exist_ok=True)
    fd, log_name = tempfile.mkstemp(prefix=f"{name}-", suffix=".log", dir=log_dir)
    log_file = os.fdopen(fd, "wb")
    full_env = dict(os.environ)
    full_env.update(QUIET_ENV)
    if env:
        full_env.update(env)
    popen = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        env=full_env,
        cwd=str(cwd) if cwd is not None else None,
        start_new_session=True,
    )
    return ManagedProcess(name=name, argv=argv, popen=popen, log_path=Path(log_name), _log_file=log_file)


def pin_argv(argv: list[str], cpus: str) -> list[str]:
    """`argv` under `taskset -c cpus`. Whether to pin is the caller's decision (`can_pin`, asked
    before the caller pins itself): asked here, it would see the caller's own narrowed affinity
    and silently leave the child on the caller's CPUs."""
    taskset = _which("taskset")
    if taskset is None:
        return argv
    return [taskset, "-c", cpus, *argv]


def can_pin(cpus: str) -> bool:
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return False
    wanted = {int(c) for c in cpus.replace("-", ",").split(",") if c.strip()}
    return len(allowed) >= 2 and wanted <= allowed


def _which(prog: str) -> str | None:
    for d in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep):
        p = Path(d) / prog
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return None


def wait_http(
    url: str, timeout: float = 60.0, *, expect: int = 200, proc: ManagedProcess | None = None
) -> bytes:
    """Poll GET `url` until it answers `expect`; fail fast (with its log) if `proc` dies."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    delay = 0.02
    while True:
        if proc is not None:
            proc.check_alive()
        try:
            status, body = http_get(url, timeout=2.0)
            if status == expect:
                return body
            last = f"HTTP {status}: {body[:200]!r}"
        except OSError as exc:
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() > deadline:
            tail = f"\n--- log tail of {proc.name} ---\n{proc.log_tail()}" if proc is not None else ""
            raise TimeoutError(f"{url} not ready after {timeout:.0f}s (last: {last}){tail}")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.25)


class ProcessGroup:
    """Processes started together and stopped together (in reverse order)."""

    def __init__(self) -> None:
        self.procs: list[ManagedProcess] = []

    def add(self, proc: ManagedProcess) -> ManagedProcess:
        self.procs.append(proc)
        return proc

    def stop_all(self, timeout: float = 5.0) -> None:
        for p in reversed(self.procs):
            with contextlib.suppress(Exception):
                p.stop(timeout)
        self.procs.clear()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


# --------------------------------------------------------------------------- CPU accounting


def tree_cpu_seconds(pid: int) -> float:
    """utime+stime (all threads) of `pid` and its live descendants, in seconds."""
    user, system = tree_cpu_times(pid)
    return user + system


def tree_runtime_seconds(pid: int) -> float:
    """CPU time (all threads, user and kernel) of `pid` and its live descendants, in seconds.

    `tree_cpu_seconds` to the nanosecond: on Linux, each process's own CPU-time clock
    (`clock_gettime` on the clock id that glibc's `clock_getcpuclockid(pid)` returns: the
    scheduler's runtime). utime and stime count in clock ticks (10 ms here) and a tree rounds
    once per process: on a row of ~50 streams, up to ±10 % of its CPU per stream with `serve
    --workers 2` (three processes). Elsewhere: utime+stime."""
    import psutil

    try:
        root = psutil.Process(pid)
        pids = [pid, *(c.pid for c in root.children(recursive=True))]
    except psutil.Error:
        return 0.0
    if not sys.platform.startswith("linux"):
        user, system = tree_cpu_times(pid)
        return user + system
    total = 0.0
    for p in pids:
        with contextlib.suppress(OSError):
            total += time.clock_gettime(_process_cpu_clock(p))
    return total


def _process_cpu_clock(pid: int) -> int:
    """Linux's CPU-time clock id of process `pid` (MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED) in
    the kernel's include/linux/posix-timers.h, what glibc's clock_getcpuclockid returns)."""
    return ((~pid) << 3) | 2


def tree_cpu_times(pid: int) -> tuple[float, float]:
    """(utime, stime) (all threads) of `pid` and its live descendants, in seconds."""
    import psutil

    user = system = 0.0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0, 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            user += t.user
            system += t.system
    return user, system


def pin_children(pid: int, cpus: list[int]) -> list[tuple[int, int]]:
    """Pin `pid`'s direct children, in pid order, one to each CPU of `cpus` (every thread of
    each): `serve --workers N`'s serving processes, a core each, its supervisor left where it
    is. Returns (child pid, CPU) pairs. Raises ValueError when there are more children than
    CPUs."""
    import psutil

    kids = sorted(c.pid for c in psutil.Process(pid).children())
    if len(kids) > len(cpus):
        raise ValueError(f"{len(kids)} processes, {len(cpus)} CPUs to pin them to")
    out = []
    for child, cpu in zip(kids, cpus, strict=False):
        for tid in os.listdir(f"/proc/{child}/task"):
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(int(tid), {cpu})
        out.append((child, cpu))
    return out


def tree_wakeups(pid: int) -> int:
    """Voluntary context switches of every thread of `pid` and its live descendants: how often
    they blocked (in epoll_wait, mostly) and were woken. Per request, it says how many wake-ups
    a target paid: an idle target pays one per upstream event, a busy one finds several events
    per wake-up (Linux; 0 elsewhere)."""
    return _tree_switches(pid, b"voluntary_ctxt_switches:")


def tree_preemptions(pid: int) -> int:
    """Involuntary context switches of every thread of `pid` and its live descendants: how often
    the scheduler took the CPU from one of them while it could still run (another process of
    the same core was due). A process alone on its core is hardly ever preempted; two that
    share one take turns (Linux; 0 elsewhere)."""
    return _tree_switches(pid, b"nonvoluntary_ctxt_switches:")


def _tree_switches(pid: int, field: bytes) -> int:
    import psutil

    try:
        root = psutil.Process(pid)
        pids = [root.pid, *(c.pid for c in root.children(recursive=True))]
    except psutil.Error:
        return 0
    total = 0
    for p in pids:
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{p}/task/{tid}/status", "rb") as f:
                    for line in f:
                        if line.startswith(field):
                            total += int(line.split()[1])
                            break
            except (OSError, ValueError):
                continue
    return total


# --------------------------------------------------------------------------- commands

# Keep the routers from reaching for the network (HuggingFace tokenizer download) and
# from writing caches into $HOME.
QUIET_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "NO_COLOR": "1",
    "PYTHONUNBUFFERED": "1",
}


def pd_gateway_argv() -> list[str]:
    """How to run the `pd-gateway` console script with this interpreter."""
    script = Path(sys.executable).parent / "pd-gateway"
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-m", "pd_gateway.cli"]


def emulator_argv(
    engine: str,
    role: str,
    port: int,
    *,
    bootstrap_port: int | None = None,
    kv_port: int | None = None,
    model: str | None = None,
    time_scale: float | None = None,
    seed: int | None = None,
    host: str = HOST,
    extra: Sequence[str] = (),
) -> list[str]:
    argv = [*pd_gateway_argv(), "emulate", "--engine", engine, "--role", role]
    argv += ["--host", host, "--port", str(port)]
    if bootstrap_port is not None:
        argv += ["--bootstrap-port", str(bootstrap_port)]
    if kv_port is not None:
        argv += ["--kv-port", str(kv_port)]
    if model is not None:
        argv += ["--model", model]
    if time_scale is not None:
        argv += ["--time-scale", repr(time_scale)]
    if seed is not None:
        argv += ["--seed", str(seed)]
    return [*argv, *extra]


def router_available(kind: str) -> bool:
    """Whether the Rust router's Python package (with its compiled extension) is installed."""
    mod = {"sglang-router": "sglang_router", "vllm-router": "vllm_router"}[kind]
    try:
        return importlib.util.find_spec(mod) is not None
    except (ImportError, ValueError):
        return False


def sglang_router_argv(
    port: int,
    prefill: Sequence[tuple[str, int | None]],
    decode: Sequence[str],
    *,
    prometheus_port: int,
    host: str = HOST,
    policy: str | None = "round_robin",
    log_level: str | None = "warn",
    extra: Sequence[str] = (),
) -> list[str]:
    """sglang-router 0.3.x in P/D mode. `prefill` is [(url, bootstrap_port or None)].
    A `policy` or `log_level` of None leaves the router's own default (cache_aware, info)."""
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    for url, bport in prefill:
        argv += ["--prefill", url, str(bport) if bport is not None else "none"]
    for url in decode:
        argv += ["--decode", url]
    argv += [*router_common_argv(host, port, prometheus_port), "--shutdown-grace-period-secs", "1"]
    return [*argv, *_opt("--policy", policy), *_opt("--log-level", log_level), *extra]


def router_common_argv(host: str, port: int, prometheus_port: int) -> list[str]:
    """The flags sglang-router and vllm-router share: where they listen and serve metrics, and
    their own probes kept quiet (the workers are already up when a router starts)."""
    return [
        "--host",
        host,
        "--port",
        str(port),
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(prometheus_port),
        "--health-check-interval-secs",
        "300",
        "--worker-startup-check-interval",
        "1",
        "--worker-startup-timeout-secs",
        "120",
    ]


def _opt(flag: str, value: str | None) -> list[str]:
    return [] if value is None else [flag, value]


def vllm_router_argv(
    port: int,
    prefill: Sequence[str],
    decode: Sequence[str],
    *,
    prometheus_port: int,
    host: str = HOST,
    policy: str | None = "round_robin",
    log_level: str | None = "warning",
    extra: Sequence[str] = (),
) -> list[str]:
    """vllm-router 0.1.x in vLLM P/D (NIXL) mode. A `policy` or `log_level` of None leaves the
    router's own default (cache_aware, info)."""
    argv = [sys.executable, "-m", "vllm_router.launch_router", "--vllm-pd-disaggregation"]
    for url in prefill:
        argv += ["--prefill", url]
    for url in decode:
        argv += ["--decode", url]
    argv += router_common_argv(host, port, prometheus_port)
    return [*argv, *_opt("--policy", policy), *_opt("--log-level", log_level), *extra]


def gateway_argv(
    engine: str,
    port: int,
    prefill: Sequence[tuple[str, int | None]],
    decode: Sequence[str],
    *,
    host: str = HOST,
    log_level: str | None = "warning",
    extra: Sequence[str] = (),
) -> list[str]:
    """`pd-gateway serve` in front of one engine's P/D pool. A `log_level` of None leaves the
    gateway's default (info: one access-log line per request)."""
    argv = [*pd_gateway_argv(), "serve", "--engine", engine]
    for url, bport in prefill:
        argv += ["--prefill", url]
        if bport is not None:
            argv.append(str(bport))
    for url in decode:
        argv += ["--decode", url]
    argv += ["--host", host, "--port", str(port), *_opt("--log-level", log_level)]
    return [*argv, *extra]


# --------------------------------------------------------------------------- emulated clusters


@dataclass
class Upstream:
    """One started emulated server."""

    proc: ManagedProcess
    engine: str
    role: str
    port: int
    bootstrap_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"


def start_emulator(
    group: ProcessGroup,
    engine: str,
    role: str,
    *,
    model: str | None = None,
    time_scale: float | None = None,
    seed: int | None = None,
    cpus: str | None = None,
    log_dir: str | os.PathLike[str] | None = None,
    extra: Sequence[str] = (),
    wait: bool = True,
    timeout: float = 60.0,
) -> Upstream:
    """Start one emulated server (the `pd-gateway emulate` CLI) and wait for its /health."""
    port, bport, kv_port = free_ports(3)
    with_bootstrap = engine == "sglang" and role == "prefill"
    argv = emulator_argv(
        engine,
        role,
        port,
        bootstrap_port=bport if with_bootstrap else None,
        kv_port=kv_port if role == "prefill" else None,
        model=model,
        time_scale=time_scale,
        seed=seed,
        extra=extra,
    )
    proc = group.add(start_process(f"emu-{engine}-{role}", argv, cpus=cpus, log_dir=log_dir, cwd=REPO_ROOT))
    up = Upstream(proc, engine, role, port, bport if with_bootstrap else None)
    if wait:
        wait_upstream(up, timeout)
    return up


def wait_upstream(up: Upstream, timeout: float = 60.0) -> None:
    up.proc.wait_http(f"{up.url}/health", timeout)
    if up.bootstrap_port is not None:
        up.proc.wait_http(f"http://{HOST}:{up.bootstrap_port}/health", timeout)


@contextlib.contextmanager
def process_group() -> Iterator[ProcessGroup]:
    g = ProcessGroup()
    try:
        yield g
    finally:
        g.stop_all()
