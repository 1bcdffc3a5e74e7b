"""Tensor-parallel decode projections over a ``torch.distributed`` process group.

Two Megatron-style splits of ``out[M, N] = x[M, K] @ W[N, K]^T (+ bias)`` over
``world`` ranks, each rank running the warp split-K kernel on its own shard on
its own GPU (``cuda:<local rank>``; kernels are compiled per device index):

* column-parallel (``ColumnParallelDecodeLinear``): rank r holds rows
  ``[r*N/p, (r+1)*N/p)`` of W (and of the bias), takes the whole x and
  produces ``out[:, r*N/p:(r+1)*N/p]``; ``gather_output=True`` all-gathers
  the full ``[M, N]`` on every rank;
* row-parallel (``RowParallelDecodeLinear``): rank r holds columns
  ``[r*K/p, (r+1)*K/p)`` of W, takes that slice of x (or the whole x and
  slices it) and produces a partial ``[M, N]``; an in-place ``all_reduce``
  sums the partials. The bias is added once, by rank 0's kernel (see the
  class).

Shards split evenly: N (column) or K (row) must be divisible by the world
size, and the shard must be a shape the kernel takes
(``contract.shape_refusal``: N a multiple of 16; K a multiple of 128 up to
32768, or of 256 up to 65536). Anything else is a ``ValueError`` naming the
rule, at construction.

The forwards are CUDA-graph capturable: one kernel launch per rank, the
collective on the current stream (``torch.distributed`` with NCCL, which may
be captured), no host synchronisation. Prepare (construct) before capture,
and run one eager forward first so NCCL has built its communicator.

Without CUDA (gloo on CPU, for tests) the local matmul is ``F.linear``: the
modules keep ``DecodeLinear``'s ``kernel_calls`` / ``fallback_calls``
counters, and ``use_kernel`` says up front which path a module takes.

NVLink multicast (NCCL's NVLS algorithms, PyTorch symmetric-memory multimem,
NVSHMEM NVLS) stays off: on shared hosts a program that uses it can take the
GPUs out of service. Call ``ensure_no_multicast()`` before
``init_process_group``; the modules refuse a NCCL group when the environment
turns multicast on.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
from torch import nn

from .. import contract
from ..contract import MAX_M, as_integer
from ..planning import plans
from ..tactics import check_ms
from .linear import NO_MS, DecodeLinear

# ------------------------------------------------------ NVLink multicast off

#: Environment that keeps NVLink multicast off, and the value each must have.
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",                  # NCCL: no NVLS / NVLS-tree algorithms
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",  # PyTorch symmetric memory: no multimem
    "NVSHMEM_DISABLE_NVLS": "1",              # NVSHMEM (used by symmetric memory): no NVLS
}


class MulticastEnabledError(RuntimeError):
    """The environment turns NVLink multicast on."""


def multicast_problems(environ=None) -> list[tuple[str, str | None, str]]:
    """``(variable, current value or None if unset, required value)`` for each
    variable of ``MULTICAST_OFF`` that is not at its safe value."""
    environ = os.environ if environ is None else environ
    problems = []
    for name, safe in MULTICAST_OFF.items():
        value = environ.get(name)
        if value is None or value.strip() != safe:
            problems.append((name, value, safe))
    return problems


def ensure_no_multicast(environ=None) -> dict:
    """Set the variables of ``MULTICAST_OFF`` that are unset; call before
    ``torch.distributed.init_process_group`` (NCCL reads its variables when it
    builds a communicator). Raises ``MulticastEnabledError`` for a variable set
    explicitly to another value (``NCCL_NVLS_ENABLE=1``, say): that is someone's
    decision to turn multicast on, and this refuses rather than overrides it.
    Returns ``{variable: value}`` of what it set."""
    environ = os.environ if environ is None else environ
    explicit = [(n, v, s) for n, v, s in multicast_problems(environ) if v is not None]
    if explicit:
        raise MulticastEnabledError(
            "NVLink multicast must stay off (on shared hosts it can take the GPUs out of "
            "service); the environment sets " + ", ".join(
                f"{n}={v!r} (needs {s!r})" for n, v, s in explicit))
    set_now = {}
    for name, safe in MULTICAST_OFF.items():
        if name not in environ:
            environ[name] = safe
            set_now[name] = safe
    return set_now


#: Alias: the same guard under the name the launcher's docs use.
nccl_env_guard = ensure_no_multicast


def _is_nccl(backend) -> bool:
    return backend is not None and "nccl" in str(backend).lower()


def check_backend_multicast(backend, environ=None) -> None:
    """For a NCCL ``backend``: refuse (``MulticastEnabledError``) an environment
    that turns multicast on; set unset variables with a warning (NCCL may have
    built its communicator already, before they were set). Other backends:
    nothing to check."""
    if not _is_nccl(backend):
        return
    set_now = ensure_no_multicast(environ)
    if set_now:
        warnings.warn("warpsplitk.nn.parallel: NCCL group with NVLink multicast variables unset; "
                      f"set {set_now} now. Call warpsplitk.nn.parallel.ensure_no_multicast() "
                      "before init_process_group: a communicator built before this may use NVLS.",
                      RuntimeWarning, stacklevel=3)


# ------------------------------------------------------- sharding arithmetic


def check_world(rank: int, world: int) -> tuple[int, int]:
    """``(rank, world)`` as ints (any integral type); ValueError unless
    ``0 <= rank < world``."""
    world_size = as_integer(world)
    if world_size is None or world_size < 1:
        raise ValueError(f"world size must be a positive integer, got {world!r}")
    this_rank = as_integer(rank)
    if this_rank is None or not 0 <= this_rank < world_size:
        raise ValueError(f"rank must be in 0..{world_size - 1} for world size {world_size}, "
                         f"got {rank!r}")
    return this_rank, world_size


def _positive(what, value) -> int:
    size = as_integer(value)
    if size is None or size <= 0:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return size


def shard_range(size: int, rank: int, world: int, what: str = "size") -> slice:
    """Rank ``rank``'s even share of ``range(size)``: a slice of ``size // world``.
    ValueError when ``world`` does not divide ``size``."""
    rank, world = check_world(rank, world)
    size = _positive(what, size)
    if size % world:
        raise ValueError(f"{what}={size} is not divisible by the world size {world}: every "
                         f"rank takes an equal {what}/{world} share")
    part = size // world
    return slice(rank * part, (rank + 1) * part)


def kernel_shape_reason(n: int, k: int, ms=range(1, MAX_M + 1)) -> str | None:
    """Why the kernel cannot take an ``[n, k]`` weight for these Ms, or None:
    the contract's shape rules (``contract.shape_refusal``), and at least one
    M. ``ValueError`` for Ms ``check_ms`` refuses."""
    return NO_MS if not check_ms(ms) else contract.shape_refusal(n, k)


def _check_shard(mode, n, k, world, shard_n, shard_k, ms):
    reason = kernel_shape_reason(shard_n, shard_k, ms)
    if reason is not None:
        split = (f"N={n} splits into shards [N/{world}={shard_n}, K={shard_k}]" if mode == "column"
                 else f"K={k} splits into shards [N={shard_n}, K/{world}={shard_k}]")
        raise ValueError(f"{mode}-parallel over {world} ranks: {split}, which the kernel cannot "
                         f"take: {reason}")


def column_shard(n: int, k: int, rank: int, world: int, ms=range(1, MAX_M + 1),
                 check_kernel: bool = True) -> slice:
    """Column-parallel: the rows of ``W[N, K]`` (and of the bias, and the output
    columns) rank ``rank`` holds. ValueError when N is not divisible by
    ``world`` or (``check_kernel``) the ``[N/world, K]`` shard breaks a kernel rule."""
    rows = shard_range(n, rank, world, "N")
    if check_kernel:
        _check_shard("column", n, k, world, n // world, k, ms)
    return rows


def row_shard(n: int, k: int, rank: int, world: int, ms=range(1, MAX_M + 1),
              check_kernel: bool = True) -> slice:
    """Row-parallel: the columns of ``W[N, K]`` (and of x) rank ``rank`` holds.
    ValueError when K is not divisible by ``world`` or (``check_kernel``) the
    ``[N, K/world]`` shard breaks a kernel rule."""
    cols = shard_range(k, rank, world, "K")
    if check_kernel:
        _check_shard("row", n, k, world, n, k // world, ms)
    return cols


def shard_shape(mode: str, n: int, k: int, world: int) -> tuple[int, int]:
    """The ``[N, K]`` of one rank's weight shard (no validation)."""
    if mode == "column":
        return n // world, k
    if mode == "row":
        return n, k // world
    raise ValueError(f"mode must be 'column' or 'row', got {mode!r}")


