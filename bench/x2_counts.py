"""What a request costs in one gateway process and in two (`serve --workers 2`), counted.

`pd-gateway bench overhead` gives CPU per request; this says where a difference between
`gateway` and `gateway-x2` could come from. Against nginx's fixed answers (non-streamed),
with wrk's load, every target on `--target-cpus` and nginx and wrk on `--load-cpus` as the
bench pins them, each row a 1 s warm-up then `--duration` seconds measured, the targets in
turn each round; per request, summed over every process of the target:

- CPU (each process's CPU-time clock), and its user and kernel parts (`/proc/PID/stat`, in
  clock ticks: a few per cent of grain over 4 s);
- the read-type and write-type system calls (`/proc/PID/io` `syscr`, `syscw`);
- blocking waits and preemptions (voluntary and involuntary context switches of every thread);
- with `perf` and its syscall tracepoints, `epoll_pwait` calls: the loop turns that polled, so
  1 / that is the requests served per turn.

`--slice-ms MS` gives every thread of the targets an EEVDF slice of MS (sched_setattr's
sched_runtime, Linux 6.12+): with two processes on one core, how often they take turns.

    .venv/bin/python -m bench.x2_counts --engine sglang --conns 64
    .venv/bin/python -m bench.x2_counts --engine sglang --conns 32 --kinds gateway
    .venv/bin/python -m bench.x2_counts --engine sglang --conns 64 --slice-ms 20
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import nginx_upstream, procs  # noqa: E402
from bench import overhead as ov  # noqa: E402
from bench import wrk as bench_wrk  # noqa: E402

FIELDS = ("cpu", "user", "sys", "syscr", "syscw", "vol", "invol")
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
_SCHED_SETATTR = 314  # x86_64


class _SchedAttr(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_uint32),
        ("sched_policy", ctypes.c_uint32),
        ("sched_flags", ctypes.c_uint64),
        ("sched_nice", ctypes.c_int32),
        ("sched_priority", ctypes.c_uint32),
        ("sched_runtime", ctypes.c_uint64),
        ("sched_deadline", ctypes.c_uint64),
        ("sched_period", ctypes.c_uint64),
        ("util_min", ctypes.c_uint32),
        ("util_max", ctypes.c_uint32),
    ]


def tree_pids(pid: int) -> list[int]:
    import psutil

    root = psutil.Process(pid)
    return [root.pid, *(c.pid for c in root.children(recursive=True))]


def counts(pid: int) -> dict[str, float]:
    """The `FIELDS` of `pid` and its live descendants, summed."""
    out = dict.fromkeys(FIELDS, 0.0)
    for p in tree_pids(pid):
        with contextlib.suppress(OSError, ValueError):
            with open(f"/proc/{p}/io") as f:
                for line in f:
                    k, v = line.split(":")
                    if k in ("syscr", "syscw"):
                        out[k] += int(v)
            with open(f"/proc/{p}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
            out["user"] += int(stat[11]) * _TICK_S
            out["sys"] += int(stat[12]) * _TICK_S
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/status") as f:
                    for line in f:
                        if line.startswith("voluntary_ctxt_switches:"):
                            out["vol"] += int(line.split()[1])
                        elif line.startswith("nonvoluntary_ctxt_switches:"):
                            out["invol"] += int(line.split()[1])
    out["cpu"] = procs.tree_runtime_seconds(pid)
    return out


def set_slice(pid: int, ms: float) -> None:
    """Every thread of `pid`'s tree: an EEVDF slice of `ms` (SCHED_OTHER, sched_runtime)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for p in tree_pids(pid):
        for tid in os.listdir(f"/proc/{p}/task"):
            attr = _SchedAttr(size=ctypes.sizeof(_SchedAttr), sched_policy=0, sched_runtime=int(ms * 1e6))
            if libc.syscall(_SCHED_SETATTR, int(tid), ctypes.byref(attr), 0) != 0:
                raise OSError(ctypes.get_errno(), f"sched_setattr({tid})")


