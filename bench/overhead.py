"""`pd-gateway bench overhead`: the gateway's cost side by side with sglang-router and vllm-router.

One run, the same upstreams for every target:
  * per engine, three emulated servers in zero-delay mode (`--time-scale 0`): a P/D pair
    (prefill + decode) and a colocated (`--role both`) server for the direct baseline;
  * the targets under test (sglang-router, vllm-router, `pd-gateway serve`, `bare-pd`) pinned
    to one core (`taskset -c 0`), all started first and measured in turn (idle otherwise);
    `--rounds N` repeats every row N times, the targets in turn each round, and reports medians;
  * the upstreams and this process (the load generator, or wrk with `--loadgen wrk`) on the
    other core.

Per target, mode (non-stream, 64-token stream) and connection count it reports req/s,
p50/p90/p99 latency, the p50 added over a direct connection to an emulated server, and the
target's CPU per request = (utime+stime of its process tree over the window) / completed, and
the kernel's (stime) part of it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import neighbour as bench_neighbour
from bench import nginx_upstream, procs
from bench import wrk as bench_wrk
from bench.loadgen import (
    CLIENTS,
    LoadResult,
    Session,
    SglangPDSession,
    SimpleSession,
    VllmPDSession,
    client_request,
    new_event_loop,
    run_load,
)

ENGINES = ("sglang", "vllm")
TARGET_KINDS = (
    "direct",
    "direct-pd",
    "bare-pd",
    "callback-pd",
    "gateway",
    "gateway-x2",
    "gateway-noguards",
    "sglang-router",
    "vllm-router",
)
MODES = ("nonstream", "stream64")
MODEL = "bench-model"
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4
NONSTREAM_MAX_TOKENS = 8
STREAM_TOKENS = 64
RESULTS_DIR = procs.REPO_ROOT / "bench" / "results"
DOC_BEGIN = "<!-- bench:overhead:begin -->"
DOC_END = "<!-- bench:overhead:end -->"
NGINX_DOC_BEGIN = "<!-- bench:overhead-nginx:begin -->"
NGINX_DOC_END = "<!-- bench:overhead-nginx:end -->"
WRK_DOC_BEGIN = "<!-- bench:overhead-wrk:begin -->"
WRK_DOC_END = "<!-- bench:overhead-wrk:end -->"
MULTI_DOC_BEGIN = "<!-- bench:overhead-multicore:begin -->"
MULTI_DOC_END = "<!-- bench:overhead-multicore:end -->"


@dataclass
class Row:
    target: str  # e.g. "sglang-router", "gateway", "direct"
    engine: str
    mode: str
    conns: int
    rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    completed: int
    errors: int
    cpu_us_per_req: float | None  # the target's process tree; None for direct
    upstream_cpu_us_per_req: float | None
    sys_us_per_req: float | None = None  # the kernel's share (stime) of cpu_us_per_req
    # the target's voluntary context switches per request: the wake-ups it paid (an idle target
    # pays one per upstream event, a busy one finds several events per wake-up)
    wakeups_per_req: float | None = None
    # its involuntary context switches per request: how often the scheduler preempted it (two
    # processes sharing one core take turns; one alone on its core is hardly ever preempted)
    preempted_per_req: float | None = None
    added_p50_ms: float | None = None
    cpu_vs_router: float | None = None  # gateway only: / the same engine's router
    rounds: int = 1  # > 1: each figure is the median over this many interleaved rounds
    error_samples: list[str] = field(default_factory=list)


@dataclass
class Target:
    kind: str
    engine: str
    proc: procs.ManagedProcess | None
    port: int


def request_body(mode: str, engine: str) -> bytes:
    return json.dumps(request_dict(mode), separators=(",", ":")).encode()


def request_dict(mode: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "ignore_eos": True}
    if mode == "nonstream":
        body["max_tokens"] = NONSTREAM_MAX_TOKENS
    elif mode == "stream64":
        body["max_tokens"] = STREAM_TOKENS
        body["stream"] = True
    else:
        raise ValueError(f"unknown mode {mode!r}")
    return body


# --------------------------------------------------------------------------- cluster


@dataclass
class Cluster:
    engine: str
    prefill: procs.Upstream
    decode: procs.Upstream
    both: procs.Upstream

    def cpu_probe(self) -> float:
        pids = {u.proc.pid for u in (self.prefill, self.decode)}  # nginx: one process serves both
        return sum(procs.tree_runtime_seconds(pid) for pid in pids)


def start_cluster(
    group: procs.ProcessGroup, engine: str, cpus: str | None, log_dir: Path, seed: int
) -> Cluster:
    kw: dict[str, Any] = {"model": MODEL, "time_scale": 0.0, "seed": seed, "cpus": cpus, "log_dir": log_dir}
    ups = [
        procs.start_emulator(group, engine, role, wait=False, **kw) for role in ("prefill", "decode", "both")
    ]
    for u in ups:
        procs.wait_upstream(u, timeout=90.0)
    return Cluster(engine, *ups)


SETTINGS = {
    "info": "round robin, logs at info (each target's default level: the gateway's access log on)",
    "quiet": "round robin, warnings only",
    "as-shipped": "as shipped (default policy and log level)",
}


def target_settings(kind: str, settings: str) -> tuple[str | None, str | None]:
    """(policy, log level) for a router or gateway `kind`; None leaves the target's default.

    `info` (the default): every target at its own default log level, info (the gateway writes
    its access-log line per request, its full feature set on), the routers round robin as the
    gateway is, so the comparison is like for like. `quiet`: round robin, warnings only (the
    tables before 2026-12-05). `as-shipped`: each target's own default policy and log level
    (the Rust routers: cache_aware, info; the gateway: round_robin, info)."""
    if settings not in SETTINGS:
        raise ValueError(settings)
    if kind.startswith("gateway"):
        return None, "warning" if settings == "quiet" else None
    policy = None if settings == "as-shipped" else "round_robin"
    if settings != "quiet":
        return policy, None
    return policy, "warn" if kind == "sglang-router" else "warning"


def start_target(
    group: procs.ProcessGroup,
    kind: str,
    cluster: Cluster,
    cpus: str | None,
    log_dir: Path,
    *,
    settings: str = "info",
    x2_cpus: list[int] | None = None,
) -> Target:
    """Start one target with `settings` (see `target_settings`). `x2_cpus`: pin `gateway-x2`'s
    two serving processes one to each of these CPUs (its supervisor stays on `cpus`)."""
    policy, log_level = target_settings(kind, settings)
    if kind == "direct":
        return Target(kind, cluster.engine, None, cluster.both.port)
    if kind == "direct-pd":
        return Target(kind, cluster.engine, None, cluster.decode.port)
    port, prom_port = procs.free_ports(2)
    pre, dec = cluster.prefill, cluster.decode
    if kind == "sglang-router":
        argv = procs.sglang_router_argv(
            port,
            [(pre.url, pre.bootstrap_port)],
            [dec.url],
            prometheus_port=prom_port,
            policy=policy,
            log_level=log_level,
        )
    elif kind == "vllm-router":
        argv = procs.vllm_router_argv(
            port,
            [pre.url],
            [dec.url],
            prometheus_port=prom_port,
            policy=policy,
            log_level=log_level,
        )
    elif kind in ("bare-pd", "callback-pd"):
        module = "bench.bare_pd" if kind == "bare-pd" else "bench.callback_pd"
        argv = [sys.executable, "-m", module, "--engine", cluster.engine, "--port", str(port)]
        argv += ["--prefill", pre.url, "--decode", dec.url]
        if pre.bootstrap_port is not None:
            argv += ["--bootstrap-port", str(pre.bootstrap_port)]
        proc = group.add(
            procs.start_process(
                f"{kind}-{cluster.engine}", argv, cpus=cpus, log_dir=log_dir, cwd=procs.REPO_ROOT
            )
        )
        proc.wait_http(f"http://{procs.HOST}:{port}/health", timeout=90.0)
        return Target(kind, cluster.engine, proc, port)
    elif kind in ("gateway", "gateway-noguards", "gateway-x2"):
        extra = {"gateway-noguards": ["--no-guards"], "gateway-x2": ["--workers", "2"]}.get(kind, [])
        argv = procs.gateway_argv(
            cluster.engine,
            port,
            [(pre.url, pre.bootstrap_port)],
            [dec.url],
            log_level=log_level,
            extra=extra,
        )
    else:
        raise ValueError(kind)
    proc = group.add(procs.start_process(f"{kind}-{cluster.engine}", argv, cpus=cpus, log_dir=log_dir))
    proc.wait_http(f"http://{procs.HOST}:{port}/readiness", timeout=90.0)
    if kind == "gateway-x2":
        _wait_processes(proc, port, 2)
        if x2_cpus:
            procs.pin_children(proc.pid, x2_cpus)
    return Target(kind, cluster.engine, proc, port)


def _wait_processes(proc: procs.ManagedProcess, port: int, n: int, timeout: float = 90.0) -> None:
    """Until every process of a `serve --workers n` listens (their metrics answer together)."""
    deadline = time.monotonic() + timeout
    want = f"pdgw_processes_scraped {float(n)}".encode()
    while True:
        proc.check_alive()
        try:
            if want in procs.http_get(f"http://{procs.HOST}:{port}/metrics")[1]:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{proc.name}: not all {n} processes up after {timeout:g}s")
        time.sleep(0.1)


def smoke(target: Target, mode: str) -> None:
    """One request before measuring, so that a broken target fails loudly, not as a 0 req/s row."""
    import http.client

    if target.kind == "direct-pd":
        return  # its session checks every answer

    conn = http.client.HTTPConnection(procs.HOST, target.port, timeout=30)
    try:
        body = request_body(mode, target.engine)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    ok = resp.status == 200 and (mode != "stream64" or b"[DONE]" in data)
    if not ok:
        log = target.proc.log_tail() if target.proc is not None else ""
        raise RuntimeError(
            f"{target.kind} ({target.engine}) {mode}: HTTP {resp.status}: {data[:500]!r}\n{log}"
        )


def measure(
    target: Target,
    cluster: Cluster,
    mode: str,
    conns: int,
    duration: float,
    warmup: float,
    target_cpus: str | None = None,
    loadgen: str = "python",
    load_cpus: str | None = None,
    client: str = "openai",
) -> Row:
    path = "/v1/completions"
    tail = b"[DONE]" if mode == "stream64" else None
    probes = {"upstream": cluster.cpu_probe}
    make_session: Callable[[], Session]
    if target.kind == "direct-pd" and cluster.engine == "sglang":
        pre, dec = cluster.prefill, cluster.decode
        assert pre.bootstrap_port is not None
        body = request_body(mode, target.engine)
        make_session = lambda: SglangPDSession(  # noqa: E731
            (procs.HOST, pre.port), (procs.HOST, dec.port), pre.bootstrap_port or 0, path, body, tail
        )
    elif target.kind == "direct-pd":
        pre, dec = cluster.prefill, cluster.decode
        bdict = request_dict(mode)
        make_session = lambda: VllmPDSession(  # noqa: E731
            (procs.HOST, pre.port), (procs.HOST, dec.port), path, bdict, tail
        )
    else:
        req = client_request(client, procs.HOST, target.port, path, request_body(mode, target.engine))
        quick = client == "raw-quickack"
        make_session = lambda: SimpleSession(procs.HOST, target.port, req, tail, quickack=quick)  # noqa: E731
    if target.proc is not None:
        pid = target.proc.pid
        probes["target"] = lambda: procs.tree_runtime_seconds(pid)
        probes["target_sys"] = lambda: procs.tree_cpu_times(pid)[1]
        probes["target_wakeups"] = lambda: float(procs.tree_wakeups(pid))
        probes["target_preempted"] = lambda: float(procs.tree_preemptions(pid))
    elif target.kind == "direct":
        both_pid = cluster.both.proc.pid
        probes["upstream"] = lambda: procs.tree_runtime_seconds(both_pid)
    # direct-pd: the load generator *is* the router, so it gets the target's core for the row.
    saved = os.sched_getaffinity(0) if target.kind == "direct-pd" and target_cpus else None
    if saved is not None and target_cpus:
        os.sched_setaffinity(0, _cpu_set(target_cpus))
    res: LoadResult
    if loadgen == "wrk" and target.kind != "direct-pd":  # main() drops direct-pd with wrk
        res = bench_wrk.run_wrk(
            f"http://{procs.HOST}:{target.port}{path}",
            request_body(mode, target.engine),
            conns=conns,
            duration_s=duration,
            warmup_s=warmup,
            cpu_probes=probes,
            cpus=load_cpus,
            headers=bench_wrk.client_headers(client),
        )
    else:
        loop = new_event_loop()
        try:
            res = loop.run_until_complete(
                run_load(make_session, conns=conns, duration_s=duration, warmup_s=warmup, cpu_probes=probes)
            )
        finally:
            loop.close()
            if saved is not None:
                os.sched_setaffinity(0, saved)
    n = max(res.completed, 1)
    tcpu = res.cpu_s.get("target")
    tsys = res.cpu_s.get("target_sys")
    twake = res.cpu_s.get("target_wakeups")
    tpre = res.cpu_s.get("target_preempted")
    return Row(
        target=target.kind,
        engine=target.engine,
        mode=mode,
        conns=conns,
        rps=res.rps,
        p50_ms=res.percentile_ms(50),
        p90_ms=res.percentile_ms(90),
        p99_ms=res.percentile_ms(99),
        completed=res.completed,
        errors=res.errors,
        cpu_us_per_req=(tcpu / n * 1e6) if tcpu is not None and res.completed else None,
        upstream_cpu_us_per_req=res.cpu_s["upstream"] / n * 1e6 if res.completed else None,
        sys_us_per_req=(tsys / n * 1e6) if tsys is not None and res.completed else None,
        wakeups_per_req=(twake / n) if twake is not None and res.completed else None,
        preempted_per_req=(tpre / n) if tpre is not None and res.completed else None,
        error_samples=res.error_samples,
    )


def _median(values: list[float | None]) -> float | None:
    vals = sorted(v for v in values if v is not None and v == v)
    if not vals:
        return None
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


def median_row(rounds: list[Row]) -> Row:
    """One row from several rounds of the same measurement: each figure's median (the CPU
    figures each on their own), counts summed."""
    first = rounds[0]
    if len(rounds) == 1:
        return first

    def med(name: str) -> float:
        v = _median([getattr(r, name) for r in rounds])
        return float("nan") if v is None else v

    return Row(
        target=first.target,
        engine=first.engine,
        mode=first.mode,
        conns=first.conns,
        rps=med("rps"),
        p50_ms=med("p50_ms"),
        p90_ms=med("p90_ms"),
        p99_ms=med("p99_ms"),
        completed=sum(r.completed for r in rounds),
        errors=sum(r.errors for r in rounds),
        cpu_us_per_req=_median([r.cpu_us_per_req for r in rounds]),
        upstream_cpu_us_per_req=_median([r.upstream_cpu_us_per_req for r in rounds]),
        sys_us_per_req=_median([r.sys_us_per_req for r in rounds]),
        wakeups_per_req=_median([r.wakeups_per_req for r in rounds]),
        preempted_per_req=_median([r.preempted_per_req for r in rounds]),
        error_samples=[e for r in rounds for e in r.error_samples][:5],
        rounds=len(rounds),
    )


def fill_derived(rows: list[Row]) -> None:
    """added p50: vs the client-side handoff (direct-pd) when measured, else vs colocated direct."""
    direct = {(r.engine, r.mode, r.conns): r for r in rows if r.target == "direct"}
    direct.update({(r.engine, r.mode, r.conns): r for r in rows if r.target == "direct-pd"})
    routers = {(r.engine, r.mode, r.conns): r for r in rows if r.target in ("sglang-router", "vllm-router")}
    for r in rows:
        d = direct.get((r.engine, r.mode, r.conns))
        if d is not None and not r.target.startswith("direct") and r.completed and d.completed:
            r.added_p50_ms = r.p50_ms - d.p50_ms
        rt = routers.get((r.engine, r.mode, r.conns))
        if (
            (r.target.startswith("gateway") or r.target in ("bare-pd", "callback-pd"))
            and rt is not None
            and rt.cpu_us_per_req
            and r.cpu_us_per_req is not None
        ):
            r.cpu_vs_router = r.cpu_us_per_req / rt.cpu_us_per_req


# --------------------------------------------------------------------------- report


def _f(v: float | None, fmt: str) -> str:
    return "—" if v is None or v != v else format(v, fmt)


def _ratio(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}x"


def markdown_table(rows: list[Row]) -> str:
    head = (
        "| engine | target | mode | conns | req/s | p50 ms | p90 ms | p99 ms | added p50 ms "
        "| target CPU/req µs | of which kernel µs | wake-ups/req | vs router | upstream CPU/req µs "
        "| errors |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        lines.append(
            f"| {r.engine} | {r.target} | {r.mode} | {r.conns} | {r.rps:.0f} | {_f(r.p50_ms, '.3f')} "
            f"| {_f(r.p90_ms, '.3f')} | {_f(r.p99_ms, '.3f')} | {_f(r.added_p50_ms, '+.3f')} "
            f"| {_f(r.cpu_us_per_req, '.0f')} | {_f(r.sys_us_per_req, '.0f')} "
            f"| {_f(r.wakeups_per_req, '.1f')} | {_ratio(r.cpu_vs_router)} "
            f"| {_f(r.upstream_cpu_us_per_req, '.0f')} | {r.errors} |"
        )
    return head + "\n".join(lines) + "\n"


def doc_section(rows: list[Row], meta: dict[str, Any], begin: str = DOC_BEGIN, end: str = DOC_END) -> str:
    return (
        f"{begin}\n"
        f"Measured {meta['time']} on {meta['machine']} ({meta['cpus']} CPUs), "
        f"{meta['duration_s']:g} s per row after {meta['warmup_s']:g} s warm-up"
        + (f", median of {meta['rounds']} interleaved rounds" if meta.get("rounds", 1) > 1 else "")
        + f"; pinning: {meta['pinning']}"
        + (f"; targets' settings: {meta['settings']}" if "settings" in meta else "")
        + ("; load from wrk" if meta.get("loadgen") == "wrk" else "")
        + (f"; client: {meta['client']}" if "client" in meta else "")
        + (f"; upstream: {meta['upstream']}" if "upstream" in meta else "")
        + ".\n\n"
        f"```\n{meta['command']}\n```\n\n"
        f"{markdown_table(rows)}"
        + (f"\n{processes_table(rows)}" if any(r.target == "gateway-x2" for r in rows) else "")
        + f"{end}\n"
    )


def processes_table(rows: list[Row]) -> str:
    """The gateway in one and two processes (`serve --workers 2`) beside the Rust router: CPU per
    request, requests/s measured, and requests/s per core (what one core serves at that cost:
    1e6 / CPU µs per request)."""
    by = {(r.engine, r.target, r.mode, r.conns): r for r in rows}
    head = (
        "| engine | mode | conns | router CPU/req µs | gateway 1 process: CPU/req µs (vs router) "
        "| 2 processes: CPU/req µs (vs router) | 2 / 1 process CPU/req | req/s, 1 process "
        "| req/s, 2 processes | req/s per core: router | 1 process | 2 processes "
        "| preempted/req: 1 process | 2 processes |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        if r.target != "gateway-x2":
            continue
        one = by.get((r.engine, "gateway", r.mode, r.conns))
        rt = by.get((r.engine, f"{r.engine}-router", r.mode, r.conns))

        def cpu(x: Row | None) -> str:
            if x is None or x.cpu_us_per_req is None:
                return "—"
            return f"{x.cpu_us_per_req:.0f}" + (f" ({_ratio(x.cpu_vs_router)})" if x.cpu_vs_router else "")

        def per_core(x: Row | None) -> str:
            return "—" if x is None or not x.cpu_us_per_req else f"{1e6 / x.cpu_us_per_req:.0f}"

        ratio = (
            _ratio(r.cpu_us_per_req / one.cpu_us_per_req)
            if one is not None and one.cpu_us_per_req and r.cpu_us_per_req
            else "—"
        )
        lines.append(
            f"| {r.engine} | {r.mode} | {r.conns} | {_f(rt.cpu_us_per_req if rt else None, '.0f')} "
            f"| {cpu(one)} | {cpu(r)} | {ratio} | {_f(one.rps if one else None, '.0f')} | {r.rps:.0f} "
            f"| {per_core(rt)} | {per_core(one)} | {per_core(r)} "
            f"| {_f(one.preempted_per_req if one else None, '.3f')} | {_f(r.preempted_per_req, '.3f')} |"
        )
    return head + "\n".join(lines) + "\n"


DOC_HEADER = """# Benchmarks