def shard_plan(n: int, k: int, world: int, ms=range(1, MAX_M + 1)) -> dict:
    """``{"column": (N/p, K) or reason, "row": (N, K/p) or reason}``: which splits
    of an ``[n, k]`` weight over ``world`` ranks the kernel can run (a tuple),
    and why not (a string: ``world`` does not divide the split dimension, or
    the kernel cannot take the shard) for the others. ``ValueError`` for an N,
    K or world size that is no positive integer, or Ms ``check_ms`` refuses."""
    n, k = _positive("N", n), _positive("K", k)
    _, world = check_world(0, world)
    ms = check_ms(ms)
    result = {}
    for mode, shard in (("column", column_shard), ("row", row_shard)):
        try:
            shard(n, k, 0, world, ms)
        except ValueError as error:
            result[mode] = str(error)
        else:
            result[mode] = shard_shape(mode, n, k, world)
    return result


# ----------------------------------------------------------- process groups


def _resolve_group(group, rank, world):
    """(rank, world, backend) of this process in ``group``; explicit ``rank`` /
    ``world`` must agree with it. Without an initialized process group only a
    world of one is allowed (no collectives at all)."""
    if dist.is_available() and dist.is_initialized():
        g_rank, g_world = dist.get_rank(group), dist.get_world_size(group)
        if g_rank < 0:
            raise ValueError("this process is not a member of the given process group")
        if rank is not None and rank != g_rank:
            raise ValueError(f"rank={rank} disagrees with the process group (rank {g_rank})")
        if world is not None and world != g_world:
            raise ValueError(f"world={world} disagrees with the process group "
                             f"(world size {g_world})")
        return g_rank, g_world, str(dist.get_backend(group))
    if group is not None:
        raise ValueError("a process group was given but torch.distributed is not initialized")
    rank, world = check_world(0 if rank is None else rank, 1 if world is None else world)
    if world != 1:
        raise ValueError(f"world size {world} needs an initialized torch.distributed "
                         "process group (init_process_group first)")
    return rank, world, None


