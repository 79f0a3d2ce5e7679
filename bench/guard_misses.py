"""What the KV-integrity guards miss: for every corrupting fault kind x engine x guards preset,
the share of answers delivered clean (HTTP 200, or a stream ended by `[DONE]`) with wrong tokens.

    python -m bench.guard_misses [--requests 400] [--fraction 0.2] [--kinds a,b] [--engines sglang,vllm]
                                 [--presets default,strict] [--guards shadow_fraction=0.02]

Each cell starts its own emulated P/D pair and a colocated worker of the engine behind one
gateway (all in this process, real sockets on 127.0.0.1), injects the fault into `--fraction` of
the prefill's (or decode's) requests, and sends `--requests` greedy completions, half of them
streamed, 64 at a time. Every answer is compared with a colocated reference emulator outside the
gateway. Presets: `default` (the shipped `[guards]`: a 5 % sample of greedy answers verified
before delivery, every one through a suspect pair), `strict` (`shadow_fraction = 1.0`,
`shadow_before_delivery = true`: every greedy answer verified by a colocated re-run before its
clean end), `before_end` (the defaults with `prefill_verdict = "before_end"`), `off`
(`--no-guards`: no length preflight, no decode consistency, `prefill_verdict = "before_end"`). The table
(markdown) goes to stdout; docs/guards.md quotes it. "last wrong" is the place, in the order
the answers came back, of the last one delivered wrong; "re-runs per 100 P/D" counts colocated
verification re-runs per 100 handoffs the prefill received. `--guards key=value,...` sets
`[guards]` values on every preset (a candidate default, e.g. `--guards shadow_fraction=0.02`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from typing import Any, Literal

import aiohttp
import msgspec

from common.workers import Engine, Role
from emulator.api import EmulatorHandle, EmulatorSpec, start_emulator
from gateway.app import Gateway
from gateway.config import GatewayConfig, GuardsConfig, HealthConfig, ListenConfig, WorkerConfig
from gateway.logging import configure

PROMPTS = [" ".join(f"w{(i * 7 + j) % 97}" for j in range(3 + (i * 13) % 120)) for i in range(40)]
MAX_TOKENS = 8
PRESETS = {
    "default": GuardsConfig(),
    "strict": GuardsConfig(shadow_fraction=1.0, shadow_before_delivery=True),
    # SGLang streams relayed before the prefill's verdict, checked before their end
    "before_end": GuardsConfig(prefill_verdict="before_end"),
    "off": GuardsConfig(length_preflight=False, decode_consistency=False, prefill_verdict="before_end"),
}
# fault kinds that corrupt a handoff, and which leg the emulator injects each into
KINDS = {
    "silent_truncation": "prefill",
    "wrong_request_kv": "prefill",
    "stale_kv_params": "prefill",
    "bogus_kv_params": "prefill",
    "abort_during_transfer": "prefill",
    "transfer_fail": "prefill",
}


def body(prompt: str, stream: bool) -> dict[str, Any]:
    return {
        "model": "m",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": stream,
        "ignore_eos": True,
    }


def answer(raw: bytes, stream: bool) -> tuple[str, bool]:
    """(text, ended cleanly)."""
    if not stream:
        return json.loads(raw)["choices"][0]["text"], True
    text, clean = "", False
    for line in raw.split(b"\n"):
        if not line.startswith(b"data: "):
            continue
        payload = line[6:]
        if payload == b"[DONE]":
            clean = True
            continue
        ev = json.loads(payload)
        if "error" in ev:
            return text, False
        for c in ev.get("choices", []):
            text += c.get("text") or ""
    return text, clean


class Cell:
    """One engine's P/D pair, colocated worker and reference, behind a gateway with `guards`."""

    def __init__(self, engine: str, guards: GuardsConfig) -> None:
        self.engine = engine
        self.guards = guards
        self.emus: dict[str, EmulatorHandle] = {}
        self.gw: Gateway | None = None

    async def __aenter__(self) -> Cell:
        e: Literal["sglang", "vllm"] = "sglang" if self.engine == "sglang" else "vllm"
        extra: dict[str, Any] = {"bootstrap_port": 0} if e == "sglang" else {"kv_port": 0}
        specs = {
            "prefill": EmulatorSpec(engine=e, role="prefill", model="m", **extra),
            "decode": EmulatorSpec(engine=e, role="decode", model="m"),
            "colocated": EmulatorSpec(engine=e, role="both", model="m"),
            "reference": EmulatorSpec(engine=e, role="both", model="m"),
        }
        self.emus = {n: await start_emulator(s) for n, s in specs.items()}
        roles = {"prefill": Role.PREFILL, "decode": Role.DECODE, "colocated": Role.COLOCATED}
        workers = tuple(
            WorkerConfig(
                url=self.emus[n].url,
                role=r,
                engine=Engine(e),
                id=n,
                bootstrap_port=self.emus[n].bootstrap_port if e == "sglang" and n == "prefill" else None,
            )
            for n, r in roles.items()
        )
        self.gw = Gateway(
            GatewayConfig(
                listen=ListenConfig(host="127.0.0.1", port=0),
                workers=workers,
                guards=self.guards,
                health=HealthConfig(interval_s=0.5, timeout_s=2.0),
            )
        )
        await self.gw.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.gw is not None:
            await self.gw.stop(grace_s=1.0)
        for h in self.emus.values():
            await h.stop()

    async def references(self, s: aiohttp.ClientSession) -> dict[str, str]:
        out = {}
        for p in PROMPTS:
            async with s.post(self.emus["reference"].url + "/v1/completions", json=body(p, False)) as r:
                out[p] = answer(await r.read(), False)[0]
        return out

    async def run(self, kind: str, fraction: float, n: int, seed: int) -> Counter[str]:
        assert self.gw is not None
        outcomes: Counter[str] = Counter()
        rng = random.Random(seed)
        sem = asyncio.Semaphore(64)
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64), timeout=timeout) as s:
            refs = await self.references(s)
            await self.emus[KINDS[kind]].set_faults([f"{kind}:{fraction}"])
            url = self.gw.url + "/v1/completions"

            async def one(i: int) -> None:
                prompt, stream = rng.choice(PROMPTS), i % 2 == 1
                async with sem, s.post(url, json=body(prompt, stream)) as r:
                    raw = await r.read()
                outcomes["answered"] += 1  # this answer's place in the order they came back
                if r.status != 200:
                    outcomes["error"] += 1
                    return
                text, clean = answer(raw, stream)
                if not clean:
                    outcomes["error"] += 1  # an error event instead of [DONE]: not delivered as whole
                elif text == refs[prompt]:
                    outcomes["correct"] += 1
                else:
                    outcomes["wrong"] += 1
                    outcomes["last_wrong"] = outcomes["answered"]

            await asyncio.gather(*(one(i) for i in range(n)))
        metrics = self.gw.metrics.render().decode()
        outcomes["caught"] = int(guard_failures(metrics))
        outcomes["reruns"] = int(_sum(metrics, "pdgw_shadow_runs_total{", exclude='outcome="unavailable"'))
        outcomes["prefills"] = int((await self.emus["prefill"].stats())["received"])
        return outcomes


