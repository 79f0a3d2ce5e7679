"""``python -m emulator.throughput``: the emulator's own throughput in zero-delay mode.

Starts one emulated server in this process (uvloop when available) and drives it from the same
process with aiohttp clients: non-streaming requests/s, then streamed tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import aiohttp

from emulator.api import EmulatorSpec, start_emulator


async def _drive(
    url: str, body: dict[str, object], concurrency: int, seconds: float, stream: bool
) -> tuple[int, int]:
    stop = time.monotonic() + seconds
    done = 0
    events = 0
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as http:

        async def worker() -> None:
            nonlocal done, events
            while time.monotonic() < stop:
                async with http.post(url, json=body) as r:
                    if stream:
                        async for line in r.content:
                            if line.startswith(b"data: ") and line != b"data: [DONE]\n":
                                events += 1
                    else:
                        await r.read()
                done += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done, events


async def run(engine: str, concurrency: int, seconds: float, max_tokens: int) -> None:
    h = await start_emulator(EmulatorSpec(engine=engine, role="both", time_scale=0.0))  # type: ignore[arg-type]
    try:
        url = h.url + "/v1/completions"
        base = {"prompt": "The quick brown fox jumps over the lazy dog", "temperature": 0}
        t0 = time.monotonic()
        n, _ = await _drive(url, {**base, "max_tokens": 16}, concurrency, seconds, False)
        dt = time.monotonic() - t0
        print(f"{engine}: non-stream max_tokens=16: {n / dt:,.0f} req/s ({n} requests, c={concurrency})")
        t0 = time.monotonic()
        n, ev = await _drive(
            url, {**base, "max_tokens": max_tokens, "stream": True}, concurrency, seconds, True
        )
        dt = time.monotonic() - t0
        print(
            f"{engine}: stream max_tokens={max_tokens}: {n / dt:,.0f} req/s, {ev / dt:,.0f} streamed tokens/s"
        )
    finally:
        await h.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m emulator.throughput")
    ap.add_argument("--engine", choices=["sglang", "vllm", "both"], default="both")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    engines = ["sglang", "vllm"] if args.engine == "both" else [args.engine]

    async def all_runs() -> None:
        for e in engines:
            await run(e, args.concurrency, args.seconds, args.max_tokens)

    try:
        import uvloop

        uvloop.run(all_runs())
    except ImportError:
        asyncio.run(all_runs())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
