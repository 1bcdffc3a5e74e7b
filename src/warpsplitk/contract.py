"""What the kernel takes, stated once: the token rows, the operands, the
target archs and the GPUs the package's data was measured on.

Everything that validates an operand, picks an arch or names a GPU asks
this module instead of restating its rules: ``operand_refusal`` for one
tensor, ``weight_refusal`` for a weight (and bias) a module or plan might
prepare. No torch at import, no CuTe DSL.
"""

from __future__ import annotations

import operator

from .kernel import layout

#: Token rows (M) a call takes at most: the largest token tile, so one
#: weight tile is streamed once per call.
MAX_M = 32

#: Bytes every operand's address must be a multiple of: the compiled code
#: is told its pointers are this aligned (``runtime.dsl.gmem_pointer``)
#: and vectorises its loads and stores on that promise.
ALIGN_BYTES = 32

#: The archs the kernel is built for (Hopper and Blackwell).
SUPPORTED_ARCHS = ("sm_90a", "sm_100a")

#: The GPUs a target can name (``warpsplitk plan --gpu``): (the name torch
#: reports, SM count, arch).
GPUS = {"h100": ("NVIDIA H100 80GB HBM3", 132, "sm_90a"),
        "h200": ("NVIDIA H200", 132, "sm_90a"),
        "b200": ("NVIDIA B200", 148, "sm_100a")}

#: The GPU (name, SM count) an arch stands for where none is present
#: (``warpsplitk plan --arch`` without ``--gpu``): the H200 for sm_90a, the
#: GPU the built-in plan and the cost model were measured on.
ARCH_GPUS = {"sm_90a": GPUS["h200"][:2], "sm_100a": GPUS["b200"][:2]}

#: The built-in plans and the GPU (name, SM count) each was measured on.
BUILTIN_PLAN_GPUS = {"h200": GPUS["h200"][:2]}

#: K tiles per CTA at most: the compute loop is fully unrolled over them.
MAX_K_TILES = 64
#: CTAs of a cluster that may share one output tile's K at most: a split of
#: 2 halves each CTA's K tiles, so K up to 2 x 64 tiles of 256 (32768: a
#: 70B model's ``down`` at TP 1) stays within ``MAX_K_TILES`` per CTA; 3 and
#: 4 only where K needs them (``OPTIONAL_K_SPLIT``): Qwen2.5-72B's ``down``
#: (K = 29568, 231 tiles of 128) and Gemma-2-27B's (K = 36864) at TP 1.
MAX_K_SPLIT = 4
#: The largest split a K that a smaller one takes may have: wider clusters
#: measured 1.2-4x slower than a split in two (docs/design-notes.md).
OPTIONAL_K_SPLIT = 2
#: The K tile widths (elements) of the kernel's pipeline stages.
K_TILE_WIDTHS = (128, 256)
#: Weight rows at most, exclusive: the epilogue's byte offsets of output
#: columns (and the bias's) are 32-bit.
MAX_N = 2 ** 30

#: The element type of every operand but an FP8 weight and its scales.
DTYPE_NAME = "bfloat16"
#: The element type of an FP8 weight (W8A16: activations stay BF16).
FP8_DTYPE_NAME = "float8_e4m3fn"
#: The scales an FP8 weight takes, FP32: one for the whole tensor (shape
#: ``()`` or ``(1,)``), one per output channel (``[N]`` or ``[N, 1]``), or
#: one per 128 x 128 block (``[ceil(N / 128), ceil(K / 128)]``, row-major:
#: DeepSeek's and transformers' ``weight_scale_inv``).
FP8_SCALE_KINDS = ("tensor", "channel", "block128")
#: The block scales' block edge (the address math's: ``kernel.layout``).
FP8_SCALE_BLOCK = layout.FP8_SCALE_BLOCK
#: Block scales must be below this in magnitude: the kernel folds each into
#: its block's weights as BF16 ``scale * 2 ** 120``, finite below 2 ** 8
#: (e4m3 weights up to 448 then reach 57344, past any model's).
FP8_BLOCK_SCALE_BOUND = 2.0 ** 7