def _sum(metrics: str, prefix: str, exclude: str | None = None) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith(prefix) and (exclude is None or exclude not in line)
    )


def guard_failures(metrics: str) -> float:
    """The sum of `pdgw_guard_failures_total`: handoffs the guards caught."""
    return _sum(metrics, "pdgw_guard_failures_total{")


async def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for engine in args.engines:
        for kind in args.kinds:
            for preset in args.presets:
                t0 = time.monotonic()
                # `--seed` also seeds the verification sampler: which answers are re-run
                guards = msgspec.structs.replace(PRESETS[preset], **{"shadow_seed": args.seed, **args.guards})
                async with Cell(engine, guards) as cell:
                    got = await cell.run(kind, args.fraction, args.requests, args.seed)
                injected = args.fraction * args.requests
                rows.append(
                    {
                        "kind": kind,
                        "engine": engine,
                        "preset": preset,
                        "requests": args.requests,
                        "correct": got["correct"],
                        "error": got["error"],
                        "wrong": got["wrong"],
                        "caught": got["caught"],
                        # answers in the order they came back: the last wrong one's place (0: none)
                        "last_wrong": got["last_wrong"],
                        # colocated verification re-runs per 100 handoffs the prefill received
                        "reruns_per_100": round(100 * got["reruns"] / got["prefills"], 1)
                        if got["prefills"]
                        else 0.0,
                        "miss_rate": got["wrong"] / injected if injected else 0.0,
                        "seconds": round(time.monotonic() - t0, 1),
                    }
                )
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict[str, Any]], fraction: float) -> str:
    out = [
        f"| fault kind ({fraction:.0%} of requests) | engine | guards | delivered wrong | guards caught | clear error | correct | miss rate | last wrong | re-runs per 100 P/D |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        last = f"#{r['last_wrong']}" if r["last_wrong"] else "—"
        out.append(
            f"| `{r['kind']}` | {r['engine']} | {r['preset']} | {r['wrong']} of {r['requests']} | "
            f"{r['caught']} | {r['error']} | {r['correct']} | {r['miss_rate']:.1%} | {last} | "
            f"{r['reruns_per_100']:.1f} |"
        )
    return "\n".join(out)


def _overrides(v: str) -> dict[str, Any]:
    """`key=value,...` of `[guards]` fields, each value read as JSON (else as a string)."""
    out: dict[str, Any] = {}
    for item in filter(None, v.split(",")):
        key, _, raw = item.partition("=")
        if key not in GuardsConfig.__struct_fields__:
            raise argparse.ArgumentTypeError(f"no [guards] setting {key!r}")
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.guard_misses", description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--fraction", type=float, default=0.2, help="share of requests the fault hits")
    ap.add_argument("--kinds", type=lambda v: v.split(","), default=list(KINDS))
    ap.add_argument("--engines", type=lambda v: v.split(","), default=["sglang", "vllm"])
    ap.add_argument("--presets", type=lambda v: v.split(","), default=list(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--guards",
        type=_overrides,
        default={},
        help="`[guards]` values set on every preset, e.g. shadow_fraction=0.1 (to measure a candidate)",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    for k in args.kinds:
        if k not in KINDS:
            ap.error(f"unknown kind {k!r}; known: {', '.join(KINDS)}")
    configure("error", json=False)  # each caught corruption logs a warning: not this table's
    rows = asyncio.run(measure(args))
    print(table(rows, args.fraction))
    return 0


if __name__ == "__main__":
    sys.exit(main())
