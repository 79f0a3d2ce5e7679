"""`pd-gateway serve --workers N`: N gateway processes on one port, and the process over them.

The supervisor (the process `serve` started as) holds the port, and the admin API's own
`admin.listen_port` when set (bound with SO_REUSEPORT, never listening, so that nothing else
takes them; a port 0 is picked here, the same for every process), makes the shared table and
the group's secret, forks the N gateway processes, and then only watches:

- **Start.** Each process builds its gateway (probing its workers) and listens on the port with
  SO_REUSEPORT: the kernel spreads new connections over the listening processes. Once all N
  listen, `gateway.processes_started` is logged. One that fails to start (a config error, the
  port) ends the start: the others are stopped and `serve` exits with that process's status.
- **SIGTERM / SIGINT.** Passed on to every process as SIGTERM: each stops accepting, lets its
  requests finish for `shutdown_grace_s`, then ends the rest (docs/operations.md, "Graceful
  shutdown"). A second signal is passed on as SIGUSR1, which ends every process's grace period
  at once. The processes ignore a second SIGINT/SIGTERM of their own, so a terminal's Ctrl-C,
  which reaches the whole process group, still counts once. `serve` exits 0 when all have.
- **A process that dies** (killed, crashed) is not restarted: it may have held admin changes
  made since the start, which a fresh process would not have. The supervisor logs
  `gateway.process_died`, frees the shared table's lock if the dead process held it, stops the
  other processes as on SIGTERM (their requests in flight finish) and exits with status 1, for
  whatever runs the gateway (systemd, Kubernetes) to restart it whole.
- **The supervisor dies** (SIGKILL): each process gets SIGTERM from the kernel
  (PR_SET_PDEATHSIG) and stops as above.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import sys
import time
import traceback

import structlog

from gateway.config import ConfigError, GatewayConfig
from gateway.listen import ListenError, bind_all, listen_error
from gateway.logging import configure, get_logger
from gateway.multiprocess.siblings import ProcessContext
from gateway.multiprocess.table import SharedTable

log = get_logger("pd_gateway.supervisor")

HURRY_SIGNAL = signal.SIGUSR1
KILL_AFTER_GRACE_S = 15.0  # past shutdown_grace_s: a process still there is killed
_POLL_S = 0.1


def reserve_port(host: str, port: int) -> list[socket.socket]:
    """Bind (SO_REUSEPORT, not listening) every address `host` resolves to: the port is the
    group's (port 0: one is picked, the same on every address). Raises ListenError."""
    try:
        infos = socket.getaddrinfo(
            host or None, port, family=socket.AF_UNSPEC, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError as e:
        raise listen_error(host, port, e) from None
    return bind_all(infos, host, port, reuse_port=True)


def run(cfg: GatewayConfig) -> int:
    """Serve with `cfg.listen.processes` processes until a signal (see the module docstring).
    The exit status: 0 after a signal, 1 when a process died, a failed process's at start."""
    import msgspec

    n = cfg.listen.processes
    held: list[socket.socket] = []
    try:
        held += reserve_port(cfg.listen.host, cfg.listen.port)
        port = held[0].getsockname()[1]
        if cfg.listen.port != port:
            cfg = msgspec.structs.replace(cfg, listen=msgspec.structs.replace(cfg.listen, port=port))
        a = cfg.admin
        if a.listen_port is not None and a.resolve_token(os.environ) is not None:
            # the admin API's own listener: every process listens there too (any of them
            # applies an admin change in all), on one port, picked here when it is 0
            admin = reserve_port(a.listen_host, a.listen_port)
            held += admin
            admin_port = admin[0].getsockname()[1]
            if a.listen_port != admin_port:
                cfg = msgspec.structs.replace(cfg, admin=msgspec.structs.replace(a, listen_port=admin_port))
    except ListenError as e:
        for sock in held:
            sock.close()
        print(f"pd-gateway serve: {e}", file=sys.stderr)
        return 2
    table = SharedTable(n)
    secret = os.urandom(16)
    ready_r, ready_w = os.pipe()
    parent = os.getpid()
    children: dict[int, int] = {}
    for s in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            s.flush()
    for i in range(n):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child's own coverage is not collected
            os.close(ready_r)
            for s in held:
                s.close()
            code = 1
            try:
                code = _child(i, cfg, table, secret, ready_w, parent)
            finally:
                _flush_logs()
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)
        children[pid] = i
    os.close(ready_w)
    try:
        return Supervisor(cfg, children, table, ready_r, port).run()
    finally:
        os.close(ready_r)
        for s in held:
            s.close()


