"""Load from `wrk` (C, one thread) instead of the Python load generator.

The Python generator (`bench/loadgen.py`) shares the upstream core with the upstreams; behind
nginx it tops out near 10k requests/s, so a fast target idles part of the time and pays a
wake-up for most events. `wrk` drives the same closed loop several times harder, which is the
regime the 2026-11-29 bare proxies were measured in (wrk + nginx; docs/benchmarks.md, "The
starting point"). It only sends a fixed request, so it cannot be the client-side P/D handoff
(`direct-pd`); the rows it drives are marked in the table.

Install: `apt-get install wrk` (Debian's package).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.loadgen import OPENAI_HEAD, LoadResult

INSTALL_HINT = "apt-get install wrk"

# wrk's Lua API: a fixed POST, and at the end one JSON line with the counts and percentiles (µs).
_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
%s
wrk.body = %s

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '\\nWRKJSON {"requests": %%d, "duration_us": %%d, "connect": %%d, "read": %%d, ' ..
    '"write": %%d, "status": %%d, "timeout": %%d, "p50": %%d, "p90": %%d, "p99": %%d}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99)))
end
"""


def available() -> bool:
    return shutil.which("wrk") is not None


def _lua_string(b: bytes) -> str:
    """`b` as a Lua string literal (decimal escapes for anything not printable ASCII)."""
    out = []
    for ch in b:
        if 32 <= ch < 127 and ch not in (ord('"'), ord("\\")):
            out.append(chr(ch))
        else:
            out.append(f"\\{ch:03d}")
    return '"' + "".join(out) + '"'


def client_headers(client: str) -> dict[str, str]:
    """The header fields a `--client` sends besides Host, Content-Type and Content-Length (which
    wrk writes itself). wrk writes the whole request at once whatever the client: the `openai`
    client's second write (its body) is the Python load generator's alone."""
    if client != "openai":
        return {"Accept": "*/*"}
    out: dict[str, str] = {}
    for line in OPENAI_HEAD.split("\r\n")[1:]:
        name, sep, value = line.partition(": ")
        if sep and name.lower() not in ("host", "content-type", "content-length"):
            out[name] = value
    return out


def _argv(url: str, script: Path, conns: int, seconds: float, cpus: str | None) -> list[str]:
    argv = ["wrk", "-t1", f"-c{conns}", f"-d{max(1, round(seconds))}s", "--timeout", "30s", "-s", str(script)]
    argv.append(url)
    return (["taskset", "-c", cpus] if cpus else []) + argv


def run_wrk(
    url: str,
    body: bytes,
    *,
    conns: int,
    duration_s: float,
    warmup_s: float,
    cpu_probes: dict[str, Callable[[], float]],
    cpus: str | None,
    headers: dict[str, str] | None = None,
) -> LoadResult:
    """A warm-up run, then the measured run with `cpu_probes` read just around it."""
    with tempfile.TemporaryDirectory(prefix="pdgw-wrk-") as tmp:
        script = Path(tmp) / "post.lua"
        fields = "\n".join(
            f"wrk.headers[{_lua_string(k.encode())}] = {_lua_string(v.encode())}"
            for k, v in (headers or {}).items()
        )
        script.write_text(_SCRIPT % (fields, _lua_string(body)))
        if warmup_s > 0:
            subprocess.run(
                _argv(url, script, conns, warmup_s, cpus),
                capture_output=True,
                check=True,
                timeout=warmup_s + 60,
            )
        before = {k: p() for k, p in cpu_probes.items()}
        t0 = time.perf_counter()
        proc = subprocess.run(
            _argv(url, script, conns, duration_s, cpus),
            capture_output=True,
            text=True,
            check=True,
            timeout=duration_s + 60,
        )
        wall = time.perf_counter() - t0
        after = {k: p() for k, p in cpu_probes.items()}
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("WRKJSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no summary:\n{proc.stdout}\n{proc.stderr}")
    s = json.loads(line.removeprefix("WRKJSON "))
    errors = s["connect"] + s["read"] + s["write"] + s["status"] + s["timeout"]
    samples = [f"wrk errors: {k}={s[k]}" for k in ("connect", "read", "write", "status", "timeout") if s[k]]
    # The CPU window is the whole wrk process (connection set-up included); the requests are
    # the ones wrk completed in it.
    completed = max(int(s["requests"]) - int(s["status"]), 0)
    return LoadResult(
        duration_s=s["duration_us"] / 1e6 or wall,
        completed=completed,
        errors=errors,
        latencies_s=[],
        error_samples=samples,
        cpu_s={k: after[k] - before[k] for k in cpu_probes},
        fixed_percentiles_ms={50.0: s["p50"] / 1000.0, 90.0: s["p90"] / 1000.0, 99.0: s["p99"] / 1000.0},
    )
