"""`pd-gateway bench`: benchmark subcommands (each module exposes `main(argv) -> int`)."""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "overhead": (
        "bench.overhead",
        "CPU per request and added latency of the gateway vs sglang-router and vllm-router",
    ),
    "cache-decision": (
        "bench.cache_decision",
        "cache_aware's decision time (8 to 1,000 workers, millions of blocks) and index memory",
    ),
    "cost": (
        "bench.perf_report",
        "hot-path cost per request (bytecodes, instructions or CPU time), a git revision vs the work tree",
    ),
    "replay": (
        "bench.replay.main",
        "trace replay: goodput under SLOs, TTFT/TPOT, cache hits and load spread per router",
    ),
}


def usage() -> str:
    lines = ["usage: pd-gateway bench <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "`pd-gateway bench <command> --help` lists each command's options."]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], list(argv[1:])
    if name not in COMMANDS:
        print(f"pd-gateway bench: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    result: int = module.main(rest)
    return result


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(sys.argv[1:]))
