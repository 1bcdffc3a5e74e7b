"""Merged projections: linears that read the same input, run as one GEMM.

A decode layer reads its input through several weights: q, k and v, then
gate and up. Run apart they are several launches, each a fixed cost and a
break in the PDL chain; stacked into one ``[sum N, K]`` weight they are one
(what vLLM does with its ``qkv_proj`` and ``gate_up_proj``).

:func:`merge_linears` stacks the weights of some ``nn.Linear`` into one
storage (a :class:`MergedWeight`) and returns a :class:`MergedPart` per
linear, each a drop-in for its linear: the same ``weight`` and ``bias``
names, now views into the merged storage, so ``state_dict`` keeps its keys
and ``load_state_dict`` writes through into what the kernel reads. The
group's dispatch (a :class:`MergedGroup`) runs the merged weight once for
the first part called with an input (a
:class:`~warpsplitk.nn.linear.DecodeLinear`), and the others called with
the same input tensor take their columns of that output: transformers'
Llama attention calls ``q_proj``, ``k_proj`` and ``v_proj`` on one
``hidden_states``. A part called with another input, or a group whose
merged weight the kernel cannot take (on a CPU, say), computes its own
``F.linear`` on its view: the result of the unmerged linear, bit for bit.

FP8 linears (``fp8_linear_scale``: transformers' ``FP8Linear``, per-row
FP8 linears) of one class merge the same way, their scales with them:
per-row scales stacked, 128 x 128 block scales stacked by block rows (every
part but the last whole blocks of rows), each part's scales a view under its
own name. A part the kernel does not serve computes what an FP8
``DecodeLinear`` falls back to (``fallback_linear``: the dequantized weight).

``patch_model(model, merge=True)`` (:mod:`warpsplitk.nn.patch`) merges each
module's ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj``
(Llama, Mistral, Qwen2 and Qwen3 name them so); ``unpatch`` gives every
part back as an ``nn.Linear`` holding its current values in its own
storage.
"""

from __future__ import annotations

from itertools import accumulate

import torch
from torch import nn

from . import ops
from .. import contract
from ..contract import MAX_M
from ..planning import plans
from ..tactics import check_ms
from .linear import DecodeLinear, fallback_linear, fp8_linear_scale

#: Attribute names of the projections a transformers decoder layer runs on
#: one input, merged by ``patch_model(merge=True)``, in call order.
MERGED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def merge_refusal(linears) -> str | None:
    """Why ``linears`` cannot be merged, or None: plain ``nn.Linear``, or FP8
    linears of one class whose scales stack (:func:`fp8_merge_refusal`)."""
    if len(linears) < 2:
        return "fewer than two linears"
    if len({id(lin) for lin in linears}) != len(linears):
        return "the same linear twice"
    first = linears[0]
    for lin in linears:
        if getattr(lin, "weight", None) is None:
            return "a linear without a weight (merged already?)"
        if type(lin) is not nn.Linear and not contract.is_fp8(lin.weight):
            return f"{type(lin).__name__} is not a plain nn.Linear"
        if type(lin) is not type(first):
            return f"mixed classes ({type(first).__name__} and {type(lin).__name__})"
        if lin._forward_hooks or lin._forward_pre_hooks or "forward" in lin.__dict__:
            return "has forward hooks or an overridden forward"
        if lin.in_features != first.in_features:
            return f"in_features differ ({first.in_features} and {lin.in_features})"
        if lin.weight.dtype != first.weight.dtype or lin.weight.device != first.weight.device:
            return "weights differ in dtype or device"
        if (lin.bias is None) != (first.bias is None):
            return "some have a bias and some do not"
    reason = None if type(first) is nn.Linear else fp8_merge_refusal(linears)
    if reason is not None:
        return reason
    shared = [p for lin in linears for p in lin._parameters.values() if p is not None]
    if len({id(p) for p in shared}) != len(shared):
        return "two of them share a Parameter (merging would split it)"
    return None


