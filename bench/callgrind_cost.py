"""Machine instructions per request of the gateway's Python path, counted by valgrind.

`bench.python_cost` times the gateway over in-memory transports; on a shared machine its
figures move by several percent between runs. This runs the same rig under valgrind's
callgrind twice, with `n` and `2n` measured requests after the same warm-up, and divides the
difference in instructions executed by `n`: start-up, imports and warm-up cancel out, and what
is left is every instruction one request costs in this process (the interpreter, msgspec,
httptools, uvloop, the allocator), not the kernel's part. The count is the same to a few
tenths of a percent from run to run, whatever else the machine is doing (the hash seed is
fixed): the figure to compare before and after a change to the request path. `--client
openai` sends the head the `openai` client sends (as `bench.perf_report` does).

    .venv/bin/python -m bench.callgrind_cost --engines sglang,vllm --modes nonstream,stream64
    .venv/bin/python -m bench.callgrind_cost --log-file /tmp/gw.log   # with an access-log line

Needs valgrind (`apt-get install valgrind`). About a minute per case.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def instructions(args: list[str], n: int, warmup: int) -> int:
    """Instructions callgrind counted for a whole `bench.python_cost` run of `n` requests."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        cmd = [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={out}",
            sys.executable,
            "-m",
            "bench.python_cost",
            *args,
            "-n",
            str(n),
            "--repeats",
            "1",
            "--warmup",
            str(warmup),
        ]
        # the same hash seed each run: set and dict layouts, and so the work, the same
        env = dict(os.environ, PYTHONHASHSEED=os.environ.get("PYTHONHASHSEED", "0"))
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        m = re.search(r"^(?:summary|totals): (\d+)", out.read_text(errors="replace"), re.M)
        if m is None:
            raise RuntimeError(f"no instruction total in {out}")
        return int(m.group(1))


def per_request(args: list[str], n: int, warmup: int) -> float:
    return (instructions(args, 2 * n, warmup) - instructions(args, n, warmup)) / n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="sglang,vllm")
    ap.add_argument("--modes", default="nonstream,stream64")
    ap.add_argument("-n", type=int, default=500, help="requests in the shorter run (default 500)")
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--target", choices=("gateway", "bare-pd"), default="gateway")
    ap.add_argument("--serve-args", default="")
    ap.add_argument("--apart", action="store_true")
    ap.add_argument("--log-file", default=None)
    ap.add_argument("--client", choices=("raw", "openai"), default="raw")
    ap.add_argument("--json", action="store_true", help="one JSON object per case instead of a line")
    ap.add_argument(
        "--processes", type=int, default=1, help="the gateway as one of this many processes (python_cost's)"
    )
    args = ap.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    for engine in args.engines.split(","):
        for mode in args.modes.split(","):
            rig = ["--engines", engine, "--modes", mode, "--target", args.target, "--client", args.client]
            if args.serve_args:
                rig.append(f"--serve-args={args.serve_args}")
            if args.apart:
                rig.append("--apart")
            if args.processes != 1:
                rig += ["--processes", str(args.processes)]
            if args.log_file:
                rig += ["--log-file", args.log_file]
            k = per_request(rig, args.n, args.warmup)
            if args.json:
                case = {"engine": engine, "mode": mode, "target": args.target, "count": "instructions"}
                print(json.dumps({**case, "per_request": k}))
                continue
            print(f"{args.target:8} {engine:7} {mode:10} instructions/request: {k / 1000:8.1f}k")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
