"""`pd-gateway demo` (and `make run`): the gateway in front of an embedded emulated cluster.

Starts, in this process: an SGLang prefill + decode pair serving `demo-sglang`, a vLLM prefill +
decode pair serving `demo-vllm`, and one colocated vLLM-protocol worker serving `demo-colocated`,
all emulated (a Llama-3-8B-on-H100 timing profile, time scale 0.05 so answers come quickly), and
the gateway on 127.0.0.1:8000 in front of them. Runs until Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from collections.abc import Sequence

import msgspec

from common.workers import Engine, Role
from emulator.api import EmulatorHandle, EmulatorSpec, start_emulator
from emulator.tokenizer import VOCAB_SIZE
from gateway.app import Gateway
from gateway.config import GatewayConfig, ListenConfig, WorkerConfig
from gateway.logging import configure
from gateway.serve import install_uvloop

EXAMPLES = """
Try it:

  curl -s {url}/v1/models | python3 -m json.tool

  curl -s {url}/v1/chat/completions -H 'content-type: application/json' \\
       -d '{{"model": "demo-sglang", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 16}}'

  curl -sN {url}/v1/completions -H 'content-type: application/json' \\
       -d '{{"model": "demo-vllm", "prompt": "Once upon a time", "max_tokens": 24, "stream": true}}'

  python3 - <<'PY'
  from openai import OpenAI
  client = OpenAI(base_url="{url}/v1", api_key="unused")
  r = client.chat.completions.create(model="demo-sglang", messages=[{{"role": "user", "content": "Hi"}}], max_tokens=16)
  print(r.choices[0].message.content)
  PY

Metrics: {url}/metrics   Readiness: {url}/readiness   Ctrl-C stops everything.
"""


async def start_cluster(
    time_scale: float, profile: str | None
) -> tuple[list[EmulatorHandle], list[WorkerConfig]]:
    specs = [
        (
            "sglang-prefill",
            EmulatorSpec(
                engine="sglang",
                role="prefill",
                model="demo-sglang",
                bootstrap_port=0,
                time_scale=time_scale,
            ),
        ),
        (
            "sglang-decode",
            EmulatorSpec(engine="sglang", role="decode", model="demo-sglang", time_scale=time_scale),
        ),
        (
            "vllm-prefill",
            EmulatorSpec(engine="vllm", role="prefill", model="demo-vllm", kv_port=0, time_scale=time_scale),
        ),
        (
            "vllm-decode",
            EmulatorSpec(engine="vllm", role="decode", model="demo-vllm", time_scale=time_scale),
        ),
        (
            "colocated",
            EmulatorSpec(engine="vllm", role="both", model="demo-colocated", time_scale=time_scale),
        ),
    ]
    handles: list[EmulatorHandle] = []
    workers: list[WorkerConfig] = []
    roles = {"prefill": Role.PREFILL, "decode": Role.DECODE, "both": Role.COLOCATED}
    for name, spec in specs:
        if profile:
            spec = msgspec.structs.replace(spec, profile=profile)
        h = await start_emulator(spec)
        handles.append(h)
        engine = Engine(spec.engine)
        role = roles[spec.role]
        workers.append(
            WorkerConfig(
                url=h.url,
                role=role,
                engine=engine,
                id=name,
                bootstrap_port=h.bootstrap_port if engine is Engine.SGLANG and role is Role.PREFILL else None,
                # the emulator's tokenizer: a prompt id beyond it would kill an emulated SGLang
                # worker for good, as it kills the real one (a 400 from the gateway instead)
                vocab_size=VOCAB_SIZE,
            )
        )
    return handles, workers


async def amain(host: str, port: int, time_scale: float, profile: str | None) -> None:
    handles, workers = await start_cluster(time_scale, profile)
    gw = Gateway(GatewayConfig(listen=ListenConfig(host=host, port=port), workers=tuple(workers)))
    await gw.start()
    print(f"pd-gateway demo: gateway on {gw.url} in front of {len(handles)} emulated workers")
    for w, h in zip(workers, handles, strict=True):
        print(f"  {w.worker_id:<15} {w.engine.value:<7} {w.role.value:<10} {h.url}")
    print(EXAMPLES.format(url=gw.url))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await gw.stop(grace_s=5.0)
        for h in handles:
            await h.stop()


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="pd-gateway demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    listen = ListenConfig()  # the gateway's own defaults
    ap.add_argument("--host", default=listen.host)
    ap.add_argument("--port", type=int, default=listen.port)
    ap.add_argument("--time-scale", type=float, default=0.05, help="emulator delay scale (0 = no delays)")
    ap.add_argument(
        "--profile", default=None, help="emulator timing profile (see `pd-gateway emulate --help`)"
    )
    ap.add_argument("--log-level", default="warning")
    args = ap.parse_args(list(argv))
    configure(args.log_level)
    install_uvloop()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(amain(args.host, args.port, args.time_scale, args.profile))
    return 0