#: The device type the kernel runs on. Read at call time, so CPU tests can
#: set it to "cpu" and exercise the kernel paths on CPU tensors.
DEVICE_TYPE = "cuda"


def as_integer(value, otherwise=None):
    """``value`` as an int where it is integral (``operator.index``: Python,
    NumPy and torch integer scalars), else ``otherwise``. A bool is no size."""
    # torch.tensor(True) indexes as 1
    if isinstance(value, bool) or str(getattr(value, "dtype", "")) == "torch.bool":
        return otherwise
    try:
        return operator.index(value)
    except TypeError:
        return otherwise


def n_bound_refusal(n):
    return f"N must be below {MAX_N} (32-bit output offsets), got N={n}"


def _size(value):
    """``value`` as an int where it is a positive integer, else None."""
    value = as_integer(value)
    return value if value is not None and value > 0 else None


def min_k_split(k, k_tile) -> int | None:
    """The fewest CTAs (1..``MAX_K_SPLIT``) that can share K, whole tiles of
    ``k_tile``, so each streams at most ``MAX_K_TILES`` of them, or None
    where none can. Past ``MAX_K_TILES`` tiles a count the split does not
    divide splits unevenly, the first CTAs taking one tile more
    (``kernel.layout.k_share``)."""
    if k % k_tile:
        return None
    tiles = k // k_tile
    for split in range(1, MAX_K_SPLIT + 1):
        if -(-tiles // split) <= MAX_K_TILES:
            return split
    return None


def shape_refusal(n, k) -> str | None:
    """Why no tactic takes an ``[n, k]`` weight, or None when some does: N a
    positive multiple of 16 below ``MAX_N``; K whole tiles of 128 or 256,
    at most ``MAX_K_TILES`` of them per CTA with K split over up to
    ``MAX_K_SPLIT`` CTAs (``min_k_split``): a multiple of 128 up to 32768, or
    of 256 up to 65536. The one statement of these
    rules: ``default_tactic`` raises it, the model tables and the CLI leave
    such a weight to cuBLAS with it. N and K may be any integral type."""
    n, k = as_integer(n, n), as_integer(k, k)
    if _size(n) is None or n % 16:
        return f"N must be a positive multiple of 16, got {n!r}"
    if n >= MAX_N:
        return n_bound_refusal(n)
    if _size(k) is None or not any(min_k_split(k, width) for width in K_TILE_WIDTHS):
        small, large = K_TILE_WIDTHS
        most = MAX_K_TILES * MAX_K_SPLIT
        return (f"K must be a positive multiple of {small} up to {most * small}, or of "
                f"{large} up to {most * large}; got {k!r}")
    return None


def describe(t) -> str:
    """A tensor's shape, dtype, device and strides, for error messages."""
    return (f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')} on {t.device} "
            f"strides {tuple(t.stride())}")


def _packed(t, shape) -> bool:
    if len(shape) == 2 and shape[0] == 1:
        return t.stride()[1] == 1  # a single row: its row stride is irrelevant
    return tuple(t.stride()) == ((1,) if len(shape) == 1 else (shape[1], 1))


def operand_refusal(name, t, shape=None, device=None, dtype_name=DTYPE_NAME) -> str | None:
    """Why ``t`` cannot be the kernel's operand ``name`` (weight, x, out,
    bias), or None: a packed row-major tensor of ``dtype_name`` (bfloat16)
    on ``device`` (default:
    any device of ``DEVICE_TYPE``), of ``shape`` (default: any 2-D ``[N,
    K]``), its address a multiple of ``ALIGN_BYTES``. The device is checked
    first, the most common mistake. The reason reads ``"<name> must ...,
    got ..."``."""
    import torch  # only callers holding tensors get here; importing contract stays torch-free

    if not isinstance(t, torch.Tensor):
        return matrix_refusal(name, t) if shape is None else (
            f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if device is None and t.device.type != DEVICE_TYPE:
        return f"{name} must be on a {DEVICE_TYPE.upper()} device, got {t.device}"
    if device is not None and t.device != device:
        return f"{name} must be on {device}, got {t.device}"
    if shape is None:
        reason = matrix_refusal(name, t)
        if reason is not None:
            return reason
        shape = tuple(t.shape)
    if t.dtype != getattr(torch, dtype_name):
        return f"{name} must be {dtype_name}, got {t.dtype}"
    if tuple(t.shape) != tuple(shape):
        return f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}"
    if not _packed(t, shape):
        packed = (1,) if len(shape) == 1 else (shape[1], 1)
        return f"{name} must be packed row-major (strides {packed}), got {describe(t)}"
    if t.data_ptr() % ALIGN_BYTES:
        return (f"{name} must be {ALIGN_BYTES}-byte aligned, its address is "
                f"{t.data_ptr() % ALIGN_BYTES} bytes past a boundary")
    return None


def matrix_refusal(name, t, dims="[N, K]") -> str | None:
    """Why ``t`` is not a 2-D tensor (``dims`` names its axes), or None."""
    import torch  # as operand_refusal

    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        given = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        return f"{name} must be a 2-D torch.Tensor {dims}, got {given}"
    return None


def weight_refusal(weight, bias=None) -> str | None:
    """Why no tactic can run ``weight`` (with ``bias``), or None: a tensor
    refusal of either (``weight_tensors_refusal``), or the weight's shape
    (``shape_refusal``)."""
    return weight_tensors_refusal(weight, bias) or shape_refusal(*weight.shape)


def weight_tensors_refusal(weight, bias=None) -> str | None:
    """Why ``weight`` (a 2-D ``[N, K]``) or ``bias`` (``[N]``, on the
    weight's device) is no operand the kernel takes, whatever the shape
    rules say, or None."""
    reason = operand_refusal("weight", weight)
    if reason is None and bias is not None:
        reason = operand_refusal("bias", bias, (weight.shape[0],), weight.device)
    return reason


def is_fp8(t) -> bool:
    """Whether ``t`` is a tensor of ``FP8_DTYPE_NAME`` (an e4m3 weight)."""
    return str(getattr(t, "dtype", "")) == f"torch.{FP8_DTYPE_NAME}"


def fp8_scale_shape(kind, n, k) -> tuple:
    """The shape of an ``[n, k]`` FP8 weight's scales of ``kind``
    (``FP8_SCALE_KINDS``; one of the shapes ``fp8_scale_kind`` reads so)."""
    return {"tensor": (1,), "channel": (n,), "block128": layout.fp8_scale_blocks(n, k)}[kind]


def fp8_scale_factors(scale, n, k):
    """An ``[n, k]`` FP8 weight's FP32 scales (``fp8_scale_kind``'s shapes)
    as each weight's factor, ``[n, k]`` (one or per-row scales: a broadcast
    view; blocks, partial at the edges, expanded)."""
    scale = scale.float()
    if scale.dim() == 2 and tuple(scale.shape) != (n, 1):
        block = FP8_SCALE_BLOCK
        return scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return scale.reshape(-1, 1).expand(n, k)


def fp8_scale_kind(scale, n, k=None) -> str | None:
    """The kind (``FP8_SCALE_KINDS``) an FP8 ``[n, k]`` weight's ``scale``
    has by its shape, or None when it has none of their shapes (``k`` None:
    block scales are not considered)."""
    shape = tuple(scale.shape)
    if shape in ((), (1,)):
        return "tensor"
    if shape in ((n,), (n, 1)) and n > 1:
        return "channel"
    if k is not None and shape == layout.fp8_scale_blocks(n, k):
        return "block128"
    return None


def fp8_refusal(weight, scale, bias=None, scale_kind=None) -> str | None:
    """Why an FP8 ``weight`` (packed ``float8_e4m3fn [N, K]``) with ``scale``
    (FP32, contiguous, on the weight's device: ``fp8_scale_kind``'s shapes)
    and ``bias`` (BF16 ``[N]``) is no operand set the kernel takes (an FP8
    weight without scales included), or None.
    ``scale_kind``: the kind the caller means (None: by the scale's shape).
    The values are not read (``fp8_value_refusal`` reads them)."""
    import torch

    if scale is None and is_fp8(weight):
        return (f"an FP8 ({FP8_DTYPE_NAME}) weight needs weight_scale: one FP32 scale, one per "
                "output row, or one per 128 x 128 block")
    reason = operand_refusal("weight", weight, dtype_name=FP8_DTYPE_NAME)
    if reason is None and bias is not None:
        reason = operand_refusal("bias", bias, (weight.shape[0],), weight.device)
    if reason is not None:
        return reason
    if scale_kind is not None and scale_kind not in FP8_SCALE_KINDS:
        return f"scale_kind must be one of {FP8_SCALE_KINDS} or None, got {scale_kind!r}"
    n, k = weight.shape
    if not isinstance(scale, torch.Tensor):
        return f"weight_scale must be a float32 torch.Tensor, got {type(scale).__name__}"
    kind = fp8_scale_kind(scale, n, k)
    wanted = {"tensor": "() or (1,)", "channel": f"({n},) or ({n}, 1)",
              "block128": str(layout.fp8_scale_blocks(n, k))}
    if kind is None or (scale_kind is not None and kind != scale_kind):
        expected = (wanted[scale_kind] if scale_kind is not None
                    else f"{wanted['tensor']} (one scale), {wanted['channel']} (one per row) "
                         f"or {wanted['block128']} (one per 128 x 128 block)")
        return f"weight_scale must have shape {expected}, got {tuple(scale.shape)}"
    if scale.device != weight.device:
        return f"weight_scale must be on {weight.device}, got {scale.device}"
    if scale.dtype != torch.float32:
        return f"weight_scale must be float32, got {scale.dtype}"
    if not scale.is_contiguous():
        return f"weight_scale must be contiguous, got {describe(scale)}"
    if scale.data_ptr() % ALIGN_BYTES:
        return (f"weight_scale must be {ALIGN_BYTES}-byte aligned, its address is "
                f"{scale.data_ptr() % ALIGN_BYTES} bytes past a boundary")
    return None


def fp8_value_refusal(weight, scale) -> str | None:
    """Why the values of an FP8 weight and its scales cannot run, or None:
    e4m3 has NaN codes (``0x7F``, ``0xFF``), which the kernel's exact
    conversion would read as ±480, a scale must be finite, and a block scale
    below ``FP8_BLOCK_SCALE_BOUND`` in magnitude. Reads the tensors (a device
    synchronisation: preparation only)."""
    import torch

    bits = weight.view(torch.uint8)
    nan_codes = int(torch.count_nonzero((bits & 0x7F) == 0x7F))
    if nan_codes:
        return f"weight holds {nan_codes} NaN code(s) (0x7F or 0xFF); e4m3 weights must be finite"
    if not bool(torch.isfinite(scale).all()):
        return "weight_scale must be finite, got a NaN or infinity"
    if fp8_scale_kind(scale, *weight.shape) == "block128":
        largest = float(scale.abs().max())
        if largest >= FP8_BLOCK_SCALE_BOUND:
            return (f"block scales must be below {FP8_BLOCK_SCALE_BOUND:g} in magnitude (the "
                    f"kernel folds them into BF16 weights), got {largest:g}")
    return None


__all__ = ["MAX_M", "ALIGN_BYTES", "SUPPORTED_ARCHS", "GPUS", "ARCH_GPUS", "BUILTIN_PLAN_GPUS",
           "MAX_K_TILES", "MAX_K_SPLIT", "OPTIONAL_K_SPLIT", "MAX_N", "DTYPE_NAME",
           "FP8_DTYPE_NAME", "FP8_SCALE_KINDS", "FP8_SCALE_BLOCK", "FP8_BLOCK_SCALE_BOUND",
           "as_integer", "shape_refusal",
           "n_bound_refusal", "DEVICE_TYPE", "describe", "operand_refusal", "matrix_refusal",
           "weight_refusal", "weight_tensors_refusal", "is_fp8", "fp8_scale_shape",
           "fp8_scale_factors",
           "fp8_scale_kind", "fp8_refusal",
           "fp8_value_refusal"]
