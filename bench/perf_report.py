"""Before/after cost per request of the gateway's hot paths: a git revision against the working tree.

Each side runs `bench.python_cost` (the real gateway over in-memory transports) in a child
process, with the same rig: a revision is exported with `git archive` into a temporary folder
and this tree's `bench/` is laid over it, so only the gateway's code differs between the two.
What is compared (`--count`):

- `bytecodes` (default): Python bytecodes executed per request. Moves by ~0.2 % between runs
  whatever the machine is doing, so a trim of 1 % shows; C code and the kernel are not in it.
- `calls`: Python frames entered per request (calls and coroutine resumptions, `sys.setprofile`):
  the same from run to run; the number of calls a fold of bookkeeping removes.
- `instructions`: every machine instruction of the process per request, under valgrind's
  callgrind (`bench.callgrind_cost`): interpreter, msgspec, httptools, uvloop, allocator. Also
  steady to a few tenths of a percent; about a minute per case and side.
- `time`: CPU µs per request (`time.process_time`), the sides interleaved `--rounds` times,
  each the median of its rounds; pinned with `taskset -c 0` where there is one. Noisy on a
  shared machine: the figure the other two stand for.

    .venv/bin/python -m bench.perf_report                    # HEAD against the working tree
    .venv/bin/python -m bench.perf_report --base main --count instructions
    .venv/bin/python -m bench.perf_report --base HEAD~1 --after HEAD   # one commit's change
    make perf-report PERF_ARGS="--base main"                 # the same, from make
    pd-gateway bench cost --base main                        # and from the CLI
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# (label, python_cost flags): serve's defaults each time, requests with the `openai` client's
# head; "logged" writes serve's default access-log line (info) per request to a file; "apart"
# feeds a stream event by event
CASES: dict[str, list[str]] = {
    "sglang nonstream": ["--engines", "sglang", "--modes", "nonstream"],
    "sglang stream64": ["--engines", "sglang", "--modes", "stream64"],
    "sglang stream64 apart": ["--engines", "sglang", "--modes", "stream64", "--apart"],
    "sglang nonstream logged": ["--engines", "sglang", "--modes", "nonstream", "--log-file", "{log}"],
    "vllm nonstream": ["--engines", "vllm", "--modes", "nonstream"],
    "vllm stream64": ["--engines", "vllm", "--modes", "stream64"],
    "vllm stream64 apart": ["--engines", "vllm", "--modes", "stream64", "--apart"],
}
UNITS = {
    "bytecodes": "bytecodes/request",
    "calls": "Python calls/request",
    "instructions": "instructions/request",
    "time": "CPU µs/request",
}


@contextmanager
def revision_tree(rev: str) -> Iterator[Path]:
    """`rev`'s files in a temporary folder, with this tree's `bench/` over them."""
    with tempfile.TemporaryDirectory(prefix="perf-report-") as tmp:
        dest = Path(tmp)
        archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True).stdout
        tar_path = dest / ".rev.tar"
        tar_path.write_bytes(archive)
        with tarfile.open(tar_path) as tar:
            tar.extractall(dest, filter="data")
        tar_path.unlink()
        shutil.rmtree(dest / "bench", ignore_errors=True)
        shutil.copytree(ROOT / "bench", dest / "bench", ignore=shutil.ignore_patterns("__pycache__"))
        yield dest


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONHASHSEED="0", PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONPATH", None)
    return env


def measure(tree: Path, flags: list[str], count: str, n: int, warmup: int, log: str) -> float:
    """One side's figure for one case: a child process run in `tree` (whose folder comes first
    on its `sys.path`, so its `gateway` is the one measured)."""
    flags = [f.replace("{log}", log) for f in flags] + ["--client", "openai"]
    if count == "instructions":
        cmd = [
            sys.executable,
            "-m",
            "bench.callgrind_cost",
            *flags,
            "-n",
            str(n),
            "--warmup",
            str(warmup),
            "--json",
        ]
    else:
        cmd = [sys.executable, "-m", "bench.python_cost", *flags, "-n", str(n), "--repeats", "1"]
        cmd += ["--warmup", str(warmup), "--json"]
        if count in ("bytecodes", "calls"):
            cmd += ["--count", count]
        elif shutil.which("taskset"):
            cmd = ["taskset", "-c", "0", *cmd]
    out = subprocess.run(cmd, cwd=tree, env=_env(), check=True, capture_output=True, text=True).stdout
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if len(results) != 1:
        raise RuntimeError(f"expected one result from {' '.join(cmd)}, got: {out[-500:]}")
    r: dict[str, Any] = results[0]
    return float(r["per_request"] if "per_request" in r else r["us_per_request"][0])


@contextmanager
def working_tree() -> Iterator[Path]:
    yield ROOT


def report(
    base: str, after_rev: str | None, count: str, cases: list[str], n: int, warmup: int, rounds: int
) -> list[tuple[str, float, float]]:
    rows: list[tuple[str, float, float]] = []
    with (
        revision_tree(base) as before,
        revision_tree(after_rev) if after_rev else working_tree() as after,
        tempfile.TemporaryDirectory(prefix="perf-report-log-") as logs,
    ):
        for case in cases:
            log = str(Path(logs) / "access.log")
            sides: dict[str, list[float]] = {"before": [], "after": []}
            for _ in range(rounds if count == "time" else 1):
                sides["before"].append(measure(before, CASES[case], count, n, warmup, log))
                sides["after"].append(measure(after, CASES[case], count, n, warmup, log))
            b, a = statistics.median(sides["before"]), statistics.median(sides["after"])
            rows.append((case, b, a))
            print(f"{case:26} {b:12.1f} {a:12.1f} {100 * (a - b) / b:+8.2f} %", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="the git revision to compare against (default HEAD)")
    ap.add_argument("--after", default=None, help="a git revision instead of the working tree")
    ap.add_argument("--count", choices=tuple(UNITS), default="bytecodes")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    ap.add_argument(
        "-n", type=int, default=None, help="measured requests (bytecodes 300, instructions 300, time 5000)"
    )
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3, help="time: interleaved rounds per side")
    args = ap.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    if args.count == "instructions" and shutil.which("valgrind") is None:
        print("--count instructions needs valgrind (apt-get install valgrind)", file=sys.stderr)
        return 2
    n = args.n or (5000 if args.count == "time" else 300)
    names = []
    for r in (args.base, args.after):
        if r is None:
            names.append("the working tree")
            continue
        rev = subprocess.run(["git", "rev-parse", "--short", r], cwd=ROOT, capture_output=True, text=True)
        if rev.returncode != 0:
            print(f"perf_report: unknown revision {r!r}", file=sys.stderr)
            return 2
        names.append(f"{r} ({rev.stdout.strip()})")
    print(f"{UNITS[args.count]}: {names[0]} against {names[1]}, n={n}")
    print(f"{'case':26} {'before':>12} {'after':>12} {'change':>10}")
    report(args.base, args.after, args.count, cases, n, args.warmup, args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
