"""The kernel as PyTorch custom ops.

    decode_linear(Tensor x, Tensor weight, Tensor? bias, int handle) -> Tensor
    decode_swiglu(Tensor x, Tensor weight, Tensor? bias, int handle) -> Tensor
    decode_linear_fp8(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias,
                      int handle) -> Tensor
    decode_swiglu_fp8(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias,
                      int handle) -> Tensor

``decode_linear``: ``out[M, N] = x[M, K] @ weight[N, K]^T (+ bias)`` on CUDA.
``decode_swiglu``: ``weight`` is ``[w_gate; w_up]`` and the kernel has the
SwiGLU epilogue, ``out[M, N / 2] = silu(gate) * up`` (what a merged MLP runs
under torch.compile). ``decode_linear_fp8``: an e4m3 ``weight`` with its FP32
``weight_scale`` (one, one per row, or one per 128 x 128 block), x and out
BF16; ``decode_swiglu_fp8``: both (a merged FP8 MLP's gate/up). A custom op
cannot take a ``PreparedWarpSplitK``
(compiled code, CuTe views) as an argument, so the prepared object lives in
a registry here and the op gets its integer ``handle``. ``weight`` and
``bias`` are passed as well, although the kernel reads them through the
prepared object: that way torch.compile sees the op's real data
dependencies, and the fake implementation knows N without a lookup.

CUDA-graph capturable: the implementation allocates only the output (from
the caching allocator, so from the graph's pool while capturing), launches
once on the current stream and never synchronises. Compile with
``prepare`` before capturing; nothing here compiles.

The registry holds prepared objects weakly: whoever registers one (a
``DecodeLinear``, a merged MLP's group) keeps it alive, and its handle stops
resolving when it dies.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Optional

import torch

from ..contract import ALIGN_BYTES, fp8_scale_factors


_registry: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_handles = itertools.count(1)
_lock = threading.Lock()


def register(prepared) -> int:
    """A new handle for ``prepared`` (a ``PreparedWarpSplitK``); the caller
    keeps ``prepared`` alive for as long as the handle is used."""
    with _lock:
        handle = next(_handles)
        _registry[handle] = prepared
    return handle


def unregister(handle) -> None:
    with _lock:
        _registry.pop(handle, None)


def lookup(handle: int):
    prepared = _registry.get(handle)
    if prepared is None:
        raise KeyError(f"warpsplitk: no prepared weight with handle {handle} "
                       "(it was re-prepared or freed)")
    return prepared


def _same(a, b):
    return (a is None) == (b is None) and (a is None or a.data_ptr() == b.data_ptr())


def _run(name, x, weight, bias, handle, weight_scale=None):
    prepared = lookup(handle)
    # The kernel reads the prepared weight; refuse to silently use a stale one.
    if not (_same(weight, prepared.weight) and _same(bias, prepared.bias)
            and _same(weight_scale, getattr(prepared, "weight_scale", None))):
        raise ValueError(f"warpsplitk.{name}: weight/bias are not the tensors handle "
                         f"{handle} was prepared for; re-prepare after replacing them")
    if prepared.swiglu != name.startswith("decode_swiglu"):
        raise ValueError(f"warpsplitk.{name}: handle {handle} is a kernel "
                         f"{'with' if prepared.swiglu else 'without'} the SwiGLU epilogue")
    # The modules only send packed, aligned x in eager mode; under torch.compile
    # they cannot see addresses, so re-pack here instead of failing (an [M, K]
    # copy, small next to the weight read).
    if not x.is_contiguous() or x.data_ptr() % ALIGN_BYTES:
        x = x.clone(memory_format=torch.contiguous_format)
    out = torch.empty((x.shape[0], prepared.out_columns), dtype=torch.bfloat16, device=x.device)
    return prepared.run(x, out)


def _decode_linear_cuda(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                        handle: int) -> torch.Tensor:
    return _run("decode_linear", x, weight, bias, handle)


def _decode_swiglu_cuda(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                        handle: int) -> torch.Tensor:
    return _run("decode_swiglu", x, weight, bias, handle)


def _decode_linear_fp8_cuda(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                            bias: Optional[torch.Tensor], handle: int) -> torch.Tensor:
    return _run("decode_linear_fp8", x, weight, bias, handle, weight_scale)


def _decode_swiglu_fp8_cuda(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                            bias: Optional[torch.Tensor], handle: int) -> torch.Tensor:
    return _run("decode_swiglu_fp8", x, weight, bias, handle, weight_scale)


def dequantized(weight, weight_scale, dtype):
    """An FP8 weight times its scales (``contract.fp8_scale_factors``), as ``dtype``."""
    return (weight.float() * fp8_scale_factors(weight_scale, *weight.shape)).to(dtype)


def _linear_backward(ctx, grad):
    # Plain matmuls: the kernel is forward-only, but a model run without
    # torch.no_grad() should still get correct gradients.
    x, weight, bias = ctx.saved_tensors
    grad_x = grad @ weight if ctx.needs_input_grad[0] else None
    grad_w = grad.t() @ x if ctx.needs_input_grad[1] else None
    grad_b = grad.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
    return grad_x, grad_w, grad_b, None


def _swiglu_backward(ctx, grad):
    x, weight, bias = ctx.saved_tensors
    return _linear_backward(ctx, _swiglu_pre_grad(x, weight, bias, grad))


def _swiglu_pre_grad(x, weight, bias, grad):
    """The gradient at ``x @ weight^T + bias`` (``[gate; up]``) of ``silu(gate)
    * up`` given ``grad`` at its output; recomputes gate and up (the epilogue
    keeps neither) in the inputs' precision."""
    half = weight.shape[0] // 2
    pre = x @ weight.t()
    if bias is not None:
        pre = pre + bias
    acc = torch.promote_types(pre.dtype, torch.float32)  # the epilogue computes in FP32
    gate, up, grad = pre[:, :half].to(acc), pre[:, half:].to(acc), grad.to(acc)
    sig = torch.sigmoid(gate)
    grad_gate = grad * up * sig * (1 + gate * (1 - sig))  # d silu(g) / dg
    return torch.cat([grad_gate, grad * gate * sig], dim=1).to(x.dtype)