def fp8_merge_refusal(linears) -> str | None:
    """Why FP8 linears (one class, e4m3 weights of one K) cannot merge, or
    None: each an FP8 linear the kernel computes (``fp8_linear_scale``)
    holding only its weight, bias and scales, all scales of one name, dtype,
    device and kind, and that kind one that stacks into the merged weight's:
    per row, or 128 x 128 blocks with every part but the last whole blocks
    of rows (one scale per part has no view in one weight's scales)."""
    names, kinds = [], []
    for lin in linears:
        name, reason = fp8_linear_scale(lin)
        if reason is not None:
            return reason
        extra = [n for n, t in (*lin._parameters.items(), *lin._buffers.items())
                 if t is not None and n not in ("weight", "bias", name)]
        if extra:
            return f"{type(lin).__name__} holds {', '.join(extra)} besides weight, bias and {name}"
        scale, (n, k) = getattr(lin, name), lin.weight.shape
        kind = contract.fp8_scale_kind(scale, n, k)
        if kind is None:
            return (f"{name} of shape {tuple(scale.shape)} is none of "
                    f"{', '.join(contract.FP8_SCALE_KINDS)} for a [{n}, {k}] weight")
        names.append(name)
        kinds.append(kind)
    scales = [getattr(lin, name) for lin, name in zip(linears, names)]
    if len(set(names)) > 1:
        return f"scales under different names ({' and '.join(dict.fromkeys(names))})"
    if len(set(kinds)) > 1:
        return f"scale kinds differ ({' and '.join(dict.fromkeys(kinds))})"
    if len({(s.dtype, s.device) for s in scales}) > 1:
        return "scales differ in dtype or device"
    if kinds[0] == "tensor":
        return ("tensor scales (one per linear) cannot be views of one merged weight's scales; "
                "per-row or 128 x 128 block scales can")
    block = contract.FP8_SCALE_BLOCK
    short = [lin.weight.shape[0] for lin in linears[:-1] if lin.weight.shape[0] % block]
    if kinds[0] == "block128" and short:
        return (f"block scales stack only where every part but the last has a multiple of "
                f"{block} rows, got a part of {short[0]} rows")
    return None


