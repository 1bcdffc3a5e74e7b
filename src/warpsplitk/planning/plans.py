"""Preparing weights with a decode plan: ``prepare``, ``prepare_model``,
``precompile_for``, and the plan ``plan="auto"`` stands for (``resolve_plan``).

The plan data (``DecodePlan``, plan files, ``load_plan``, ``builtin_plan``,
``default_choice``, ``CUBLAS``) is :mod:`warpsplitk.planning.decode_plan`,
importable from here too. ``prepare`` compiles everything a weight needs
before any graph capture.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace

from ..contract import (
    MAX_M,
    fp8_refusal,
    fp8_scale_kind,
    fp8_value_refusal,
    is_fp8,
    matrix_refusal,
    weight_refusal,
    weight_tensors_refusal,
)
from ..runtime.compile import device_arch
from ..runtime.precompile import precompile
from ..runtime.prepared import PreparedDecode, PreparedWarpSplitK
from ..tactics import WarpSplitKTactic, check_ms, is_legal
from . import plan_cache
from .choose import default_tactic
from .decode_plan import (
    CUBLAS,
    FP8_PLAN_VERSION,
    PLAN_FORMAT,
    PLAN_VERSION,
    DecodePlan,
    builtin_plan,
    builtin_plans,
    check_plan,
    default_choice,
    is_time,
    load_plan,
    plan_from_json,
)


def resolve_plan(plan, shapes, ms=range(1, MAX_M + 1), *, progress=print, jobs=None,
                 fp8_shapes=None):
    """The ``DecodePlan`` (or None) ``plan`` stands for: ``"auto"`` is this
    GPU's plan (``plan_cache.auto_plan``), tuned first for the ``shapes``
    (``[(n, k)]`` of BF16 weights) and ``fp8_shapes`` (``[(n, k, scale
    kind)]`` of FP8 weights, :func:`fp8_tuning_shapes`) it lacks; no shapes,
    nothing to tune: None."""
    if check_plan(plan) != "auto":
        return plan
    if not shapes and not fp8_shapes:
        return None
    return plan_cache.auto_plan(shapes, ms, progress=progress, jobs=jobs, fp8_shapes=fp8_shapes)


def fp8_tuning_shapes(weights) -> list:
    """``[(n, k, scale kind)]`` of the FP8 weights of ``{name: (weight,
    scale)}`` (or ``(weight, scale, bias)``, as :func:`precompile_fp8`
    takes them) the kernel takes with their scales, each once: what
    ``plan="auto"`` tunes as FP8. The others are left to ``prepare``, which
    says what is wrong."""
    found = []
    for weight, scale, *_ in weights.values():
        if is_fp8(weight) and fp8_refusal(weight, scale) is None:
            n, k = weight.shape
            found.append((int(n), int(k), fp8_scale_kind(scale, n, k)))
    return list(dict.fromkeys(found))


def _weight_shape(name, t):
    """``t``'s shape, unless it is not a 2-D tensor ``[N, K]``."""
    reason = matrix_refusal(name, t, "[N, K]")
    if reason is not None:
        raise ValueError(reason)
    return t.shape


def _check_prepare_ms(ms) -> tuple[int, ...]:
    """``check_ms``, and at least one M: a prepared weight runs some M."""
    checked = check_ms(ms)
    if not checked:
        raise ValueError(f"ms must name at least one M in 1..{MAX_M}, got {ms!r}")
    return checked


