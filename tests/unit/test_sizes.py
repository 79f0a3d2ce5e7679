"""Modules and functions stay small enough to read (issue #28, CONTRIBUTING.md): no module in
`gateway/`, `adapters/`, `policies/` or `common/` over `MAX_MODULE_LINES` lines, and no function
over `MAX_FUNCTION_LINES` lines except the few start-up functions named in `LONG_STARTUP` (they
run once per process, wiring a component from its configuration; none runs per request).

A module that grows past the limit is split by responsibility (see docs/architecture.md for how
the existing ones are cut); a function, by naming its steps. The synthetic sources at the end
show the checks fail."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gateway", "adapters", "policies", "common")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
# "module:Qualified.name" of the functions allowed past the limit: start-up only, never per request
LONG_STARTUP = frozenset(
    {
        "gateway.app:Gateway.__init__",
        "gateway.app:Gateway.start",
        "gateway.cli_args:build_serve_parser",
        "gateway.cli_args:merge_args",
        "gateway.metrics:GatewayMetrics.__init__",
        "gateway.router_flags:prepare_router_flags",
        "gateway.router_flags:apply_router_flags",
        "gateway.worker:Worker.__init__",
    }
)


def functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, int, int]]:
    """(qualified name, first line, lines) of every function in `tree`, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = prefix + node.name
            end = node.end_lineno or node.lineno
            yield name, node.lineno, end - node.lineno + 1
            yield from functions(node, name + ".<locals>.")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, prefix + node.name + ".")
        else:
            yield from functions(node, prefix)


def oversized(modules: Iterable[tuple[str, str]], allowed: frozenset[str] = LONG_STARTUP) -> list[str]:
    """What breaks the size rules among (dotted module name, source) pairs, one line each."""
    found = []
    for module, source in modules:
        lines = source.count("\n")
        if lines > MAX_MODULE_LINES:
            found.append(f"{module}: {lines} lines (at most {MAX_MODULE_LINES})")
        for name, line, length in functions(ast.parse(source)):
            if length > MAX_FUNCTION_LINES and f"{module}:{name}" not in allowed:
                found.append(f"{module}:{name} (line {line}): {length} lines (at most {MAX_FUNCTION_LINES})")
    return found


def project_modules() -> list[tuple[str, str]]:
    out = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out.append((".".join(parts), path.read_text()))
    return out


def test_no_module_or_function_is_too_long() -> None:
    assert oversized(project_modules()) == []


def test_every_allowed_long_function_still_exists_and_is_long() -> None:
    """The list names only what needs it: an entry whose function was shortened (or moved) goes."""
    long = {
        f"{module}:{name}"
        for module, source in project_modules()
        for name, _, length in functions(ast.parse(source))
        if length > MAX_FUNCTION_LINES
    }
    assert sorted(LONG_STARTUP - long) == []


def _function(name: str, body_lines: int, indent: str = "") -> str:
    body = "".join(f"{indent}    x = {i}\n" for i in range(body_lines))
    return f"{indent}def {name}() -> None:\n{body}"


def test_a_long_module_is_caught() -> None:
    source = "".join(_function(f"f{i}", 9) for i in range(51))  # 510 lines, short functions
    assert oversized([("gateway.big", source)]) == ["gateway.big: 510 lines (at most 500)"]


def test_a_long_function_is_caught_a_method_and_a_nested_one_too() -> None:
    source = (
        _function("short", 59)
        + _function("long", 60)
        + "class C:\n"
        + _function("method", 61, "    ")
        + "def outer() -> None:\n"
        + _function("inner", 61, "    ")
    )
    assert oversized([("policies.p", source)]) == [
        "policies.p:long (line 61): 61 lines (at most 60)",
        "policies.p:C.method (line 123): 62 lines (at most 60)",
        "policies.p:outer (line 185): 63 lines (at most 60)",
        "policies.p:outer.<locals>.inner (line 186): 62 lines (at most 60)",
    ]


def test_an_allowed_start_up_function_passes_only_under_its_own_name() -> None:
    source = "class Gateway:\n" + _function("__init__", 70, "    ")
    assert oversized([("gateway.app", source)]) == []
    assert oversized([("gateway.other", source)]) == [
        "gateway.other:Gateway.__init__ (line 2): 71 lines (at most 60)"
    ]
