"""How many tokens arrive together with a stream's first token (issue #27 item 12's repro).

One emulated SGLang P/D pair (``--time-scale 0.5`` by default) serves long prompts (6 of 40k
tokens) interleaved with short streams (30 of 60 output tokens). For each short stream the
client records what each socket read brought: the first read that carries a token, and how
many tokens it carried (an engine that streams each decode step as it finishes sends the first
token alone; a front end that holds the decode's bytes, or an engine that bunches its steps,
delivers several at once). It also counts tokens per SSE event, which the client's own pace
cannot change.

Targets, any of them in one run (``--via``):

* ``direct``: the bench is its own P/D router: it sends each request to the prefill and to the
  decode (bootstrap fields as sglang-router sets them) and reads the decode's stream;
* ``sglang-router``: the real Rust router (``sglang-router``, in the dev extra) started in front
  of the pair;
* ``gateway``, ``gateway-noguards``: ``pd-gateway serve`` started in front of the pair;
  ``gateway-before-end``: the same with ``[guards] prefill_verdict = "before_end"`` (the decode's
  tokens relayed before the prefill's verdict, docs/guards.md);
* ``URL``: any front end already serving the pair (the gateway, say): ``--pair-url`` prints the
  pair's addresses and waits, so that one can be started against them; or ``--prefill`` /
  ``--decode`` point at a pair started elsewhere.

    python -m bench.stream_bunching                       # direct and sglang-router
    python -m bench.stream_bunching --via direct --json out.json
    python -m bench.stream_bunching --via http://127.0.0.1:8080 --prefill URL:BPORT --decode URL

The figures are the distribution (median, p90, p99, max) of tokens in the first read and of
tokens per event over the short streams, and their TTFT (with each target's TTFT less
``direct``'s at the same percentile, where ``direct`` ran too). Reads are what the client's socket returned
(aiohttp ``iter_any``): a slow client merges reads, so the event counts are the engine's own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from bench import procs

HOST = procs.HOST


@dataclass
class StreamRecord:
    """What one short stream's client saw."""

    ttft_s: float = 0.0
    first_read_tokens: int = 0  # tokens in the first read that carried any
    reads: int = 0
    events: int = 0
    max_event_tokens: int = 0  # the most tokens one event added
    tokens: int = 0
    error: str = ""
    event_tokens: list[int] = field(default_factory=list)


def event_tokens(event: bytes, seen: int) -> int:
    """The tokens an SSE event adds: `/generate`'s cumulative `meta_info.completion_tokens`
    less `seen`; on the OpenAI routes the characters of its text (the emulator's tokens are one
    ASCII character each: its model draws from a letter alphabet)."""
    if not event.startswith(b"data: {"):
        return 0
    try:
        obj = msgspec.json.decode(event[6:])
    except msgspec.DecodeError:
        return 0
    meta = obj.get("meta_info")
    if isinstance(meta, dict):
        return max(0, int(meta.get("completion_tokens") or 0) - seen)
    n = 0
    for choice in obj.get("choices") or ():
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        n += len(text or "")
    return n


def short_body(route: str, i: int, max_tokens: int, salt: str, model: str) -> dict[str, Any]:
    text = f"{salt} short question number {i}: what follows?"
    if route == "generate":
        return {
            "text": text,
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
            "stream": True,
        }
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    if route == "chat":
        return body | {"messages": [{"role": "user", "content": text}]}
    return body | {"prompt": text}


def long_body(route: str, i: int, tokens: int, max_tokens: int, salt: str, model: str) -> dict[str, Any]:
    # the emulator's tokenizer is byte-level: a character is a token; `salt` leads the text so
    # that no run finds another's prompt in the prefix cache
    rng = random.Random(i)
    text = salt + "".join(rng.choice("abcdefghij ") for _ in range(tokens - len(salt)))
    if route == "generate":
        return {
            "text": text,
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0},
            "stream": True,
        }
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if route == "chat":
        return body | {"messages": [{"role": "user", "content": text}]}
    return body | {"prompt": text}


PATHS = {"generate": "/generate", "completions": "/v1/completions", "chat": "/v1/chat/completions"}