def prepare(weight, plan: DecodePlan | str | None = None, ms=range(1, MAX_M + 1), bias=None, *,
            swiglu: bool = False, weight_scale=None, scale_kind: str | None = None):
    """``weight`` prepared with the plan's choice for each M in ``ms`` (the
    default (cost model) where the plan has none; ``plan="auto"``: this GPU's
    plan, tuned first where it lacks the shape), all compiled now: a
    ``PreparedWarpSplitK``, or, where the plan or the cost model runs some Ms
    on cuBLAS, a ``PreparedDecode`` with the same interface. With ``swiglu``
    (``weight`` is ``[gate; up]``): a ``PreparedWarpSplitK`` with the SwiGLU
    epilogue, every M on the kernel (:func:`swiglu_tactic`).

    An FP8 weight (``float8_e4m3fn``, with ``weight_scale`` and optionally
    ``scale_kind`` as ``PreparedWarpSplitK`` takes them) runs the plan's FP8
    entry for each M and its scales' kind, the FP8 default for them
    (``default_tactic(..., fp8=True, fp8_scales=...)``) where it has none;
    ``plan="auto"`` tunes its shape as FP8 where this GPU's plan lacks it."""
    n, k = _weight_shape("weight", weight)
    ms = _check_prepare_ms(ms)
    import torch  # not at the top: importing plans stays torch-free
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise ValueError(f"bias must be None or a torch.Tensor [N], got {type(bias).__name__}")
    check_plan(plan)
    if is_fp8(weight) or weight_scale is not None or scale_kind is not None:
        return _prepare_fp8(weight, plan, ms, bias, swiglu=swiglu, weight_scale=weight_scale,
                           scale_kind=scale_kind)
    # a tensor the kernel cannot take (device, dtype, layout) is refused before
    # any plan is read or tuned; a shape it cannot take, by the default below
    reason = weight_tensors_refusal(weight, bias)
    if reason:
        raise ValueError(reason)
    plan = resolve_plan(plan, [(n, k)] if weight_refusal(weight, bias) is None else [], ms)
    plan = plan if plan is not None else DecodePlan()
    if swiglu:
        return PreparedWarpSplitK(weight, {m: swiglu_tactic(plan, m, n, k) for m in ms},
                                  bias=bias, swiglu=True)
    return prepare_choices(weight, {m: plan.tactic_for(n, k, m) for m in ms}, bias)


def _prepare_fp8(weight, plan, ms, bias=None, *, swiglu=False, weight_scale=None,
                scale_kind=None) -> PreparedWarpSplitK:
    """:func:`prepare` of an FP8 weight (or of a weight given scales): its
    operands refused first, before any plan is read or tuned (``plan="auto"``
    tunes on e4m3 weights with scales of this weight's kind); then
    ``PreparedWarpSplitK``'s rules (scales only with an FP8 weight). With
    ``swiglu``: :func:`swiglu_tactic`'s FP8 choice (the tuner times no
    epilogue: a plan entry only where the epilogue takes it)."""
    n, k = weight.shape
    reason = fp8_refusal(weight, weight_scale, bias, scale_kind) if is_fp8(weight) else None
    if not reason and is_fp8(weight) and plan == "auto":
        # NaN codes and non-finite scales too (a read of both, which
        # PreparedWarpSplitK makes again), before any tuning
        reason = fp8_value_refusal(weight, weight_scale)
    if reason:
        raise ValueError(reason)
    # tuned only for what PreparedWarpSplitK then takes
    tunable = is_fp8(weight) and not swiglu
    plan = resolve_plan(plan, [], ms, fp8_shapes=fp8_tuning_shapes(
        {"weight": (weight, weight_scale)}) if tunable else None)
    plan = plan if plan is not None else DecodePlan()
    # (a BF16 weight given scales has no kind: PreparedWarpSplitK refuses it)
    kind = scale_kind or (fp8_scale_kind(weight_scale, n, k) if is_fp8(weight) else "channel")
    tactics = {m: swiglu_tactic(plan, m, n, k, fp8_scales=kind) if swiglu
               else plan.tactic_for(n, k, m, fp8_scales=kind) for m in ms}
    return PreparedWarpSplitK(weight, tactics, bias=bias, swiglu=swiglu,
                              weight_scale=weight_scale, scale_kind=scale_kind)


#: ``before_down`` applies up to this M: in chained layers (``bench --chain
#: --model``) it gained 1.1-2.6 us per gate/up at M = 1 and 8, and lost
#: 5.6 us at M = 32 (gemma-2-27b TP4, H200).
BEFORE_DOWN_MAX_M = 8


