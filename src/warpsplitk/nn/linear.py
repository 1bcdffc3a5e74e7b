"""``DecodeLinear`` and ``patch_model``: the warp split-K kernel behind ``nn.Linear``.

``DecodeLinear`` is a drop-in for an ``nn.Linear`` (same ``weight``/``bias``
parameters, same state_dict keys) whose forward runs
``torch.ops.warpsplitk.decode_linear`` when the call suits the kernel and
``F.linear`` otherwise. ``patch_model`` swaps the eligible linears of a model
in place; ``unpatch`` puts the original modules back.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from . import ops
from ..planning.plans import check_plan, resolve_plan
from ..runtime.prepared import _matrix_shape
from ..planning.choose import default_tactic
from ..tactics import DEFAULT_SM_COUNT, MAX_M, check_ms

logger = logging.getLogger("warpsplitk")

#: The device type the kernel runs on. A module constant so that CPU tests can
#: trace the kernel branch on meta tensors; nothing else should change it.
_KERNEL_DEVICE_TYPE = "cuda"


@functools.lru_cache(maxsize=None)
def _shape_reason(n, k, ms):
    # The tactic rules decide, not a copy of them: every M the module will
    # serve needs a legal default tactic (a plan only replaces legal tactics).
    if not ms:
        return "no Ms to prepare"
    try:
        for m in ms:
            default_tactic(m, n, k, DEFAULT_SM_COUNT)
    except ValueError as error:
        return str(error)
    return None


def _tensor_reason(name, t, device):
    if t.device != device:
        return f"{name} on {t.device}, not with the weight on {device}"
    if t.dtype != torch.bfloat16:
        return f"{name} is {str(t.dtype).replace('torch.', '')}, the kernel needs bfloat16"
    if not t.is_contiguous():
        return f"{name} is not contiguous"
    if t.data_ptr() % ops.ALIGN_BYTES:
        return f"{name} is not {ops.ALIGN_BYTES}-byte aligned"
    return None


def ineligibility(weight, bias=None, ms=range(1, MAX_M + 1)):
    """Why the kernel cannot take ``weight`` (and ``bias``) for these Ms, or None."""
    if weight.device.type != _KERNEL_DEVICE_TYPE:
        return f"weight on {weight.device}, the kernel needs a {_KERNEL_DEVICE_TYPE} weight"
    if weight.dim() != 2:
        return f"weight must be 2-D, got shape {tuple(weight.shape)}"
    reason = _tensor_reason("weight", weight, weight.device)
    if reason is None and bias is not None:
        reason = _tensor_reason("bias", bias, weight.device)
    return reason or _shape_reason(*weight.shape, tuple(ms))


def linear_ineligibility(module, ms=range(1, MAX_M + 1)):
    """Why ``patch_model`` leaves ``module`` alone, or None when it can swap it."""
    if type(module) is not nn.Linear:
        # subclasses (quantised, LoRA, MultiheadAttention's out_proj) have their own semantics
        return f"{type(module).__name__} is not a plain nn.Linear"
    if module._forward_hooks or module._forward_pre_hooks:
        return "has forward hooks, which the swap would drop"
    if "forward" in module.__dict__:
        return "its forward is overridden on the instance (e.g. accelerate hooks)"
    return ineligibility(module.weight, module.bias, ms)


class DecodeLinear(nn.Module):
    """``y = x @ weight^T + bias`` through the warp split-K kernel for decode-sized inputs.

    The kernel path runs when x is a BF16 tensor on the weight's CUDA device,
    its leading dims flatten to M rows with M among the prepared ``ms``, and
    (eagerly) the flattened x is packed and 32-byte aligned; anything else
    goes to ``F.linear`` (same result up to BF16 rounding). A weight the
    kernel cannot take (on CPU, not BF16, a shape ``default_tactic`` refuses)
    is not an error: the module just always falls back.

    ``kernel_calls`` / ``fallback_calls`` count eager forward calls; traced
    (torch.compile) and replayed (CUDA graph) calls do not run this Python and
    are not counted. Fallback reasons are logged once each at DEBUG level on
    the ``warpsplitk`` logger.
    """

    def __init__(self, weight, bias=None, plan=None, ms=range(1, MAX_M + 1)):
        super().__init__()
        out_features, _ = _matrix_shape("weight", weight, "[out_features, in_features]")
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
        self.out_features, self.in_features = weight.shape
        self.plan = check_plan(plan)
        self.ms = check_ms(ms)
        # a range check alone when ms is contiguous: simpler guards under torch.compile
        self._ms_contiguous = self.ms == tuple(range(self.ms[0], self.ms[-1] + 1)) if self.ms else False
        self.kernel_calls = 0
        self.fallback_calls = 0
        self._logged = set()
        self._prepared = None
        self._handle = None
        self._unprepared = "not prepared"
        self.reprepare()

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
        if linear is None:
            # device="meta": no allocation or init for tensors replaced right away
            linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                               device="meta", dtype=self.weight.dtype)
        # current Parameters: load_state_dict(assign=True) or .to() may have replaced them
        linear.weight = self.weight
        linear.bias = self.bias
        return linear

    # ---------------------------------------------------------- preparation

    def reprepare(self) -> bool:
        """Compile for the current weight and bias. Returns False (and the module
        falls back from then on) when the kernel cannot take them. Call it after
        replacing the weight other than through load_state_dict or .to()."""
        self._release()
        reason = ineligibility(self.weight, self.bias, self.ms)
        if reason is not None:
            self._unprepared = f"not prepared: {reason}"
            logger.debug("%s: %s", self._label(), self._unprepared)
            return False
        from ..planning.plans import prepare  # loads the CuTe DSL: only when there is work for it
        weight = self.weight.detach()  # same storage: in-place updates stay visible
        bias = None if self.bias is None else self.bias.detach()
        self._prepared = prepare(weight, self.plan, self.ms, bias=bias)
        self._handle = ops.register(self._prepared)
        self._ptrs = self._current_ptrs()
        return True

    def _release(self):
        if self._handle is not None:
            ops.unregister(self._handle)
        self._prepared = None
        self._handle = None

    def _current_ptrs(self):
        return (self.weight.data_ptr(), None if self.bias is None else self.bias.data_ptr())

    @property
    def prepared(self):
        """The ``PreparedWarpSplitK`` (or, with Ms on cuBLAS, ``PreparedDecode``) in
        use, or None when falling back."""
        return self._prepared

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

    def _fallback_reason(self, x):
        if self._handle is None:
            return self._unprepared
        if x.device != self.weight.device:
            return f"x on {x.device}, weight on {self.weight.device}"
        if x.dtype != torch.bfloat16:
            return f"x is {str(x.dtype).replace('torch.', '')}, not bfloat16"
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            return f"x has shape {tuple(x.shape)}, expected [..., {self.in_features}]"
        m = math.prod(x.shape[:-1])
        if not (self.ms[0] <= m <= self.ms[-1] and (self._ms_contiguous or m in self.ms)):
            # no M in the text: formatting a symbolic M would specialise it, a
            # recompile per prefill length under torch.compile(dynamic=True)
            return f"M (rows of x) not among the prepared Ms {self._ms_text()}"
        if not torch.compiler.is_compiling():
            # Eager only: fake tensors have no addresses (the op re-packs x when
            # compiled, and checks the weight itself).
            if self._current_ptrs() != self._ptrs:
                return "weight or bias replaced since preparation; call reprepare()"
            x2d = x.reshape(m, self.in_features)
            if not x2d.is_contiguous() or x2d.data_ptr() % ops.ALIGN_BYTES:
                return f"x (as [M, K]) is not packed and {ops.ALIGN_BYTES}-byte aligned"
        return None

    def _needs_grad(self, x):
        return torch.is_grad_enabled() and (
            x.requires_grad or self.weight.requires_grad
            or (self.bias is not None and self.bias.requires_grad))

    def forward(self, x):
        reason = self._fallback_reason(x)
        if reason is None:
            x2d = x.reshape(-1, self.in_features)
            if torch.compiler.is_compiling() or self._needs_grad(x):
                out = torch.ops.warpsplitk.decode_linear(x2d, self.weight, self.bias, self._handle)
            else:
                # Eager inference: the op would only add dispatcher time (more
                # than the launch on a small weight) around this same call.
                # _fallback_reason has made run()'s checks on x (device, dtype,
                # shape, M prepared, packed, aligned, weight unchanged) and out
                # is new, so the launch goes without them.
                out = self._prepared._launch(x2d, x2d.new_empty((x2d.shape[0], self.out_features)))
            out = out.view(*x.shape[:-1], self.out_features)
        else:
            out = F.linear(x, self.weight, self.bias)
        if not torch.compiler.is_compiling():
            # Python side effects would force graph breaks or recompiles under
            # torch.compile: count and log eager calls only.
            # plain ints in the instance dict: nn.Module.__setattr__ costs
            # microseconds per call on the eager path
            if reason is None:
                self.__dict__["kernel_calls"] += 1
            else:
                self.__dict__["fallback_calls"] += 1
                if reason not in self._logged:
                    self._logged.add(reason)
                    logger.debug("%s: F.linear fallback: %s", self._label(), reason)
        return out

    def _ms_text(self):
        return (f"{self.ms[0]}..{self.ms[-1]}" if self._ms_contiguous
                else ", ".join(map(str, self.ms)))

    def _label(self):
        return f"DecodeLinear({self.in_features} -> {self.out_features})"

    def extra_repr(self):
        path = (f"kernel for M in {self._ms_text()}" if self._handle is not None
                else self._unprepared)
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {path}")


# ------------------------------------------------------------ whole models


@dataclass
class PatchReport:
    """What ``patch_model`` did: qualified names swapped, and (name, reason) skipped."""

    swapped: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    #: with merge=True: the qualified names of each merged group
    merged: list = field(default_factory=list)
    #: with merge=True: the MLPs whose gate/up run with the SwiGLU epilogue
    swiglu: list = field(default_factory=list)

    def __str__(self):
        lines = [f"warpsplitk: swapped {len(self.swapped)} nn.Linear, skipped {len(self.skipped)}"
                 + (f", merged {len(self.merged)} groups" if self.merged else "")
                 + (f", {len(self.swiglu)} MLPs with the SwiGLU epilogue" if self.swiglu else "")]
        by_reason = {}  # grouped: a large model repeats the same few reasons
        for name, reason in self.skipped:
            by_reason.setdefault(reason, []).append(name)
        for reason, names in by_reason.items():
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            lines.append(f"  skipped {shown}: {reason}")
        return "\n".join(lines)


def _linear_children(model, kind):
    """(qualified name, parent, attribute, module) for every submodule of type
    ``kind``, in named_modules order, once per path (a module reachable
    through two parents comes twice)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    for name, module in modules.items():
        if name and isinstance(module, kind):
            parent_name, _, attr = name.rpartition(".")
            yield name, modules[parent_name], attr, module


