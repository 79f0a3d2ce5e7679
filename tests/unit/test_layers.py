"""The packages' import arrows point one way (docs/architecture.md, "Layers"):

    pd_gateway (the command line)
        ├──> gateway ──> adapters ──> common
        │       │  └───> policies ──> common
        │       └──> gateway.http (the data plane: imports nothing of ours)
        └──> emulator (imports nothing of ours)

Each module's imports are read with `ast` (function-level ones, those under TYPE_CHECKING and
`importlib.import_module("...")` calls included) and each arrow checked against `ALLOWED`; and
no code outside the adapters and the configuration compares against an `Engine` member: what
an engine can do is its adapter's to say. The synthetic trees at the end show the checks fail on
a wrong arrow."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# layer -> the layers it may import (besides itself)
ALLOWED: dict[str, frozenset[str]] = {
    "common": frozenset(),
    "policies": frozenset({"common"}),
    "adapters": frozenset({"common"}),
    "gateway.http": frozenset(),
    "gateway": frozenset({"common", "adapters", "policies", "gateway.http"}),
    "emulator": frozenset(),
    "pd_gateway": frozenset(
        {"gateway", "gateway.http", "emulator", "bench", "common", "adapters", "policies"}
    ),
}
# first-party packages that are no layer of the product (they may import anything)
UNCHECKED = frozenset({"bench", "tests", "tools"})
# where comparing against an Engine member is the point: the adapters and the configuration
ENGINE_CHECKS_ALLOWED = ("adapters", "gateway.config", "gateway.cli_args", "pd_gateway")


def layer_of(module: str) -> str | None:
    """The layer a dotted module name belongs to (the longest prefix in `ALLOWED`), or None for
    anything that is not ours."""
    best = None
    for layer in ALLOWED.keys() | UNCHECKED:
        if (module == layer or module.startswith(layer + ".")) and (best is None or len(layer) > len(best)):
            best = layer
    return best


def imports_of(tree: ast.AST, module: str) -> Iterator[tuple[int, str]]:
    """(line, imported module) for every import in `tree`, relative ones resolved."""
    package = module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target:
                yield node.lineno, target
            else:  # `from . import x` at the top of the tree
                for alias in node.names:
                    yield node.lineno, alias.name
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.lineno, node.args[0].value


def wrong_arrows(modules: Iterable[tuple[str, str]]) -> list[str]:
    """Every import that breaks `ALLOWED`, as "module:line -> imported (layer -> layer)"."""
    out = []
    for module, source in modules:
        layer = layer_of(module)
        if layer is None or layer in UNCHECKED:
            continue
        for line, target in imports_of(ast.parse(source), module):
            to = layer_of(target)
            if to is None or to == layer or to in ALLOWED[layer]:
                continue
            out.append(f"{module}:{line} -> {target} ({layer} -> {to})")
    return sorted(set(out))


def engine_comparisons(modules: Iterable[tuple[str, str]]) -> list[str]:
    """Every comparison against an `Engine` member outside the adapters and the configuration."""
    out = []
    for module, source in modules:
        if module.startswith(ENGINE_CHECKS_ALLOWED) or layer_of(module) in UNCHECKED | {None, "emulator"}:
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Compare):
                for operand in (node.left, *node.comparators):
                    if (
                        isinstance(operand, ast.Attribute)
                        and isinstance(operand.value, ast.Name)
                        and operand.value.id == "Engine"
                    ):
                        out.append(f"{module}:{node.lineno} compares against Engine.{operand.attr}")
    return out


def project_modules() -> list[tuple[str, str]]:
    out = []
    for package in ("common", "policies", "adapters", "gateway", "emulator", "pd_gateway"):
        for path in sorted((ROOT / package).rglob("*.py")):
            # (a package's own module keeps its `__init__`: its relative imports start there)
            out.append((".".join(path.relative_to(ROOT).with_suffix("").parts), path.read_text()))
    return out


def test_every_import_arrow_points_the_allowed_way() -> None:
    modules = project_modules()
    assert len(modules) > 50  # (the tree was found)
    assert wrong_arrows(modules) == []


def test_no_engine_comparisons_outside_the_adapters_and_configuration() -> None:
    assert engine_comparisons(project_modules()) == []


@pytest.mark.parametrize(
    ("module", "source", "arrow"),
    [
        ("policies.pd", "from gateway.registry import Registry", "policies -> gateway"),
        ("policies.pd", "from adapters import ADAPTERS", "policies -> adapters"),
        ("adapters.sglang", "from policies.snapshot import WorkerState", "adapters -> policies"),
        ("adapters.vllm", "from gateway import jsonbytes", "adapters -> gateway"),
        ("common.request", "import gateway.errors", "common -> gateway"),
        ("gateway.http.server", "from gateway.config import LimitsConfig", "gateway.http -> gateway"),
        ("gateway.http.client", "from common.errors import BadRequest", "gateway.http -> common"),
        ("gateway.demo", "from emulator.api import start_emulator", "gateway -> emulator"),
        ("gateway.cli", "import importlib\nimportlib.import_module('bench.cli')", "gateway -> bench"),
        ("emulator.app", "from common.errors import BadRequest", "emulator -> common"),
        ("gateway.handlers", "def f():\n    from pd_gateway import cli", "gateway -> pd_gateway"),
        ("policies.base", "from .. import gateway", "policies -> gateway"),
    ],
)
def test_a_wrong_arrow_is_caught(module: str, source: str, arrow: str) -> None:
    [found] = wrong_arrows([(module, source)])
    assert found.endswith(f"({arrow})")


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("gateway.handlers", "from adapters import ADAPTERS\nfrom policies.snapshot import Role"),
        ("gateway.orchestration.legs", "from gateway.http.client import UpstreamResponse"),
        ("adapters.sglang", "from common import jsonbytes\nfrom adapters.base import HandoffCtx"),
        ("policies.pd", "from common.workers import Role\nimport msgspec"),
        ("pd_gateway.demo", "from emulator.api import start_emulator\nfrom gateway.app import Gateway"),
        ("gateway.http.server", "import httptools\nfrom gateway.http.limits import ServerLimits"),
    ],
)
def test_a_right_arrow_passes(module: str, source: str) -> None:
    assert wrong_arrows([(module, source)]) == []


def test_an_engine_comparison_is_caught_outside_the_adapters() -> None:
    src = "def alone(w):\n    return w.engine is Engine.VLLM\n"
    assert engine_comparisons([("policies.pd", src)]) == ["policies.pd:2 compares against Engine.VLLM"]
    assert engine_comparisons([("gateway.handlers", "x = Engine.SGLANG == e")])
    assert engine_comparisons([("adapters.vllm", src), ("gateway.config", src)]) == []
