"""What the deployment tests share: the repository's deploy files, compose interpolation as
Docker Compose does it, the engines' vendored flags and metric names, the gateway's own metric
names (from its metrics registry, at test time) and the PromQL metric names an expression reads."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import promql_parser
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
ENGINES = DEPLOY / "engines"

_VAR = re.compile(r"\$(?:\$|\{(?P<braced>[^}]*)\}|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))")


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose's variable interpolation (`${VAR}`, `${VAR:-default}`, `${VAR-default}`,
    `${VAR:?error}`, `$VAR`, `$$`), applied to every string of a document."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        if m["plain"]:
            return env.get(m["plain"], "")
        expr = m["braced"]
        for sep in (":-", "-", ":?", "?"):
            if sep in expr:
                name, arg = expr.split(sep, 1)
                present = env.get(name)
                if (sep == ":-" and not present) or (sep == "-" and present is None):
                    return arg
                if sep in (":?", "?") and not present:
                    raise ValueError(f"${{{name}}} is required: {arg}")
                return present or ""
        return env.get(expr, "")

    return _VAR.sub(one, value)


def load_compose(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return interpolate(doc, env or {})


@functools.cache
def engine_flags(engine: str, version: str) -> dict[str, frozenset[str] | None]:
    """flag -> its choices (None: any value), from deploy/engines/<engine>-<version>.flags."""
    path = ENGINES / f"{engine}-{version}.flags"
    out: dict[str, frozenset[str] | None] = {}
    for line in path.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        flag, _, choices = line.partition(" ")
        out[flag] = frozenset(choices.split("|")) if choices else None
    return out


@functools.cache
def engine_metrics() -> frozenset[str]:
    names: set[str] = set()
    for path in ENGINES.glob("*.metrics"):
        names.update(n for n in path.read_text().splitlines() if n and not n.startswith("#"))
    return frozenset(names)


def image_version(image: str, repository: str) -> str:
    """The version an image tag names: `lmsysorg/sglang:v0.5.23` -> `0.5.23`."""
    name, _, tag = image.rpartition(":")
    assert name == repository, f"{image}: expected the official image {repository}"
    assert re.fullmatch(r"v\d+\.\d+\.\d+", tag), f"{image}: pin a release tag (vX.Y.Z)"
    return tag[1:]


def check_engine_args(engine: str, version: str, args: list[str]) -> None:
    """Every `--flag` in `args` exists in that engine version, and a value given to a flag with
    choices is one of them (`--flag=value` or `--flag value`)."""
    flags = engine_flags(engine, version)
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        flag, eq, inline = arg.partition("=")
        assert flag in flags, f"{engine} {version} has no flag {flag}"
        choices = flags[flag]
        if choices is not None:
            value = inline if eq else args[i + 1]
            assert value in choices, f"{engine} {version} {flag}: {value!r} not in {sorted(choices)}"


@functools.cache
def gateway_metric_families() -> dict[str, str]:
    """name -> type of every metric family the gateway exports, read from a gateway's own metrics
    registry (a Gateway built from a config with one worker; nothing is started)."""
    from gateway.app import Gateway
    from gateway.config import GatewayConfig, WorkerConfig
    from policies.snapshot import Engine, Role

    gw = Gateway(
        GatewayConfig(
            workers=(WorkerConfig(url="http://127.0.0.1:9", role=Role.COLOCATED, engine=Engine.VLLM),)
        )
    )
    return {fam.name: fam.type for fam in gw.metrics.registry.collect()}


_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created"),
    "gauge": ("",),
    "unknown": ("",),
}


def gateway_series() -> frozenset[str]:
    names: set[str] = set()
    for name, kind in gateway_metric_families().items():
        names.update(name + s for s in _SUFFIXES.get(kind, ("",)))
        if kind != "counter":
            names.add(name)
    return frozenset(names)


def engine_series() -> frozenset[str]:
    out: set[str] = set()
    for name in engine_metrics():
        base = name.removesuffix("_total")
        out.update({name, base + "_total", base + "_bucket", base + "_sum", base + "_count", base})
    return frozenset(out)


def known_series() -> frozenset[str]:
    """Every series name a query may read: the gateway's, the engines', and Prometheus's own `up`."""
    return gateway_series() | engine_series() | {"up"}


def promql_metrics(expr: str) -> list[str]:
    """The metric names an expression reads (ValueError if it does not parse)."""
    tree = promql_parser.parse(expr)
    found: list[str] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            name = node.name or next((m.value for m in node.matchers.matchers if m.name == "__name__"), None)
            assert name, f"{expr}: a selector without a metric name"
            found.append(name)

    promql_parser.walk(tree, visit)
    return found


GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h", "$model": ".*"}


def grafana_to_promql(expr: str) -> str:
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"{expr}: an unknown dashboard variable"
    return expr


def load_json(path: Path) -> Any:
    return json.loads(path.read_text())
