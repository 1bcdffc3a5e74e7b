"""transformers' fine-grained FP8 linear as a baseline where the Hub cannot
be reached.

``FP8Linear`` (what ``FineGrainedFP8Config`` puts in a model) runs a Triton
kernel that transformers fetches from the Hub at its first call
(``kernels-community/finegrained-fp8``, through the ``kernels`` package).
Offline, that fetch fails and the model cannot run at all. The kernel is
pure Triton, so a source checkout of it runs as well as the Hub's build:
``use_local_kernel`` imports one and hands it to transformers, which then
calls it where it would call the downloaded one. DeepGEMM, which
transformers prefers for 128 x 128 blocks where it can load it, is a Hub
kernel too and stays off.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

#: the package's import name in kernels-community's finegrained-fp8
PACKAGE = "finegrained_fp8"
#: the torch.library namespace its ops register in from a source checkout
#: (a Hub build generates ``_ops.py`` with a namespace of its own)
LOCAL_OP_NAMESPACE = "_finegrained_fp8_local"
#: transformers' names for the kernel's entry points -> the package's
ENTRY_POINTS = {"matmul": "matmul_2d", "batched_matmul": "matmul_batched",
                "grouped_matmul": "matmul_grouped"}


def package_dir(path) -> Path:
    """The ``finegrained_fp8`` package folder ``path`` names: the package
    itself, the kernel's folder (``finegrained-fp8``) or a checkout of
    kernels-community."""
    root = Path(path)
    for candidate in (root, root / "torch-ext" / PACKAGE,
                      root / "finegrained-fp8" / "torch-ext" / PACKAGE):
        if (candidate / "__init__.py").is_file() and (candidate / "matmul.py").is_file():
            return candidate
    raise ValueError(f"expected kernels-community's finegrained-fp8 (a checkout, its "
                     f"finegrained-fp8 folder or torch-ext/{PACKAGE}), got {str(path)!r}")


def _ops_module():
    """What kernel-builder generates as ``_ops.py``: the op namespace."""
    import torch
    module = types.ModuleType(f"{PACKAGE}._ops")
    module.ops = getattr(torch.ops, LOCAL_OP_NAMESPACE)
    module.add_op_namespace_prefix = lambda name: f"{LOCAL_OP_NAMESPACE}::{name}"
    return module


def load_package(path):
    """Import the ``finegrained_fp8`` package at ``path`` (once a process)."""
    if PACKAGE in sys.modules:
        return sys.modules[PACKAGE]
    root = package_dir(path)
    spec = importlib.util.spec_from_file_location(PACKAGE, root / "__init__.py",
                                                  submodule_search_locations=[str(root)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = module
    if not (root / "_ops.py").is_file():
        sys.modules[f"{PACKAGE}._ops"] = _ops_module()
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(PACKAGE, None)
        sys.modules.pop(f"{PACKAGE}._ops", None)
        raise
    return module


class _Kernel(types.SimpleNamespace):
    """The loaded kernel as transformers' loader returns it: its entry
    points under transformers' names, anything else from the package."""

    def __init__(self, package):
        super().__init__(**{ours: getattr(package, theirs)
                            for ours, theirs in ENTRY_POINTS.items()})
        self._package = package

    def __getattr__(self, name):
        return getattr(self.__dict__["_package"], name)


def use_local_kernel(path) -> str:
    """Make transformers' ``FP8Linear`` run the finegrained-fp8 kernel at
    ``path`` instead of fetching it; returns a line saying what runs."""
    from transformers.integrations import finegrained_fp8 as hf

    kernel = _Kernel(load_package(path))
    # transformers looks the loader up at every call: replacing it is how
    # its FP8Linear reaches a kernel that did not come from the Hub
    hf.load_finegrained_fp8_kernel = lambda: kernel
    return f"transformers FP8Linear on kernels-community finegrained-fp8 (Triton) from {path}"


__all__ = ["use_local_kernel", "load_package", "package_dir", "PACKAGE", "ENTRY_POINTS"]
