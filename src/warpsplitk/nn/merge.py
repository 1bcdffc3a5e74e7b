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

``patch_model(model, merge=True)`` (:mod:`warpsplitk.nn.patch`) merges each
module's ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj``
(Llama, Mistral, Qwen2 and Qwen3 name them so); ``unpatch`` gives every
part back as an ``nn.Linear`` holding its current values in its own
storage.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import ops
from ..contract import MAX_M
from ..planning import plans
from ..tactics import check_ms
from .linear import DecodeLinear

#: Attribute names of the projections a transformers decoder layer runs on
#: one input, merged by ``patch_model(merge=True)``, in call order.
MERGED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def merge_refusal(linears) -> str | None:
    """Why ``linears`` cannot be merged, or None."""
    if len(linears) < 2:
        return "fewer than two linears"
    if len({id(lin) for lin in linears}) != len(linears):
        return "the same linear twice"
    first = linears[0]
    for lin in linears:
        if type(lin) is not nn.Linear:
            return f"{type(lin).__name__} is not a plain nn.Linear"
        if lin.weight is None:
            return "a linear without a weight (merged already?)"
        if lin._forward_hooks or lin._forward_pre_hooks or "forward" in lin.__dict__:
            return "has forward hooks or an overridden forward"
        if lin.in_features != first.in_features:
            return f"in_features differ ({first.in_features} and {lin.in_features})"
        if lin.weight.dtype != first.weight.dtype or lin.weight.device != first.weight.device:
            return "weights differ in dtype or device"
        if (lin.bias is None) != (first.bias is None):
            return "some have a bias and some do not"
    shared = [p for lin in linears for p in (lin.weight, lin.bias) if p is not None]
    if len({id(p) for p in shared}) != len(shared):
        return "two of them share a Parameter (merging would split it)"
    return None


class MergedWeight:
    """The storage of a merged group: the stacked ``[W_a; W_b; ...]`` (and
    bias) of its parts, each part's ``weight`` and ``bias`` Parameters views
    of its rows. Not an ``nn.Module``: its tensors belong to the parts'
    Parameters, so ``state_dict`` keeps the parts' keys, ``load_state_dict``
    writes through and ``.to()`` or ``assign=True`` (new tensors) call for
    ``stack`` again. A copy (deepcopy, pickle) holds no storage until
    stacked from its parts' copied values."""

    def __init__(self, parts):
        self.parts = parts
        self.weight = self.bias = None
        self.columns = []  # each part's (start, end) rows of the merged weight
        self._views = []  # each part's (weight, bias) Parameters as stack() made them

    def __getstate__(self):
        # a copy's parts get Parameters of their own: it stacks them again
        return {**self.__dict__, "weight": None, "bias": None, "columns": [], "_views": []}

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
        """Whether the parts share one device and dtype (not so while a
        ``.to()`` is half done)."""
        return (len({p.weight.device for p in self.parts}) == 1
                and len({p.weight.dtype for p in self.parts}) == 1)

    def stack(self):
        """Stack the parts' current weights (and biases) into new storage and
        make each part's Parameters views of it."""
        self.columns = self.offsets()
        self.weight = torch.cat([p.weight.detach() for p in self.parts])
        has_bias = self.parts[0].bias is not None
        self.bias = torch.cat([p.bias.detach() for p in self.parts]) if has_bias else None
        for part, (start, end) in zip(self.parts, self.columns):
            part._parameters["weight"] = nn.Parameter(self.weight[start:end],
                                                      requires_grad=part.weight.requires_grad)
            if has_bias:
                part._parameters["bias"] = nn.Parameter(self.bias[start:end],
                                                        requires_grad=part.bias.requires_grad)
        self._views = [(part._parameters["weight"], part._parameters["bias"])
                       for part in self.parts]

    def merged(self) -> bool:
        """Whether every part's weight (and bias) is still its view of the
        storage (``.to()`` or ``load_state_dict(assign=True)`` give parts
        tensors of their own)."""
        if torch.compiler.is_compiling():
            # fake tensors have no addresses: the Parameters stack() made
            # (Dynamo guards the identities, so a replaced one recompiles)
            return all(part._parameters["weight"] is weight and part._parameters["bias"] is bias
                       for part, (weight, bias) in zip(self.parts, self._views))
        weight, bias = self.weight, self.bias
        row_bytes = weight.stride(0) * weight.element_size()
        for part, (start, _) in zip(self.parts, self.columns):
            if part.weight.device != weight.device \
                    or part.weight.data_ptr() != weight.data_ptr() + start * row_bytes:
                return False
            if bias is not None and \
                    part.bias.data_ptr() != bias.data_ptr() + start * bias.element_size():
                return False
        return True


