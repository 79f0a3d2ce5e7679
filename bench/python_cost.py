"""The gateway's own Python cost per request, without sockets or a kernel in the way.

`pd-gateway bench overhead` measures what a deployment pays (system calls, wake-ups and the
machine's noise included: ±10 % between runs here). This drives the real gateway objects
(`Gateway` from the same flags as `pd-gateway serve`: server protocol, handlers,
orchestrator, adapters, guards, metrics, upstream pools) over in-memory transports on one
uvloop loop: the client's request is fed to the server protocol, the engine answers (shaped
like bench/nginx_upstream.py's) are fed to the upstream connections, and the CPU time of the
whole loop is divided by the requests served. Every answer is checked, so a broken path fails
loudly instead of looking fast. What is left out is exactly the kernel's part, so before/after
figures of a change to the Python path are comparable to a few percent.

    .venv/bin/python -m bench.python_cost                     # both engines, both modes
    .venv/bin/python -m bench.python_cost --engines sglang --modes nonstream -n 20000
    .venv/bin/python -m bench.python_cost --target bare-pd        # the HTTP layer's floor
    .venv/bin/python -m bench.python_cost --serve-args=--no-guards  # the guards' share
    .venv/bin/python -m bench.python_cost --log-file /tmp/gw.log   # with serve's default logging
    .venv/bin/python -m bench.python_cost --count bytecodes -n 300 --repeats 1 --top 30  # counted

`--count bytecodes` counts instead of timing: the Python bytecodes the gateway executes per
request (`sys.settrace` with opcode events; the rig's own frames left out). The count moves by
~0.2 % between runs (timers that fire or not), so a change of half a percent shows on a
machine whose timings move by ten; C code (msgspec, httptools, uvloop) and the kernel are not
in it. `--top K` also lists the K functions that execute the most. `bench/callgrind_cost.py`
counts every machine instruction instead, under valgrind; `python -m bench.perf_report`
compares either between a git revision and the working tree.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import structlog  # noqa: E402
import uvloop  # noqa: E402

from adapters.base import ProbeInfo  # noqa: E402
from bench.bare_pd import make_handler  # noqa: E402
from bench.loadgen import OPENAI_HEAD  # noqa: E402
from bench.nginx_upstream import _completion, _stream, prefill_answer  # noqa: E402
from bench.overhead import NONSTREAM_MAX_TOKENS, PROMPT, request_body  # noqa: E402
from gateway.app import Gateway  # noqa: E402
from gateway.cli_args import parse_serve_args  # noqa: E402
from gateway.http.client import _UpstreamConnection  # noqa: E402
from gateway.http.server import HttpServer, ServerLimits  # noqa: E402
from gateway.logging import LEVELS  # noqa: E402
from gateway.logging import configure as configure_logging  # noqa: E402

MODEL = "bench-model"


class MemTransport:
    """Enough of asyncio.Transport for the gateway's protocols; writes are kept."""

    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.out.append(bytes(data))

    def writelines(self, parts: Any) -> None:
        for p in parts:
            self.write(p)

    def take(self) -> bytes:
        data = b"".join(self.out)
        self.out.clear()
        return data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