def local_cuda_device() -> torch.device:
    """``cuda:<LOCAL_RANK>`` (torchrun sets it), else the current CUDA device."""
    local = os.environ.get("LOCAL_RANK")
    return torch.device("cuda", int(local) if local is not None else torch.cuda.current_device())


def _resolve_device(device, weight, backend):
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif _is_nccl(backend):
        device = local_cuda_device()
    elif weight.device.type == "cuda" and weight.device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = weight.device
    if _is_nccl(backend) and device.type != "cuda":
        raise ValueError(f"a NCCL process group needs CUDA tensors, got device {device}")
    return device


def _matrix_shape(name, t):
    """``t``'s ``[N, K]``; ``ValueError`` unless it is a 2-D tensor."""
    reason = contract.matrix_refusal(name, t)
    if reason is not None:
        raise ValueError(reason)
    return t.shape


def _check_input(x, mode, rank):
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        raise ValueError(f"{mode}-parallel rank {rank}: x must be a tensor [..., K], got "
                         f"{getattr(x, 'shape', type(x).__name__)}")


def _place(t, device):
    """``t`` on ``device``, packed and ``ALIGN_BYTES``-aligned: itself where it is,
    else a fresh copy (:func:`_copy`)."""
    if t is None:
        return None
    t = t.detach()
    if t.device == device and t.is_contiguous() and t.data_ptr() % contract.ALIGN_BYTES == 0:
        return t
    return _copy(t, device)


def _copy(t, device):
    """A fresh packed copy of ``t`` on ``device`` (from_full_weight's slices:
    a shard never keeps the full weight alive)."""
    if t is None:
        return None
    return torch.empty(t.shape, dtype=t.dtype, device=device).copy_(t.detach())


def all_gather(output, tensor, group):
    """Every rank's ``tensor`` into ``output`` (``[p, *tensor.shape]``, or
    its memory), over ``group`` on the current stream."""
    # all_gather_single is the newer name (all_gather_into_tensor is deprecated there)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    # the concatenated form [p*M, ...] (the same memory as [p, M, ...]): gloo
    # takes only that one
    gather(output.view(-1, *tensor.shape[1:]), tensor, group=group)


