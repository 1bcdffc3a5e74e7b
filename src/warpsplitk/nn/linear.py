"""``DecodeLinear``: the warp split-K kernel behind one ``nn.Linear``.

``DecodeLinear`` is a drop-in for an ``nn.Linear`` (same ``weight``/``bias``
parameters, same state_dict keys) whose forward runs the kernel when the
call suits it (:meth:`DecodeLinear.accepts`) and ``F.linear`` otherwise.
What the kernel takes is ``warpsplitk.contract``'s to say; this module asks
it. ``patch_model`` (:mod:`warpsplitk.nn.patch`) swaps a model's linears for
these modules.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from . import ops
from .. import contract
from ..contract import MAX_M
from ..planning import plans
from ..tactics import check_ms

logger = logging.getLogger("warpsplitk")

#: Why a module prepared for no M runs no kernel.
NO_MS = "no Ms to prepare"


def ineligibility(weight, bias=None, ms=range(1, MAX_M + 1), weight_scale=None) -> str | None:
    """Why the kernel cannot take ``weight`` (and ``bias``) for these Ms, or
    None: the contract's weight rules (``contract.weight_refusal``, which
    build no tactic; with ``weight_scale``, an FP8 weight's:
    ``contract.fp8_refusal`` and ``fp8_value_refusal``) and at least one M."""
    if weight_scale is None:
        reason = contract.weight_refusal(weight, bias)
    else:
        reason = (contract.fp8_refusal(weight, weight_scale, bias)
                  or contract.shape_refusal(*weight.shape)
                  or contract.fp8_value_refusal(weight, weight_scale))
    if reason is None and not tuple(ms):
        return NO_MS
    return reason


#: How FP8 linears name their scales: transformers' fine-grained FP8 linear
#: (``weight_scale_inv``: one scale, or one per 128 x 128 block) and per-row
#: FP8 linears (``weight_scale``).
FP8_SCALE_NAMES = ("weight_scale_inv", "weight_scale")


def fp8_linear_scale(module) -> tuple[str | None, str | None]:
    """``(scale attribute, None)`` for a module that is an FP8 linear the
    kernel's W8A16 path computes as its forward does (an e4m3 ``weight``,
    FP32 scales under one of ``FP8_SCALE_NAMES``, 128 x 128 blocks when
    blocked, activations quantized per call if at all), else ``(None,
    why not)``."""
    if not contract.is_fp8(getattr(module, "weight", None)):
        return None, f"{type(module).__name__} has no {contract.FP8_DTYPE_NAME} weight"
    name = next((n for n in FP8_SCALE_NAMES if isinstance(getattr(module, n, None), torch.Tensor)),
                None)
    if name is None:
        return None, f"{type(module).__name__} has no scales named {' or '.join(FP8_SCALE_NAMES)}"
    block = getattr(module, "block_size", None)
    if block is not None and tuple(block) != (contract.FP8_SCALE_BLOCK,) * 2:
        return None, f"block scales of {tuple(block)}, not 128 x 128"
    if getattr(module, "activation_scale", None) is not None:
        # a static activation scale: the module's own output rounds x to e4m3
        # with it; W8A16 would not
        return None, "a static activation scale (activation_scheme='static')"
    return name, None


def fallback_linear(x, weight, bias=None, weight_scale=None):
    """What a ``DecodeLinear`` (or a merged part) computes where the kernel
    does not run: ``F.linear``, of the dequantized weight (``ops.dequantized``,
    in x's dtype) for an e4m3 weight with ``weight_scale``."""
    if weight_scale is not None:
        weight = ops.dequantized(weight, weight_scale, x.dtype)
    return F.linear(x, weight, bias)


class DecodeLinear(nn.Module):
    """``y = x @ weight^T + bias`` through the warp split-K kernel for decode-sized inputs.

    The kernel path runs when x is a BF16 tensor on the weight's CUDA device,
    its leading dims flatten to M rows with M among the prepared ``ms``, and
    (eagerly) the flattened x is packed and 32-byte aligned; anything else
    goes to ``F.linear`` (same result up to BF16 rounding). A weight the
    kernel cannot take (on CPU, not BF16, a shape ``contract.shape_refusal``
    refuses) is not an error: the module just always falls back.

    ``kernel_calls`` / ``fallback_calls`` count eager forward calls; traced
    (torch.compile) and replayed (CUDA graph) calls do not run this Python and
    are not counted. Fallback reasons are logged once each at DEBUG level on
    the ``warpsplitk`` logger.

    With ``weight_scale`` (:meth:`from_fp8`) the weight is e4m3 and ``y = x @
    (weight * weight_scale)^T + bias``: the FP8 kernel (W8A16) for decode-sized
    x, ``F.linear`` on the dequantized weight otherwise.
    """

    def __init__(self, weight, bias=None, plan=None, ms=range(1, MAX_M + 1), *,
                 weight_scale=None, scale_name: str = "weight_scale"):
        super().__init__()
        reason = contract.matrix_refusal("weight", weight, "[out_features, in_features]")
        if reason is not None:
            raise ValueError(reason)
        out_features = weight.shape[0]
        if bias is not None and (not isinstance(bias, torch.Tensor)
                                 or tuple(bias.shape) != (out_features,)):
            given = (f"shape {tuple(bias.shape)}" if isinstance(bias, torch.Tensor)
                     else type(bias).__name__)
            raise ValueError(f"bias must be None or a tensor of shape ({out_features},), "
                             f"got {given}")
        # A plain tensor becomes a frozen Parameter (an inference module);
        # pass Parameters to share them, gradients included.
        if not isinstance(weight, nn.Parameter):
            weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None and not isinstance(bias, nn.Parameter):
            bias = nn.Parameter(bias, requires_grad=False)
        self.weight = weight
        self.register_parameter("bias", bias)
        if weight_scale is not None:
            if not isinstance(weight_scale, torch.Tensor):
                raise ValueError(f"weight_scale must be a torch.Tensor, got "
                                 f"{type(weight_scale).__name__}")
            if not isinstance(weight_scale, nn.Parameter):
                weight_scale = nn.Parameter(weight_scale, requires_grad=False)
            # under the FP8 module's own name (weight_scale, weight_scale_inv):
            # the state_dict keeps the checkpoint's keys
            self.register_parameter(scale_name, weight_scale)
        self._scale_name = None if weight_scale is None else scale_name
        self.out_features, self.in_features = weight.shape
        self.plan = plans.check_plan(plan)
        self.ms = check_ms(ms)
        # a range check alone when ms is contiguous: simpler guards under torch.compile
        self._ms_contiguous = bool(self.ms) and self.ms == tuple(range(self.ms[0], self.ms[-1] + 1))
        self.kernel_calls = 0
        self.fallback_calls = 0
        self._logged = set()
        self._prepared = None
        self._handle = None
        self._unprepared = "not prepared"
        self.reprepare()

    @property
    def fp8_scale(self):
        """An FP8 weight's scales (the Parameter under ``scale_name``), or None."""
        return None if self._scale_name is None else getattr(self, self._scale_name)

    @classmethod
    def from_fp8(cls, weight, weight_scale, bias=None, plan=None, ms=range(1, MAX_M + 1)):
        """An e4m3 ``weight`` ``[N, K]`` (``float8_e4m3fn``) with FP32
        ``weight_scale`` (one: ``()`` or ``(1,)``; one per row: ``[N]`` or
        ``[N, 1]``; one per 128 x 128 block) and an optional BF16 ``bias``: the FP8 kernel (the
        plan's FP8 entries, the FP8 default where it has none) for decode-sized x,
        ``F.linear`` on the dequantized weight otherwise. The state_dict
        holds ``weight``, ``weight_scale`` (and ``bias``)."""
        return cls(weight, bias, plan, ms, weight_scale=weight_scale)

    @classmethod
    def from_fp8_module(cls, module, plan=None, ms=range(1, MAX_M + 1)):
        """Wrap an FP8 linear's own Parameters (no copy; ``to_linear`` gives
        the module back): its ``weight``, ``bias`` and scales under their own
        name (``fp8_linear_scale``: transformers' fine-grained ``FP8Linear``
        ``weight_scale_inv``, a per-row ``weight_scale``)."""
        scale_name, reason = fp8_linear_scale(module)
        if reason is not None:
            raise ValueError(reason)
        made = cls(module.weight, module.bias, plan, ms,
                   weight_scale=getattr(module, scale_name), scale_name=scale_name)
        object.__setattr__(made, "_original", module)
        return made

    @classmethod
    def from_linear(cls, linear: nn.Linear, plan=None, ms=range(1, MAX_M + 1)):
        """Wrap ``linear``'s own Parameters (no copy); ``to_linear`` gives it back."""
        module = cls(linear.weight, linear.bias, plan, ms)
        # object.__setattr__: kept out of the submodules, so it never shows up
        # in state_dict, .to() or named_modules.
        object.__setattr__(module, "_original", linear)
        return module

    def to_linear(self) -> nn.Linear:
        """The original ``nn.Linear`` (or an equivalent one) holding this module's
        current weight and bias Parameters."""
        linear = self.__dict__.get("_original")
        if linear is None and self.fp8_scale is not None:
            raise ValueError("an FP8 DecodeLinear made by from_fp8 has no nn.Linear to give back "
                             "(an nn.Linear has no weight scales)")
        if linear is None:
            # device="meta": no allocation or init for tensors replaced right away
            linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                               device="meta", dtype=self.weight.dtype)
        # current Parameters: load_state_dict(assign=True) or .to() may have replaced them
        linear.weight = self.weight
        linear.bias = self.bias
        if self._scale_name is not None:
            setattr(linear, self._scale_name, self.fp8_scale)
        return linear

    # ---------------------------------------------------------- preparation

    def reprepare(self) -> bool:
        """Compile for the current weight and bias. Returns False (and the module
        falls back from then on) when the kernel cannot take them. Call it after
        replacing the weight other than through load_state_dict or .to()."""
        self._release()
        reason = ineligibility(self.weight, self.bias, self.ms, self.fp8_scale)
        if reason is not None:
            self._unprepared = f"not prepared: {reason}"
            logger.debug("%s: %s", self._label(), self._unprepared)
            return False
        weight = self.weight.detach()  # same storage: in-place updates stay visible
        bias = None if self.bias is None else self.bias.detach()
        fp8 = {} if self.fp8_scale is None else {"weight_scale": self.fp8_scale.detach()}
        self._prepared = plans.prepare(weight, self.plan, self.ms, bias=bias, **fp8)
        self._handle = ops.register(self._prepared)
        self._ptrs = self._current_ptrs()
        self._device = self.weight.device
        return True

    def _release(self):
        if self._handle is not None:
            ops.unregister(self._handle)
        self._prepared = None
        self._handle = None

    def _current_ptrs(self):
        # from _parameters: nn.Module.__getattr__ costs a microsecond a name
        # on the eager path, which runs this every call
        params = self._parameters
        return tuple(None if t is None else t.data_ptr()
                     for t in (params["weight"], params["bias"],
                               params[self._scale_name] if self._scale_name else None))

    @property
    def prepared(self):
        """The ``PreparedWarpSplitK`` (or, with Ms on cuBLAS, ``PreparedDecode``) in
        use, or None when falling back."""
        return self._prepared

    @property
    def unprepared_reason(self) -> str | None:
        """Why no kernel is prepared (every call falls back), or None."""
        return None if self._handle is not None else self._unprepared

    def _refresh(self):
        """Re-prepare unless the weight and bias are still the prepared memory.
        Copied in place (load_state_dict) or converted to what they already
        were (.to() a no-op), the kernel already reads the current values, and
        keeping the handle keeps compiled code and captured CUDA graphs valid."""
        if self._handle is None or self._current_ptrs() != self._ptrs:
            self.reprepare()

    def _apply(self, fn, recurse=True):
        # .to(), .cuda(), .half() ...: new tensors, prepare for them
        result = super()._apply(fn, recurse)
        self._refresh()
        return result

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self._refresh()  # assign=True gives new tensors; a copy keeps the memory

    def __getstate__(self):
        # compiled code neither copies nor pickles: deepcopy / pickle re-prepare
        state = super().__getstate__()
        state.update(_prepared=None, _handle=None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self.reprepare()

    # -------------------------------------------------------------- forward

    def accepts(self, x) -> bool:
        """Whether ``forward(x)`` runs the kernel (:meth:`fallback_reason` is None)."""
        return self.fallback_reason(x) is None

    def fallback_reason(self, x) -> str | None:
        """Why ``forward(x)`` runs ``F.linear``, or None when it runs the kernel:
        no kernel prepared, x not ``[..., in_features]`` with M (its rows,
        flattened) among the prepared ``ms``, or x not an operand the kernel
        takes (``contract.operand_refusal``: on the weight's device, BF16,
        packed, aligned) or the weight replaced since preparation."""
        if self._handle is None:
            return self._unprepared
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            return f"x has shape {tuple(x.shape)}, expected [..., {self.in_features}]"
        m = math.prod(x.shape[:-1])
        if not (self.ms[0] <= m <= self.ms[-1] and (self._ms_contiguous or m in self.ms)):
            # no M in the text: formatting a symbolic M would specialise it, a
            # recompile per prefill length under torch.compile(dynamic=True)
            return f"M (rows of x) not among the prepared Ms {self._ms_text()}"
        if torch.compiler.is_compiling():
            # fake tensors have no addresses for operand_refusal: device and
            # dtype only (the op re-packs x, and checks the weight itself)
            if x.device != self.weight.device or x.dtype != torch.bfloat16:
                return f"x is {x.dtype} on {x.device}, not bfloat16 on {self.weight.device}"
            return None
        if self._current_ptrs() != self._ptrs:
            return "weight or bias replaced since preparation; call reprepare()"
        k = self.in_features
        return contract.operand_refusal("x", x.reshape(m, k), (m, k), self._device)

    def _needs_grad(self, x):
        return torch.is_grad_enabled() and (
            x.requires_grad or self.weight.requires_grad
            or (self.bias is not None and self.bias.requires_grad))

    def forward(self, x):
        reason = self.fallback_reason(x)
        compiling = torch.compiler.is_compiling()
        if reason is None:
            x2d = x.reshape(-1, self.in_features)
            as_op = compiling or self._needs_grad(x)
            if as_op and self._scale_name is not None:
                out = torch.ops.warpsplitk.decode_linear_fp8(x2d, self.weight, self.fp8_scale,
                                                             self.bias, self._handle)
            elif as_op:
                out = torch.ops.warpsplitk.decode_linear(x2d, self.weight, self.bias, self._handle)
            else:
                # Eager inference: the op would only add dispatcher time (more
                # than the launch on a small weight) around this same call.
                # fallback_reason has made run()'s checks on x and out is new.
                out = self._prepared.launch_unchecked(
                    x2d, x2d.new_empty((x2d.shape[0], self.out_features)))
            out = out.view(*x.shape[:-1], self.out_features)
        else:
            out = fallback_linear(x, self.weight, self.bias, self.fp8_scale)
        if not compiling:
            # Python side effects would force graph breaks or recompiles under
            # torch.compile: count and log eager calls only.
            self._count(reason)
        return out

    def _count(self, reason):
        # plain ints in the instance dict: nn.Module.__setattr__ costs
        # microseconds per call on the eager path
        if reason is None:
            self.__dict__["kernel_calls"] += 1
            return
        self.__dict__["fallback_calls"] += 1
        if reason not in self._logged:
            self._logged.add(reason)
            logger.debug("%s: F.linear fallback: %s", self._label(), reason)

    def _ms_text(self):
        return (f"{self.ms[0]}..{self.ms[-1]}" if self._ms_contiguous
                else ", ".join(map(str, self.ms)))

    def _label(self):
        return f"DecodeLinear({self.in_features} -> {self.out_features})"

    def extra_repr(self):
        path = (f"kernel for M in {self._ms_text()}" if self._handle is not None
                else self._unprepared)
        fp8 = "fp8 weight, " if self.fp8_scale is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {fp8}{path}")


__all__ = ["DecodeLinear", "NO_MS", "ineligibility", "fp8_linear_scale", "FP8_SCALE_NAMES",
           "fallback_linear"]