def _response(body: bytes, ctype: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (ctype, len(body)) + body


def _chunked_reads(events: list[bytes], ctype: bytes) -> list[bytes]:
    """A chunked SSE answer as the reads of an engine that sends each event when it is made:
    the head with the first event, then one event per read, the last with the end chunk."""
    out = [b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n\r\n" % ctype]
    for ev in events:
        out.append(b"%x\r\n%s\r\n" % (len(ev), ev))
    out[-1] += b"0\r\n\r\n"
    return [out[0] + out[1], *out[2:]]


class Rig:
    """One gateway in front of one in-memory prefill and decode."""

    def __init__(
        self,
        engine: str,
        mode: str,
        target: str = "gateway",
        serve_args: str = "",
        apart: bool = False,
        log_file: str | None = None,
        processes: int = 1,
        client: str = "raw",
    ) -> None:
        self.engine, self.mode = engine, mode
        self.client_kind = client
        # processes > 1: the gateway as the first of that many (`serve --workers N`): its
        # in-flight counts and breakers in a shared table (the other processes idle)
        process = None
        if processes > 1:
            from gateway.multiprocess.siblings import ProcessContext
            from gateway.multiprocess.table import SharedTable

            process = ProcessContext(0, processes, SharedTable(processes), b"\0" * 16)
        argv = ["--engine", engine, "--prefill", "http://127.0.0.1:18001"]
        if engine == "sglang":
            argv.append("18100")
        argv += ["--decode", "http://127.0.0.1:18002"]
        if log_file is None:
            argv += ["--log-level", "warning"]
        argv += serve_args.split()
        cfg = parse_serve_args(argv)
        if log_file is not None:
            # logging exactly as `serve` sets it up (its default level: info, one access-log
            # line per request), into the file (configure takes sys.stderr), for the rest of
            # this process
            saved_stderr = sys.stderr
            sys.stderr = open(log_file, "a")
            try:
                configure_logging(cfg.log_level, cfg.log_json)
            finally:
                sys.stderr = saved_stderr
            self.gw = Gateway(cfg, process=process)
        else:
            # built at `serve`'s log level (warning: no per-request access line), without
            # touching the process's logging for good (structlog's configure caches loggers on
            # first use)
            saved = structlog.get_config()
            structlog.configure(
                wrapper_class=structlog.make_filtering_bound_logger(LEVELS[cfg.log_level]),
                cache_logger_on_first_use=False,
            )
            try:
                self.gw = Gateway(cfg, process=process)
            finally:
                structlog.configure(**saved)
        # every request takes the unsampled path of the sampled verification (`guards.
        # shadow_fraction`, 5 % of greedy P/D answers by default: one countdown step each): a
        # sampled one's re-run is a second request to another worker, which this rig does not
        # serve (a revision before the sampler has none: bench.perf_report runs this rig on it)
        share = getattr(self.gw.orchestrator.s, "verify_share", None)
        if share is not None:
            share.left = 1 << 62
        prompt_tokens = len(PROMPT) // 4
        for w in self.gw.registry.workers():
            w.healthy = True
            w.info = ProbeInfo(model=MODEL, context_length=8192, max_input_len=8186)
        self.gw.registry.changed()
        loop = asyncio.get_running_loop()
        handler: Any = self.gw.handlers
        if target == "bare-pd":  # the floor: bench/bare_pd.py's handler over the same pools
            pools = {w.role.value: w.pool for w in self.gw.registry.workers()}
            handler = make_handler(engine, pools["prefill"], pools["decode"], "127.0.0.1", 18100)
        self.server = HttpServer(handler, ServerLimits(), loop)
        self.client = self.server._protocol()
        self.ct = MemTransport()
        self.client.connection_made(self.ct)  # type: ignore[arg-type]
        self.up: dict[str, tuple[_UpstreamConnection, MemTransport]] = {}
        for w in self.gw.registry.workers():
            conn = _UpstreamConnection(w.pool, loop)
            t = MemTransport()
            conn.connection_made(t)  # type: ignore[arg-type]
            w.pool._loop = loop
            w.pool._put(conn)
            self.up[w.role.value] = (conn, t)
        self.body = request_body(mode, engine)
        # the `openai` client's head but for the id, formatted once: `str.format` of the
        # seventeen fields is ~20k machine instructions, the rig's, not the gateway's
        self._openai_head = OPENAI_HEAD.format(
            path="/v1/completions", host="127.0.0.1", port=8000, length=len(self.body)
        )[:-2].encode("latin-1")
        if mode == "stream64":
            reads = _chunked_reads([ev.encode() for ev in _stream(64)], b"text/event-stream")
            self.decode_answer = b"".join(reads)
            # --apart: one event per read, a loop turn between them (the emulator's and a real
            # engine's pace); otherwise the whole stream in one read (nginx's)
            self.decode_reads = reads if apart else [self.decode_answer]
        else:
            text = "a" + "b" * (NONSTREAM_MAX_TOKENS - 1)
            body = _completion(text, prompt_tokens, NONSTREAM_MAX_TOKENS).encode()
            self.decode_answer = _response(body, b"application/json")
            self.decode_reads = [self.decode_answer]
        self.prompt_tokens = prompt_tokens
        self._prefill = prefill_answer(engine, prompt_tokens).encode()
        self._prefill_fixed = _response(self._prefill, b"application/json")

    def _prefill_answer(self, request_id: str) -> bytes:
        """vLLM's names the request (its id is in `remote_request_id`); SGLang's is fixed."""
        if self.engine == "vllm":
            return _response(self._prefill.replace(b"REQID", request_id.encode()), b"application/json")
        return self._prefill_fixed

    async def one(self, i: int) -> None:
        rid = f"bench-{i}"
        if self.client_kind == "openai":
            # the `openai` client's seventeen fields (bench/loadgen.py), and the id the rig needs
            req = self._openai_head + b"x-request-id: %s\r\n\r\n" % rid.encode() + self.body
        else:
            req = (
                b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                b"x-request-id: %s\r\ncontent-length: %d\r\n\r\n" % (rid.encode(), len(self.body))
            ) + self.body
        pconn, pt = self.up["prefill"]
        dconn, dt = self.up["decode"]
        self.client.data_received(req)
        await _until(lambda: bool(pt.out))
        pt.take()
        if self.engine == "vllm":
            pconn.data_received(self._prefill_answer(rid))
            await _until(lambda: bool(dt.out))
            dt.take()
            await self._feed(dconn)
        else:
            await _until(lambda: bool(dt.out))
            dt.take()
            pconn.data_received(self._prefill_answer(rid))
            await self._feed(dconn)
        tail = b"[DONE]" if self.mode == "stream64" else b"}"
        await _until(lambda: bool(self.ct.out) and self._ended(tail))
        out = self.ct.take()
        if not out.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"{self.engine} {self.mode}: {out[:300]!r}")

    async def _feed(self, dconn: _UpstreamConnection) -> None:
        reads = self.decode_reads
        dconn.data_received(reads[0])
        for piece in reads[1:]:
            await asyncio.sleep(0)
            dconn.data_received(piece)

    def _ended(self, tail: bytes) -> bool:
        """A stream ends with the last chunk (which may leave in its own write after [DONE]);
        a JSON answer with its closing brace."""
        data = self.ct.out[-1]
        if self.mode == "stream64":
            return data.endswith(b"0\r\n\r\n")
        # (`find`, not `in`: on Python 3.11 a bytes `in` makes and drops a TypeError first)
        return data.find(tail) >= 0 or data.rstrip().endswith(tail)


async def _until(cond: Any, limit: int = 50) -> None:
    for _ in range(limit):
        if cond():
            return
        await asyncio.sleep(0)
    raise RuntimeError("the gateway did not get there")


class _BytecodeCounter:
    """A `sys.settrace` tracer counting the bytecodes executed outside this rig's own frames."""

    def __init__(self, by_function: bool = False) -> None:
        self.n = 0
        self.by: Counter[Any] = Counter()  # code object -> bytecodes, with `by_function`
        self._skip = {__file__, asyncio.sleep.__code__.co_filename}
        if by_function:
            self._local = self._local_by_function  # type: ignore[method-assign]

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        if event != "call" or frame.f_code.co_filename in self._skip:
            return None
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        return self._local

    def _local(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            self.n += 1
        return self._local

    def _local_by_function(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            self.n += 1
            self.by[frame.f_code] += 1
        return self._local_by_function

    def top(self, k: int, per: int) -> list[tuple[str, float]]:
        """The `k` functions that executed the most bytecodes, per request of `per`."""
        root = str(ROOT) + "/"
        return [
            (f"{c.co_filename.removeprefix(root)}:{c.co_firstlineno} {c.co_qualname}", n / per)
            for c, n in self.by.most_common(k)
        ]


class _CallCounter(_BytecodeCounter):
    """A `sys.setprofile` hook counting Python call events outside this rig's own frames: calls,
    and a coroutine's resumptions (each is a frame entered)."""

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code.co_filename not in self._skip:
            self.n += 1
            self.by[frame.f_code] += 1


async def measure(
    engine: str,
    mode: str,
    n: int,
    repeats: int,
    target: str = "gateway",
    serve_args: str = "",
    apart: bool = False,
    log_file: str | None = None,
    processes: int = 1,
    warmup: int | None = None,
    count: str = "time",
    top: int = 0,
    client: str = "raw",
) -> dict[str, Any]:
    """µs of CPU per request (`count="time"`), or bytecodes per request (`"bytecodes"`), for
    each of `repeats` runs of `n` requests after `warmup` (default: up to 2000)."""
    rig = Rig(engine, mode, target, serve_args, apart, log_file, processes, client)
    for i in range(min(2000, n) if warmup is None else warmup):  # caches, pools, code paths
        await rig.one(-i - 1)
    per: list[float] = []
    functions: list[tuple[str, float]] = []
    k = 0
    for _ in range(repeats):
        if count in ("bytecodes", "calls"):
            counter = _BytecodeCounter(by_function=top > 0) if count == "bytecodes" else _CallCounter()
            hook = sys.settrace if count == "bytecodes" else sys.setprofile
            hook(counter)
            try:
                for _ in range(n):
                    await rig.one(k)
                    k += 1
            finally:
                hook(None)
            per.append(counter.n / n)
            functions = counter.top(top, n)
            continue
        t0 = time.process_time()
        for _ in range(n):
            await rig.one(k)
            k += 1
        per.append((time.process_time() - t0) / n * 1e6)
    return {
        "engine": engine,
        "mode": mode,
        "target": target,
        "requests": n * repeats,
        "us_per_request": per,
        "count": count,
        "functions": functions,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="sglang,vllm")
    ap.add_argument("--modes", default="nonstream,stream64")
    ap.add_argument("-n", type=int, default=10000, help="requests per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--target",
        choices=("gateway", "bare-pd"),
        default="gateway",
        help="the gateway, or bench/bare_pd.py's handoff-only handler (the HTTP layer's floor)",
    )
    ap.add_argument("--serve-args", default="", help='more `pd-gateway serve` flags, e.g. "--no-guards"')
    ap.add_argument(
        "--apart",
        action="store_true",
        help="streams: each event in its own read (an engine's pace) instead of all in one",
    )
    ap.add_argument(
        "--log-file",
        default=None,
        help="log as `serve` does (its default level, info: one access-log line per request, "
        "unless --serve-args names another) into this file, instead of warnings only",
    )
    ap.add_argument(
        "--processes",
        type=int,
        default=1,
        help="the gateway as one of this many processes (`serve --workers N`): in-flight counts "
        "and breakers in the shared table",
    )
    ap.add_argument(
        "--warmup", type=int, default=None, help="requests before measuring (default: min(n, 2000))"
    )
    ap.add_argument(
        "--count",
        choices=("time", "bytecodes", "calls"),
        default="time",
        help="time: CPU µs per request; bytecodes: Python bytecodes executed per request "
        "(the same to ~0.2 %% from run to run); calls: Python frames entered per request",
    )
    ap.add_argument(
        "--top",
        type=int,
        default=0,
        help="with --count bytecodes or calls: also list the K functions with the most, per request",
    )
    ap.add_argument(
        "--client",
        choices=("raw", "openai"),
        default="raw",
        help="the request's head: raw (four fields, as wrk sends) or the `openai` client's seventeen",
    )
    ap.add_argument("--json", action="store_true", help="one JSON object per case instead of a line")
    args = ap.parse_args(argv)
    for engine in args.engines.split(","):
        for mode in args.modes.split(","):
            r = uvloop.run(
                measure(
                    engine,
                    mode,
                    args.n,
                    args.repeats,
                    args.target,
                    args.serve_args,
                    args.apart,
                    args.log_file,
                    args.processes,
                    args.warmup,
                    args.count,
                    args.top,
                    args.client,
                )
            )
            per = r["us_per_request"]
            if args.json:
                print(json.dumps(r))
                continue
            if args.count in ("bytecodes", "calls"):
                print(
                    f"{args.target:8} {engine:7} {mode:10} {args.count}/request: {statistics.median(per):8.1f}"
                )
                for name, k in r["functions"]:
                    print(f"    {k:8.1f}  {name}")
                continue
            print(
                f"{args.target:8} {engine:7} {mode:10} python µs/request: median {statistics.median(per):6.1f}"
                f"  (min {min(per):.1f}, max {max(per):.1f}, {r['requests']} requests)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
