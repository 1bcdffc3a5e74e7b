"""Stand-ins shared by the CPU tests (not a test module)."""

import torch.nn.functional as F


class FakePrepared:
    """What DecodeLinear, the op and a SwiGLU MLP need of a PreparedWarpSplitK;
    run() is F.linear (with ``swiglu``: silu of the first half's F.linear
    times the second's)."""

    def __init__(self, weight, plan=None, ms=range(1, 33), bias=None, swiglu=False):
        self.weight, self.bias = weight, bias
        self.n, self.k = weight.shape
        self.ms = tuple(ms)
        self.tactics = dict.fromkeys(self.ms)
        self.swiglu = swiglu
        self.out_columns = self.n // 2 if swiglu else self.n
        self.runs = 0

    def run(self, x, out):
        self.runs += 1
        assert x.is_contiguous() and x.data_ptr() % 32 == 0
        if self.swiglu:
            i = self.n // 2
            bias = (None, None) if self.bias is None else (self.bias[:i], self.bias[i:])
            return out.copy_(F.silu(F.linear(x, self.weight[:i], bias[0]))
                             * F.linear(x, self.weight[i:], bias[1]))
        return out.copy_(F.linear(x, self.weight, self.bias))

    launch_unchecked = run  # the modules' eager path (checks made by the module)