## Overhead: pd-gateway vs sglang-router and vllm-router

What it measures: the cost a router adds in front of an SGLang or vLLM P/D pair, on emulated
engines in zero-delay mode (`pd-gateway emulate --time-scale 0`), so that the router is the
only thing that costs anything on its core.

* Each target (sglang-router, vllm-router, `pd-gateway serve`, `bare-pd`, `callback-pd`) is pinned with
  `taskset -c 0`; the emulated prefill, decode and colocated servers and the load generator
  (closed loop, raw asyncio + httptools, `bench/loadgen.py`) share core 1. The load generator
  sends each request as the `openai` client does (`--client openai`, the default since
  2026-12-04: its seventeen header fields, the head and the body in two writes, keep-alive
  connections as `AsyncOpenAI` keeps them); `--client raw` sends four header fields in one
  write, as wrk does and as every table measured before that date did. All targets are
  started first; with `--rounds N` every row is measured N times, the targets in turn each
  round, and each figure is the median of its rounds (a noisy minute of this shared machine
  then lands on every target alike).
* `direct` sends the same request straight to a colocated emulated server (`--role both`):
  the floor without any P/D work. `direct-pd` is the load generator doing the P/D handoff
  itself against the same prefill+decode pair as the routers (SGLang: the body with a fresh
  `bootstrap_room` to both at once; vLLM: prefill with `max_tokens: 1` and
  `do_remote_decode`, then the decode with the returned `kv_transfer_params`): the floor for
  any P/D router on these upstreams (it runs on the target core, as a router would). `added p50` is a target's p50 minus `direct-pd`'s p50
  (minus `direct`'s when `direct-pd` was not run) at the same mode and connection count.
* `bare-pd` (`bench/bare_pd.py`) is a P/D proxy with nothing but the handoff, on the gateway's
  own HTTP layer (`gateway.http`): one fixed pair, no routing, ids, deadlines, retries, breakers,
  guards, metrics or logs. It is what Python and this HTTP layer cost before any feature: the
  gateway's figure above it is the price of its features.
* `callback-pd` (`bench/callback_pd.py`, `--targets ...,callback-pd`) is the bare proxy
  measured on 2026-11-29 as "design b" (docs/benchmarks.md, "The starting point"), rebuilt from its description: every step run from
  the transports' callbacks (no Task, no Future), and every shortcut a product cannot take (no
  timeouts, errors mapped or ids kept). It is the least any Python P/D proxy costs here.
