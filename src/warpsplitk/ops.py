"""``torch.ops.warpsplitk.decode_linear``: the kernel as a PyTorch custom op.

    decode_linear(Tensor x, Tensor weight, Tensor? bias, int handle) -> Tensor

``out[M, N] = x[M, K] @ weight[N, K]^T (+ bias)`` on CUDA. A custom op cannot
take a ``PreparedWarpSplitK`` (compiled code, CuTe views) as an argument, so
the prepared object lives in a registry here and the op gets its integer
``handle``. ``weight`` and ``bias`` are passed as well, although the kernel
reads them through the prepared object: that way torch.compile sees the op's
real data dependencies, and the fake implementation knows N without a lookup.

CUDA-graph capturable: the implementation allocates only the output (from
the caching allocator, so from the graph's pool while capturing), launches
once on the current stream and never synchronises. Compile with
``prepare`` before capturing; nothing here compiles.

The registry holds prepared objects weakly: whoever registers one (a
``DecodeLinear``) keeps it alive, and its handle stops resolving when it dies.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Optional

import torch

#: Bytes of alignment the kernel needs (``prepared.ALIGN_BYTES``; not imported
#: from there because that module loads the CuTe DSL).
ALIGN_BYTES = 32

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


def _decode_linear_cuda(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                        handle: int) -> torch.Tensor:
    prepared = lookup(handle)
    # The kernel reads the prepared weight; refuse to silently use a stale one.
    if not (_same(weight, prepared.weight) and _same(bias, prepared.bias)):
        raise ValueError("warpsplitk.decode_linear: weight/bias are not the tensors handle "
                         f"{handle} was prepared for; re-prepare after replacing them")
    # DecodeLinear only sends packed, aligned x in eager mode; under torch.compile
    # it cannot see addresses, so re-pack here instead of failing (an [M, K]
    # copy, small next to the weight read).
    if not x.is_contiguous() or x.data_ptr() % ALIGN_BYTES:
        x = x.clone(memory_format=torch.contiguous_format)
    out = torch.empty((x.shape[0], prepared.n), dtype=torch.bfloat16, device=x.device)
    return prepared.run(x, out)


decode_linear = torch.library.custom_op("warpsplitk::decode_linear", _decode_linear_cuda,
                                        mutates_args=(), device_types="cuda")


@decode_linear.register_fake
def _decode_linear_fake(x, weight, bias, handle):
    # Shapes only: no registry lookup, handle may be symbolic while tracing.
    torch._check(x.dim() == 2, lambda: f"x must be [M, K], got {x.dim()}-D")
    torch._check(x.shape[1] == weight.shape[1], lambda: "x and weight disagree on K")
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.bfloat16)


def _setup_context(ctx, inputs, output):
    x, weight, bias, _ = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _backward(ctx, grad):
    # Plain matmuls: the kernel is forward-only, but a model run without
    # torch.no_grad() should still get correct gradients.
    x, weight = ctx.saved_tensors
    grad_x = grad @ weight if ctx.needs_input_grad[0] else None
    grad_w = grad.t() @ x if ctx.needs_input_grad[1] else None
    grad_b = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_x, grad_w, grad_b, None


decode_linear.register_autograd(_backward, setup_context=_setup_context)
