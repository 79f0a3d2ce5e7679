"""``pd-gateway emulate``: run one emulated SGLang or vLLM server."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import logging
import signal
import sys

from emulator.faults import FaultSpecError, parse_fault
from emulator.profiles import DEFAULT_PROFILE, PROFILES
from emulator.spec import EmulatorSpec


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pd-gateway emulate", description="Run an emulated SGLang or vLLM server."
    )
    p.add_argument("--engine", choices=["sglang", "vllm"], required=True)
    p.add_argument("--role", choices=["prefill", "decode", "both"], required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument(
        "--bootstrap-port", type=int, default=None, help="SGLang prefill bootstrap port (default 8998)"
    )
    p.add_argument(
        "--kv-port", type=int, default=None, help="KV transfer port of a prefill (vLLM remote_port)"
    )
    p.add_argument("--model", default="meta-llama/Meta-Llama-3-8B-Instruct")
    p.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES))
    p.add_argument(
        "--time-scale", type=float, default=1.0, help="multiplies every modelled delay; 0 = zero-delay"
    )
    p.add_argument(
        "--fault", action="append", default=[], metavar="SPEC", help="KIND[:FRACTION][,key=value...]"
    )
    p.add_argument(
        "--kv-events",
        default=None,
        metavar="tcp://127.0.0.1:PORT",
        help="ZMQ PUB endpoint (replay on PORT+1)",
    )
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--max-total-tokens", type=int, default=None, help="KV pool size in tokens (default: from profile)"
    )
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--kv-scale", type=int, default=1024, help="KV payload on the wire = real size / this")
    p.add_argument(
        "--waiting-timeout", type=float, default=None, help="SGLang decode KV wait (default 300 s)"
    )
    p.add_argument("--handshake-timeout", type=float, default=5.0)
    _engine_flags(p)
    p.add_argument("--log-level", default="warning")
    return p


def _engine_flags(p: argparse.ArgumentParser) -> None:
    """The flags named as the real engines name them."""
    p.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="SGLang: tokens per stream event (the engine's own flag; the rest comes at the end)",
    )
    p.add_argument(
        "--stop-checks-first",
        action="store_true",
        help="vLLM: stop token ids end a sequence before its length cap does (newer vLLM; 0.32 "
        "caps length first): a P/D prefill stopped on its one token hands over no KV",
    )
    p.add_argument(
        "--enable-cache-report",
        action="store_true",
        help="SGLang's own flag: the OpenAI routes report a prompt's cached tokens in "
        "usage.prompt_tokens_details.cached_tokens (left out when 0, as SGLang does)",
    )
    p.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="vLLM's own flag: usage.prompt_tokens_details.cached_tokens when a prompt found "
        "cached tokens (left out when 0, as vLLM does)",
    )
    p.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        help="vLLM's own flag: the most sample logprobs a request may ask for (-1: no cap)",
    )
    p.add_argument(
        "--ssl-certfile",
        default=None,
        help="serve the HTTP API over TLS with this certificate (PEM), as the engines' own flag",
    )
    p.add_argument("--ssl-keyfile", default=None, help="the certificate's private key (PEM)")
    p.add_argument(
        "--api-key",
        default=None,
        help="ask for `Authorization: Bearer KEY` as the engine's own flag does (SGLang: all but "
        "/health and /metrics; vLLM: /v1 paths)",
    )


def spec_from_args(args: argparse.Namespace) -> EmulatorSpec:
    return EmulatorSpec(
        engine=args.engine,
        role=args.role,
        host=args.host,
        port=args.port,
        bootstrap_port=args.bootstrap_port,
        kv_port=args.kv_port,
        model=args.model,
        profile=args.profile,
        time_scale=args.time_scale,
        faults=list(args.fault),
        kv_events=args.kv_events,
        max_model_len=args.max_model_len,
        seed=args.seed,
        max_total_tokens=args.max_total_tokens,
        block_size=args.block_size,
        kv_scale=args.kv_scale,
        waiting_timeout_s=args.waiting_timeout,
        handshake_timeout_s=args.handshake_timeout,
        stream_interval=args.stream_interval,
        stop_checks_first=args.stop_checks_first,
        max_logprobs=args.max_logprobs,
        enable_cache_report=args.enable_cache_report,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        api_key=args.api_key,
    )


async def serve(spec: EmulatorSpec) -> int:
    from emulator.api import start_emulator

    handle = await start_emulator(spec)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    extra = f" bootstrap={handle.bootstrap_port}" if handle.bootstrap_port else ""
    extra += f" kv={handle.kv_port}" if handle.kv_port else ""
    print(f"emulated {spec.engine} {spec.role} listening on {handle.url}{extra}", flush=True)
    dead_poll = 0.2
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), dead_poll)
        if handle.dead:
            print("emulated engine core died; exiting", file=sys.stderr, flush=True)
            await handle.stop()
            return 1
    await handle.stop()
    return 0


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if importlib.util.find_spec("aiohttp") is None:
        print(
            "pd-gateway emulate: the emulator needs its extra: pip install 'pd-gateway[emulator]'",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        for f in args.fault:
            parse_fault(f)
    except FaultSpecError as e:
        print(f"pd-gateway emulate: {e}", file=sys.stderr)
        return 2
    spec = spec_from_args(args)
    try:
        import uvloop

        return int(uvloop.run(serve(spec)))
    except ImportError:
        return asyncio.run(serve(spec))
