"""warpsplitk: warp split-K BF16 GEMM kernels for the decode step of LLMs.

``out[M, N] = x[M, K] @ W[N, K]^T`` for M <= 32, streaming W from HBM.

    from warpsplitk import PreparedWarpSplitK, default_tactic
    prepared = PreparedWarpSplitK(weight, {m: default_tactic(m, n, k) for m in (1, 8)})
    prepared.run(x, out)   # graph-capturable, one launch
"""

from .tactics import (
    WarpSplitKTactic,
    all_tactics,
    check_tactic,
    ctas_per_sm,
    default_tactic,
    legal_tactics,
)

__version__ = "0.1.0"

_LAZY = {
    "PreparedWarpSplitK": ("prepared", "PreparedWarpSplitK"),
    "compile_warp_splitk": ("compile", "compile_warp_splitk"),
    "compile_for_arch": ("compile", "compile_for_arch"),
    "emulate": ("emulate", "emulate"),
    "DecodePlan": ("decode", "DecodePlan"),
    "load_plan": ("decode", "load_plan"),
    "builtin_plan": ("decode", "builtin_plan"),
    "prepare": ("decode", "prepare"),
    "prepare_model": ("decode", "prepare_model"),
    "DecodeLinear": ("linear", "DecodeLinear"),
    "PatchReport": ("linear", "PatchReport"),
    "patch_model": ("linear", "patch_model"),
    "unpatch": ("linear", "unpatch"),
    "merge_linears": ("merge", "merge_linears"),
    "ColumnParallelDecodeLinear": ("parallel", "ColumnParallelDecodeLinear"),
    "RowParallelDecodeLinear": ("parallel", "RowParallelDecodeLinear"),
    "ensure_no_multicast": ("parallel", "ensure_no_multicast"),
    "MulticastEnabledError": ("parallel", "MulticastEnabledError"),
    "shard_plan": ("parallel", "shard_plan"),
    "column_shard": ("parallel", "column_shard"),
    "row_shard": ("parallel", "row_shard"),
}


def __getattr__(name):
    # torch and the CuTe DSL load on first use, so the tactic model stays light
    if name in _LAZY:
        import importlib
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(f".{module}", __name__), attr)
    raise AttributeError(f"module 'warpsplitk' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


# A name exported here that is also a submodule's (``emulate``): importing
# the submodule (``import warpsplitk.emulate``, ``from warpsplitk import
# emulate`` before first use, any module of the package importing it) makes
# the import system set the package's attribute to the submodule, hiding the
# function. So such a name is a property of the package's module class, which
# the import system's assignment cannot replace, and its value is the
# submodule made callable as its function: ``warpsplitk.emulate(x, w, tactic)``
# calls the function, and ``import warpsplitk.emulate as em; em.layout`` still
# reaches the module, whatever was imported first.
import sys as _sys
import types as _types


class _CallableModule(_types.ModuleType):
    """A submodule called as the function of its own name."""

    def __call__(self, *args, **kwargs):
        return getattr(self, self.__name__.rpartition(".")[2])(*args, **kwargs)

    @property
    def __wrapped__(self):  # inspect.signature and help() show the function's
        return getattr(self, self.__name__.rpartition(".")[2])


def _colliding(name):
    module, attr = _LAZY[name]

    def get(package):
        assigned = package.__dict__.get(f"_assigned_{name}")
        if assigned is not None:  # set by hand (a test's monkeypatch, say)
            return assigned
        import importlib
        sub = importlib.import_module(f".{module}", package.__name__)
        if type(sub) is _types.ModuleType:
            sub.__class__ = _CallableModule
        return sub

    def set_(package, value):
        # the import system assigning the submodule itself: keep serving it callable
        sub = _sys.modules.get(f"{package.__name__}.{module}")
        package.__dict__[f"_assigned_{name}"] = None if value is sub else value

    def delete(package):
        package.__dict__[f"_assigned_{name}"] = None

    return property(get, set_, delete, doc=f"{module}.{attr} (callable), or the {module} module")


class _Package(_types.ModuleType):
    pass


for _name, (_module, _attr) in _LAZY.items():
    if _name == _module:
        setattr(_Package, _name, _colliding(_name))
_sys.modules[__name__].__class__ = _Package
del _name, _module, _attr


__all__ = ["WarpSplitKTactic", "check_tactic", "default_tactic", "legal_tactics", "all_tactics",
           "ctas_per_sm", "PreparedWarpSplitK", "compile_warp_splitk", "compile_for_arch",
           "emulate", "DecodePlan", "load_plan", "builtin_plan", "prepare", "prepare_model",
           "DecodeLinear", "PatchReport", "patch_model", "unpatch", "merge_linears",
           "ColumnParallelDecodeLinear", "RowParallelDecodeLinear", "ensure_no_multicast",
           "MulticastEnabledError", "shard_plan", "column_shard", "row_shard", "__version__"]
