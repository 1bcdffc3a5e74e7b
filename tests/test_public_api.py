"""The package's public names do what they say, whatever was imported first.

Each case runs in a fresh interpreter, after one order of imports (the
subpackages first, or none). Every name of ``__all__`` resolves; those that
run on a CPU are called; the CUDA-only ones are checked to be callables or
classes.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

CHECK = r'''
import importlib.util, inspect, json, os, sys, tempfile
import numpy as np
import warpsplitk

# every name resolves, and a name is not silently the submodule of that name
for name in warpsplitk.__all__:
    value = getattr(warpsplitk, name)
    assert value is not None, name
    if name != "__version__":
        assert callable(value), (name, value)
assert sorted(set(warpsplitk.__all__) - set(dir(warpsplitk))) == []
from warpsplitk import *  # noqa: F403

# the emulator, on small integers (exact in BF16 and FP32), against numpy
tactic = warpsplitk.WarpSplitKTactic(16, 8, 128, 2, 1)
rng = np.random.default_rng(0)
x = rng.integers(-3, 4, (3, 256)).astype(np.float32)
w = rng.integers(-3, 4, (32, 256)).astype(np.float32)
out = warpsplitk.emulate(x, w, tactic, round_output=False)
np.testing.assert_array_equal(out, x @ w.T)
from warpsplitk import emulate
np.testing.assert_array_equal(emulate(x, w, tactic, round_output=False), x @ w.T)
assert "tactic" in inspect.signature(warpsplitk.emulate).parameters
import warpsplitk.kernel.emulator as em  # the module, for its other functions
assert callable(em.bank_conflicts) and em.layout is not None
np.testing.assert_array_equal(warpsplitk.emulate(x, w, tactic, round_output=False), x @ w.T)

# the tactic model
warpsplitk.check_tactic(tactic, 32, 256)
try:
    warpsplitk.check_tactic(tactic, 40, 256)
    raise SystemExit("check_tactic accepted N=40")
except ValueError:
    pass
default = warpsplitk.default_tactic(8, 4224, 7168)
warpsplitk.check_tactic(default, 4224, 7168)
legal = warpsplitk.legal_tactics(8, 4224, 7168)
assert legal and all(warpsplitk.check_tactic(t, 4224, 7168) is None for t in legal)
# the default is in the enumerated space of its own options
assert default in warpsplitk.legal_tactics(
    8, 4224, 7168, k_splits=(default.k_split,), early_launches=(default.early_launch,),
    l2_prefetches=(default.l2_prefetch,), x_copies=(default.x_copy,))
some = [t for _, t in zip(range(5), warpsplitk.all_tactics())]
assert len(some) == 5 and all(isinstance(t, warpsplitk.WarpSplitKTactic) for t in some)
assert warpsplitk.ctas_per_sm(default) >= 1

# plans
plan = warpsplitk.builtin_plan("h200")
assert plan.lookup(4224, 7168, 1) is not None
with tempfile.TemporaryDirectory() as folder:
    path = os.path.join(folder, "plan.json")
    plan.save(path)
    assert warpsplitk.load_plan(path).entries == plan.entries
empty = warpsplitk.DecodePlan()
assert empty.lookup(4224, 7168, 1) is None

# CUDA only: present and callable (classes are callables too)
for name in ("PreparedWarpSplitK", "compile_warp_splitk", "prepare", "prepare_model",
             "DecodeLinear", "PatchReport", "patch_model", "unpatch",
             "ColumnParallelDecodeLinear", "RowParallelDecodeLinear", "ensure_no_multicast",
             "shard_plan", "column_shard", "row_shard"):
    assert callable(getattr(warpsplitk, name)), name
for name in ("PreparedWarpSplitK", "PreparedDecode", "DecodeLinear", "ColumnParallelDecodeLinear",
             "RowParallelDecodeLinear", "WarpSplitKTactic", "DecodePlan"):
    assert inspect.isclass(getattr(warpsplitk, name)), name
assert issubclass(warpsplitk.MulticastEnabledError, Exception)

if os.environ.get("CHECK_COMPILE") == "1":
    report = warpsplitk.compile_for_arch(32, 256, tactic, "sm_90a")
    assert report.registers and report.audit() == [], report.summary()
print("ok")
'''

ORDERS = {
    "plain": "",
    "from-import first": "from warpsplitk import emulate\n",
    "emulator module first": "import warpsplitk.kernel.emulator\n",
    "subpackages first": ("import warpsplitk.kernel, warpsplitk.runtime, warpsplitk.planning, "
                          "warpsplitk.nn, warpsplitk.measure, warpsplitk.cli\n"),
}


@pytest.mark.parametrize("order", list(ORDERS))
def test_public_names_after_any_import_order(order):
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    # compile once (a few seconds), where the CuTe DSL is installed
    import importlib.util
    if order == "plain" and importlib.util.find_spec("cutlass") is not None:
        env["CHECK_COMPILE"] = "1"
    done = subprocess.run([sys.executable, "-c", ORDERS[order] + CHECK], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "ok"


def test_import_stays_light():
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    probe = ("import sys, warpsplitk\n"
             "print(sorted(m for m in ('torch', 'cutlass', 'numpy') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def _code_trees(source):
    """The module's syntax tree, then that of every string constant in it
    that is Python code importing warpsplitk (the probes tests run in a
    subprocess with ``python -c``)."""
    import ast
    tree = ast.parse(source)
    yield tree
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and re.search(r"^\s*(from|import) warpsplitk", node.value, re.MULTILINE):
            try:
                yield ast.parse(node.value)
            except SyntaxError:
                continue  # text about imports, not code


def _warpsplitk_imports(path, package):
    """``(line, module, name)`` of every import of warpsplitk code in ``path``,
    at any depth (imports inside functions and in subprocess probes included)."""
    import ast
    import importlib.util
    for node in (node for tree in _code_trees(path.read_text()) for node in ast.walk(tree)):
        if isinstance(node, ast.ImportFrom):
            module = (importlib.util.resolve_name("." * node.level + (node.module or ""), package)
                      if node.level else node.module)
            if module.split(".")[0] == "warpsplitk":
                yield from ((node.lineno, module, alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name, None) for alias in node.names
                        if alias.name.split(".")[0] == "warpsplitk")


def test_every_import_of_the_package_resolves():
    """Imports inside functions run only on their path (many only on a GPU):
    each import of warpsplitk code in the package, the scripts, the examples
    and the tests names a module and an attribute or submodule that exist."""
    import importlib
    root = SRC.parent
    files = [(p, ".".join(p.relative_to(SRC).parent.parts)) for p in sorted(SRC.rglob("*.py"))]
    files += [(p, None) for d in ("scripts", "examples", "tests")
              for p in sorted((root / d).glob("*.py"))]
    missing, count = [], 0
    for path, package in files:
        for line, module, name in _warpsplitk_imports(path, package):
            count += 1
            found = importlib.import_module(module)
            if name is not None and name != "*" and not hasattr(found, name):
                try:
                    importlib.import_module(f"{module}.{name}")
                except ImportError:
                    missing.append(f"{path.relative_to(root)}:{line}: {module}.{name}")
    assert count > 200 and missing == []


def test_the_package_version_is_pyprojects():
    import tomllib
    from pathlib import Path

    import warpsplitk
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert warpsplitk.__version__ == project["version"]
