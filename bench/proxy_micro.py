"""Micro-benchmark of the data plane: CPU per request of a minimal proxy on gateway.http.

Three processes: an upstream (gateway.http server on uvloop: a fixed JSON body, or 64 SSE events
in a burst), the proxy (gateway.http server + UpstreamPool: forwards the POST body, returns the
upstream's response; relays the stream with pipe() + flow control), and the load generator
(this process, closed loop over N keep-alive connections). With taskset the proxy is pinned to
core 0, the upstream and the load generator to core 1 (as in docs/benchmarks.md, "The starting
point").

CPU per request = the proxy process's utime+stime (from /proc/<pid>/stat) over the measured
window / requests completed in that window. The same load straight at the upstream ("direct")
is reported for throughput/latency reference.

    .venv/bin/python bench/proxy_micro.py                   # all cases, 5 s each
    .venv/bin/python bench/proxy_micro.py --duration 3 --conns 1 64 --cases nonstream stream

The upstream and the load generator are Python too and share one core, so at 64 connections
they, not the proxy, limit throughput; CPU per request of the proxy rises when it is not
saturated (fewer events per wake-up; the caveats of docs/benchmarks.md, "The starting point").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from emulator.ports import free_ports  # noqa: E402
from gateway.http import HttpRequest, HttpResponder, UpstreamPool, start_server  # noqa: E402

JSON_BODY = json.dumps(
    {
        "id": "cmpl-0123456789abcdef",
        "object": "text_completion",
        "created": 1700000000,
        "model": "emulated",
        "choices": [{"index": 0, "text": "hello world " * 8, "finish_reason": "length", "logprobs": None}],
        "usage": {"prompt_tokens": 24, "completion_tokens": 16, "total_tokens": 40},
    }
).encode()
SSE_EVENTS = [
    b'data: {"id":"cmpl-0123456789abcdef","object":"text_completion","choices":[{"index":0,"text":" tok%d"}]}\n\n'
    % i
    for i in range(64)
] + [b"data: [DONE]\n\n"]
REQ_BODY = json.dumps(
    {"model": "emulated", "prompt": "Say hello " * 20, "max_tokens": 16, "stream": False}
).encode()
JSON_H = ((b"content-type", b"application/json"),)
SSE_H = ((b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"))


# -- roles ------------------------------------------------------------------------------------------


async def run_upstream(port: int) -> None:
    async def handler(req: HttpRequest, resp: HttpResponder) -> None:
        if req.path == "/stream":
            resp.start_stream(200, SSE_H)
            for ev in SSE_EVENTS:
                resp.write(ev)
            resp.end()
        else:
            resp.send(200, JSON_H, JSON_BODY)

    srv = await start_server(handler, "127.0.0.1", port, reuse_port=False)
    print("ready", flush=True)
    await asyncio.Event().wait()
    await srv.close()


async def run_proxy(port: int, upstream_port: int) -> None:
    pool = UpstreamPool("127.0.0.1", upstream_port, max_idle=1024)
    fwd_headers = ((b"content-type", b"application/json"),)

    async def handler(req: HttpRequest, resp: HttpResponder) -> None:
        up = await pool.request("POST", req.path, fwd_headers, req.body)
        try:
            if req.path == "/stream":
                resp.start_stream(up.status, SSE_H)
                await up.pipe(resp.write, flow=resp, batch=resp)
                resp.end()
            else:
                body = await up.read()
                resp.send(up.status, JSON_H, body)
        finally:
            up.release()

    srv = await start_server(handler, "127.0.0.1", port)
    print("ready", flush=True)
    await asyncio.Event().wait()
    await srv.close()


# -- load generator -------------------------------------------------------------------------------


async def load(
    port: int, path: str, conns: int, warmup: float, duration: float, proxy_pid: int | None
) -> dict:
    pool = UpstreamPool("127.0.0.1", port, max_idle=conns + 8)
    headers = ((b"content-type", b"application/json"),)
    state = {"measure": False, "stop": False}
    lat: list[float] = []
    counts = [0]
    errors = [0]
    expect_len = len(JSON_BODY) if path != "/stream" else sum(len(e) for e in SSE_EVENTS)

    async def worker() -> None:
        while not state["stop"]:
            t0 = time.perf_counter()
            try:
                r = await pool.request("POST", path, headers, REQ_BODY)
                body = await r.read()
                r.release()
                if len(body) != expect_len:
                    errors[0] += 1
            except Exception:
                errors[0] += 1
                await asyncio.sleep(0.01)
                continue
            if state["measure"]:
                counts[0] += 1
                lat.append(time.perf_counter() - t0)

    tasks = [asyncio.create_task(worker()) for _ in range(conns)]
    await asyncio.sleep(warmup)
    cpu0 = proc_cpu(proxy_pid) if proxy_pid else 0.0
    t0 = time.perf_counter()
    state["measure"] = True
    await asyncio.sleep(duration)
    state["measure"] = False
    elapsed = time.perf_counter() - t0
    cpu1 = proc_cpu(proxy_pid) if proxy_pid else 0.0
    n = counts[0]
    state["stop"] = True
    await asyncio.gather(*tasks, return_exceptions=True)
    await pool.close()
    lat.sort()
    return {
        "requests": n,
        "rps": n / elapsed,
        "p50_ms": 1000 * statistics.median(lat) if lat else float("nan"),
        "p99_ms": 1000 * lat[int(len(lat) * 0.99)] if lat else float("nan"),
        "errors": errors[0],
        "proxy_cpu_us_per_req": (cpu1 - cpu0) / n * 1e6 if proxy_pid and n else None,
        "proxy_cpu_util": (cpu1 - cpu0) / elapsed if proxy_pid else None,
    }


def proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime


def spawn(args: list[str], core: int | None) -> subprocess.Popen[str]:
    cmd = [sys.executable, __file__, *args]
    if core is not None:
        cmd = ["taskset", "-c", str(core), *cmd]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    if line.strip() != "ready":
        p.kill()
        raise RuntimeError(f"{args[0]} did not start: {line!r}")
    return p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=["bench", "upstream", "proxy"], default="bench")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--upstream-port", type=int, default=0)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--conns", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--cases", nargs="+", default=["nonstream", "stream"], choices=["nonstream", "stream"])
    ap.add_argument("--no-direct", action="store_true", help="skip the direct (no proxy) runs")
    ap.add_argument("--no-pin", action="store_true", help="do not use taskset")
    ap.add_argument("--json", action="store_true", help="print results as JSON lines")
    args = ap.parse_args()

    import uvloop

    if args.role == "upstream":
        uvloop.run(run_upstream(args.port))
        return
    if args.role == "proxy":
        uvloop.run(run_proxy(args.port, args.upstream_port))
        return

    pin = not args.no_pin and shutil.which("taskset") is not None and (os.cpu_count() or 1) >= 2
    if pin:
        os.sched_setaffinity(0, {1})
    up_port, px_port = free_ports(2)
    upstream = spawn(["--role", "upstream", "--port", str(up_port)], 1 if pin else None)
    proxy = spawn(
        ["--role", "proxy", "--port", str(px_port), "--upstream-port", str(up_port)], 0 if pin else None
    )
    results = []
    try:
        for case in args.cases:
            path = "/stream" if case == "stream" else "/v1/completions"
            for c in args.conns:
                for target in (["direct"] if not args.no_direct else []) + ["proxy"]:
                    port = px_port if target == "proxy" else up_port
                    pid = proxy.pid if target == "proxy" else None
                    r = uvloop.run(load(port, path, c, args.warmup, args.duration, pid))
                    r.update(case=case, conns=c, target=target)
                    results.append(r)
                    if args.json:
                        print(json.dumps(r), flush=True)
                    else:
                        cpu = r["proxy_cpu_us_per_req"]
                        util = r["proxy_cpu_util"]
                        print(
                            f"{case:9} conns={c:<3} {target:6} {r['rps']:8.0f} req/s  p50 {r['p50_ms']:6.2f} ms"
                            f"  p99 {r['p99_ms']:6.2f} ms  err {r['errors']}"
                            + (f"  proxy CPU {cpu:6.1f} us/req ({util * 100:.0f}% of a core)" if cpu else ""),
                            flush=True,
                        )
    finally:
        for p in (proxy, upstream):
            p.terminate()
            p.wait(5)
    print(f"pinned={'proxy core 0, upstream+load core 1' if pin else 'no'}")


if __name__ == "__main__":
    main()
