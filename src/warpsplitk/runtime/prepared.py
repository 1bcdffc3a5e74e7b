"""``PreparedWarpSplitK``: a weight validated and compiled for, ready to run.

Everything slow happens in ``__init__`` (validation, one compile per distinct
tactic); ``run`` checks its arguments cheaply and launches once, with no
allocation, no host synchronisation and no compilation, so it is safe inside
CUDA graph capture. ``PreparedDecode`` is the same for a plan that runs some
Ms on cuBLAS (``plans.CUBLAS``).
"""

from __future__ import annotations

from collections.abc import Mapping

from .. import contract
from .compile import compile_warp_splitk, launcher
from ..tactics import MAX_M, WarpSplitKTactic, as_integer, check_tactic

def _torch():
    import torch
    return torch


def stream_handle(device) -> int:
    """The handle of the current stream on a CUDA ``device``, as an int.

    ``torch._C._cuda_getCurrentRawStream`` (what Triton's launcher uses)
    returns it without building a ``torch.cuda.Stream`` object, a few
    microseconds less per launch; the public call is the fallback.
    """
    torch = _torch()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None and device.index is not None:
        return raw(device.index)
    return torch.cuda.current_stream(device).cuda_stream


def _check_packed(name, t, shape, device):
    """``ValueError`` with ``contract.operand_refusal``'s reason, if any."""
    reason = contract.operand_refusal(name, t, shape, device)
    if reason is not None:
        raise ValueError(reason)


def _check_weight(weight, bias):
    """``(N, K)`` of a weight the kernel can take with ``bias``: ``ValueError``
    with the contract's reason otherwise (its shape rules are the tactics')."""
    reason = contract.weight_tensors_refusal(weight, bias)
    if reason is not None:
        raise ValueError(reason)
    return weight.shape


def _check_fp8(weight, scale, bias, scale_kind) -> str:
    """The scale kind of an FP8 weight the kernel can take with ``scale`` and
    ``bias``: ``ValueError`` with the contract's reason otherwise (NaN codes
    and non-finite scales included, read from the device)."""
    reason = (contract.fp8_refusal(weight, scale, bias, scale_kind)
              or contract.fp8_value_refusal(weight, scale))
    if reason is not None:
        raise ValueError(reason)
    return contract.fp8_scale_kind(scale, *weight.shape)


def _check_run(prepared, x, out):
    """``run``'s checks of ``x`` and ``out`` against a prepared weight (its
    ``tactics`` by M, ``k``, ``out_columns``, ``device``, ``weight``, ``bias``):
    ``ValueError`` for bad arguments, ``KeyError`` for an M not prepared."""
    torch = _torch()
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D torch.Tensor [M, K], got "
                         f"{contract.describe(x) if isinstance(x, torch.Tensor) else type(x).__name__}")
    m = x.shape[0]
    if m not in prepared.tactics:
        if not 1 <= m <= MAX_M:
            raise ValueError(f"x must have 1..{MAX_M} rows (M tokens), got {contract.describe(x)}")
        raise KeyError(f"no tactic prepared for M={m}; prepared Ms: {list(prepared.tactics)}")
    _check_packed("x", x, (m, prepared.k), prepared.device)
    _check_packed("out", out, (m, prepared.out_columns), prepared.device)
    for name, other in (("x", x), ("the weight", prepared.weight), ("the bias", prepared.bias),
                        ("the weight scale", getattr(prepared, "weight_scale", None))):
        if other is not None and _overlap(out, other):
            raise ValueError(f"out must not overlap {name}")


def _matrix_shape(name, t, dims):
    """``t``'s shape, unless it is not a 2-D tensor (``dims`` names its axes)."""
    reason = contract.matrix_refusal(name, t, dims)
    if reason is not None:
        raise ValueError(reason)
    return t.shape


def _check_tactics(tactics, n, k, swiglu=False, fp8=False) -> dict:
    """``tactics`` keyed by int M, sorted; ``ValueError`` unless it maps Ms in
    1..32 (any integral type) to tactics legal for an ``[n, k]`` weight
    (``swiglu``: with the SwiGLU epilogue; ``fp8``: e4m3); no GPU needed."""
    if not isinstance(tactics, Mapping) or not tactics:
        raise ValueError("tactics must be a non-empty mapping {M: WarpSplitKTactic}, got "
                         f"{tactics!r}")
    checked = {}
    for key, tactic in tactics.items():
        m = as_integer(key)
        if m is None or not 1 <= m <= MAX_M:
            raise ValueError(f"tactics are keyed by M in 1..{MAX_M}, got key {key!r}")
        try:
            check_tactic(tactic, n, k, swiglu=swiglu, fp8=fp8)
        except ValueError as error:
            raise ValueError(f"tactic for M={m}: {error}") from None
        checked[m] = tactic
    return dict(sorted(checked.items()))


