"""The package's import graph, read from its source: layers import only
downward, no module imports itself back through others, and an import
inside a function is there only to keep torch or the CuTe DSL out of a
light import (and says so)."""

import ast
import sys
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "src" / "warpsplitk"

#: Bottom to top; a module may import its own layer and those below. The
#: address math (kernel/layout.py) sits with the data: tactic legality
#: (the shared-memory plan) and the kernel both read it.
LAYERS = (
    ("contract", "jsonfile", "version", "kernel.layout"),
    ("tactics", "shapes", "models"),
    ("kernel",),
    ("runtime",),
    ("planning",),
    ("nn",),
    ("measure", "cli", "__main__", ""),
)

#: What a function-level import may keep out of a light import.
HEAVY = ("torch", "cutlass", "cuda", "numpy", "matplotlib", "transformers")


def _name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _layer(module: str) -> int:
    best = None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or (prefix and module.startswith(prefix + ".")):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    assert best is not None, f"{module} is in no layer of LAYERS"
    return best[0]


def _targets(module: str, node) -> list[str]:
    """Package modules (by name, "" for the package itself) an import names;
    third-party ones as "ext:<top-level name>"."""
    if isinstance(node, ast.Import):
        return [a.name[len("warpsplitk."):] if a.name.startswith("warpsplitk.")
                else "" if a.name == "warpsplitk" else "ext:" + a.name.split(".")[0]
                for a in node.names]
    if node.level == 0:
        if node.module == "warpsplitk" or node.module.startswith("warpsplitk."):
            base = node.module[len("warpsplitk."):] if node.module != "warpsplitk" else ""
        else:
            return ["ext:" + node.module.split(".")[0]]
    else:
        package = module.split(".") if MODULES[module].name == "__init__.py" else \
            module.split(".")[:-1]
        package = [p for p in package[:len(package) - (node.level - 1)] if p]
        base = ".".join(package + ([node.module] if node.module else []))
    found = []
    for alias in node.names:
        sub = f"{base}.{alias.name}" if base else alias.name
        found.append(sub if sub in MODULES else base)
    return found


@cache
def _imports(module: str) -> tuple:
    """``(target, inside_function, line)`` for every import of ``module``."""
    tree = ast.parse(MODULES[module].read_text())
    inner = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inner |= {id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and not (
                isinstance(node, ast.ImportFrom) and node.module == "__future__"):
            out += [(t, id(node) in inner, node.lineno) for t in _targets(module, node)]
    return tuple(out)


@cache
def _heavy_at_import(module: str) -> bool:
    """Whether importing ``module`` imports a HEAVY package (top-level imports)."""
    for target, inner, _ in _imports(module):
        if inner:
            continue
        if target.startswith("ext:"):
            if target[4:] in HEAVY:
                return True
        elif target != module and _heavy_at_import(target):
            return True
    return False


def test_every_module_is_in_a_layer():
    for module in MODULES:
        _layer(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down_the_layers(module):
    upward = [f"{module}:{line} imports {target}" for target, _, line in _imports(module)
              if not target.startswith("ext:") and _layer(target) > _layer(module)]
    assert not upward, upward


def test_no_import_loops():
    graph = {m: {t for t, _, _ in _imports(m) if not t.startswith("ext:") and t != m}
             for m in MODULES}
    # a package's __init__ is imported with each of its modules: no edge back to it
    loops = []
    for start in graph:
        stack, seen = [(start, (start,))], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start and not (start == "" or path[-1].startswith(start + ".")):
                    loops.append(" -> ".join(path + (nxt,)))
                elif nxt not in seen and nxt != start:
                    seen.add(nxt)
                    stack.append((nxt, path + (nxt,)))
    assert not loops, loops[:10]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_inside_functions_keep_heavy_modules_lazy(module):
    """An import inside a function is of torch, the DSL or another heavy
    package, or of a package module that imports one, and the line (or the
    one above it) says why."""
    lines = MODULES[module].read_text().splitlines()
    bad = []
    for target, inner, line in _imports(module):
        if not inner:
            continue
        heavy = target[4:] in HEAVY if target.startswith("ext:") else _heavy_at_import(target)
        if target.startswith("ext:") and not heavy:
            continue  # a rarely used standard module: nothing to keep light
        commented = "#" in lines[line - 1] or lines[line - 2].strip().startswith("#")
        if not heavy or (not target.startswith("ext:") and not commented):
            bad.append(f"{module}:{line} imports {target} inside a function"
                       + ("" if heavy else " (it is light: import it at the top)"))
    assert not bad, bad


def test_no_module_uses_another_modules_private_names():
    """``from x import _name`` and ``module._name`` of a package module stay
    inside their module: what another module needs is public."""
    found = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        aliases = set()  # names bound to package modules
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                for alias, target in zip(node.names, _targets(module, node)):
                    if target.startswith("ext:"):
                        continue
                    if target.split(".")[-1] == alias.name:  # a module, not a name in one
                        aliases.add(alias.asname or alias.name)
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{module}:{node.lineno} imports {alias.name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in aliases and node.attr.startswith("_") \
                    and not node.attr.startswith("__"):
                found.append(f"{module}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert not found, found


#: Lines a function may span (its docstring included). The kernel's warp-role
#: methods are exempt: each is one warp's whole program, read top to bottom.
MAX_FUNCTION_LINES = 60
EXEMPT = ("kernel.warp_splitk",)


def test_functions_are_short():
    long = []
    for module, path in MODULES.items():
        if module in EXEMPT:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{module}.{node.name}: {lines} lines")
    assert not long, long