class MergedGroup:
    """The dispatch of a merged group: a ``DecodeLinear`` of its
    :class:`MergedWeight` whose output serves every part called with the same
    input (the kernel where it accepts x, else ``F.linear`` on the merged
    weight), each part's own ``F.linear`` where the storage is no longer
    merged or has no kernel; for a ``[gate; up]`` group also the kernel with
    the SwiGLU epilogue."""

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
        self.linear = DecodeLinear(self.weight, self.bias, self.plan, self.ms)
        self._release_swiglu()
        if self.swiglu and self.linear.prepared is not None:
            self.swiglu_prepared, self._swiglu_handle = swiglu_kernel(
                self.weight, self.bias, self.plan, self.ms)

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
            return F.linear(x, part.weight, part.bias)
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
        ``warpsplitk::decode_swiglu`` op."""
        if self.swiglu_prepared is None or not self.merged():
            return None
        if torch.is_grad_enabled() and (x.requires_grad or self.parts[0].weight.requires_grad):
            return None
        return swiglu_launch(self.linear, self.swiglu_prepared, self._swiglu_handle, x)


def swiglu_kernel(weight, bias, plan, ms):
    """``(prepared, handle)``: the SwiGLU kernel of a ``[gate; up]`` weight
    (compiled, or loaded from the disk cache) and its custom-op handle."""
    prepared = plans.prepare(weight, plan, ms, bias, swiglu=True)
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
    torch.compile, the ``warpsplitk::decode_swiglu`` op."""
    if not linear.accepts(x):
        return None
    x2d = x.reshape(-1, linear.in_features)
    if torch.compiler.is_compiling():
        # the DecodeLinear's Parameters: static addresses for CUDA graph trees
        out = torch.ops.warpsplitk.decode_swiglu(x2d, linear.weight, linear.bias, handle)
    else:
        # accepts() has made run()'s checks on x, and out is new
        out = prepared.launch_unchecked(x2d, x2d.new_empty((x2d.shape[0],
                                                            prepared.out_columns)))
    return out.view(*x.shape[:-1], prepared.out_columns)


class MergedPart(nn.Module):
    """One linear of a merged group: ``weight`` and ``bias`` are views into
    the group's storage; ``forward`` is the linear's (see the module
    docstring)."""

    def __init__(self, linear: nn.Linear, group: MergedGroup, index: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)
        # kept out of the submodules (state_dict, .to(), named_modules)
        object.__setattr__(self, "group", group)
        object.__setattr__(self, "index", index)
        object.__setattr__(self, "_original", linear)

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
        """An ``nn.Linear`` (the original object) holding this part's current
        values in storage of its own."""
        linear = self._original
        linear.weight = nn.Parameter(self.weight.detach().clone(),
                                     requires_grad=self.weight.requires_grad)
        if self.bias is not None:
            linear.bias = nn.Parameter(self.bias.detach().clone(),
                                       requires_grad=self.bias.requires_grad)
        return linear

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, part {self.index + 1} of "
                f"{len(self.group.parts)} merged")


def merge_linears(linears, plan=None, ms=None, prepare=True) -> list[MergedPart]:
    """``linears`` (``nn.Linear`` reading the same input) as merged parts,
    in order; ``ValueError`` (:func:`merge_refusal`) when they cannot be.
    With ``prepare=False`` the kernel is left to ``parts[0].group.prepare()``
    (``patch_model`` compiles every group's kernels in parallel first)."""
    plans.check_plan(plan)
    ms = check_ms(range(1, MAX_M + 1) if ms is None else ms)
    linears = list(linears)
    reason = merge_refusal(linears)
    if reason is not None:
        raise ValueError(f"cannot merge these linears: {reason}")
    storage = MergedWeight([])
    group = MergedGroup(storage, plan, ms)
    storage.parts = [MergedPart(lin, group, i) for i, lin in enumerate(linears)]
    storage.stack()
    if prepare:
        group.prepare()
    for lin in linears:  # the original modules keep no second copy of the weights
        lin._parameters["weight"] = None
        lin._parameters["bias"] = None
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
