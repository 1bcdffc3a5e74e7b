"""Stand-ins shared by the CPU tests (not a test module), and the FP8
linears (transformers' fine-grained one as its Parameters look, a per-row
one) and quantizer they and the GPU tests build FP8 models with."""

import torch
import torch.nn.functional as F
from torch import nn

from warpsplitk.nn import ops


class FakePrepared:
    """What DecodeLinear, the op and a SwiGLU MLP need of a PreparedWarpSplitK;
    run() is F.linear (with ``swiglu``: silu of the first half's F.linear
    times the second's; with ``weight_scale``: of the dequantized weight)."""

    def __init__(self, weight, plan=None, ms=range(1, 33), bias=None, swiglu=False,
                 weight_scale=None):
        self.weight, self.bias, self.weight_scale = weight, bias, weight_scale
        self.n, self.k = weight.shape
        self.ms = tuple(ms)
        self.tactics = dict.fromkeys(self.ms)
        self.swiglu = swiglu
        self.out_columns = self.n // 2 if swiglu else self.n
        self.runs = 0

    def run(self, x, out):
        self.runs += 1
        assert x.is_contiguous() and x.data_ptr() % 32 == 0
        weight = self.weight
        if self.weight_scale is not None:
            weight = ops.dequantized(weight, self.weight_scale, x.dtype)
        if self.swiglu:
            i = self.n // 2
            bias = (None, None) if self.bias is None else (self.bias[:i], self.bias[i:])
            return out.copy_(F.silu(F.linear(x, weight[:i], bias[0]))
                             * F.linear(x, weight[i:], bias[1]))
        return out.copy_(F.linear(x, weight, self.bias))

    launch_unchecked = run  # the modules' eager path (checks made by the module)


def fp8_weight(n, k, device="cpu"):
    return (torch.randn(n, k, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)


class FineGrainedFP8Linear(nn.Linear):
    """transformers' fine-grained FP8 linear, as its Parameters look: an e4m3
    weight, ``weight_scale_inv`` per 128 x 128 block (one, ``block_size``
    None), a dynamic activation scheme (no ``activation_scale``), its own
    forward."""

    def __init__(self, n, k, bias=False, block_size=(128, 128), activation_scale=None):
        super().__init__(k, n, bias=bias, dtype=torch.bfloat16)
        self.block_size = block_size
        self.weight = nn.Parameter(fp8_weight(n, k), requires_grad=False)
        shape = () if block_size is None else (-(-n // 128), -(-k // 128))
        self.weight_scale_inv = nn.Parameter(torch.rand(shape) + 0.5, requires_grad=False)
        self.register_parameter("activation_scale", activation_scale)

    def forward(self, x):
        return F.linear(x, ops.dequantized(self.weight, self.weight_scale_inv, x.dtype), self.bias)


class RowwiseFP8Linear(nn.Linear):
    """A per-row FP8 linear (``weight_scale`` ``[N, 1]``, as fbgemm's)."""

    def __init__(self, n, k):
        super().__init__(k, n, bias=False, dtype=torch.bfloat16)
        self.weight = nn.Parameter(fp8_weight(n, k), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.rand(n, 1) + 0.5, requires_grad=False)

    def forward(self, x):
        return F.linear(x, ops.dequantized(self.weight, self.weight_scale, x.dtype))


def quantize_fp8(model, only=None, skip=("lm_head",)):
    """Each ``nn.Linear`` of ``model`` (named in ``only`` if given, not in
    ``skip``) replaced in place by transformers' ``FP8Linear`` holding it as
    ``FineGrainedFP8Config`` quantizes: per 128 x 128 block, ``weight_scale_inv``
    the block's largest magnitude / 448, the weight e4m3 of weight / scale.
    Returns ``{qualified name: (FP8Linear, its dequantized nn.Linear)}``."""
    from transformers.integrations.finegrained_fp8 import FP8Linear
    replaced = {}
    for parent_name, parent in list(model.named_modules()):
        for attr, child in list(parent.named_children()):
            if type(child) is not nn.Linear or attr in skip or (only and attr not in only):
                continue
            n, k = child.weight.shape
            with torch.device("meta"):
                layer = FP8Linear(k, n, block_size=(128, 128), has_bias=child.bias is not None)
            blocks = child.weight.detach().float().view(n // 128, 128, k // 128, 128)
            amax = blocks.abs().amax(dim=(1, 3))
            inv = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
            q = (blocks / inv[:, None, :, None]).clamp(-448, 448).view(n, k)
            layer.weight = nn.Parameter(q.to(torch.float8_e4m3fn), requires_grad=False)
            layer.weight_scale_inv = nn.Parameter(inv.contiguous(), requires_grad=False)
            layer.bias = child.bias
            setattr(parent, attr, layer)
            plain = nn.Linear(k, n, bias=child.bias is not None, device=child.weight.device,
                              dtype=child.weight.dtype)
            plain.weight = nn.Parameter(ops.dequantized(layer.weight, inv, child.weight.dtype))
            plain.bias = child.bias
            replaced[f"{parent_name}.{attr}" if parent_name else attr] = (layer, plain)
    return replaced