def swiglu_tactic(plan: DecodePlan | None, m: int, n: int, k: int,
                  sm_count: int | None = None, *, fp8_scales: str | None = None
                  ) -> WarpSplitKTactic:
    """The tactic M tokens run on a ``[gate; up]`` weight with the SwiGLU
    epilogue: the plan's, where it has one the epilogue takes (not cuBLAS,
    not a mixed grid), else ``default_tactic``'s for the epilogue; as the
    call before down (:func:`before_down`: the early PDL trigger at M <= 8).
    ``fp8_scales``: an e4m3 weight with scales of that kind, its plan
    entries and FP8 default (which set no trigger: measured on BF16 only)."""
    fp8 = fp8_scales is not None
    choice = plan.lookup(n, k, m, fp8_scales=fp8_scales) if plan is not None else None
    if choice is None or choice == CUBLAS or not is_legal(choice, n, k, swiglu=True, fp8=fp8):
        choice = default_tactic(m, n, k, sm_count, swiglu=True, fp8=fp8,
                                fp8_scales=fp8_scales or "channel")
    return choice if fp8 else before_down(choice, m)


def before_down(choice, m: int):
    """``choice`` for M tokens of an MLP's gate/up call, whose output the
    down projection's kernel reads next: with the early PDL trigger at
    M <= ``BEFORE_DOWN_MAX_M`` (cuBLAS as it is). Down's CTAs then become
    resident as gate/up's last CTAs leave their SMs and fill their rings
    from HBM during gate/up's tail; with the late trigger they launch only
    when gate/up's last CTAs are nearly done. The cost model and the tuner
    choose for independent calls, whose next call is the same shape, and
    leave the trigger off on large weights (``choose.hbm_bound``)."""
    if choice == CUBLAS or m > BEFORE_DOWN_MAX_M:
        return choice
    return replace(choice, early_launch=True)


def prepare_choices(weight, choices, bias=None):
    """``weight`` prepared for ``{M: tactic or CUBLAS}``: a ``PreparedWarpSplitK``
    when every M runs the kernel, else a ``PreparedDecode``."""
    cublas_ms = [m for m, t in choices.items() if t == CUBLAS]
    if not cublas_ms:
        return PreparedWarpSplitK(weight, choices, bias=bias)
    tactics = {m: t for m, t in choices.items() if t != CUBLAS}
    return PreparedDecode(weight, tactics, cublas_ms, bias=bias)


def precompile_for(weights, plan: DecodePlan | None = None, ms=range(1, MAX_M + 1),
                   jobs=None, progress=print, has_bias=False, swiglu=False):
    """Compile, in parallel worker processes, every kernel that preparing
    ``weights`` (an iterable of CUDA tensors) with ``plan`` (and ``swiglu``,
    as :func:`prepare`) will need, into the disk cache; preparing then loads
    them. Returns the failures (the later in-process compile reports their
    errors)."""
    import torch  # as in prepare

    weights = list(weights)
    plan = resolve_plan(plan, [tuple(w.shape) for w in weights if isinstance(w, torch.Tensor)
                               and w.is_cuda and w.dim() == 2], ms, progress=progress,
                        jobs=jobs)
    plan = plan if plan is not None else DecodePlan()
    by_arch = {}
    for weight in weights:
        # what PreparedWarpSplitK would refuse is left to it (and its errors)
        if (not isinstance(weight, torch.Tensor) or weight.device.type != "cuda"
                or weight.dtype != torch.bfloat16 or weight.dim() != 2):
            continue
        n, k = weight.shape
        index = weight.device.index
        try:
            arch = device_arch(torch.cuda.current_device() if index is None else index)
            if swiglu:
                kernels = [(n, k, swiglu_tactic(plan, m, n, k), has_bias, True, True)
                           for m in ms]
            else:
                kernels = [(n, k, t, has_bias, True)
                           for t in (plan.tactic_for(n, k, m) for m in ms) if t != CUBLAS]
        except ValueError:
            continue
        by_arch.setdefault(arch, []).extend(kernels)
    failures = {}
    for arch, kernels in by_arch.items():
        failures.update(precompile(kernels, arch, jobs, progress))
    return failures