class MergedWeight:
    """The storage of a merged group: the stacked ``[W_a; W_b; ...]`` (and
    bias, and an FP8 group's scales under ``scale_name``) of its parts, each
    part's Parameters views of its rows. Not an ``nn.Module``: its tensors
    belong to the parts' Parameters, so ``state_dict`` keeps the parts' keys,
    ``load_state_dict`` writes through and ``.to()`` or ``assign=True`` (new
    tensors) call for ``stack`` again. A copy (deepcopy, pickle) holds no
    storage until stacked from its parts' copied values."""

    def __init__(self, parts, scale_name=None):
        self.parts = parts
        #: an FP8 group's scales' Parameter name (``fp8_linear_scale``), else None
        self.scale_name = scale_name
        self.weight = self.bias = self.scale = None
        self.columns = []  # each part's (start, end) rows of the merged weight
        self.scale_rows = []  # each part's (start, end) rows of the merged scales
        self._views = []  # each part's Parameters (names()) as stack() made them
        self._addresses = []  # (Parameter dict, name, address, device) of each view

    def __getstate__(self):
        # a copy's parts get Parameters of their own: it stacks them again
        return {**self.__dict__, "weight": None, "bias": None, "scale": None, "columns": [],
                "scale_rows": [], "_views": [], "_addresses": []}

    def names(self) -> tuple:
        """The names of the Parameters each part holds a view for."""
        return ("weight", "bias") + (() if self.scale_name is None else (self.scale_name,))

    def awaits_stack(self) -> bool:
        """Whether this is a restored copy, every part restored too (their
        order depends on where the copy started), that has not stacked yet."""
        return ("weight" in self.__dict__ and self.weight is None
                and all("_parameters" in part.__dict__ for part in self.parts))

    def offsets(self):
        """Each part's ``(start, end)`` rows of the merged weight (``stack`` keeps them)."""
        out, start = [], 0
        for part in self.parts:
            out.append((start, start + part.out_features))
            start += part.out_features
        return out

    def can_stack(self) -> bool:
        """Whether the parts' tensors share one device and their weights one
        dtype (not so while a ``.to()`` is half done)."""
        tensors = [t for p in self.parts for t in (p.weight, p.fp8_scale) if t is not None]
        return (len({t.device for t in tensors}) == 1
                and len({p.weight.dtype for p in self.parts}) == 1)

    def stack(self):
        """Stack the parts' current weights (and biases, and scales) into new
        storage and make each part's Parameters views of it."""
        self.columns = self.offsets()
        self.weight = torch.cat([p.weight.detach() for p in self.parts])
        has_bias = self.parts[0].bias is not None
        self.bias = torch.cat([p.bias.detach() for p in self.parts]) if has_bias else None
        self.scale, self.scale_rows = self._stacked_scales()
        for i, part in enumerate(self.parts):
            start, end = self.columns[i]
            views = {"weight": self.weight[start:end]}
            if has_bias:
                views["bias"] = self.bias[start:end]
            if self.scale is not None:
                start, end = self.scale_rows[i]
                views[self.scale_name] = self.scale[start:end].view(part.fp8_scale.shape)
            for name, view in views.items():
                part._parameters[name] = nn.Parameter(
                    view, requires_grad=part._parameters[name].requires_grad)
        self._views = [tuple(part._parameters[n] for n in self.names()) for part in self.parts]
        # what merged() compares on every eager call: each part's Parameter
        # dict, and the name, address and device each view was made at
        self._addresses = [(part._parameters, name, view.data_ptr(), view.device)
                           for part, views in zip(self.parts, self._views)
                           for name, view in zip(self.names(), views) if view is not None]

    def _stacked_scales(self):
        """``(scales, each part's (start, end) rows of them)`` of an FP8
        group, else ``(None, [])``: per-row scales flattened and
        concatenated; 128 x 128 block scales concatenated by block rows
        (``merge_refusal``: every part but the last whole blocks of rows)."""
        if self.scale_name is None:
            return None, []
        first = self.parts[0]
        blocks = contract.fp8_scale_kind(first.fp8_scale, first.out_features,
                                         first.in_features) == "block128"
        scales = [p.fp8_scale.detach() for p in self.parts]
        scales = scales if blocks else [s.reshape(-1) for s in scales]
        rows = list(accumulate((s.shape[0] for s in scales), initial=0))
        return torch.cat(scales), list(zip(rows[:-1], rows[1:]))

    def merged(self) -> bool:
        """Whether every part's weight (and bias, and scales) is still its
        view of the storage (``.to()`` or ``load_state_dict(assign=True)``
        give parts tensors of their own)."""
        if torch.compiler.is_compiling():
            # fake tensors have no addresses: the Parameters stack() made
            # (Dynamo guards the identities, so a replaced one recompiles)
            return all(part._parameters[n] is view for part, views in zip(self.parts, self._views)
                       for n, view in zip(self.names(), views))
        if self.weight is None:
            return False  # a copy not stacked yet
        # the addresses stack() made the views at: nn.Module attribute
        # lookups would cost a microsecond a name on every part's call
        for params, name, address, device in self._addresses:
            t = params[name]
            if t is None or t.data_ptr() != address or t.device != device:
                return False
        return True