class Target:
    """Where the requests go: a front end URL, or the pair itself (`direct`)."""

    def __init__(self, url: str | None, prefill: tuple[str, int] | None, decode: str | None) -> None:
        self.url = url
        self.prefill = prefill
        self.decode = decode
        self._room = random.Random(7).randrange(1 << 40)

    async def stream(
        self, session: aiohttp.ClientSession, path: str, body: dict[str, Any], rec: StreamRecord | None
    ) -> None:
        if self.url is not None:
            await read_stream(session, self.url + path, body, rec)
            return
        assert self.prefill is not None and self.decode is not None
        self._room += 1
        pd = {
            "bootstrap_host": HOST,
            "bootstrap_port": self.prefill[1],
            "bootstrap_room": self._room,
        }
        # as sglang-router's P/D mode: the same body to both, the decode's stream to the client
        prefill = asyncio.ensure_future(read_stream(session, self.prefill[0] + path, body | pd, None))
        try:
            await read_stream(session, self.decode + path, body | pd, rec)
        finally:
            await prefill


async def read_stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], rec: StreamRecord | None
) -> None:
    t0 = time.perf_counter()
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                if rec is not None:
                    rec.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                else:
                    await resp.read()
                return
            if rec is None:
                await resp.read()
                return
            await _record(resp, rec, t0)
    except (aiohttp.ClientError, TimeoutError) as e:
        if rec is not None:
            rec.error = repr(e)


async def _record(resp: aiohttp.ClientResponse, rec: StreamRecord, t0: float) -> None:
    pending = b""
    seen = 0
    async for data in resp.content.iter_any():
        rec.reads += 1
        pending += data
        *events, pending = pending.split(b"\n\n")
        for event in events:
            n = event_tokens(event, seen)
            if n <= 0:
                continue
            rec.events += 1
            rec.event_tokens.append(n)
            rec.max_event_tokens = max(rec.max_event_tokens, n)
            if seen == 0:
                rec.ttft_s = time.perf_counter() - t0
            seen += n
        if seen and not rec.first_read_tokens:
            rec.first_read_tokens = seen
    rec.tokens = seen


def dist(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    v = sorted(values)
    return {
        "n": len(v),
        "median": statistics.median(v),
        "p90": v[min(len(v) - 1, int(0.9 * len(v)))],
        "p99": v[min(len(v) - 1, int(0.99 * len(v)))],
        "max": v[-1],
    }


async def run_workload(target: Target, args: argparse.Namespace) -> list[StreamRecord]:
    """Long prompts interleaved with short streams: every `--every`-th request is a long one,
    one request started every `--gap-ms`."""
    path = PATHS[args.route]
    salt = f"run {time.time_ns()}:"
    records: list[StreamRecord] = []
    tasks: list[asyncio.Task[None]] = []
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        n_long = n_short = 0
        k = 0
        while n_short < args.short or n_long < args.long:
            is_long = n_long < args.long and (k % args.every == 0 or n_short >= args.short)
            if is_long:
                body = long_body(args.route, n_long, args.long_tokens, args.long_max_tokens, salt, args.model)
                tasks.append(asyncio.ensure_future(target.stream(session, path, body, None)))
                n_long += 1
            else:
                rec = StreamRecord()
                records.append(rec)
                body = short_body(args.route, n_short, args.short_max_tokens, salt, args.model)
                tasks.append(asyncio.ensure_future(target.stream(session, path, body, rec)))
                n_short += 1
            k += 1
            await asyncio.sleep(args.gap_ms / 1000.0)
        await asyncio.gather(*tasks)
    return records


def summary(name: str, records: list[StreamRecord]) -> dict[str, Any]:
    ok = [r for r in records if not r.error]
    return {
        "target": name,
        "streams": len(records),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:3],
        "first_read_tokens": dist([r.first_read_tokens for r in ok]),
        "tokens_per_event": dist([float(t) for r in ok for t in r.event_tokens]),
        "max_event_tokens": dist([r.max_event_tokens for r in ok]),
        "ttft_ms": dist([r.ttft_s * 1000.0 for r in ok]),
        "first_read_tokens_each": [r.first_read_tokens for r in ok],
    }


