"""The layers of ``broker/`` (docs/ARCHITECTURE.md, "Layers") hold: read from the imports of every module.

Every ``import`` counts, those under ``TYPE_CHECKING`` and inside functions too: a circle
hidden from the interpreter is still a circle for whoever reads the code. Sizes are bounded per
class, not per file: a file may hold several small classes, and one class is never cut over files.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("broker", "workers")

#: Modules every layer may use: pure domain rules and types, with no I/O of their own.
BASE = {"broker", "broker.changes", "broker.config", "broker.errors", "broker.tenants", "broker.uris", "broker.metrics",
        "broker.feeds", "broker.feeds.model", "broker.upstreams", "broker.upstreams.spec"}
#: Each folder's layer. A module at the root of ``broker/`` outside ``BASE`` is core, and so is
#: every folder not named here (``feeds``, ``delivery``, ``events``, ``auth``, ``sources``, ``resources``, ``ops``).
FOLDERS = {"broker.protocol": "protocol", "broker.backends": "backends", "broker.transport": "transport",
           "broker.runtime": "wiring", "broker.cli": "wiring", "workers": "wiring"}
#: ``mount_broker``, the wiring a host application imports: the one root module of the wiring layer.
ROOT_WIRING = {"broker.mount"}


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
    if name in BASE:
        return "base"
    if name in ROOT_WIRING:
        return "wiring"
    for folder, its_layer in FOLDERS.items():
        if name == folder or name.startswith(folder + "."):
            return its_layer
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


def folder(name: str) -> str:
    """The folder of ``broker/`` a module sits in (``root`` for the root's modules)."""
    parts = name.split(".")
    if parts[0] != "broker" or len(parts) == 1:
        return parts[0]
    return parts[1] if (ROOT / "broker" / parts[1]).is_dir() else "root"


#: Within the core, what some folders may never reach: who is calling is told to the core, it asks
#: nothing of it; change sources and resources publish through the publisher, never into delivery.
FORBIDDEN = {
    "auth": {"root", "feeds", "delivery", "events", "sources", "resources", "ops"},
    "sources": {"feeds", "delivery", "events"},
    "resources": {"feeds", "delivery", "events", "sources"},
}


def test_identity_and_sources_stay_out_of_delivery() -> None:
    wrong = sorted(f"{name} imports {target}" for name, targets in GRAPH.items() for target in targets
                   if layer(name) == "core" and layer(target) == "core"
                   and folder(target) in FORBIDDEN.get(folder(name), set()))
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
        if layer(name) in ("core", "transport") or layer(name) == "wiring" and name != "broker.runtime":
            found = re.search(r"\bbroker\.(backend|hub)\b|\._hub\b", path.read_text())
            assert found is None, f"{name} reaches {found.group(0)!r}"


#: Bounds of one class: a concept a reader can hold. Files may hold several small classes.
MAX_PUBLIC_METHODS = 20
MAX_CLASS_LINES = 300


def class_sizes(source: str) -> dict[str, tuple[int, int]]:
    """Per class (``Outer.Inner`` for a nested one): its public methods and its lines of code.

    Lines of code leave out blank lines, comments and declarative fields (``name: type = default``
    in the class body, as settings and dataclasses declare them): a setting more is not more
    behaviour to read.
    """
    lines = source.splitlines()
    sizes: dict[str, tuple[int, int]] = {}

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                name = prefix + node.name
                public = sum(1 for item in node.body if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                             and not item.name.startswith("_"))
                fields = {line for item in node.body if isinstance(item, ast.AnnAssign)
                          for line in range(item.lineno, (item.end_lineno or item.lineno) + 1)}
                code = sum(1 for number in range(node.lineno, (node.end_lineno or node.lineno) + 1)
                           if number not in fields and lines[number - 1].strip()
                           and not lines[number - 1].lstrip().startswith("#"))
                sizes[name] = (public, code)
                visit(node.body, name + ".")
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.If | ast.Try):
                visit(node.body, prefix)

    visit(ast.parse(source).body, "")
    return sizes


def too_large(source: str) -> list[str]:
    return [f"{name} has {public} public methods and {code} lines of code (at most {MAX_PUBLIC_METHODS} "
            f"and {MAX_CLASS_LINES})" for name, (public, code) in class_sizes(source).items()
            if public > MAX_PUBLIC_METHODS or code > MAX_CLASS_LINES]


def test_the_class_guard_counts_methods_and_code_but_not_declared_fields() -> None:
    method = "    def m{0}(self) -> None:\n        return None\n"
    many = "class Many:\n" + "".join(method.format(n) for n in range(MAX_PUBLIC_METHODS + 1))
    assert too_large(many) == ["Many has 21 public methods and 43 lines of code (at most 20 and 300)"]
    assert too_large(many.replace("def m0(", "def _m0(")) == []  # a private helper is not interface
    long = "class Long:\n    def run(self) -> None:\n" + "        x = 1\n" * MAX_CLASS_LINES
    assert too_large(long) == ["Long has 1 public methods and 302 lines of code (at most 20 and 300)"]
    settings = "class Settings:\n" + "    #: a bound\n    bound: int = Field(\n        default=1)\n\n" * 400
    assert class_sizes(settings) == {"Settings": (0, 1)}
    nested = "def f():\n    class Inner:\n        def a(self): ...\n"
    assert class_sizes(nested) == {"Inner": (1, 2)}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_class_is_larger_than_one_concept(name: str) -> None:
    assert not too_large(MODULES[name].read_text()), "\n".join(too_large(MODULES[name].read_text()))


def test_no_backend_protocol_has_more_than_15_methods() -> None:
    from typing import Protocol

    import broker.backends.base as base

    for value in vars(base).values():
        if isinstance(value, type) and issubclass(value, Protocol) and value.__module__ == base.__name__:  # type: ignore[arg-type]
            methods = [n for n, v in vars(value).items() if callable(v) and not n.startswith("_")]
            assert len(methods) <= 15, f"{value.__name__} has {len(methods)} methods"