# ------------------------------------------------------------------ modules


class _ParallelDecodeLinear(nn.Module):
    """What both splits share: group, device, the local ``DecodeLinear``."""

    mode = None

    def __init__(self, weight_shard, bias, *, group, rank, world, plan, ms, use_kernel,
                 device):
        super().__init__()
        shard_n, shard_k = _matrix_shape("weight shard", weight_shard)
        self.rank, self.world, self.backend = _resolve_group(group, rank, world)
        check_backend_multicast(self.backend)
        self.group = group
        plans.check_plan(plan)
        self.ms = check_ms(ms)
        if bias is not None and (not isinstance(bias, torch.Tensor)
                                 or tuple(bias.shape) != (shard_n,)):
            raise ValueError(f"{self.mode}-parallel bias must be a tensor of shape ({shard_n},), "
                             f"got {tuple(getattr(bias, 'shape', ())) or type(bias).__name__}")
        if use_kernel is not False:
            # the kernel's rules hold whatever the device: a CPU test refuses
            # what the GPU run would
            reason = kernel_shape_reason(shard_n, shard_k, self.ms)
            if reason is not None:
                raise ValueError(f"{self.mode}-parallel shard [{shard_n}, {shard_k}] on rank "
                                 f"{self.rank} of {self.world}: the kernel cannot take it: "
                                 f"{reason}")
        self.device = _resolve_device(device, weight_shard, self.backend)
        if use_kernel is None:
            use_kernel = self.device.type == "cuda"
        if use_kernel and self.device.type != "cuda":
            raise ValueError(f"use_kernel=True needs a CUDA device, got {self.device}")
        self.use_kernel = bool(use_kernel)
        weight = _place(weight_shard, self.device)
        bias = _place(bias, self.device)
        # ms=() prepares nothing: DecodeLinear then always falls back to F.linear
        self.local = DecodeLinear(weight, bias, plan, self.ms if self.use_kernel else ())
        if self.use_kernel and self.local.prepared is None:
            raise ValueError(f"{self.mode}-parallel shard on {self.device}: "
                             f"{self.local.unprepared_reason} (use_kernel=False runs F.linear)")

    @property
    def kernel_calls(self) -> int:
        """Eager forwards whose local matmul ran the kernel (DecodeLinear's counter)."""
        return self.local.kernel_calls

    @property
    def fallback_calls(self) -> int:
        """Eager forwards whose local matmul ran ``F.linear``."""
        return self.local.fallback_calls

    @property
    def weight(self):
        """This rank's weight shard (a frozen Parameter of ``local``)."""
        return self.local.weight

    def _collective_needed(self):
        return self.world > 1


