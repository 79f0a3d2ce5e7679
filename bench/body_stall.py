"""How long the gateway's event loop stalls while it takes in, and refuses, the largest bodies.

A client can send a body of up to `limits.max_body_bytes` (16 MiB by default) shaped to cost the
most to decode: millions of one-character prompts, token ids or chat messages. Decoding such a
body in one go held the event loop for seconds (issue #27: 350,000 tiny prompts, 4.1 s, health
checks stalled). This drives the real gateway (`Gateway`, default limits, in front of one
emulated colocated worker, on uvloop, its heap frozen as `pd-gateway serve` freezes it) with,
on its loop, a ticker that wakes every 0.5 ms, while another process, connected beforehand,
sends each body over a real socket and reads the answer. Two figures per body, the longest
over the request: the gap between two wake-ups of the ticker in wall time, and the CPU time the
loop's thread used in such a gap, which is the loop's own work (a 2-core machine shared with
other work adds its noise to the wall figure: the first row, the ticker alone, shows it).

    .venv/bin/python -m bench.body_stall
    .venv/bin/python -m bench.body_stall --rounds 5 --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import uvloop  # noqa: E402

from emulator.api import EmulatorSpec, start_emulator  # noqa: E402
from gateway.app import Gateway  # noqa: E402
from gateway.config import GatewayConfig, LimitsConfig, ListenConfig, WorkerConfig  # noqa: E402
from gateway.logging import configure  # noqa: E402
from policies.snapshot import Engine, Role  # noqa: E402

DOC_BEGIN = "<!-- bench:body-stall:begin -->"
DOC_END = "<!-- bench:body-stall:end -->"
MODEL = "m"
TICK_S = 0.0005


def _list(item: bytes, size: int, head: bytes, tail: bytes) -> bytes:
    """`head` + `[item,item,...]` + `tail`, `size` bytes in all (the most items that fit)."""
    n = (size - len(head) - len(tail) - 2) // (len(item) + 1)
    return head + b"[" + b",".join([item] * n) + b"]" + tail


def cases(max_body: int) -> list[tuple[str, str, bytes]]:
    """(name, path, body): the costliest shapes at the largest size, the issue's body, and a
    large body within every cap (parsed whole, then refused by the worker's context length)."""
    cmpl = b'{"model":"m","max_tokens":1,"prompt":'
    chat = b'{"model":"m","max_tokens":1,"messages":'
    # the issue's: 350,000 prompts of some 25 characters, 9 MB
    tiny_350k = _list(b'"' + b"x" * 24 + b'"', 350_000 * 27 + 60, cmpl, b"}")
    return [
        ('tiny prompts (`"a"`), max size', "/v1/completions", _list(b'"a"', max_body, cmpl, b"}")),
        ("token ids, max size", "/v1/completions", _list(b"7", max_body, cmpl, b"}")),
        ("id lists (`[7]`), max size", "/v1/completions", _list(b"[7]", max_body, cmpl, b"}")),
        (
            "chat messages, max size",
            "/v1/chat/completions",
            _list(b'{"role":"user","content":"a"}', max_body, chat, b"}"),
        ),
        (
            'escapes (`\\"`), max size',
            "/v1/completions",
            cmpl + b'"' + b'\\"' * ((max_body - 60) // 2) + b'"}',
        ),
        (
            "one text of commas, max size",
            "/v1/completions",
            cmpl + b'"' + b"a, " * ((max_body - 60) // 3) + b'"}',
        ),
        ("issue #27: 350,000 tiny prompts", "/v1/completions", tiny_350k),
        ("100,000 token ids (within the caps)", "/v1/completions", _list(b"7", 100_000 * 2 + 60, cmpl, b"}")),
    ]


_CLIENT = """
import socket, sys
port, path, file = int(sys.argv[1]), sys.argv[2], sys.argv[3]
body = open(file, "rb").read()
s = socket.create_connection(("127.0.0.1", port))
print("ready", flush=True)
sys.stdin.readline()
s.sendall(b"POST %s HTTP/1.1\\r\\nHost: b\\r\\ncontent-type: application/json\\r\\n"
          b"content-length: %d\\r\\nconnection: close\\r\\n\\r\\n" % (path.encode(), len(body)))
s.sendall(body)
out = b""
while chunk := s.recv(65536):
    out += chunk
sys.stdout.buffer.write(out)
"""


class Stall(NamedTuple):
    wall_s: float  # the longest gap between two wake-ups of the ticker
    cpu_s: float  # the most CPU the loop's thread used between two wake-ups: its own work
    status: int
    body: bytes


async def _measure(start: Callable[[], None] | None, wait: Callable[[], bytes]) -> Stall:
    """Run `start()` (on the loop), then `wait()` in a thread, while a ticker on the loop wakes
    every TICK_S and records the longest gaps between its wake-ups: in wall time, and in the CPU
    time of the loop's thread (what the loop itself did; the wall figure adds the time the
    machine gave to other processes)."""
    loop = asyncio.get_running_loop()
    done = threading.Event()
    wall = cpu = 0.0

    async def tick() -> None:
        nonlocal wall, cpu
        last, last_cpu = time.perf_counter(), time.thread_time()
        while not done.is_set():
            await asyncio.sleep(TICK_S)
            now, now_cpu = time.perf_counter(), time.thread_time()
            wall, cpu = max(wall, now - last), max(cpu, now_cpu - last_cpu)
            last, last_cpu = now, now_cpu

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.01)
    wall = cpu = 0.0
    if start is not None:
        start()

    def go() -> bytes:
        try:
            return wait()
        finally:
            done.set()

    out = await loop.run_in_executor(None, go)
    await ticker
    if not out:
        return Stall(wall, cpu, 0, b"")
    return Stall(wall, cpu, int(out.split(b" ", 2)[1]), out.partition(b"\r\n\r\n")[2])


async def _one(port: int, path: str, file: Path) -> Stall:
    """One request from another process over a real socket, measured from the moment it is
    sent (the client's start-up, on this 2-core machine, is left out)."""
    proc = subprocess.Popen(  # noqa: ASYNC220 (before the measurement)
        [sys.executable, "-c", _CLIENT, str(port), path, str(file)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None
    loop = asyncio.get_running_loop()
    assert (await loop.run_in_executor(None, proc.stdout.readline)) == b"ready\n"

    def start() -> None:
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        proc.stdin.flush()

    def wait() -> bytes:
        out, _ = proc.communicate(timeout=120)
        return out

    return await _measure(start, wait)


def _pause() -> bytes:
    time.sleep(0.3)
    return b""


async def measure(rounds: int) -> list[tuple[str, int, str, list[Stall]]]:
    emu = await start_emulator(EmulatorSpec(engine="vllm", role="both", model=MODEL, time_scale=0.0))
    worker = WorkerConfig(url=emu.url, role=Role.COLOCATED, engine=Engine.VLLM, id="w")
    gw = Gateway(GatewayConfig(listen=ListenConfig(host="127.0.0.1", port=0), workers=(worker,)))
    await gw.start()
    gc.collect()
    gc.freeze()  # as run_forever does once started
    out = []
    try:
        limits = LimitsConfig()
        idle = [await _measure(None, _pause) for _ in range(rounds)]
        out.append(("(no request: the ticker alone)", 0, "", idle))
        for name, path, body in cases(limits.max_body_bytes):
            stalls = []
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                f.write(body)
                f.flush()
                for _ in range(rounds):
                    stalls.append(await _one(gw.port, path, Path(f.name)))
            last = stalls[-1]
            try:
                code = str(json.loads(last.body)["error"]["code"])
            except (ValueError, KeyError, TypeError):
                code = ""
            out.append((f"{name} ({len(body) / 2**20:.1f} MiB)", last.status, code, stalls))
    finally:
        await gw.stop(1.0)
        await emu.stop()
    return out


def table(rows: list[tuple[str, int, str, list[Stall]]], rounds: int) -> str:
    lines = [
        "| body | answer | longest stall, the loop's own CPU, ms: median (worst) | longest stall, wall, ms: median (worst) |",
        "|---|---|---|---|",
    ]
    for name, status, code, stalls in rows:
        answer = f"{status} `{code}`" if status else "-"
        cpu = [s.cpu_s * 1000 for s in stalls]
        wall = [s.wall_s * 1000 for s in stalls]
        lines.append(
            f"| {name} | {answer} | {statistics.median(cpu):.1f} ({max(cpu):.1f}) "
            f"| {statistics.median(wall):.1f} ({max(wall):.1f}) |"
        )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        "\n".join(lines)
        + f"\n\n({rounds} rounds per body; the ticker sleeps {TICK_S * 1000:g} ms; {os.cpu_count()} cores, "
        f"load average {load:.1f} at the end.)\n"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.body_stall", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="replace the marked block in this file")
    args = ap.parse_args(argv)
    configure("warning")
    uvloop.install()
    rows = asyncio.run(measure(args.rounds))
    text = table(rows, args.rounds)
    print(text)
    if args.out is not None:
        doc = args.out.read_text()
        head, _, rest = doc.partition(DOC_BEGIN)
        _, _, tail = rest.partition(DOC_END)
        cmd = "python -m bench.body_stall" + (f" --rounds {args.rounds}" if args.rounds != 3 else "")
        block = f"{DOC_BEGIN}\n\n`{cmd} --out {args.out}`:\n\n{text}\n{DOC_END}"
        args.out.write_text(head + block + tail if DOC_BEGIN in doc else doc.rstrip() + "\n\n" + block + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
