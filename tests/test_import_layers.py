"""The package's imports go one way: core -> kernel bindings -> layers and
policies -> gearbox and routing -> generation and speculative decoding ->
telemetry -> the client and router of remote servers -> command lines, evaluation
and the server. Every import counts, those inside
functions too; a module that is in no layer, an import that goes up a layer, or
a cycle fails the test. Imports inside functions are allowed only for optional
third-party modules.

No module imports another module's private name either: ``from x import _y``
and ``x._y`` (``x`` a module of the package imported by name) fail
:func:`private_uses`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, List, Sequence, Set, Tuple

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "gearbx_mlx"

#: Layers, lowest first: (name, module patterns relative to the package).
#: A pattern ending in ``.*`` takes every module of a subpackage; the first
#: matching pattern wins, so exceptions come before their subpackage.
LAYERS: Sequence[Tuple[str, Sequence[str]]] = (
    ("core", ("launch", "mlx_tables", "blas", "heap", "jsonsafe", "atomicfile", "config", "entropy", "classifier", "chat", "affine", "kernelcheck",
              "packed.formats", "sources",
              "sources.*")),
    # Build, load, launch and first-use check of every custom kernel: what
    # packed/, nested/ and kvcache/ build on; it imports only core.
    ("kernel bindings", ("bindings", "bindings.*")),
    ("layers and policies", (
        "packed", "packed.*", "nested", "nested.*", "kvcache", "kvcache.*", "policies", "sourcecheck",
        "calibration", "blockstep",
    )),
    ("gearbox and routing", ("resolver", "discovery", "precision", "gearbox", "routing", "distributed",
                             "distributed.*")),
    ("generation and speculative decoding", ("generation", "record", "pipeline", "speculative", "speculative.decode",
                                             "speculative.acceptance", "speculative.draft", "speculative.host",
                                             "speculative.calibration", "speculative.*")),
    ("telemetry", ("plotting", "telemetry", "telemetry.*")),
    ("remote servers", ("remote", "remote.*")),
    ("command lines, evaluation and the server", (
        "", "speculative.cli", "remote.cli", "remote.__main__", "console", "run_summary", "thresholds", "generate", "evaluate",
        "analyze", "selftest", "bench", "evaluation", "evaluation.*", "server", "server.*",
    )),
)
# speculative.cli and remote.cli must match before their subpackage's .*: exact names win.
OPTIONAL_THIRD_PARTY = ("matplotlib",)


def layer_of(module: str, layers: Sequence[Tuple[str, Sequence[str]]] = LAYERS) -> int:
    """Index of ``module``'s layer (exact names before ``pkg.*`` patterns); -1 if none."""
    for i, (_, patterns) in enumerate(layers):
        if module in patterns:
            return i
    for i, (_, patterns) in enumerate(layers):
        for p in patterns:
            if p.endswith(".*") and module.startswith(p[:-1]):
                return i
    return -1