class Supervisor:
    def __init__(
        self, cfg: GatewayConfig, children: dict[int, int], table: SharedTable, ready: int, port: int
    ) -> None:
        self.cfg = cfg
        self.children = dict(children)  # pid -> process index, while alive
        self.table = table
        self.ready_fd = ready
        self.port = port
        self.ready: set[int] = set()
        self.stopping = False
        self.kill_at = 0.0
        self.status = 0
        self.started = False
        os.set_blocking(ready, False)

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        log.info(
            "gateway.supervisor_started",
            processes=len(self.children),
            pids=sorted(self.children),
            port=self.port,
        )
        while self.children:
            self._reap()
            self._read_ready()
            if self.stopping and time.monotonic() >= self.kill_at:
                for pid, i in list(self.children.items()):
                    log.error("gateway.process_killed", process=i, pid=pid, reason="grace period over")
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                self.kill_at = float("inf")
            time.sleep(_POLL_S)
        log.info("gateway.supervisor_stopped", status=self.status)
        return self.status

    def _on_signal(self, signum: int, _frame: object) -> None:
        if not self.stopping:
            log.info("gateway.stopping", signal=signal.Signals(signum).name, processes=len(self.children))
            self._stop_all()
        else:
            log.warning("gateway.hurry", reason="second signal: ending every process's grace period now")
            self._send(HURRY_SIGNAL)

    def _stop_all(self) -> None:
        self.stopping = True
        self.kill_at = time.monotonic() + self.cfg.shutdown_grace_s + KILL_AFTER_GRACE_S
        self._send(signal.SIGTERM)

    def _send(self, sig: int) -> None:
        for pid in list(self.children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def _reap(self) -> None:
        while self.children:
            try:
                pid, raw = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.children.clear()
                return
            if pid == 0:
                return
            index = self.children.pop(pid, None)
            if index is None:
                continue
            code = os.waitstatus_to_exitcode(raw)
            self.table.clear_lock_of(pid)
            if self.stopping:
                if code != 0 and self.status == 0:
                    self.status = code if code > 0 else 1
                continue
            if not self.started:  # failed to start: the others go too, with its status
                log.error("gateway.process_failed_to_start", process=index, pid=pid, status=code)
                self.status = code if code > 0 else 1
            else:
                log.error(
                    "gateway.process_died",
                    process=index,
                    pid=pid,
                    status=code,
                    action="stopping the other processes; the gateway exits (its supervisor restarts it)",
                )
                self.status = 1
            self._stop_all()

    def _read_ready(self) -> None:
        try:
            data = os.read(self.ready_fd, 256)
        except BlockingIOError:
            return
        self.ready.update(data)
        if not self.started and len(self.ready) == self.cfg.listen.processes and not self.stopping:
            self.started = True
            log.info(
                "gateway.processes_started",
                processes=len(self.ready),
                url=f"http://{self.cfg.listen.host}:{self.port}",
            )


def _child(
    index: int, cfg: GatewayConfig, table: SharedTable, secret: bytes, ready_w: int, parent: int
) -> int:  # pragma: no cover - runs in the forked process
    from gateway.app import Gateway, run_forever
    from gateway.serve import install_uvloop, raise_open_files_limit
    from policies.build import PolicyBuildError

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    _die_with(parent)
    table.attach(index)
    configure(cfg.log_level, cfg.log_json)
    structlog.contextvars.bind_contextvars(process=index)

    def started() -> None:
        with contextlib.suppress(OSError):
            os.write(ready_w, bytes([index]))
            os.close(ready_w)

    ctx = ProcessContext(index, cfg.listen.processes, table, secret, started)
    try:
        gw = Gateway(cfg, process=ctx)
        install_uvloop()
        raise_open_files_limit()
        asyncio.run(run_forever(gw, cfg.shutdown_grace_s, hurry_signal=HURRY_SIGNAL))
    except (ListenError, ConfigError, PolicyBuildError) as e:
        print(f"pd-gateway serve (process {index}): {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _die_with(parent: int) -> None:  # pragma: no cover - runs in the forked process
    """SIGTERM to this process when the supervisor dies (Linux), so none is left serving."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before that
        os.kill(os.getpid(), signal.SIGTERM)


def _flush_logs() -> None:  # pragma: no cover - runs in the forked process
    """os._exit() skips atexit: write the log lines still pending."""
    with contextlib.suppress(Exception):
        factory = structlog.get_config()["logger_factory"]
        writer = factory()
        flush = getattr(writer, "flush", None)
        if flush is not None:
            flush()