class ColumnParallelDecodeLinear(_ParallelDecodeLinear):
    """Column-parallel decode linear: this rank's ``[N/p, K]`` rows of W.

    ``forward(x[..., K])`` -> this rank's output columns ``[..., N/p]``, or
    with ``gather_output`` the full ``[..., N]`` on every rank (an all-gather
    into a ``[p, M, N/p]`` buffer, then one reorder copy into ``[M, N]``;
    for M = 1 the gather writes ``[1, N]`` directly, no copy). x must be the
    same on every rank.

    weight_shard: ``[N/p, K]``; bias: this rank's ``[N/p]`` shard or None.
    Use ``from_full_weight`` to slice a full weight. Inference only: forward
    runs under ``torch.no_grad``.
    """

    mode = "column"

    def __init__(self, weight_shard, bias=None, *, group=None, rank=None, world=None,
                 gather_output=False, plan=None, ms=range(1, MAX_M + 1), use_kernel=None,
                 device=None):
        super().__init__(weight_shard, bias, group=group, rank=rank, world=world, plan=plan,
                         ms=ms, use_kernel=use_kernel, device=device)
        self.gather_output = gather_output
        self.shard_features = self.local.out_features
        self.in_features = self.local.in_features
        self.out_features = self.shard_features * self.world
        self.output_slice = shard_range(self.out_features, self.rank, self.world, "N")
        # [p, max M, N/p], flat: the first p*M*N/p elements viewed [p, M, N/p]
        rows = max(self.ms) if self.ms else MAX_M
        self.register_buffer("_gather_buffer", torch.empty(
            self.world * rows * self.shard_features, dtype=self.local.weight.dtype,
            device=self.device), persistent=False)

    @classmethod
    def from_full_weight(cls, weight, rank=None, world=None, group=None, plan=None,
                         ms=range(1, MAX_M + 1), bias=None, **kwargs):
        """This rank's shard of a full ``[N, K]`` weight (and ``[N]`` bias), copied
        to the rank's device; rank and world default to the group's."""
        rank, world, backend = _resolve_group(group, rank, world)
        n, k = _matrix_shape("full weight", weight)
        rows = column_shard(n, k, rank, world, ms, check_kernel=kwargs.get("use_kernel") is not False)
        device = _resolve_device(kwargs.get("device"), weight, backend)
        return cls(_copy(weight[rows], device), None if bias is None else _copy(bias[rows], device),
                   group=group, rank=rank, world=world, plan=plan, ms=ms, **kwargs)

    @torch.no_grad()
    def forward(self, x, gather_output=None):
        """``gather_output`` overrides the module's setting for this call."""
        _check_input(x, self.mode, self.rank)
        lead = x.shape[:-1]
        y = self.local(x.reshape(-1, x.shape[-1]))
        if self.gather_output if gather_output is None else gather_output:
            y = self.gather(y)
        return y.view(*lead, y.shape[-1])

    def gather(self, y):
        """All-gather the local ``[M, N/p]`` outputs into a new ``[M, N]``."""
        if not self._collective_needed():
            return y
        m, part = y.shape
        out = torch.empty((m, part * self.world), dtype=y.dtype, device=y.device)
        if m == 1:
            # [p, 1, N/p] is the memory of [1, N]: gather in place
            all_gather(out.view(self.world, 1, part), y, self.group)
            return out
        if m * self.world * part <= self._gather_buffer.numel() and y.dtype == self._gather_buffer.dtype:
            stacked = self._gather_buffer[: self.world * m * part].view(self.world, m, part)
        else:
            stacked = torch.empty((self.world, m, part), dtype=y.dtype, device=y.device)
        all_gather(stacked, y, self.group)
        out.view(m, self.world, part).copy_(stacked.transpose(0, 1))
        return out

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(this rank {self.output_slice.start}:{self.output_slice.stop}), "
                f"rank={self.rank}/{self.world}, gather_output={self.gather_output}, "
                f"{'kernel' if self.use_kernel else 'F.linear'} on {self.device}")