* `target CPU/req` = (utime+stime of the target's process tree over the window) / completed
  requests, `of which kernel` its stime part; `vs router` is the gateway's (or a floor's) figure over the same engine's Rust
  router in the same run. `upstream CPU/req` is the emulated prefill+decode (direct: the colocated server).
  `wake-ups/req` (tables from 2026-12-04 on) is the target's voluntary context switches per
  request, all its threads: how often it went to sleep waiting for the next event. An idle
  target pays about one per upstream event; a busy one finds several events per wake-up, and
  its CPU per request falls with them (docs/benchmarks.md, "Why two measurements of streams
  disagree").
* Requests: `POST /v1/completions`, greedy; `nonstream` asks for 8 tokens, `stream64` for a
  64-token SSE stream (`ignore_eos`).
* sglang-router 0.3.2, `stream64` at 1 connection: on a reused keep-alive connection the
  first body byte comes ~40 ms after the headers (the first request on a connection is
  fast), which is the signature of Nagle's algorithm on the router's client socket meeting
  the client's delayed ACK (it sets no `TCP_NODELAY`: "Why two measurements of streams
  disagree"). Any keep-alive client sees it, `AsyncOpenAI` included; the sync `OpenAI` client
  does not, as it opens a connection per stream.
* The machine may be shared with other work: rerun, and compare figures only within one run: CPU per request depends on load (events batched per
  wake-up), and latencies on the contended upstream core (docs/benchmarks.md, "The starting point").

"""


def write_doc(path: Path, section: str, begin: str = DOC_BEGIN, end: str = DOC_END) -> None:
    text = path.read_text() if path.exists() else DOC_HEADER
    if begin in text and end in text:
        before, _, rest = text.partition(begin)
        _, _, after = rest.partition(end)
        text = before + section.rstrip("\n") + after
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# --------------------------------------------------------------------------- driver


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pd-gateway bench overhead", description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=5.0, help="measured seconds per row (default 5)")
    p.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds before each row (default 1)")
    p.add_argument("--conns", default="1,64", help="comma-separated connection counts (default 1,64)")
    p.add_argument("--modes", default="nonstream,stream64", help="nonstream,stream64")
    p.add_argument(
        "--targets",
        default="direct,direct-pd,bare-pd,gateway,sglang-router,vllm-router",
        help="any of direct,direct-pd,bare-pd,callback-pd,gateway,gateway-noguards,sglang-router,vllm-router",
    )
    p.add_argument("--engines", default="sglang,vllm", help="which P/D pools: sglang,vllm")
    p.add_argument(
        "--out",
        nargs="?",
        const=str(procs.REPO_ROOT / "docs" / "benchmarks.md"),
        default=None,
        help="write the table into this markdown file (default with no value: docs/benchmarks.md)",
    )
    p.add_argument("--json", default=None, help="results JSON (default bench/results/overhead-<time>.json)")
    p.add_argument("--target-cpus", default="0", help="CPU list for the target under test (default 0)")
    p.add_argument("--upstream-cpus", default="1", help="CPU list for emulators + load generator (default 1)")
    p.add_argument("--no-pin", action="store_true", help="do not pin anything")
    p.add_argument(
        "--x2-cpus",
        default=None,
        help="gateway-x2: pin its two serving processes one to each CPU of this list (e.g. 0,1), "
        "its supervisor staying on --target-cpus; default: the whole tree on --target-cpus",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every row this many times, the targets in turn each round, and report "
        "each figure's median (default 1)",
    )
    p.add_argument(
        "--loadgen",
        choices=("python", "wrk"),
        default="python",
        help="python (bench/loadgen.py, the default) or wrk: several times the request rate, "
        "so a fast target is busier (direct-pd, which needs the Python one, is skipped) "
        f"({bench_wrk.INSTALL_HINT})",
    )
    p.add_argument(
        "--client",
        choices=CLIENTS,
        default="openai",
        help="how the load generator sends each request: openai (the default: the openai Python "
        "client's header fields, head and body in two writes, as it sends them), raw (four "
        "header fields in one write, as wrk sends them) or raw-quickack (raw, every answer's "
        "segments ACKed at once: no Nagle stall at any target); see docs/benchmarks.md",
    )
    settings = p.add_mutually_exclusive_group()
    settings.add_argument(
        "--as-shipped",
        action="store_true",
        help="run the routers and the gateway with their own default policy and log level "
        "(the Rust routers: cache_aware, info; the gateway: round_robin, info) instead of all "
        "round robin at info (the default)",
    )
    settings.add_argument(
        "--quiet-logs",
        action="store_true",
        help="run the routers and the gateway at log level warning (no access-log line per "
        "request), all round robin: the tables before 2026-12-05; the default is info, the "
        "gateway's full feature set as shipped",
    )
    p.add_argument(
        "--token-interval-ms",
        type=float,
        default=1.0,
        help="with --upstream nginx: a stream's events leave one per write, this far apart, every "
        "stream in step (as an engine sends a decode step's tokens; default 1, nginx's least); 0: "
        "the whole stream in one write (the tables before 2026-12-04)",
    )
    p.add_argument(
        "--neighbour",
        default=None,
        metavar="KIND",
        help="a control: keep this process running on --target-cpus beside the targets while "
        "they are measured: spin (the core's time, not its caches) or copy:MB (its time and MB "
        "of cache lines swept each pass); see bench/neighbour.py",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-going", action="store_true", help="a target that fails to start is skipped")
    p.add_argument(
        "--upstream",
        choices=("emulator", "nginx"),
        default="emulator",
        help="emulator (zero-delay mode, the default) or nginx: fixed engine-shaped answers from "
        "nginx + its echo module, fast enough that the target is the bottleneck "
        f"({nginx_upstream.INSTALL_HINT})",
    )
    return p.parse_args(argv)


def _settings(args: argparse.Namespace) -> str:
    return "as-shipped" if args.as_shipped else "quiet" if args.quiet_logs else "info"


def _split(s: str, allowed: tuple[str, ...], what: str) -> list[str]:
    out = [x.strip() for x in s.split(",") if x.strip()]
    bad = [x for x in out if x not in allowed]
    if bad:
        raise SystemExit(f"unknown {what}: {', '.join(bad)} (choose from {', '.join(allowed)})")
    return out


def plan(targets: list[str], engines: list[str]) -> list[tuple[str, list[str]]]:
    """[(engine, [target kinds in run order])]: direct, the Rust router, then the gateway."""
    out = []
    for engine in engines:
        order = (
            "direct",
            "direct-pd",
            "bare-pd",
            "callback-pd",
            f"{engine}-router",
            "gateway",
            "gateway-x2",
            "gateway-noguards",
        )
        kinds = [k for k in order if k in targets]
        if kinds:
            out.append((engine, kinds))
    return out


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.rounds < 1:
        print("--rounds must be at least 1", file=sys.stderr)
        return 2
    if args.neighbour:
        try:
            bench_neighbour.parse(args.neighbour)
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
    targets = _split(args.targets, TARGET_KINDS, "target")
    modes = _split(args.modes, MODES, "mode")
    engines = _split(args.engines, ENGINES, "engine")
    conns = [int(c) for c in args.conns.split(",") if c.strip()]
    pin = not args.no_pin and procs.can_pin(args.target_cpus) and procs.can_pin(args.upstream_cpus)
    target_cpus = args.target_cpus if pin else None
    up_cpus = args.upstream_cpus if pin else None
    x2_cpus = sorted(_cpu_set(args.x2_cpus)) if pin and args.x2_cpus else None
    if pin:
        os.sched_setaffinity(0, _cpu_set(args.upstream_cpus))
    if args.loadgen == "wrk":
        if not bench_wrk.available():
            print(f"wrk is not installed ({bench_wrk.INSTALL_HINT})", file=sys.stderr)
            return 2
        if "direct-pd" in targets:  # the handoff needs a client that can do it: not wrk
            print(
                "note: direct-pd needs the Python load generator; skipped with --loadgen wrk", file=sys.stderr
            )
            targets.remove("direct-pd")
    for kind in ("sglang-router", "vllm-router"):
        if kind in targets and not procs.router_available(kind):
            print(f"note: {kind} is not installed; skipping it", file=sys.stderr)
            targets.remove(kind)

    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    log_dir = RESULTS_DIR / f"logs-{stamp}"
    command = "pd-gateway bench overhead " + shlex.join(argv)
    meta: dict[str, Any] = {
        "time": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command.strip(),
        "machine": f"{platform.machine()} {platform.processor() or platform.node()}".strip(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "pinning": f"targets on CPU {target_cpus}, upstreams + load generator on CPU {up_cpus}"
        + (
            (
                f" (gateway-x2: the supervisor on CPU {target_cpus}, its two processes on CPUs "
                f"{args.x2_cpus}, one each)"
                if args.x2_cpus
                else f" (gateway-x2: the supervisor and both processes on CPU {target_cpus}, sharing it)"
            )
            if "gateway-x2" in targets
            else ""
        )
        if pin
        else "none",
        "versions": _versions(),
        "loadgen": args.loadgen,
        "client": args.client,
        "rounds": args.rounds,
        "settings": SETTINGS[_settings(args)]
        + (f"; a neighbour process ({args.neighbour}) busy on the targets' CPU" if args.neighbour else ""),
    }
    rows: list[Row] = []
    all_rounds: list[Row] = []
    failures: list[str] = []
    t0 = time.monotonic()

    def run_targets(engine: str, kinds: list[str], cluster: Cluster, row_modes: list[str]) -> None:
        # Every target is started first (each alone on the target CPU, idle between its rows);
        # then each round measures every row of every target in turn, so a noisy stretch of
        # the machine lands on all targets alike instead of on whichever ran through it.
        with procs.process_group() as tgroup:
            started: list[Target] = []
            for kind in kinds:
                try:
                    target = start_target(
                        tgroup,
                        kind,
                        cluster,
                        target_cpus,
                        log_dir,
                        settings=_settings(args),
                        x2_cpus=x2_cpus,
                    )
                    for mode in row_modes:
                        smoke(target, mode)
                except Exception as exc:
                    msg = f"{kind} ({engine}) failed to start: {exc}"
                    if not args.keep_going:
                        raise
                    print(msg, file=sys.stderr)
                    failures.append(msg.splitlines()[0])
                    continue
                started.append(target)
            if args.neighbour:
                tgroup.add(
                    procs.start_process(
                        "neighbour",
                        [sys.executable, "-m", "bench.neighbour", args.neighbour],
                        cpus=target_cpus,
                        log_dir=log_dir,
                        cwd=procs.REPO_ROOT,
                    )
                )
            per_row: dict[tuple[str, str, int], list[Row]] = {}
            for rnd in range(args.rounds):
                for mode in row_modes:
                    for c in conns:
                        for target in started:
                            row = measure(
                                target,
                                cluster,
                                mode,
                                c,
                                args.duration,
                                args.warmup,
                                target_cpus,
                                loadgen=args.loadgen,
                                load_cpus=up_cpus,
                                client=args.client,
                            )
                            per_row.setdefault((target.kind, mode, c), []).append(row)
                            print(
                                f"[{engine}] round {rnd + 1}/{args.rounds} {target.kind:<13} {mode:<9} "
                                f"c={c:<3} {row.rps:8.0f} req/s p50 {row.p50_ms:7.3f} ms  cpu/req "
                                f"{_f(row.cpu_us_per_req, '.0f')} µs  errors {row.errors}",
                                file=sys.stderr,
                            )
            for target in started:
                for mode in row_modes:
                    for c in conns:
                        rounds = per_row[(target.kind, mode, c)]
                        rows.append(median_row(rounds))
                        all_rounds.extend(rounds)

    if args.upstream == "nginx":
        meta["upstream"] = "nginx (fixed answers, echo module)" + (
            f", stream events {args.token_interval_ms:g} ms apart" if args.token_interval_ms > 0 else ""
        )
        with procs.process_group() as upstreams:
            print("starting nginx upstreams", file=sys.stderr)
            nginx, layout, bport = nginx_upstream.start(
                upstreams,
                engines,
                modes,
                prompt_tokens=len(PROMPT) // 4,
                token_interval_ms=args.token_interval_ms,
                max_tokens=NONSTREAM_MAX_TOKENS,
                cpus=up_cpus,
                log_dir=log_dir,
            )
            for engine, kinds in plan(targets, engines):
                for mode in modes:
                    ports = layout[(engine, mode)]

                    cluster = Cluster(
                        engine,
                        procs.Upstream(
                            nginx, engine, "prefill", ports.prefill, bport if engine == "sglang" else None
                        ),
                        procs.Upstream(nginx, engine, "decode", ports.decode),
                        procs.Upstream(nginx, engine, "both", ports.both),
                    )
                    run_targets(engine, kinds, cluster, [mode])
    else:
        meta["upstream"] = "emulator (zero-delay mode)"
        for engine, kinds in plan(targets, engines):
            with procs.process_group() as upstreams:
                print(f"[{engine}] starting emulated prefill, decode and colocated servers", file=sys.stderr)
                cluster = start_cluster(upstreams, engine, up_cpus, log_dir, args.seed)
                run_targets(engine, kinds, cluster, modes)
    fill_derived(rows)
    meta["wall_s"] = round(time.monotonic() - t0, 1)
    meta["failures"] = failures

    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    json_path = Path(args.json) if args.json else RESULTS_DIR / f"overhead-{stamp}.json"
    json_path.write_text(
        json.dumps(
            {"meta": meta, "rows": [asdict(r) for r in rows], "rounds": [asdict(r) for r in all_rounds]},
            indent=2,
        )
    )
    print(markdown_table(rows))
    print(f"results: {json_path}", file=sys.stderr)
    if args.out:
        if "gateway-x2" in targets:
            marks = (MULTI_DOC_BEGIN, MULTI_DOC_END)
        elif args.loadgen == "wrk":
            marks = (WRK_DOC_BEGIN, WRK_DOC_END)
        elif args.upstream == "nginx":
            marks = (NGINX_DOC_BEGIN, NGINX_DOC_END)
        else:
            marks = (DOC_BEGIN, DOC_END)
        write_doc(Path(args.out), doc_section(rows, meta, *marks), *marks)
        print(f"wrote {args.out}", file=sys.stderr)
    return 1 if failures or any(r.errors for r in rows) else 0


def _cpu_set(cpus: str) -> set[int]:
    out: set[int] = set()
    for part in cpus.split(","):
        lo, _, hi = part.strip().partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for dist in ("sglang-router", "vllm-router", "pd-gateway"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[dist] = metadata.version(dist)
    return out


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(sys.argv[1:]))