def print_summary(s: dict[str, Any]) -> None:
    def fmt(d: dict[str, float]) -> str:
        if not d.get("n"):
            return "-"
        return f"median {d['median']:.0f}, p90 {d['p90']:.0f}, p99 {d['p99']:.0f}, max {d['max']:.0f}"

    print(f"{s['target']}: {s['streams']} short streams, {s['failed']} failed {s['errors'] or ''}")
    print(f"  tokens in the first read  {fmt(s['first_read_tokens'])}")
    print(f"  tokens per event          {fmt(s['tokens_per_event'])}")
    print(f"  most tokens in one event  {fmt(s['max_event_tokens'])}")
    print(f"  TTFT ms                   {fmt(s['ttft_ms'])}")
    added = s.get("ttft_added_ms")
    if added:
        print(
            f"  TTFT added vs direct, ms  median {added['median']:.0f}, p90 {added['p90']:.0f}, "
            f"p99 {added['p99']:.0f}"
        )


def start_pair(group: procs.ProcessGroup, args: argparse.Namespace) -> tuple[procs.Upstream, procs.Upstream]:
    extra = ["--max-model-len", str(args.max_model_len), "--profile", args.profile]
    if args.stream_interval != 1:
        extra += ["--stream-interval", str(args.stream_interval)]
    prefill = procs.start_emulator(
        group, "sglang", "prefill", time_scale=args.time_scale, extra=extra, wait=False
    )
    decode = procs.start_emulator(
        group, "sglang", "decode", time_scale=args.time_scale, extra=extra, wait=False
    )
    procs.wait_upstream(prefill)
    procs.wait_upstream(decode)
    return prefill, decode


def start_router(group: procs.ProcessGroup, prefill: str, bootstrap_port: int, decode: str) -> str:
    """sglang-router in P/D mode in front of the pair; its URL."""
    port, prom = procs.free_ports(2)
    argv = procs.sglang_router_argv(port, [(prefill, bootstrap_port)], [decode], prometheus_port=prom)
    router = group.add(procs.start_process("sglang-router", argv))
    url = f"http://{HOST}:{port}"
    router.wait_http(f"{url}/readiness", 60.0)
    return url


GATEWAYS = ("gateway", "gateway-noguards", "gateway-before-end")


def start_gateway(
    group: procs.ProcessGroup, prefill: str, bootstrap_port: int, decode: str, name: str, model: str
) -> str:
    """`pd-gateway serve` in front of the pair, as `name` (one of GATEWAYS) says; its URL."""
    port = procs.free_port()
    extra = ["--model", model]
    if name == "gateway-noguards":
        extra.append("--no-guards")
    elif name == "gateway-before-end":
        conf = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)
        with conf:
            conf.write('[guards]\nprefill_verdict = "before_end"\n')
        extra += ["--config", conf.name]
    argv = procs.gateway_argv("sglang", port, [(prefill, bootstrap_port)], [decode], extra=extra)
    gateway = group.add(procs.start_process(name, argv, cwd=procs.REPO_ROOT))
    url = f"http://{HOST}:{port}"
    gateway.wait_http(f"{url}/readiness", 90.0)
    return url


def parse_pair(value: str) -> tuple[str, int]:
    url, _, bport = value.rpartition(":")
    return url, int(bport)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.stream_bunching", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--via",
        action="append",
        default=[],
        help="direct, sglang-router, gateway, gateway-noguards, gateway-before-end or a front end URL (repeatable)",
    )
    p.add_argument(
        "--prefill", type=parse_pair, default=None, help="a running pair's prefill as URL:BOOTSTRAP_PORT"
    )
    p.add_argument("--decode", default=None, help="a running pair's decode URL")
    p.add_argument("--pair-url", action="store_true", help="start the pair, print its addresses, wait for ^C")
    p.add_argument("--route", choices=sorted(PATHS), default="chat")
    p.add_argument("--model", default="m", help="the served model's name (a started pair's too)")
    p.add_argument("--time-scale", type=float, default=0.5)
    p.add_argument("--profile", default="llama-3-8b-h100")
    p.add_argument("--max-model-len", type=int, default=65536)
    p.add_argument("--stream-interval", type=int, default=1)
    p.add_argument("--long", type=int, default=6, help="long prompts")
    p.add_argument("--long-tokens", type=int, default=40000)
    p.add_argument("--long-max-tokens", type=int, default=16)
    p.add_argument("--short", type=int, default=30, help="short streams")
    p.add_argument("--short-max-tokens", type=int, default=60)
    p.add_argument("--every", type=int, default=6, help="a long prompt every N requests")
    p.add_argument("--gap-ms", type=float, default=100.0, help="between request starts")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", default=None, help="write the figures here")
    return p


