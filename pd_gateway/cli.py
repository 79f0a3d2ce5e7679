"""The `pd-gateway` console script: one entry point, one subcommand per tool.

Each subcommand lives in its own module and is imported only when chosen, so
`pd-gateway emulate` never imports the gateway and vice versa.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# subcommand -> (module, one-line help). Each module exposes `main(argv) -> int`.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("gateway.serve", "run the gateway in front of SGLang / vLLM / OpenAI-compatible workers"),
    "emulate": ("emulator.cli", "run an emulated SGLang or vLLM server (prefill, decode or both)"),
    "demo": ("pd_gateway.demo", "the gateway in front of an embedded emulated P/D cluster"),
    "bench": ("bench.cli", "benchmarks: gateway overhead, side by side with the Rust routers"),
}


def usage() -> str:
    lines = ["usage: pd-gateway <command> [options]", "", "commands:"]
    for name, (_, text) in SUBCOMMANDS.items():
        lines.append(f"  {name:<9} {text}")
    lines.append("")
    lines.append("`pd-gateway <command> --help` describes each command's options.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"pd-gateway: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    result: int = module.main(rest)
    return result


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
