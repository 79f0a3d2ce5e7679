"""The emulator's import graph, read from its source with ast: no cycle among its modules
(imports inside functions and under ``TYPE_CHECKING`` count too: a cycle hidden there is still
one), and nothing imported from the gateway's packages (the emulator is an independent reading
of the engines' protocols)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("gateway", "adapters", "policies", "bench", "tools")


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(root: Path, path: Path) -> set[str]:
    """Every module `path` imports, wherever the import statement stands."""
    me = module_name(root, path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            found.add(mod)
            # `from pkg import sub` imports the module pkg.sub when there is one
            found.update(f"{mod}.{alias.name}" for alias in node.names)
    return found


def graph(root: Path, top: str) -> dict[str, set[str]]:
    """Module -> the modules of `top` it imports (only those that exist as files)."""
    files = {module_name(root, p): p for p in (root / top).rglob("*.py")}
    return {mod: {m for m in imports_of(root, p) if m in files and m != mod} for mod, p in files.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the graph (its modules in import order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_emulator_imports_no_module_in_a_circle() -> None:
    edges = graph(ROOT, "emulator")
    assert len(edges) > 30  # (the walk found the package)
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_emulator_imports_nothing_from_the_gateway_side() -> None:
    wrong = {
        (module_name(ROOT, p), m)
        for p in (ROOT / "emulator").rglob("*.py")
        for m in imports_of(ROOT, p)
        if m.split(".")[0] in FORBIDDEN
    }
    assert not wrong


def test_a_cycle_through_a_lazy_or_type_checking_import_is_found(tmp_path: Path) -> None:
    pkg = tmp_path / "emu"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "server.py").write_text("def build():\n    from emu.sub import api\n")
    (pkg / "sub" / "api.py").write_text("from .helpers import x\n")
    (pkg / "sub" / "helpers.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..server import build\nx = 1\n"
    )
    assert find_cycle(graph(tmp_path, "emu")) == [
        "emu.server",
        "emu.sub.api",
        "emu.sub.helpers",
        "emu.server",
    ]
    (pkg / "sub" / "helpers.py").write_text("x = 1\n")
    assert find_cycle(graph(tmp_path, "emu")) is None


def test_the_old_layout_had_a_cycle(tmp_path: Path) -> None:
    """The import statements of the layout before the engines' surfaces became classes: the
    server set up the surfaces, which imported the server back."""
    pkg = tmp_path / "emulator"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "app.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from emulator.api import EmulatorSpec\n"
        "def setup():\n    from emulator import sglang_api\n"
    )
    (pkg / "api.py").write_text("def start():\n    from emulator.app import EmulatorServer\n")
    (pkg / "sglang_api.py").write_text("from emulator.app import DONE\n")
    assert find_cycle(graph(tmp_path, "emulator")) == ["emulator.api", "emulator.app", "emulator.api"]
