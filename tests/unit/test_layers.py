"""The layers of ``broker/`` (docs/ARCHITECTURE.md, "Layers") hold: read from the imports of every module.

Every ``import`` counts, those under ``TYPE_CHECKING`` and inside functions too: a circle
hidden from the interpreter is still a circle for whoever reads the code.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("broker", "workers")

#: Modules every layer may use: pure domain rules and types, with no I/O of their own.
BASE = {"broker", "broker.changes", "broker.config", "broker.config_identity", "broker.config_wire", "broker.errors",
        "broker.tenants", "broker.uris", "broker.metrics"}
#: The processes' wiring and entry points: they may import anything, nothing imports them but each other.
WIRING = {"broker.runtime", "broker.app", "broker.mount", "broker.server", "broker.cli", "broker.demo", "workers",
          "workers.fanout"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """The modules of ours ``path`` imports (a ``from pkg import name`` counts ``pkg.name`` when that is a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] in PACKAGES and name in MODULES}


MODULES = {module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}
GRAPH = {name: imports_of(path) for name, path in MODULES.items()}


def layer(name: str) -> str:
    if name in WIRING:
        return "wiring"
    if name in BASE:
        return "base"
    for prefix in ("broker.protocol", "broker.backends", "broker.transport"):
        if name == prefix or name.startswith(prefix + "."):
            return prefix.removeprefix("broker.")
    return "core"


#: Which layers each layer may import: each one only those below it.
ALLOWED = {
    "protocol": {"protocol"},
    "base": {"protocol", "base"},
    "backends": {"protocol", "base", "backends"},
    "core": {"protocol", "base", "backends", "core"},
    "transport": {"protocol", "base", "core", "transport"},
    "wiring": {"protocol", "base", "backends", "core", "transport", "wiring"},
}


def test_each_layer_imports_only_the_layers_below_it() -> None:
    wrong = sorted(f"{name} ({layer(name)}) imports {target} ({layer(target)})"
                   for name, targets in GRAPH.items() for target in targets
                   if target != name and layer(target) not in ALLOWED[layer(name)])
    assert not wrong, "\n".join(wrong)


def test_the_protocol_layer_is_pure() -> None:
    io = {"asyncio", "socket", "redis", "starlette", "fastapi", "uvicorn"}
    for name, path in MODULES.items():
        if layer(name) == "protocol":
            tree = ast.parse(path.read_text())
            used = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
            used |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.module}
            assert not used & io, f"{name} does I/O: {used & io}"


def test_no_module_imports_itself_back_through_others() -> None:
    """No import circle, however long."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for target in sorted(GRAPH[name]):
            # A package's __init__ re-exporting its own modules is not a circle of the design.
            if target.startswith(name + "."):
                continue
            if state.get(target) == 1:
                circle = path[path.index(target):] + [target]
                pytest.fail("import circle: " + " -> ".join(circle))
            if state.get(target) is None:
                visit(target)
        path.pop()
        state[name] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name)


def test_nothing_above_the_backends_reaches_into_the_broker_for_them() -> None:
    """Services get the stores they use through their constructors, never ``broker.backend`` or a hub."""
    for name, path in MODULES.items():
        if layer(name) in ("core", "transport") or name in WIRING - {"broker.runtime"}:
            found = re.search(r"\bbroker\.(backend|hub)\b|\._hub\b", path.read_text())
            assert found is None, f"{name} reaches {found.group(0)!r}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_is_longer_than_400_lines(name: str) -> None:
    lines = MODULES[name].read_text().count("\n")
    limit = 300 if name in ("broker.transport.http", "broker.transport.stdio") else 400
    assert lines <= limit, f"{name} has {lines} lines, more than {limit}"


def test_no_backend_protocol_has_more_than_15_methods() -> None:
    from typing import Protocol

    import broker.backends.base as base

    for value in vars(base).values():
        if isinstance(value, type) and issubclass(value, Protocol) and value.__module__ == base.__name__:  # type: ignore[arg-type]
            methods = [n for n, v in vars(value).items() if callable(v) and not n.startswith("_")]
            assert len(methods) <= 15, f"{value.__name__} has {len(methods)} methods"