def _merge_groups(model, ms, filter, report):
    """``[(names, parents and attributes, linears)]``: each module's
    ``merge.MERGED_GROUPS`` whose linears can merge; refusals go to
    ``report.skipped`` under the group's names."""
    from .merge import MERGED_GROUPS, merge_refusal
    # where each linear sits and which modules hold each Parameter: a linear
    # used in a second place, or a Parameter another module holds too (tied),
    # would be left with no weight, or split from its twin, by the merge
    places, holders = {}, {}
    for _, parent, attr, child in _linear_children(model, nn.Linear):
        places.setdefault(id(child), set()).add((id(parent), attr))
    for module in dict(model.named_modules(remove_duplicate=False)).values():
        for param in module._parameters.values():
            if param is not None:
                holders.setdefault(id(param), set()).add(id(module))
    groups, seen = [], set()
    for name, module in model.named_modules():
        for attrs in MERGED_GROUPS:
            linears = [getattr(module, a, None) for a in attrs]
            if not all(isinstance(lin, nn.Linear) for lin in linears):
                continue
            names = [f"{name}.{a}" if name else a for a in attrs]
            if any(id(lin) in seen for lin in linears):
                continue  # a layer shared by two parents: merged once
            if filter is not None and not all(filter(n, lin) for n, lin in zip(names, linears)):
                report.skipped.append((names[0], "excluded by filter"))
                continue
            reason = merge_refusal(linears)
            if reason is None and any(len(places[id(lin)]) > 1 for lin in linears):
                reason = "a linear is also used elsewhere in the model"
            if reason is None and any(holders[id(p)] != {id(lin)} for lin in linears
                                      for p in (lin.weight, lin.bias) if p is not None):
                reason = "a Parameter is also held by another module (tied)"
            if reason is not None:
                report.skipped.append((" + ".join(names), f"not merged: {reason}"))
                continue
            seen |= {id(lin) for lin in linears}
            groups.append((names, [(module, a) for a in attrs], linears))
    return groups