HOLD = "pdgw_prefill_verdict_hold_seconds"


async def verdict_holds(url: str) -> dict[str, dict[str, float]]:
    """A gateway's `pdgw_prefill_verdict_hold_seconds` after the run, by `held`: how many
    handoffs, how many held over 50 ms, and the bucket bound under which 99 % fell."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as r:
        text = await r.text()
    buckets: dict[str, list[tuple[float, float]]] = {}
    for line in text.splitlines():
        if line.startswith(HOLD + "_bucket{"):
            labels, _, value = line[len(HOLD) + 8 :].partition("} ")
            fields = dict(kv.split("=", 1) for kv in labels.split(","))
            held, le = fields["held"].strip('"'), fields["le"].strip('"')
            buckets.setdefault(held, []).append((float(le), float(value)))
    out = {}
    for held, bs in buckets.items():
        bs.sort()
        n = bs[-1][1]
        if not n:
            continue
        over_50ms = n - next(c for le, c in bs if le >= 0.05)
        p99 = next(le for le, c in bs if c >= 0.99 * n)
        out[held] = {"n": n, "over_50ms": over_50ms, "p99_le_s": p99}
    return out


async def measure(targets: list[tuple[str, Target]], args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for name, target in targets:
        records = await run_workload(target, args)
        s = summary(name, records)
        print_summary(s)
        if name in GATEWAYS and target.url is not None:
            s["verdict_hold"] = holds = await verdict_holds(target.url)
            for held, h in holds.items():
                print(
                    f"  verdict hold ({held})     {h['n']:.0f} handoffs, {h['over_50ms']:.0f} over 50 ms, "
                    f"p99 <= {h['p99_le_s'] * 1000:g} ms"
                )
        out.append(s)
    base = next((s for s in out if s["target"] == "direct"), None)
    if base is not None and base["ttft_ms"].get("n"):
        for s in out:
            if s is not base and s["ttft_ms"].get("n"):
                s["ttft_added_ms"] = {
                    k: s["ttft_ms"][k] - base["ttft_ms"][k] for k in ("median", "p90", "p99", "max")
                }
        print("\nTTFT added vs direct (same percentile), ms:")
        for s in out:
            if "ttft_added_ms" in s:
                a = s["ttft_added_ms"]
                print(f"  {s['target']}: median {a['median']:.0f}, p90 {a['p90']:.0f}, p99 {a['p99']:.0f}")
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    vias = args.via or ["direct", "sglang-router"]
    with procs.process_group() as group:
        if args.prefill is not None and args.decode is not None:
            prefill_url, bport = args.prefill
            pair = (prefill_url, bport, args.decode)
        else:
            p, d = start_pair(group, args)
            assert p.bootstrap_port is not None
            pair = (p.url, p.bootstrap_port, d.url)
            if args.pair_url:
                print(f"prefill {p.url} bootstrap {p.bootstrap_port}\ndecode {d.url}", flush=True)
                try:
                    while True:
                        time.sleep(3600)
                except KeyboardInterrupt:
                    return 0
        targets: list[tuple[str, Target]] = []
        for via in vias:
            if via == "direct":
                targets.append((via, Target(None, (pair[0], pair[1]), pair[2])))
            elif via == "sglang-router":
                url = start_router(group, *pair)
                targets.append((via, Target(url, None, None)))
            elif via in GATEWAYS:
                url = start_gateway(group, *pair, name=via, model=args.model)
                targets.append((via, Target(url, None, None)))
            else:
                targets.append((via, Target(via.rstrip("/"), None, None)))
        figures = asyncio.run(measure(targets, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args) | {"prefill": args.prefill}, "results": figures}, f, indent=2)
    return 0 if all(s["failed"] == 0 for s in figures) else 1


if __name__ == "__main__":
    sys.exit(main())
