"""MLPs that already hold one ``[gate; up]`` projection, run with the SwiGLU epilogue.

Phi-3 and GLM name it ``gate_up_proj``: one ``nn.Linear`` whose first half
of rows is the gate and second half the up projection, then
``up * act(gate)`` and ``down_proj``. That is the weight layout the
SwiGLU epilogue reads (``PreparedWarpSplitK(..., swiglu=True)``, an e4m3
one with its scales too), so no merging is needed: :class:`GateUpSwiGLUMLP` runs ``silu(gate) * up`` in the
projection's one launch, where Llama-style MLPs need ``patch_model(merge=True)``
to stack ``gate_proj`` and ``up_proj`` first (:class:`~warpsplitk.nn.merge.SwiGLUMLP`).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import contract
from .linear import DecodeLinear, fp8_linear_scale, ineligibility
from .merge import SILU_ACTIVATIONS, release_swiglu, swiglu_kernel, swiglu_launch

#: transformers MLPs computing ``down(up * silu(gate))`` from one
#: ``gate_up_proj`` whose rows are ``[gate; up]`` (``chunk(2, dim=-1)``).
GATE_UP_MLPS = ("Phi3MLP", "GlmMLP", "Glm4MLP")


def gate_up_refusal(mlp, ms) -> str | None:
    """Why ``mlp`` cannot run as a :class:`GateUpSwiGLUMLP` for ``ms``, or None."""
    if type(mlp).__name__ not in GATE_UP_MLPS:
        return f"{type(mlp).__name__} is not one of {', '.join(GATE_UP_MLPS)}"
    if type(getattr(mlp, "activation_fn", None)).__name__ not in SILU_ACTIVATIONS:
        return "its activation is not SiLU"
    if mlp._forward_hooks or mlp._forward_pre_hooks or "forward" in mlp.__dict__:
        return "has forward hooks or an overridden forward"
    gate_up = getattr(mlp, "gate_up_proj", None)
    fp8 = isinstance(gate_up, nn.Linear) and contract.is_fp8(getattr(gate_up, "weight", None))
    if type(gate_up) not in (nn.Linear, DecodeLinear) and not fp8:
        return "its gate_up_proj is not a plain nn.Linear or an FP8 linear"
    if gate_up.out_features % 32:
        return (f"gate_up_proj has {gate_up.out_features} rows: not two halves of whole "
                "16-row tiles")
    return ineligibility(gate_up.weight, gate_up.bias, ms, gate_up_scale(gate_up))


def gate_up_scale(gate_up):
    """An FP8 ``gate_up_proj``'s scales (a ``DecodeLinear``'s, or an FP8
    linear's under their own name), else None."""
    if isinstance(gate_up, DecodeLinear):
        return gate_up.fp8_scale
    if not contract.is_fp8(getattr(gate_up, "weight", None)):
        return None
    name, _ = fp8_linear_scale(gate_up)
    return None if name is None else getattr(gate_up, name)


class GateUpSwiGLUMLP(nn.Module):
    """A ``[gate; up]`` MLP (``GATE_UP_MLPS``) whose ``gate_up_proj`` runs with
    the SwiGLU epilogue: one launch writes ``silu(gate) * up``, which
    ``down_proj`` reads. The same submodules under the same names
    (``state_dict`` keys unchanged); where the epilogue cannot run (no
    kernel, x not what ``gate_up_proj.accepts``, autograd) the MLP's own
    computation runs. ``unpatch`` puts the original module back."""

    def __init__(self, mlp, plan=None, ms=range(1, 33)):
        reason = gate_up_refusal(mlp, ms)
        if reason is not None:
            raise ValueError(f"a GateUpSwiGLUMLP wraps a [gate; up] MLP: {reason}")
        super().__init__()
        self.gate_up_proj, self.down_proj = mlp.gate_up_proj, mlp.down_proj
        self.activation_fn = mlp.activation_fn
        object.__setattr__(self, "_original", mlp)
        self.plan, self.ms = plan, tuple(ms)
        self.prepared = None
        self._handle = None  # the prepared kernel's in the custom ops' registry
        self.prepare()

    def prepare(self):
        """The SwiGLU kernel for ``gate_up_proj``'s current weight (compiled,
        or loaded from the disk cache), registered for the custom op."""
        self._release()
        gate_up = self.gate_up_proj
        if isinstance(gate_up, DecodeLinear) and gate_up.prepared is not None:
            scale = gate_up.fp8_scale
            self.prepared, self._handle = swiglu_kernel(
                gate_up.weight, gate_up.bias, self.plan, self.ms,
                None if scale is None else scale.detach())

    def _release(self):
        release_swiglu(self._handle)
        self.prepared, self._handle = None, None

    def __getstate__(self):
        # compiled code and a registry handle neither copy nor pickle
        return {**self.__dict__, "prepared": None, "_handle": None}

    def __setstate__(self, state):
        super().__setstate__(state)
        self.prepare()

    def fused(self, x):
        """``silu(gate(x)) * up(x)`` in one launch, or None where it cannot run."""
        gate_up, prepared = self.gate_up_proj, self.prepared
        if prepared is None:
            return None
        if not torch.compiler.is_compiling() and gate_up.weight is not prepared.weight:
            return None  # replaced since preparation: the MLP's own computation
        if torch.is_grad_enabled() and (x.requires_grad or gate_up.weight.requires_grad):
            return None
        return swiglu_launch(gate_up, prepared, self._handle, x)

    def forward(self, x):
        fused = self.fused(x)
        if fused is None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(up * self.activation_fn(gate))
        return self.down_proj(fused)

    def to_original(self) -> nn.Module:
        """The original MLP module, holding this one's current submodules."""
        self._release()
        mlp = self._original
        for name in ("gate_up_proj", "down_proj", "activation_fn"):
            setattr(mlp, name, getattr(self, name))
        return mlp


__all__ = ["GATE_UP_MLPS", "GateUpSwiGLUMLP", "gate_up_refusal", "gate_up_scale"]