def precompile_fp8(weights, ms=range(1, MAX_M + 1), jobs=None, progress=None, *,
                   plan: DecodePlan | None = None, swiglu: bool = False):
    """As :func:`precompile_for`, for ``{name: (fp8 weight, scale)}`` or
    ``{name: (fp8 weight, scale, bias)}``: the kernels of ``plan``'s FP8
    entries for each weight's scales (the FP8 default's where it has none;
    ``swiglu``: :func:`swiglu_tactic`'s, with the epilogue), compiled in
    worker processes into the disk cache."""
    import torch  # as in prepare

    plan = plan if plan is not None else DecodePlan()
    by_arch = {}
    for weight, scale, *bias in weights.values():
        if not is_fp8(weight) or not weight.is_cuda or weight.dim() != 2:
            continue  # prepare says what is wrong
        n, k = weight.shape
        kind = fp8_scale_kind(scale, n, k) if hasattr(scale, "shape") else None
        if kind is None:
            continue  # as above
        has_bias = bool(bias) and bias[0] is not None
        try:
            arch = device_arch(weight.device.index if weight.device.index is not None
                               else torch.cuda.current_device())
            kernels = [(n, k, swiglu_tactic(plan, m, n, k, fp8_scales=kind) if swiglu
                        else plan.tactic_for(n, k, m, fp8_scales=kind), has_bias, True,
                        swiglu, kind) for m in ms]
        except ValueError:
            continue
        by_arch.setdefault(arch, []).extend(kernels)
    for arch, kernels in by_arch.items():
        precompile(kernels, arch, jobs, progress)


def prepare_model(weights, plan: DecodePlan | None = None, ms=range(1, MAX_M + 1), progress=print,
                  jobs=None, *, weight_scales=None):
    """Prepare every weight of ``{name: weight}`` before graph capture; reports
    progress and the total compile time. Returns ``{name: prepared}`` (each a
    ``PreparedWarpSplitK`` or ``PreparedDecode``, as :func:`prepare`).

    The kernels are first compiled ``jobs`` at a time in worker processes
    (default: ``precompile.default_jobs()``) into the
    disk cache, from which each weight's preparation then loads them.

    ``plan="auto"``: the plan for this GPU (``warpsplitk.planning.plan_cache``), tuning
    first the weights' shapes it lacks (the FP8 weights' as FP8) and keeping
    them for the next process.
    ``weight_scales``: ``{name: scale}`` for the FP8 weights among ``weights``
    (as :func:`prepare`'s ``weight_scale``)."""
    start = time.perf_counter()
    if not isinstance(weights, Mapping):
        raise ValueError(f"weights must be a mapping {{name: torch.Tensor}}, got "
                         f"{type(weights).__name__}")
    scales = dict(weight_scales or {})
    strays = sorted(set(scales) - set(weights), key=str)
    if strays:
        raise ValueError(f"weight_scales names weights not in weights: {strays[:3]}")
    for name, weight in weights.items():
        _weight_shape(f"weights[{name!r}]", weight)
    ms = _check_prepare_ms(ms)
    bf16 = {name: w for name, w in weights.items() if name not in scales and not is_fp8(w)}
    fp8 = {name: (weights[name], scale) for name, scale in scales.items()}
    plan = resolve_plan(plan, [tuple(w.shape) for w in bf16.values()], ms,
                        progress=progress, jobs=jobs, fp8_shapes=fp8_tuning_shapes(fp8))
    precompile_for(bf16.values(), plan, ms, jobs, progress)
    precompile_fp8(fp8, ms, jobs, progress, plan=plan)
    prepared = {}
    for i, (name, weight) in enumerate(weights.items(), 1):
        t0 = time.perf_counter()
        try:
            prepared[name] = prepare(weight, plan, ms, weight_scale=scales.get(name))
        except ValueError as error:
            raise ValueError(f"weights[{name!r}]: {error}") from None
        if progress:
            progress(f"[{i}/{len(weights)}] {name} {tuple(weight.shape)} "
                     f"{time.perf_counter() - t0:.1f} s")
    if progress:
        progress(f"prepared {len(weights)} weights in {time.perf_counter() - start:.1f} s")
    return prepared


__all__ = ["resolve_plan", "prepare", "prepare_model", "precompile_fp8",
           "fp8_tuning_shapes", "prepare_choices", "precompile_for",
           "swiglu_tactic", "before_down", "BEFORE_DOWN_MAX_M",
           # from decode_plan
           "CUBLAS", "FP8_PLAN_VERSION", "PLAN_FORMAT", "PLAN_VERSION", "DecodePlan", "builtin_plan", "builtin_plans",
           "check_plan", "default_choice", "is_time", "load_plan", "plan_from_json"]
