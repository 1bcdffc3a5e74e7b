"""The FP8-weight kernel (``WarpSplitKFp8Kernel``) on a real GPU: e4m3
weights with tensor and channel scales against a float64 reference of the
dequantized weight, bit for bit against the emulator on a small problem,
and e4m3's special codes (both zeros, subnormals, 448)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from warpsplitk import WarpSplitKTactic  # noqa: E402
from warpsplitk.kernel import emulator  # noqa: E402

pytestmark = pytest.mark.gpu

T = WarpSplitKTactic
CASES = [  # tactic, N, K
    (T(16, 8, 128, 4, 1), 4096, 4096),
    (T(32, 8, 256, 6, 2), 4096, 4096),
    (T(16, 8, 256, 8, 1, 2), 1536, 7168),                 # k_split
    (T(32, 1, 256, 4, 1, early_launch=True, l2_prefetch=2), 2048, 2048),  # narrow, options
    (T(64, 16, 128, 4, 2), 1024, 2048),
    (T(32, 32, 256, 3, 2), 2048, 4096),
    (T(32, 8, 256, 5, 2, 2), 8192, 28672),                # K past 64 tiles
]
MS = (1, 5, 8, 16, 32)


def _kernel(tactic, n, k, has_bias, scales):
    from warpsplitk.runtime.compile import device_arch
    from warpsplitk.runtime.dsl import build
    arch = device_arch(torch.cuda.current_device())
    return build(n, k, tactic, has_bias, True, arch, fp8_scales=scales)


def _run(compiled, w8, x, bias, scale, out):
    from cuda.bindings import driver

    from warpsplitk.runtime.dsl import gmem_pointer
    stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
    compiled(gmem_pointer(w8.data_ptr()), gmem_pointer(x.data_ptr()),
             gmem_pointer(bias.data_ptr() if bias is not None else scale.data_ptr()),
             gmem_pointer(scale.data_ptr()), gmem_pointer(out.data_ptr()), x.shape[0], stream)


def _special_codes(n, k, generator):
    """Random e4m3 weights around 1/16, with +-0, the smallest subnormal and
    +-448 planted (NaN codes excluded)."""
    w = (torch.randn(n, k, generator=generator) * 0.06).to(torch.float8_e4m3fn)
    codes = w.view(torch.uint8)
    codes[codes == 0x7F] = 0x7E
    codes[codes == 0xFF] = 0xFE
    flat = codes.view(-1)
    for i, code in enumerate((0x00, 0x80, 0x01, 0x81, 0x7E, 0xFE)):
        flat[i * 977 % flat.numel()] = code
    return w


@pytest.mark.parametrize("tactic,n,k", CASES, ids=[f"{t.short()}-{n}x{k}" for t, n, k in CASES])
@pytest.mark.parametrize("scales", ["tensor", "channel"])
def test_fp8_weights_against_float64(tactic, n, k, scales):
    g = torch.Generator().manual_seed(n + k)
    w8 = _special_codes(n, k, g).cuda()
    scale = (torch.rand(1 if scales == "tensor" else n, generator=g) + 0.5).cuda()
    bias = torch.randn(n, generator=g).to(torch.bfloat16).cuda()
    dequant = w8.double() * scale.double().reshape(-1, 1)
    for has_bias in (False, True):
        compiled = _kernel(tactic, n, k, has_bias, scales)
        for m in MS:
            x = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            _run(compiled, w8, x, bias if has_bias else None, scale, out)
            torch.cuda.synchronize()
            ref = x.double() @ dequant.t() + (bias.double() if has_bias else 0)
            err = ((out.double() - ref).norm() / ref.norm()).item()
            assert not out.isnan().any() and err < 1e-2, (m, has_bias, err)


def test_fp8_matches_the_emulator_bit_for_bit():
    tactic, n, k, m = T(32, 8, 128, 3, 1), 64, 1024, 5
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 256, size=(n, k)).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x00
    x = rng.standard_normal((m, k)).astype(np.float32)
    scale = (2.0 ** rng.integers(-3, 3, size=n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    expected = emulator.emulate_fp8(x, codes, scale, tactic, bias)
    compiled = _kernel(tactic, n, k, True, "channel")
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    _run(compiled, torch.from_numpy(codes).cuda().view(torch.float8_e4m3fn),
         torch.from_numpy(x).to(torch.bfloat16).cuda(),
         torch.from_numpy(bias).to(torch.bfloat16).cuda(), torch.from_numpy(scale).cuda(), out)
    torch.cuda.synchronize()
    got = out.float().cpu().numpy()
    # the mma's FP32 accumulation order is the hardware's: equal up to BF16 rounding of the sums
    np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-2)