class MergedGroup:
    """The dispatch of a merged group: a ``DecodeLinear`` of its
    :class:`MergedWeight` whose output serves every part called with the same
    input (the kernel where it accepts x, else ``F.linear`` on the merged
    weight, dequantized for FP8), each part's own ``fallback_linear`` where
    the storage is no longer merged or has no kernel; for a ``[gate; up]``
    group also the kernel with the SwiGLU epilogue."""

    def __init__(self, storage: MergedWeight, plan, ms):
        self.storage = storage
        self.plan, self.ms = plan, tuple(ms)
        self.linear = None
        #: a [gate; up] group run with the SwiGLU epilogue by a SwiGLUMLP
        self.swiglu = False
        self.swiglu_prepared = None
        self._swiglu_handle = None  # swiglu_prepared's in the custom ops' registry
        self._stash = None  # (input, merged output, parts served)

    @property
    def parts(self):
        return self.storage.parts

    @property
    def weight(self):
        """The merged ``[sum N, K]`` weight the group runs."""
        return self.storage.weight

    @property
    def bias(self):
        return self.storage.bias

    @property
    def scale(self):
        """An FP8 group's merged scales, or None."""
        return self.storage.scale

    def merged(self) -> bool:
        """Whether the parts are still views of the storage (``MergedWeight.merged``)."""
        return self.storage.merged()

    def __getstate__(self):
        # compiled code and a registry handle neither copy nor pickle
        return {**self.__dict__, "linear": None, "swiglu_prepared": None,
                "_swiglu_handle": None, "_stash": None}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.merge_when_restored()

    def merge_when_restored(self):
        """A copy's ``merge``, once the group, its storage and every part are
        restored (``MergedPart.__setstate__`` calls it too)."""
        if "storage" in self.__dict__ and self.storage.awaits_stack():
            self.merge()

    def merge(self):
        """Stack the storage from the parts' current tensors and prepare the
        kernels for it."""
        self.storage.stack()
        self._stash = None
        self.prepare()

    def prepare(self):
        """The ``DecodeLinear`` of the merged weight (it falls back, and the
        parts with it, where the kernel cannot take the weight); for a
        ``swiglu`` group also the kernel with the SwiGLU epilogue."""
        fp8 = ({} if self.scale is None
               else {"weight_scale": self.scale, "scale_name": self.storage.scale_name})
        self.linear = DecodeLinear(self.weight, self.bias, self.plan, self.ms, **fp8)
        self._release_swiglu()
        if self.swiglu and self.linear.prepared is not None:
            self.swiglu_prepared, self._swiglu_handle = swiglu_kernel(
                self.weight, self.bias, self.plan, self.ms, weight_scale=self.scale)

    def _release_swiglu(self):
        release_swiglu(self._swiglu_handle)
        self.swiglu_prepared = None
        self._swiglu_handle = None

    def output(self, part_index, x):
        """Part ``part_index``'s output for ``x``: its columns of the merged
        output, computed once for the parts called in turn with one input."""
        part = self.parts[part_index]
        if self.linear is None or self.linear.prepared is None or not self.merged():
            # no kernel for the merged weight (or storage replaced): exactly
            # the unmerged linear
            self._stash = None
            return fallback_linear(x, part.weight, part.bias, part.fp8_scale)
        stash = self._stash
        if stash is None or stash[0] is not x or part_index in stash[2]:
            stash = self._stash = (x, self.linear(x), set())
        stash[2].add(part_index)
        if len(stash[2]) == len(self.parts):
            self._stash = None  # every part served: hold no tensors past the call
        start, end = self.storage.columns[part_index]
        return stash[1][..., start:end]

    def swiglu_output(self, x):
        """``silu(gate(x)) * up(x)`` in one launch of the SwiGLU epilogue, or
        None where it cannot run (no kernel, the storage replaced, x not a
        packed 32-byte aligned BF16 tensor on the weight's device with M
        prepared, or autograd needing a graph: the caller then runs the parts
        and the activation as the model would). Under torch.compile, the
        ``warpsplitk::decode_swiglu`` op (``decode_swiglu_fp8`` for FP8)."""
        if self.swiglu_prepared is None or not self.merged():
            return None
        if torch.is_grad_enabled() and (x.requires_grad or self.parts[0].weight.requires_grad):
            return None
        return swiglu_launch(self.linear, self.swiglu_prepared, self._swiglu_handle, x)


