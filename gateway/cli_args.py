"""`pd-gateway serve` flags, read like sglang-router's, merged over an optional TOML file.

    pd-gateway serve --prefill http://p1:30000 8998 --prefill http://p2:30000 none \\
        --decode http://d1:30001 --worker http://c1:8000 --engine sglang --policy least_load

Merge rules: `--config FILE` is read first. Workers given by flags (`--prefill`, `--decode`,
`--worker`) are **appended** to the file's `workers`; every other flag **replaces** the file's
value. `--engine` and `--model` apply only to the workers given by flags. For an SGLang
`--prefill URL` without a port the bootstrap port is SGLang's default, 8998; `none` means the
prefill has no bootstrap server. The merged document is decoded and validated once, so a flag
error reads like a file error.

sglang-router's and vllm-router's other flags are accepted too (`gateway/router_flags.py`): mapped
to a setting, or ignored / refused with a reason (`parse_serve_command` returns the notes).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import Any, get_args

import msgspec

from common.workers import Engine
from gateway.config import (
    PHASE_TIMEOUTS,
    SGLANG_DEFAULT_BOOTSTRAP_PORT,
    ConfigError,
    GatewayConfig,
    ListenConfig,
    LogLevel,
    TimeoutsConfig,
    WorkerConfig,
    config_from_raw,
    normalize_raw,
    read_toml,
)
from gateway.router_flags import add_router_flags, apply_router_flags, prepare_router_flags
from policies.config import DeciderCfg, policy_shorthand

_LOG_LEVELS = get_args(LogLevel)
# the defaults the flags' help names are the configuration's own (gateway/config.py)
_LISTEN = ListenConfig()
_DECIDER = DeciderCfg()
_ENGINE: Engine = next(f.default for f in msgspec.structs.fields(WorkerConfig) if f.name == "engine")


def build_serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pd-gateway serve",
        description="Run the gateway in front of SGLang / vLLM / OpenAI-compatible workers.",
        epilog="Workers given by flags are appended to the config file's workers; other flags replace "
        "the file's values.",
    )
    w = p.add_argument_group("workers")
    w.add_argument(
        "--prefill",
        nargs="+",
        action="append",
        default=[],
        metavar=("URL", "BOOTSTRAP_PORT"),
        help=f"a prefill worker, with its SGLang bootstrap port (default {SGLANG_DEFAULT_BOOTSTRAP_PORT} for "
        "sglang; 'none' for none)",
    )
    w.add_argument("--decode", action="append", default=[], metavar="URL", help="a decode worker")
    w.add_argument("--worker", action="append", default=[], metavar="URL", help="a colocated worker")
    w.add_argument(
        "--engine",
        choices=[e.value for e in Engine],
        default=None,
        help=f"engine of the workers given by flags (default: {_ENGINE.value}; vllm with "
        "--vllm-pd-disaggregation)",
    )
    w.add_argument(
        "--model", default=None, help="model served by the workers given by flags (default: probed)"
    )
    w.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        metavar="N",
        help="vocabulary size of the workers given by flags: prompts of token ids outside it are "
        "a 400 (SGLang does not check them and dies)",
    )

    s = p.add_argument_group("server")
    s.add_argument(
        "--config", default=None, metavar="FILE", help="TOML config file (see docs/configuration.md)"
    )
    s.add_argument("--host", default=None, help=f"listen address (default {_LISTEN.host})")
    s.add_argument("--port", type=int, default=None, help=f"listen port (default {_LISTEN.port})")
    s.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help=f"gateway processes on the port (listen.processes, default {_LISTEN.processes}): one core "
        "each; in-flight counts, breakers, admin and metrics span them (docs/operations.md)",
    )
    s.add_argument("--log-level", choices=(*_LOG_LEVELS, "warn"), default=None)  # warn: sglang-router's
    s.add_argument("--log-json", action=argparse.BooleanOptionalAction, default=None, help="JSON log lines")

    r = p.add_argument_group("routing")
    for flag in ("--policy", "--prefill-policy", "--decode-policy"):
        r.add_argument(
            flag,
            default=None,
            metavar="NAME",
            help="round_robin | random | least_load | power_of_two | session_affinity | cache_aware | plugin:NAME"
            + ("" if flag == "--policy" else " (default: --policy)"),
        )
    r.add_argument(
        "--min-prefill-tokens",
        type=int,
        default=None,
        metavar="N",
        help="disaggregate only prompts of at least this many tokens (less any the policy knows to be cached "
        f"on the decode: the built-in policies assume none); default {_DECIDER.min_prefill_tokens}: always",
    )
    r.add_argument(
        "--decider",
        default=None,
        choices=("threshold", "always", "never", "cost_model"),
        help="disaggregate or not, per request (docs/policies.md, Deciders); default "
        f"{_DECIDER.type}; cost_model weighs each alternative's predicted TTFT and TPOT",
    )
    r.add_argument(
        "--tokenizer",
        default=None,
        metavar="KIND[:PATH]",
        help="the routing tokenizer ([tokenizer]): emulator | hf:PATH (the model's tokenizer.json) | "
        "none; text prompts' ids for cache_aware's precise index (workers with KV events)",
    )
    for flag, key in (("--ttft-slo-s", "ttft_slo_s"), ("--tpot-slo-s", "tpot_slo_s")):
        r.add_argument(
            flag,
            type=float,
            default=None,
            metavar="S",
            help=f"the cost_model decider's SLO (default {getattr(_DECIDER, key)})",
        )

    k = p.add_argument_group("limits")
    k.add_argument(
        "--request-timeout-s",
        type=float,
        default=None,
        metavar="S",
        help="whole-request timeout (timeouts.total_s); lowers larger phase timeouts to it",
    )
    k.add_argument(
        "--max-concurrent",
        type=int,
        default=None,
        metavar="N",
        help="requests in flight (limits.max_concurrent)",
    )
    k.add_argument(
        "--guards",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="KV-integrity guards (length preflight, decode consistency); --no-guards turns them off "
        "and checks the prefill's verdict before a stream's end, not its first byte",
    )
    k.add_argument(
        "--admin-token-env",
        default=None,
        metavar="VAR",
        help="enable the admin API with this env var's token",
    )
    add_router_flags(p)
    return p


def _prefill_worker(
    values: list[str], engine: Engine, model: str | None, vocab: int | None
) -> dict[str, Any]:
    if len(values) > 2:
        raise ConfigError(f"--prefill takes URL [BOOTSTRAP_PORT|none], got {' '.join(values)}")
    url = values[0]
    worker: dict[str, Any] = {"url": url, "role": "prefill", "engine": engine.value}
    if len(values) == 2:
        port = values[1]
        if port.lower() != "none":
            try:
                worker["bootstrap_port"] = int(port)
            except ValueError:
                raise ConfigError(
                    f"--prefill {url}: bootstrap port {port!r} is not a number or 'none'"
                ) from None
    elif engine is Engine.SGLANG:
        worker["bootstrap_port"] = SGLANG_DEFAULT_BOOTSTRAP_PORT
    if model is not None:
        worker["model"] = model
    if vocab is not None:
        worker["vocab_size"] = vocab
    return worker


def merge_args(raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Apply parsed flags over a raw (file) document: workers appended, scalars replaced."""
    doc = normalize_raw(raw)
    engine = Engine(args.engine or _ENGINE.value)
    vocab = getattr(args, "vocab_size", None)
    flag_workers: list[dict[str, Any]] = [_prefill_worker(v, engine, args.model, vocab) for v in args.prefill]
    for role, urls in (("decode", args.decode), ("colocated", args.worker)):
        for url in urls:
            worker: dict[str, Any] = {"url": url, "role": role, "engine": engine.value}
            if args.model is not None:
                worker["model"] = args.model
            if vocab is not None:
                worker["vocab_size"] = vocab
            flag_workers.append(worker)
    if flag_workers:
        doc["workers"] = [*doc.get("workers", []), *flag_workers]

    def section(name: str) -> dict[str, Any]:
        current = doc.get(name, {})
        table = dict(current) if isinstance(current, dict) else current
        doc[name] = table
        return table  # a non-table here fails decoding with the key's path

    if args.host is not None:
        section("listen")["host"] = args.host
    if args.port is not None:
        section("listen")["port"] = args.port
    if args.workers is not None:
        section("listen")["processes"] = args.workers
    if args.log_level is not None:
        doc["log_level"] = args.log_level
    if args.log_json is not None:
        doc["log_json"] = args.log_json
    for key in ("policy", "prefill_policy", "decode_policy"):
        value = getattr(args, key)
        if value is not None:
            doc[key] = policy_shorthand(value)
    if args.guards is not None:
        guards = section("guards")
        for key in ("length_preflight", "decode_consistency"):
            guards[key] = args.guards
        # guards off: nothing is held for the prefill's verdict either (it is still checked,
        # before the stream's end)
        guards["prefill_verdict"] = "before_first_byte" if args.guards else "before_end"
    if args.min_prefill_tokens is not None:
        section("decider")["min_prefill_tokens"] = args.min_prefill_tokens
    for key in ("decider", "ttft_slo_s", "tpot_slo_s"):
        value = getattr(args, key)
        if value is not None:
            section("decider")["type" if key == "decider" else key] = value
    if args.request_timeout_s is not None:
        if not (args.request_timeout_s > 0 and math.isfinite(args.request_timeout_s)):
            # checked here: below it would be copied into the phase limits and named after them
            raise ConfigError(
                f"--request-timeout-s must be a positive number of seconds, got {args.request_timeout_s!r}"
            )
        timeouts = section("timeouts")
        timeouts["total_s"] = args.request_timeout_s
        # a shorter whole-request limit lowers the phase limits above it instead of failing
        # their "<= total_s" check; phase limits below it are kept
        defaults = TimeoutsConfig()
        for name in PHASE_TIMEOUTS:
            current = timeouts.get(name, getattr(defaults, name)) if isinstance(timeouts, dict) else None
            if isinstance(current, int | float) and current > args.request_timeout_s:
                timeouts[name] = args.request_timeout_s
    if args.max_concurrent is not None:
        section("limits")["max_concurrent"] = args.max_concurrent
    if args.tokenizer is not None:
        _tokenizer_flag(doc, args.tokenizer)
    if args.admin_token_env is not None:
        admin = section("admin")
        admin.pop("token", None)  # the flag replaces whatever the file chose
        admin["token_env"] = args.admin_token_env
    return doc


