"""The package's imports go one way: core -> layers and policies -> gearbox and
routing -> generation and speculative decoding -> command lines, evaluation and
telemetry. Every import counts, those inside functions too; a module that is in
no layer, an import that goes up a layer, or a cycle fails the test. Imports
inside functions are allowed only for optional third-party modules.
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
    ("core", ("config", "entropy", "classifier", "chat", "jsonsafe", "affine", "kernelcheck", "packed.formats", "sources",
              "sources.*")),
    ("layers and policies", (
        "packed", "packed.*", "nested", "nested.*", "kvcache", "kvcache.*", "policies", "sourcecheck",
        "calibration",
    )),
    ("gearbox and routing", ("precision", "gearbox", "routing", "distributed", "distributed.*")),
    ("generation and speculative decoding", ("generation", "speculative", "speculative.decode",
                                             "speculative.acceptance", "speculative.draft", "speculative.host",
                                             "speculative.calibration", "speculative.*")),
    ("command lines, evaluation and telemetry", (
        "", "speculative.cli", "console", "plotting", "generate", "evaluate", "analyze", "remote", "selftest",
        "bench",
        "evaluation", "evaluation.*", "telemetry", "telemetry.*",
    )),
)
# speculative.cli must match before speculative.*: order the check by specificity.
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
                    if in_fn and not child.module.split(".")[0] in OPTIONAL_THIRD_PARTY:
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
    ("config", 0), ("packed.formats", 0), ("packed.layers", 1), ("precision", 2),
    ("speculative.decode", 3), ("speculative.cli", 4), ("evaluation.harness", 4), ("nope", -1),
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