def swiglu_kernel(weight, bias, plan, ms, weight_scale=None):
    """``(prepared, handle)``: the SwiGLU kernel of a ``[gate; up]`` weight
    (an e4m3 one with its ``weight_scale``) (compiled, or loaded from the
    disk cache) and its custom-op handle."""
    fp8 = {} if weight_scale is None else {"weight_scale": weight_scale}
    prepared = plans.prepare(weight, plan, ms, bias, swiglu=True, **fp8)
    return prepared, ops.register(prepared)


def release_swiglu(handle):
    """Unregister a ``swiglu_kernel`` handle (None: nothing to release)."""
    if handle is not None:
        ops.unregister(handle)


def swiglu_launch(linear, prepared, handle, x):
    """``silu(gate(x)) * up(x)`` by ``prepared`` (the SwiGLU kernel of
    ``linear``'s ``[gate; up]`` weight, registered as ``handle``) in one
    launch, or None where ``linear`` (prepared for the same Ms) would not run
    the kernel on x: device, dtype, K, M, packed, aligned. Under
    torch.compile, the ``warpsplitk::decode_swiglu`` op (an FP8 ``linear``:
    ``decode_swiglu_fp8``)."""
    if not linear.accepts(x):
        return None
    x2d = x.reshape(-1, linear.in_features)
    if torch.compiler.is_compiling() and linear.fp8_scale is not None:
        out = torch.ops.warpsplitk.decode_swiglu_fp8(x2d, linear.weight, linear.fp8_scale,
                                                     linear.bias, handle)
    elif torch.compiler.is_compiling():
        # the DecodeLinear's Parameters: static addresses for CUDA graph trees
        out = torch.ops.warpsplitk.decode_swiglu(x2d, linear.weight, linear.bias, handle)
    else:
        # accepts() has made run()'s checks on x, and out is new
        out = prepared.launch_unchecked(x2d, x2d.new_empty((x2d.shape[0],
                                                            prepared.out_columns)))
    return out.view(*x.shape[:-1], prepared.out_columns)


class MergedPart(nn.Module):
    """One linear of a merged group: ``weight`` and ``bias`` (an FP8
    linear's scales too, under their own name) are views into the group's
    storage; ``forward`` is the linear's (see the module docstring)."""

    def __init__(self, linear: nn.Linear, group: MergedGroup, index: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # in the linear's order: the state_dict keys come out as they were
        for name, param in linear._parameters.items():
            if name in group.storage.names():
                self.register_parameter(name, param)
        # kept out of the submodules (state_dict, .to(), named_modules)
        object.__setattr__(self, "group", group)
        object.__setattr__(self, "index", index)
        object.__setattr__(self, "_original", linear)

    @property
    def fp8_scale(self):
        """An FP8 part's scales (the Parameter under the group's
        ``scale_name``), or None."""
        name = self.group.storage.scale_name
        return None if name is None else self._parameters[name]

    def forward(self, x):
        return self.group.output(self.index, x)

    def __setstate__(self, state):
        # deepcopy / unpickle: the last part of a group restored merges the
        # copy (stack and prepare) from the parts' copied values
        super().__setstate__(state)
        if "group" in self.__dict__:
            self.group.merge_when_restored()

    def remerge(self) -> bool:
        """Stack the group again from the parts' current tensors (after
        ``.to()`` or ``load_state_dict(assign=True)``); False while the parts
        are on different devices (a ``.to()`` half done)."""
        if not self.group.storage.can_stack():
            return False
        self.group.merge()
        return True

    def _apply(self, fn, recurse=True):
        result = super()._apply(fn, recurse)
        if not self.group.merged():
            self.remerge()
        return result

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        if not self.group.merged():  # assign=True: new tensors; a copy wrote through
            self.remerge()

    def to_linear(self) -> nn.Linear:
        """An ``nn.Linear`` (the original object, an FP8 linear's class
        included) holding this part's current values in storage of its own."""
        linear = self._original
        for name, param in self._parameters.items():
            if param is not None:
                setattr(linear, name, nn.Parameter(param.detach().clone(),
                                                   requires_grad=param.requires_grad))
        return linear

    def extra_repr(self):
        fp8 = "" if self.fp8_scale is None else "fp8 weight, "
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {fp8}part {self.index + 1} of "
                f"{len(self.group.parts)} merged")