class RowParallelDecodeLinear(_ParallelDecodeLinear):
    """Row-parallel decode linear: this rank's ``[N, K/p]`` columns of W.

    ``forward(x)`` -> the full ``[..., N]`` on every rank: the local kernel
    computes a partial ``x[:, Kr] @ W[:, Kr]^T`` and an in-place ``all_reduce``
    (SUM, on the current stream) adds the ranks' partials. ``x`` is either the
    full ``[..., K]`` (the rank takes its K slice: a column slice of a
    row-major x is not packed, so for M > 1 it is copied into a preallocated
    ``[max M, K/p]`` buffer; M = 1 needs no copy) or, with
    ``input_is_parallel=True``, already this rank's ``[..., K/p]`` (the output
    of a column-parallel layer).

    The bias (the full ``[N]``, the same on every rank) is added once, by rank
    ``0``'s kernel in its FP32 epilogue, before the sum; the other ranks'
    kernels have none. That costs no launch, where adding it after the
    all-reduce would be one more elementwise kernel per call (a few µs, the
    size of the GEMM itself at decode sizes). The only difference is rounding:
    the bias enters one BF16 partial instead of the BF16 sum.

    The x buffer is shared by all calls of the module: calls on one stream
    (or graphs replayed on one stream) are safe, concurrent calls on several
    streams are not. Inference only: forward runs under ``torch.no_grad``.
    """

    mode = "row"
    bias_rank = 0

    def __init__(self, weight_shard, bias=None, *, group=None, rank=None, world=None,
                 input_is_parallel=False, plan=None, ms=range(1, MAX_M + 1), use_kernel=None,
                 device=None):
        this_rank, _, _ = _resolve_group(group, rank, world)
        adds_bias = bias is not None and this_rank == self.bias_rank
        if bias is not None and (not isinstance(bias, torch.Tensor) or bias.dim() != 1
                                 or bias.shape[0] != weight_shard.shape[0]):
            got = (f"shape {tuple(bias.shape)}" if isinstance(bias, torch.Tensor)
                   else type(bias).__name__)
            raise ValueError(f"row-parallel bias must be the full [N={weight_shard.shape[0]}], "
                             f"got {got}")
        super().__init__(weight_shard, bias if adds_bias else None, group=group, rank=rank,
                         world=world, plan=plan, ms=ms, use_kernel=use_kernel, device=device)
        self.adds_bias = adds_bias
        self.input_is_parallel = input_is_parallel
        self.out_features = self.local.out_features
        self.shard_features = self.local.in_features
        self.in_features = self.shard_features * self.world
        self.input_slice = shard_range(self.in_features, self.rank, self.world, "K")
        rows = max(self.ms) if self.ms else MAX_M
        self.register_buffer("_x_buffer", torch.empty(
            rows, self.shard_features, dtype=self.local.weight.dtype, device=self.device),
            persistent=False)

    @classmethod
    def from_full_weight(cls, weight, rank=None, world=None, group=None, plan=None,
                         ms=range(1, MAX_M + 1), bias=None, **kwargs):
        """This rank's shard of a full ``[N, K]`` weight, copied packed to the
        rank's device; ``bias`` is the full ``[N]`` (rank 0 adds it)."""
        rank, world, backend = _resolve_group(group, rank, world)
        n, k = _matrix_shape("full weight", weight)
        cols = row_shard(n, k, rank, world, ms, check_kernel=kwargs.get("use_kernel") is not False)
        device = _resolve_device(kwargs.get("device"), weight, backend)
        return cls(_copy(weight[:, cols], device), _copy(bias, device), group=group, rank=rank,
                   world=world, plan=plan, ms=ms, **kwargs)

    def local_input(self, x2d):
        """This rank's ``[M, K/p]`` slice of a full ``[M, K]`` x, packed."""
        xs = x2d[:, self.input_slice]
        if xs.is_contiguous():
            return xs  # one row: the slice is packed already (and 256-byte aligned)
        buf = self._x_buffer
        m = x2d.shape[0]
        if m <= buf.shape[0] and xs.dtype == buf.dtype and xs.device == buf.device:
            return buf[:m].copy_(xs)
        return xs.contiguous()

    @torch.no_grad()
    def forward(self, x, input_is_parallel=None):
        """``input_is_parallel`` overrides the module's setting for this call."""
        _check_input(x, self.mode, self.rank)
        lead = x.shape[:-1]
        parallel = self.input_is_parallel if input_is_parallel is None else input_is_parallel
        want = self.shard_features if parallel else self.in_features
        if x.shape[-1] != want:
            raise ValueError(f"row-parallel rank {self.rank}: x has shape {tuple(x.shape)}, "
                             f"expected [..., {want}] "
                             f"({'this rank K/p' if parallel else 'the full K'})")
        x2d = x.reshape(-1, x.shape[-1])
        if not parallel:
            x2d = self.local_input(x2d)
        partial = self.local(x2d)
        self.reduce(partial)
        return partial.view(*lead, self.out_features)

    def reduce(self, partial):
        """Sum ``partial`` over the ranks, in place, on the current stream."""
        if self._collective_needed():
            dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=self.group)
        return partial

    def extra_repr(self):
        return (f"in_features={self.in_features} (this rank {self.input_slice.start}:"
                f"{self.input_slice.stop}), out_features={self.out_features}, "
                f"rank={self.rank}/{self.world}, input_is_parallel={self.input_is_parallel}, "
                f"bias={'here' if self.adds_bias else 'no'}, "
                f"{'kernel' if self.use_kernel else 'F.linear'} on {self.device}")


__all__ = ["ColumnParallelDecodeLinear", "RowParallelDecodeLinear", "MULTICAST_OFF",
           "MulticastEnabledError", "all_gather", "check_backend_multicast", "check_world",
           "column_shard", "ensure_no_multicast", "kernel_shape_reason", "local_cuda_device",
           "multicast_problems", "nccl_env_guard", "row_shard", "shard_plan", "shard_range",
           "shard_shape"]