def patch_model(model: nn.Module, plan=None, ms=range(1, MAX_M + 1), filter=None,
                jobs=None, progress=print, merge=False) -> PatchReport:
    """Replace, in place, every eligible ``nn.Linear`` of ``model`` by a
    ``DecodeLinear`` sharing its Parameters, compiling the kernels now (before
    any graph capture). Eligible: a plain ``nn.Linear`` without forward hooks,
    BF16 weight on CUDA whose shape the kernel supports for every M in ``ms``
    and, if given, ``filter(name, module)`` is true. Returns a ``PatchReport``,
    also logged at INFO (skips at DEBUG).

    The kernels are compiled first, ``jobs`` worker processes at a time
    (default: ``precompile.default_jobs()``), into the
    disk cache the swapped modules then load from.

    ``plan``: a ``DecodePlan``, None (the default (cost model)), or ``"auto"``:
    the plan for this GPU (``warpsplitk.planning.plan_cache``), tuning first, with
    ``progress``, the shapes of the eligible linears it lacks and keeping
    them for the next process.

    ``merge=True``: each module's ``q_proj``, ``k_proj``, ``v_proj`` and
    ``gate_proj``, ``up_proj`` (transformers' Llama-family names) become
    parts of one merged weight run in one launch (:mod:`warpsplitk.nn.merge`),
    keeping their parameter names; ``report.merged`` lists the groups."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_plan(plan)
    ms = check_ms(ms)
    report = PatchReport()
    if isinstance(model, nn.Linear):
        report.skipped.append(("", "the root module cannot be replaced in place; "
                                   "use DecodeLinear.from_linear"))
    groups = _merge_groups(model, ms, filter, report) if merge else []
    in_groups = {id(lin) for _, _, linears in groups for lin in linears}
    eligible = {}  # id(linear) -> linear, in model order
    for name, parent, attr, child in _linear_children(model, nn.Linear):
        if id(child) in eligible or id(child) in in_groups:
            continue
        if filter is not None and not filter(name, child):
            report.skipped.append((name, "excluded by filter"))
            continue
        reason = linear_ineligibility(child, ms)
        if reason is not None:
            report.skipped.append((name, reason))
            continue
        eligible[id(child)] = child
    from .merge import SwiGLUMLP, merge_linears, swiglu_refusal
    merged, mlps = [], []
    for names, places, linears in groups:
        parts = merge_linears(linears, plan=None, ms=ms, prepare=False)
        for (parent, attr), part in zip(places, parts):
            setattr(parent, attr, part)
        merged.append(parts[0].group)
        report.merged.append(names)
        owner = places[0][0]
        if [a for _, a in places] == ["gate_proj", "up_proj"] and swiglu_refusal(owner) is None:
            parts[0].group.swiglu = True
            mlps.append(owner)
    plan = resolve_plan(plan, [tuple(lin.weight.shape) for lin in eligible.values()]
                        + [tuple(g.weight.shape) for g in merged
                           if ineligibility(g.weight, g.bias, ms) is None], ms,
                        progress=progress, jobs=jobs)
    _precompile_linears(list(eligible.values()) + merged, plan, ms, jobs)
    _precompile_linears([g for g in merged if g.swiglu], plan, ms, jobs, swiglu=True)
    for group in merged:
        group.plan = plan
        group.prepare()
    wrapped = {}  # id(mlp) -> its SwiGLUMLP: an MLP shared by two parents stays shared
    swiglu_ids = {id(mlp) for mlp in mlps}
    for name, parent, attr, child in list(_linear_children(model, nn.Module)):
        if id(child) in swiglu_ids:
            if id(child) not in wrapped:
                wrapped[id(child)] = SwiGLUMLP(child)
                report.swiglu.append(name)
            setattr(parent, attr, wrapped[id(child)])
    done = {}  # id(linear) -> DecodeLinear: a Linear shared by two parents stays shared
    for name, parent, attr, child in _linear_children(model, nn.Linear):
        if id(child) not in eligible:
            continue
        if id(child) not in done:
            done[id(child)] = DecodeLinear.from_linear(child, plan, ms)
            report.swapped.append(name)
        setattr(parent, attr, done[id(child)])
    logger.info("warpsplitk: swapped %d nn.Linear, skipped %d", len(report.swapped),
                len(report.skipped))
    for name, reason in report.skipped:
        logger.debug("warpsplitk: skipped %s: %s", name, reason)
    return report


def _precompile_linears(linears, plan, ms, jobs, swiglu=False):
    """The kernels of ``linears`` (anything with ``weight`` and ``bias``: linears,
    merged groups; with ``swiglu``, gate/up groups' SwiGLU kernels), compiled
    in parallel workers first."""
    from ..planning.plans import precompile_for
    with_bias = [lin.weight for lin in linears if lin.bias is not None]
    without = [lin.weight for lin in linears if lin.bias is None]
    for weights, has_bias in ((with_bias, True), (without, False)):
        if weights:
            precompile_for(weights, plan, ms, jobs, progress=None, has_bias=has_bias,
                           swiglu=swiglu)


def unpatch(model: nn.Module) -> list:
    """Put back the ``nn.Linear`` behind every ``DecodeLinear`` of ``model``
    (the original objects when they came from ``patch_model``/``from_linear``).
    Returns the qualified names restored."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    from .merge import MergedPart, SwiGLUMLP
    for _, parent, attr, child in list(_linear_children(model, SwiGLUMLP)):
        setattr(parent, attr, child.to_original())
    restored, done = [], {}
    for name, parent, attr, child in _linear_children(model, MergedPart):
        if id(child) not in done:
            done[id(child)] = child.to_linear()
            restored.append(name)
        setattr(parent, attr, done[id(child)])
    for name, parent, attr, child in _linear_children(model, DecodeLinear):
        if id(child) not in done:
            done[id(child)] = child.to_linear()
            restored.append(name)
        setattr(parent, attr, done[id(child)])
    return restored