def merge_linears(linears, plan=None, ms=None, prepare=True) -> list[MergedPart]:
    """``linears`` (``nn.Linear``, or FP8 linears of one class, reading the
    same input) as merged parts, in order; ``ValueError``
    (:func:`merge_refusal`) when they cannot be.
    With ``prepare=False`` the kernel is left to ``parts[0].group.prepare()``
    (``patch_model`` compiles every group's kernels in parallel first)."""
    plans.check_plan(plan)
    ms = check_ms(range(1, MAX_M + 1) if ms is None else ms)
    linears = list(linears)
    reason = merge_refusal(linears)
    if reason is not None:
        raise ValueError(f"cannot merge these linears: {reason}")
    scale_name = None if type(linears[0]) is nn.Linear else fp8_linear_scale(linears[0])[0]
    storage = MergedWeight([], scale_name)
    group = MergedGroup(storage, plan, ms)
    storage.parts = [MergedPart(lin, group, i) for i, lin in enumerate(linears)]
    storage.stack()
    if prepare:
        group.prepare()
    for lin in linears:  # the original modules keep no second copy of the weights
        for name in storage.names():
            lin._parameters[name] = None
    return list(storage.parts)


#: transformers MLP classes whose forward is ``down_proj(act_fn(gate_proj(x)) *
#: up_proj(x))``, and the activations that are SiLU
SWIGLU_MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP")
SILU_ACTIVATIONS = ("SiLU", "SiLUActivation")


def swiglu_refusal(mlp) -> str | None:
    """Why ``mlp`` cannot run as a :class:`SwiGLUMLP`, or None."""
    if type(mlp).__name__ not in SWIGLU_MLPS:
        return f"{type(mlp).__name__} is not one of {', '.join(SWIGLU_MLPS)}"
    if type(getattr(mlp, "act_fn", None)).__name__ not in SILU_ACTIVATIONS:
        return "its activation is not SiLU"
    if mlp._forward_hooks or mlp._forward_pre_hooks or "forward" in mlp.__dict__:
        return "has forward hooks or an overridden forward"
    parts = (getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None))
    if not all(isinstance(p, MergedPart) for p in parts) or parts[0].group is not parts[1].group \
            or parts[0].index != 0 or parts[1].index != 1:
        return "gate_proj and up_proj are not one merged group in that order"
    return None


class SwiGLUMLP(nn.Module):
    """A Llama-family MLP whose gate and up run as one merged weight with
    the SwiGLU epilogue: one launch writes ``silu(gate(x)) * up(x)``, which
    ``down_proj`` reads. The same submodules under the same names
    (``state_dict`` keys unchanged); where the epilogue cannot run
    (:meth:`MergedGroup.swiglu_output`) the MLP's own computation runs, the
    same operations as the original module. ``unpatch`` puts the original
    module back."""

    def __init__(self, mlp):
        reason = swiglu_refusal(mlp)
        if reason is not None:
            raise ValueError(f"a SwiGLUMLP wraps a Llama-family MLP with merged gate and up: "
                             f"{reason}")
        super().__init__()
        self.gate_proj, self.up_proj = mlp.gate_proj, mlp.up_proj
        self.down_proj, self.act_fn = mlp.down_proj, mlp.act_fn
        object.__setattr__(self, "_original", mlp)

    @property
    def group(self):
        return self.gate_proj.group

    def forward(self, x):
        fused = self.group.swiglu_output(x)
        if fused is None:
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(fused)

    def to_original(self) -> nn.Module:
        """The original MLP module, holding this one's current submodules."""
        mlp = self._original
        for name in ("gate_proj", "up_proj", "down_proj", "act_fn"):
            setattr(mlp, name, getattr(self, name))
        return mlp