def modules_of(root: Path) -> Dict[str, Path]:
    """``{dotted name relative to the package ("" for its __init__): path}``."""
    out = {}
    for p in sorted(root.rglob("*.py")):
        parts = list(p.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def imports_of(name: str, path: Path, known: Set[str], package: str) -> List[Tuple[str, int, bool]]:
    """``(imported module, line, inside a function)`` for each import of the package."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if name else []
    if not is_pkg:
        base = base[:-1]
    found: List[Tuple[str, int, bool]] = []

    def add(target: str, node: ast.AST, in_fn: bool) -> None:
        found.append((target, node.lineno, in_fn))

    def visit(node: ast.AST, in_fn: bool) -> None:
        for child in ast.iter_child_nodes(node):
            fn = in_fn or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    pkg = base[: len(base) - (child.level - 1)]
                    mod = ".".join(pkg + ([child.module] if child.module else []))
                elif child.module and (child.module == package or child.module.startswith(package + ".")):
                    mod = child.module[len(package) + 1:]
                else:
                    mod = None
                    if in_fn and child.module.split(".")[0] not in OPTIONAL_THIRD_PARTY:
                        add("<third-party:" + child.module + ">", child, True)
                if mod is not None:
                    for a in child.names:  # "from . import x" may import the module x
                        sub = f"{mod}.{a.name}" if mod else a.name
                        add(sub if sub in known else mod, child, in_fn)
            elif isinstance(child, ast.Import):
                for a in child.names:
                    if a.name == package or a.name.startswith(package + "."):
                        add(a.name[len(package) + 1:], child, in_fn)
                    elif in_fn and a.name.split(".")[0] not in OPTIONAL_THIRD_PARTY:
                        add("<third-party:" + a.name + ">", child, True)
            visit(child, fn)

    visit(tree, False)
    return found


def check_package(root: Path, layers: Sequence[Tuple[str, Sequence[str]]] = LAYERS) -> List[str]:
    """Every violation of the layering of the package at ``root``, as readable lines."""
    package = root.name
    mods = modules_of(root)
    problems: List[str] = []
    graph: Dict[str, Set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        if layer_of(name, layers) < 0:
            problems.append(f"{package}.{name} ({path.name}) is in no layer: add it to LAYERS")
            continue
        for target, line, in_fn in imports_of(name, path, set(mods), package):
            where = f"{path.relative_to(root.parent)}:{line}"
            if target.startswith("<third-party:"):
                problems.append(f"{where}: import of {target[13:-1]} inside a function "
                                "(only optional third-party modules may be imported there)")
                continue
            if in_fn:
                problems.append(f"{where}: import of {package}.{target} inside a function")
            if target == name or target not in mods:
                continue
            graph[name].add(target)
            lo, hi = layer_of(name, layers), layer_of(target, layers)
            if hi > lo:
                problems.append(f"{where}: {package}.{name} ({layers[lo][0]}) imports "
                                f"{package}.{target} ({layers[hi][0]}), a higher layer")
    problems += [f"import cycle: {' -> '.join(package + '.' + m for m in c)}" for c in cycles(graph)]
    return problems


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One cycle through each strongly connected component of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp) + [sorted(comp)[0]])

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(root: Path) -> List[str]:
    """``path:line: what`` for every private name a module takes from another module of the package.

    Two forms: ``from <module> import _name`` (relative or absolute; a private
    submodule counts too), and ``m._name`` where ``m`` is bound by an import
    to another module of the package (``import pkg.a as m``, ``from pkg import
    a as m``, or a dotted ``pkg.a._name``). A module's own names are its own.
    """
    package = root.name
    mods = modules_of(root)
    problems: List[str] = []
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        base = (name.split(".") if name else []) if path.name == "__init__.py" else name.split(".")[:-1]
        bound: Dict[str, str] = {}  # local name -> dotted module (relative to the package)
        where = lambda node: f"{path.relative_to(root.parent)}:{node.lineno}"  # noqa: E731
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    mod = ".".join(base[: len(base) - (node.level - 1)] + ([node.module] if node.module else []))
                elif node.module == package or (node.module or "").startswith(package + "."):
                    mod = node.module[len(package) + 1:]
                else:
                    continue
                for a in node.names:
                    sub = f"{mod}.{a.name}" if mod else a.name
                    if sub in mods:
                        bound[a.asname or a.name] = sub
                    if _is_private(a.name):
                        problems.append(f"{where(node)}: from {package}{'.' if mod else ''}{mod} import {a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == package or a.name.startswith(package + "."):
                        if a.asname:
                            bound[a.asname] = a.name[len(package) + 1:]
                        else:
                            bound[package] = ""
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
                continue
            chain, value = [], node.value  # m.a.b._x -> module "a.b" of the package bound to m
            while isinstance(value, ast.Attribute):
                chain.insert(0, value.attr)
                value = value.value
            if not isinstance(value, ast.Name) or value.id not in bound:
                continue
            target = ".".join(p for p in [bound[value.id]] + chain if p)
            if target in mods and target != name:
                problems.append(f"{where(node)}: {package}{'.' if target else ''}{target}.{node.attr}")
    return sorted(problems)


def test_no_module_imports_a_private_name():
    problems = private_uses(PACKAGE)
    assert not problems, "private names used across modules (make them public, or move the code):\n" + "\n".join(
        problems)


def test_planted_private_uses_are_reported(tmp_path):
    root = _plant(tmp_path, {
        "a.py": "_x = 1\n\ndef _f():\n    return _x\n\ny = _f()\n",
        "b.py": "from .a import _x, y\n",
        "c.py": "from . import a\n\nz = a._f()\n",
        "d.py": "import pkg.a\nimport pkg.a as m\n\nw = pkg.a._x + m._x\n",
        "e.py": "from .a import y\nfrom . import a as ok\n\nv = ok.y + y\n",
        "sub/__init__.py": "from ..a import _f\n",
    })
    problems = private_uses(root)
    assert any(p.startswith("pkg/b.py:1: from pkg.a import _x") for p in problems), problems
    assert any(p.startswith("pkg/c.py:3: pkg.a._f") for p in problems), problems
    assert sum(p.startswith("pkg/d.py:4: pkg.a._x") for p in problems) == 2, problems
    assert any(p.startswith("pkg/sub/__init__.py:1: from pkg.a import _f") for p in problems), problems
    assert not [p for p in problems if p.startswith(("pkg/a.py", "pkg/e.py"))], problems


def test_package_imports_go_one_way():
    problems = check_package(PACKAGE)
    assert not problems, "\n".join(problems)


def _plant(tmp_path: Path, files: Dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for rel, text in {"__init__.py": "", **files}.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


PLANTED_LAYERS = (("low", ("", "a", "b")), ("high", ("c",)))


def test_a_planted_cycle_fails(tmp_path):
    root = _plant(tmp_path, {"a.py": "from . import b\n", "b.py": "def f():\n    from .a import x\n"})
    problems = check_package(root, PLANTED_LAYERS)
    assert any(re.search(r"import cycle: pkg\.a -> pkg\.b -> pkg\.a", p) for p in problems), problems
    assert any("inside a function" in p for p in problems), problems


def test_an_upward_import_and_an_unlisted_module_fail(tmp_path):
    root = _plant(tmp_path, {"a.py": "from .c import y\n", "c.py": "y = 1\n", "d.py": ""})
    problems = check_package(root, PLANTED_LAYERS)
    assert any("pkg.a (low) imports pkg.c (high)" in p for p in problems), problems
    assert any("pkg.d (d.py) is in no layer" in p for p in problems), problems


def test_function_level_third_party_imports_only_when_optional(tmp_path):
    root = _plant(tmp_path, {
        "a.py": "def f():\n    import json\n\ndef g():\n    import matplotlib.pyplot as plt\n",
        "b.py": "", "c.py": "",
    })
    problems = check_package(root, PLANTED_LAYERS)
    assert [p for p in problems if "json" in p] and not [p for p in problems if "matplotlib" in p], problems


@pytest.mark.parametrize("module,layer", [
    ("config", 0), ("packed.formats", 0), ("bindings", 1), ("bindings.guard", 1), ("bindings.packed_gpu", 1),
    ("packed.layers", 2), ("kvcache.write_kernel", 2), ("precision", 3), ("speculative.decode", 4),
    ("telemetry.trace", 5), ("remote.session", 6), ("remote.cli", 7), ("speculative.cli", 7),
    ("evaluation.harness", 7), ("server.app", 7), ("nope", -1),
])
def test_layer_of(module, layer):
    assert layer_of(module) == layer


def test_every_subpackage_ships_in_the_wheel():
    """pyproject lists its packages by hand: a subpackage left out of the list
    works in an editable install and is missing from a built wheel."""
    import tomllib

    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"gearbx_mlx"} | {
        "gearbx_mlx." + ".".join(p.parent.relative_to(PACKAGE).parts) for p in PACKAGE.rglob("*/__init__.py")
    }
    assert found - listed == set(), "subpackages missing from pyproject.toml's packages"