def _tokenizer_flag(doc: dict[str, Any], value: str) -> None:
    """`--tokenizer KIND[:PATH]` replaces the file's [tokenizer] kind and path, keeping its other
    keys (`none`: removes the section)."""
    kind, _, path = value.partition(":")
    if kind == "none" and not path:
        doc.pop("tokenizer", None)
        return
    if kind not in ("emulator", "hf") or (kind == "hf") != bool(path):
        raise ConfigError(f"--tokenizer takes emulator, hf:PATH or none, got {value!r}")
    current = doc.get("tokenizer")
    table = dict(current) if isinstance(current, dict) else {}
    table["kind"] = kind
    if path:
        table["path"] = path
    else:
        table.pop("path", None)
    doc["tokenizer"] = table


def parse_serve_args(argv: Sequence[str]) -> GatewayConfig:
    """Flags (and `--config FILE`) to a validated config. Raises ConfigError; argparse exits on bad syntax."""
    return parse_serve_command(argv)[0]


def parse_serve_command(argv: Sequence[str]) -> tuple[GatewayConfig, list[str]]:
    """As `parse_serve_args`, with the notes on router flags that were ignored or mapped loosely."""
    args = build_serve_parser().parse_args(list(argv))
    notes = prepare_router_flags(args)
    raw = read_toml(args.config) if args.config is not None else {}
    source = f"{args.config} + flags" if args.config is not None else "flags"
    doc = merge_args(raw, args)
    apply_router_flags(doc, args, notes, len(args.prefill) + len(args.decode) + len(args.worker))
    return config_from_raw(doc, source), notes