def start_perf(pid: int, out: Path) -> subprocess.Popen[bytes] | None:
    if shutil.which("perf") is None:
        return None
    pids = ",".join(map(str, tree_pids(pid)))
    argv = ["perf", "stat", "-x,", "-o", str(out), "-e", "syscalls:sys_enter_epoll_pwait", "-p", pids]
    proc = subprocess.Popen(argv, stderr=subprocess.DEVNULL)
    time.sleep(0.3)
    return proc


def stop_perf(proc: subprocess.Popen[bytes] | None, out: Path) -> float | None:
    if proc is None:
        return None
    proc.send_signal(signal.SIGINT)
    proc.wait()
    with contextlib.suppress(OSError, ValueError):
        for line in out.read_text().splitlines():
            if "epoll_pwait" in line:
                return float(line.split(",")[0])
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="sglang", choices=ov.ENGINES)
    ap.add_argument("--conns", type=int, default=64)
    ap.add_argument("--kinds", default="gateway,gateway-x2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--duration", type=float, default=4.0)
    ap.add_argument("--target-cpus", default="0")
    ap.add_argument("--load-cpus", default="1")
    ap.add_argument("--slice-ms", type=float, default=0.0)
    args = ap.parse_args(argv)
    os.sched_setaffinity(0, {int(c) for c in args.load_cpus.split(",")})
    engine, mode = args.engine, "nonstream"
    with tempfile.TemporaryDirectory(prefix="pdgw-x2-") as tmp, procs.process_group() as ups:
        log_dir = Path(tmp)
        nginx, layout, bport = nginx_upstream.start(
            ups,
            [engine],
            [mode],
            prompt_tokens=len(ov.PROMPT) // 4,
            max_tokens=ov.NONSTREAM_MAX_TOKENS,
            cpus=args.load_cpus,
            log_dir=log_dir,
        )
        ports = layout[(engine, mode)]
        cluster = ov.Cluster(
            engine,
            procs.Upstream(nginx, engine, "prefill", ports.prefill, bport if engine == "sglang" else None),
            procs.Upstream(nginx, engine, "decode", ports.decode),
            procs.Upstream(nginx, engine, "both", ports.both),
        )
        with procs.process_group() as group:
            targets = [
                ov.start_target(group, k, cluster, args.target_cpus, log_dir) for k in args.kinds.split(",")
            ]
            if args.slice_ms:
                for t in targets:
                    assert t.proc is not None
                    set_slice(t.proc.pid, args.slice_ms)
            body = ov.request_body(mode, engine)
            headers = bench_wrk.client_headers("openai")
            for rnd in range(args.rounds):
                for t in targets:
                    assert t.proc is not None
                    url = f"http://{procs.HOST}:{t.port}/v1/completions"
                    kw = {"conns": args.conns, "cpu_probes": {}, "cpus": args.load_cpus, "headers": headers}
                    bench_wrk.run_wrk(url, body, duration_s=1.0, warmup_s=0.0, **kw)
                    pstat = log_dir / f"perf-{t.kind}-{rnd}.txt"
                    perf = start_perf(t.proc.pid, pstat)
                    before = counts(t.proc.pid)
                    res = bench_wrk.run_wrk(url, body, duration_s=args.duration, warmup_s=0.0, **kw)
                    after = counts(t.proc.pid)
                    polls = stop_perf(perf, pstat)
                    n = max(res.completed, 1)
                    d = {k: after[k] - before[k] for k in FIELDS}
                    print(
                        f"{engine} c={args.conns} round {rnd + 1} {t.kind:<11} req/s {res.rps:6.0f}"
                        f"  CPU/req {d['cpu'] / n * 1e6:6.1f} µs (user {d['user'] / n * 1e6:5.1f},"
                        f" kernel {d['sys'] / n * 1e6:5.1f})  reads/req {d['syscr'] / n:.3f}"
                        f"  writes/req {d['syscw'] / n:.3f}  blocked/req {d['vol'] / n:.4f}"
                        f"  preempted/req {d['invol'] / n:.4f}"
                        + (f"  epoll_pwait/req {polls / n:.3f}" if polls is not None else ""),
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