def _span(t):
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def _overlap(a, b):
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


class PreparedWarpSplitK:
    """``out[M, N] = x[M, K] @ weight[N, K]^T (+ bias)`` for M <= 32, a tactic per M.

    weight: packed row-major BF16 ``[N, K]`` on a CUDA device, 32-byte
        aligned; kept by reference (it must not be changed or freed while
        prepared code may run). Or FP8: ``float8_e4m3fn`` (W8A16: x and out
        stay BF16), with ``weight_scale``.
    tactics: ``{M: WarpSplitKTactic}`` for the Ms ``run`` will see (1..32);
        Ms that share a tactic share one compiled kernel.
    bias: optional BF16 ``[N]``, added in FP32 before the final rounding.
    swiglu: the SwiGLU epilogue: ``weight`` is ``[w_gate; w_up]`` (``N =
        2 I`` rows, ``bias`` likewise ``[b_gate; b_up]``) and ``run`` writes
        ``out[M, I] = silu(x @ w_gate^T + b_gate) * (x @ w_up^T + b_up)``,
        in FP32 until the one BF16 rounding, in the same single launch.
    weight_scale: an FP8 weight's FP32 scales, on its device (kept by
        reference): one (shape ``()`` or ``(1,)``, ``scale_kind="tensor"``),
        one per output row (``[N]`` or ``[N, 1]``, ``"channel"``), applied to
        each column's FP32 sum, or one per 128 x 128 block (``[ceil(N / 128),
        ceil(K / 128)]``, ``"block128"``, each below 128), folded into the
        weight's conversion (each weight times its scale rounded to BF16:
        <= 2 ** -7 relative); ``out = x @ (weight * scale)^T (+ bias)``.
        ``scale_kind`` None: by the scale's shape.
        e4m3 NaN codes in the weight are refused here (a read of the weight).

    Raises ``ValueError`` for anything the kernel cannot run.
    """

    #: BF16 weights: no scales (an FP8 weight's instance sets these)
    weight_scale = None
    fp8_scales = None
    _scale_address = None

    def __init__(self, weight, tactics: Mapping[int, WarpSplitKTactic], bias=None, *,
                 swiglu: bool = False, weight_scale=None, scale_kind: str | None = None):
        torch = _torch()
        fp8 = contract.is_fp8(weight) or weight_scale is not None or scale_kind is not None
        if fp8 and isinstance(weight, torch.Tensor) and not contract.is_fp8(weight):
            raise ValueError(f"weight_scale and scale_kind are for {contract.FP8_DTYPE_NAME} "
                             f"weights, got a {weight.dtype} weight")
        if fp8:
            self.fp8_scales = _check_fp8(weight, weight_scale, bias, scale_kind)
            n, k = weight.shape
        else:
            self.fp8_scales = None
            n, k = _check_weight(weight, bias)
        tactics = _check_tactics(tactics, n, k, bool(swiglu), fp8)
        self.weight = weight
        self.bias = bias
        #: the FP8 weight's scales (None for BF16); ``fp8_scales`` their kind
        self.weight_scale = weight_scale
        self.n, self.k = n, k
        self.swiglu = bool(swiglu)
        #: columns of ``out``: N, or I = N / 2 with the SwiGLU epilogue
        self.out_columns = n // 2 if self.swiglu else n
        self.device = weight.device
        self.tactics = tactics
        index = weight.device.index if weight.device.index is not None else torch.cuda.current_device()
        has_bias = bias is not None
        options = dict(has_bias=has_bias, swiglu=self.swiglu, fp8_scales=self.fp8_scales)
        by_tactic = {t: compile_warp_splitk(index, n, k, t, **options)
                     for t in set(self.tactics.values())}
        self.codes = {m: by_tactic[t] for m, t in self.tactics.items()}
        self._launchers = {m: launcher(index, n, k, t, **options)
                           for m, t in self.tactics.items()}
        self._weight_address = weight.data_ptr()
        # Without a bias the kernel never reads its bias argument; the weight's
        # address fills the slot.
        self._bias_address = bias.data_ptr() if has_bias else weight.data_ptr()
        self._scale_address = weight_scale.data_ptr() if fp8 else None

    @property
    def ms(self):
        return tuple(self.tactics)

    def run(self, x, out):
        """Launch on the current stream of x's device; returns ``out``.

        x: packed row-major BF16 ``[M, K]``; out: packed row-major BF16
        ``[M, N]`` (``[M, N / 2]`` with ``swiglu``), not overlapping x or
        the weight; both 32-byte aligned,
        on the weight's device. ``ValueError`` for bad arguments and
        ``KeyError`` for an M with no prepared tactic, before any launch.
        """
        _check_run(self, x, out)
        return self.launch_unchecked(x, out)

    def launch_unchecked(self, x, out):
        """``run`` without its checks, for a caller that has made them: x a
        packed, aligned BF16 ``[M, K]`` on the weight's device with M among
        ``ms``, ``out`` a packed, aligned ``[M, out_columns]`` overlapping
        nothing (a fresh allocation). Anything else is undefined on the GPU."""
        m = x.shape[0]
        if self._scale_address is None:
            self._launchers[m](self._weight_address, x.data_ptr(), self._bias_address,
                               out.data_ptr(), m, stream_handle(self.device))
        else:
            self._launchers[m](self._weight_address, x.data_ptr(), self._bias_address,
                               self._scale_address, out.data_ptr(), m,
                               stream_handle(self.device))
        return out

    __call__ = run

    def __repr__(self):
        plan = ", ".join(f"{m}: ({t.short()})" for m, t in self.tactics.items())
        swiglu = ", swiglu=True" if self.swiglu else ""
        fp8 = f", fp8 {self.fp8_scales} scales" if self.fp8_scales else ""
        return (f"PreparedWarpSplitK(N={self.n}, K={self.k}, device={self.device}, "
                f"bias={self.bias is not None}{swiglu}{fp8}, tactics={{{plan}}})")


