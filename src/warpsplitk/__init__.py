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


__all__ = ["WarpSplitKTactic", "check_tactic", "default_tactic", "legal_tactics", "all_tactics",
           "ctas_per_sm", "PreparedWarpSplitK", "compile_warp_splitk", "compile_for_arch",
           "emulate", "DecodePlan", "load_plan", "builtin_plan", "prepare", "prepare_model",
           "DecodeLinear", "PatchReport", "patch_model", "unpatch",
           "ColumnParallelDecodeLinear", "RowParallelDecodeLinear", "ensure_no_multicast",
           "MulticastEnabledError", "shard_plan", "column_shard", "row_shard", "__version__"]