def _setup_context(ctx, inputs, output):
    x, weight, bias, _ = inputs
    ctx.save_for_backward(x, weight, bias)


def _check_matrices(x, weight):
    """The fake implementations' first checks: ``x`` ``[M, K]``, ``weight`` ``[N, K]``."""
    torch._check(x.dim() == 2, lambda: f"x must be [M, K], got {x.dim()}-D")
    torch._check(weight.dim() == 2, lambda: f"weight must be [N, K], got {weight.dim()}-D")


def _fake_output(x, weight, bias, out_columns):
    """After the dtypes: K and the bias checked, and the output the op
    returns (``out_columns(weight)`` BF16 columns)."""
    torch._check(x.shape[1] == weight.shape[1],
                 lambda: f"x [M, {x.shape[1]}] and weight [N, {weight.shape[1]}] disagree on K")
    torch._check(bias is None or tuple(bias.shape) == (weight.shape[0],),
                 lambda: f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    return x.new_empty((x.shape[0], out_columns(weight)), dtype=torch.bfloat16)


def _define(name, implementation, out_columns, backward):
    """The custom op ``warpsplitk::<name>``; its fake implementation's output
    has ``out_columns(weight)`` columns."""
    op = torch.library.custom_op(f"warpsplitk::{name}", implementation, mutates_args=(),
                                 device_types="cuda")

    def fake(x, weight, bias, handle):
        # Shapes only: no registry lookup, handle may be symbolic while tracing.
        _check_matrices(x, weight)
        torch._check(x.dtype == weight.dtype == torch.bfloat16,
                     lambda: f"x and weight must be bfloat16, got {x.dtype} and {weight.dtype}")
        return _fake_output(x, weight, bias, out_columns)

    op.register_fake(fake)
    op.register_autograd(backward, setup_context=_setup_context)
    return op


decode_linear = _define("decode_linear", _decode_linear_cuda, lambda w: w.shape[0],
                        _linear_backward)


def _fp8_backward(ctx, grad):
    # The input's gradient through the dequantized weight; the e4m3 weight
    # and its scales are frozen (no gradient).
    x, weight, weight_scale = ctx.saved_tensors[:3]
    grad_x = grad @ dequantized(weight, weight_scale, grad.dtype) if ctx.needs_input_grad[0] else None
    return grad_x, None, None, None, None


def _fp8_swiglu_backward(ctx, grad):
    # As _fp8_backward, through silu(gate) * up recomputed on the dequantized weight.
    x, weight, weight_scale, bias = ctx.saved_tensors
    if not ctx.needs_input_grad[0]:
        return None, None, None, None, None
    dequant = dequantized(weight, weight_scale, x.dtype)
    return _swiglu_pre_grad(x, dequant, bias, grad) @ dequant, None, None, None, None


def _fp8_setup_context(ctx, inputs, output):
    x, weight, weight_scale, bias, _ = inputs
    ctx.save_for_backward(x, weight, weight_scale, bias)


def _define_fp8(name, implementation, out_columns, backward):
    """The custom op ``warpsplitk::<name>`` of an e4m3 weight with its scales;
    its fake implementation's output has ``out_columns(weight)`` columns."""
    op = torch.library.custom_op(f"warpsplitk::{name}", implementation, mutates_args=(),
                                 device_types="cuda")

    def fake(x, weight, weight_scale, bias, handle):
        _check_matrices(x, weight)
        torch._check(x.dtype == torch.bfloat16 and weight.dtype == torch.float8_e4m3fn,
                     lambda: f"x must be bfloat16 and weight float8_e4m3fn, got {x.dtype} and "
                             f"{weight.dtype}")
        return _fake_output(x, weight, bias, out_columns)

    op.register_fake(fake)
    op.register_autograd(backward, setup_context=_fp8_setup_context)
    return op


decode_linear_fp8 = _define_fp8("decode_linear_fp8", _decode_linear_fp8_cuda,
                                lambda w: w.shape[0], _fp8_backward)
decode_swiglu = _define("decode_swiglu", _decode_swiglu_cuda, lambda w: w.shape[0] // 2,
                        _swiglu_backward)
decode_swiglu_fp8 = _define_fp8("decode_swiglu_fp8", _decode_swiglu_fp8_cuda,
                                lambda w: w.shape[0] // 2, _fp8_swiglu_backward)