class PreparedDecode:
    """What ``plans.prepare`` returns when a plan runs some Ms on cuBLAS:
    ``torch.matmul`` (``torch.addmm`` with a bias) into ``out`` for
    ``cublas_ms``, the warp split-K kernel (a ``PreparedWarpSplitK``) for the
    Ms of ``tactics``. The same interface and checks as
    ``PreparedWarpSplitK``; ``run`` allocates nothing, so it is captured in
    CUDA graphs like the kernel (prepare, or run once, before capturing:
    cuBLAS sets up its workspace on its first call)."""

    def __init__(self, weight, tactics: Mapping[int, WarpSplitKTactic], cublas_ms, bias=None):
        torch = _torch()
        # as the kernel's rules: the cuBLAS Ms alone would run anywhere, but a
        # prepared weight is one the kernel path could take
        n, k = _check_weight(weight, bias)
        cublas_ms = tuple(sorted(set(cublas_ms)))
        for m in cublas_ms:
            if not isinstance(m, int) or isinstance(m, bool) or not 1 <= m <= MAX_M:
                raise ValueError(f"cuBLAS Ms are in 1..{MAX_M}, got {m!r}")
            if m in tactics:
                raise ValueError(f"M={m} has both a tactic and cuBLAS")
        if not cublas_ms:
            raise ValueError("a PreparedDecode has at least one cuBLAS M "
                             "(else use PreparedWarpSplitK)")
        self.kernel = PreparedWarpSplitK(weight, tactics, bias=bias) if tactics else None
        self.weight, self.bias = weight, bias
        self.n, self.k = n, k
        self.out_columns = n
        self.swiglu = False  # the SwiGLU epilogue runs on the kernel alone
        self.device = weight.device
        self.cublas_ms = cublas_ms
        self.tactics = dict(sorted({**dict(tactics), **{m: "cublas" for m in cublas_ms}}.items()))
        self._weight_t = weight.t()  # a view: no copy, the weight's storage

    @property
    def ms(self):
        return tuple(self.tactics)

    def run(self, x, out):
        """As ``PreparedWarpSplitK.run``: checks, then one call (the kernel,
        or cuBLAS for ``cublas_ms``) on the current stream; returns ``out``."""
        _check_run(self, x, out)
        return self.launch_unchecked(x, out)

    def launch_unchecked(self, x, out):
        """As ``PreparedWarpSplitK.launch_unchecked``: ``run`` without its
        checks, only for a caller that has made them."""
        if x.shape[0] in self.cublas_ms:
            torch = _torch()
            if self.bias is None:
                return torch.matmul(x, self._weight_t, out=out)
            return torch.addmm(self.bias, x, self._weight_t, out=out)
        return self.kernel.launch_unchecked(x, out)

    __call__ = run

    def __repr__(self):
        plan = ", ".join(f"{m}: ({t if t == 'cublas' else t.short()})"
                         for m, t in self.tactics.items())
        return (f"PreparedDecode(N={self.n}, K={self.k}, device={self.device}, "
                f"bias={self.bias is not None}, tactics={{{plan}}})")
