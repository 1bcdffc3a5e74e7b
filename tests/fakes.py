"""Stand-ins shared by the CPU tests (not a test module)."""

import torch.nn.functional as F


class FakePrepared:
    """What DecodeLinear and the op need of a PreparedWarpSplitK; run() is F.linear."""

    def __init__(self, weight, plan=None, ms=range(1, 33), bias=None):
        self.weight, self.bias = weight, bias
        self.n, self.k = weight.shape
        self.ms = tuple(ms)
        self.runs = 0

    def run(self, x, out):
        self.runs += 1
        assert x.is_contiguous() and x.data_ptr() % 32 == 0
        return out.copy_(F.linear(x, self.weight, self.bias))

    _launch = run  # DecodeLinear's eager path (checks made by the module)
