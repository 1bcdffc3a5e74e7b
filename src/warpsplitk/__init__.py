"""warpsplitk: warp split-K GEMM kernels for the decode step of LLMs.

``out[M, N] = x[M, K] @ W[N, K]^T`` for M <= 32, streaming W from HBM: BF16
weights, or e4m3 (FP8) weights with FP32 scales (activations BF16).

    from warpsplitk import PreparedWarpSplitK, default_tactic
    prepared = PreparedWarpSplitK(weight, {m: default_tactic(m, n, k) for m in (1, 8)})
    prepared.run(x, out)   # graph-capturable, one launch
"""

from .tactics import (
    WarpSplitKTactic,
    all_tactics,
    check_tactic,
    ctas_per_sm,
    legal_tactics,
)

from .version import __version__

_LAZY = {
    "default_tactic": ("planning.choose", "default_tactic"),
    "PreparedWarpSplitK": ("runtime.prepared", "PreparedWarpSplitK"),
    "PreparedDecode": ("runtime.prepared", "PreparedDecode"),
    "compile_warp_splitk": ("runtime.compile", "compile_warp_splitk"),
    "compile_for_arch": ("runtime.compile", "compile_for_arch"),
    "emulate": ("kernel.emulator", "emulate"),
    "emulate_fp8": ("kernel.emulator", "emulate_fp8"),
    "DecodePlan": ("planning.decode_plan", "DecodePlan"),
    "load_plan": ("planning.decode_plan", "load_plan"),
    "builtin_plan": ("planning.decode_plan", "builtin_plan"),
    "prepare": ("planning.plans", "prepare"),
    "prepare_model": ("planning.plans", "prepare_model"),
    "DecodeLinear": ("nn.linear", "DecodeLinear"),
    "PatchReport": ("nn.patch", "PatchReport"),
    "patch_model": ("nn.patch", "patch_model"),
    "unpatch": ("nn.patch", "unpatch"),
    "merge_linears": ("nn.merge", "merge_linears"),
    "ColumnParallelDecodeLinear": ("nn.parallel", "ColumnParallelDecodeLinear"),
    "RowParallelDecodeLinear": ("nn.parallel", "RowParallelDecodeLinear"),
    "ensure_no_multicast": ("nn.parallel", "ensure_no_multicast"),
    "MulticastEnabledError": ("nn.parallel", "MulticastEnabledError"),
    "shard_plan": ("nn.parallel", "shard_plan"),
    "column_shard": ("nn.parallel", "column_shard"),
    "row_shard": ("nn.parallel", "row_shard"),
}


def __getattr__(name):
    # planning, torch and the CuTe DSL load on first use, so the tactic model stays light
    if name in _LAZY:
        import importlib
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(f".{module}", __name__), attr)
    raise AttributeError(f"module 'warpsplitk' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["WarpSplitKTactic", "check_tactic", "default_tactic", "legal_tactics", "all_tactics",
           "ctas_per_sm", "PreparedWarpSplitK", "PreparedDecode", "compile_warp_splitk",
           "compile_for_arch", "emulate", "emulate_fp8", "DecodePlan", "load_plan", "builtin_plan", "prepare",
           "prepare_model", "DecodeLinear", "PatchReport", "patch_model", "unpatch",
           "merge_linears", "ColumnParallelDecodeLinear", "RowParallelDecodeLinear",
           "ensure_no_multicast", "MulticastEnabledError", "shard_plan", "column_shard",
           "row_shard", "__version__"]
