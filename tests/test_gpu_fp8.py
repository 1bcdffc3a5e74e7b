"""FP8 weights on a real GPU, through the public API (``PreparedWarpSplitK``
with ``weight_scale``, ``prepare``): e4m3 weights with tensor, channel and
block scales against a float64 reference of the dequantized weight (block
scales: also within the fold's rounding bound of the exact one), against the
emulator on a small problem, e4m3's special codes (both zeros, subnormals,
448), refusals that leave ``out`` untouched, and CUDA-graph replay."""

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
    (T(32, 32, 128, 2, 2, 2), 4096, 13696),               # uneven split: 54 + 53 tiles
    (T(16, 8, 256, 6, 2, 3, early_launch=True), 4608, 36864),  # three CTAs along K
    (T(16, 32, 128, 2, 2, 4), 4608, 29568),               # four, uneven: 58 + 3 x 57 tiles
]
MS = (1, 5, 8, 16, 32)


def _prepared(w8, tactic, ms, bias, scale):
    from warpsplitk import PreparedWarpSplitK
    return PreparedWarpSplitK(w8, dict.fromkeys(ms, tactic), bias=bias, weight_scale=scale)


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


def _scales(kind, n, k, generator):
    """Random FP32 scales of ``kind`` in [0.5, 1.5), and the ``[n, k]`` factor
    each weight is dequantized by."""
    from warpsplitk.kernel import layout
    shape = {"tensor": (1,), "channel": (n,), "block128": layout.fp8_scale_blocks(n, k)}[kind]
    scale = torch.rand(shape, generator=generator) + 0.5
    if kind == "block128":
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    else:
        full = scale.reshape(-1, 1).expand(n, k)
    return scale.cuda(), full.double().cuda()


def _dequantized(w8, factor, kind):
    """The weight the kernel multiplies, in float64: each e4m3 weight times
    its scale; with block scales folded into the conversion
    (``ptx.block_multiplier``) the scale and each product rounded to BF16."""
    if kind != "block128":
        return w8.double() * factor
    return (w8.double() * factor.to(torch.bfloat16).double()).to(torch.bfloat16).double()


def _runs_match_float64(prepared, dequant, ms, generator, bias=None, exact=None):
    """``prepared`` at each M of fresh x, its output NaN-poisoned first,
    within 1e-2 of float64 ``x @ dequant^T (+ bias)``, no NaN left. With
    ``exact`` (block scales: the weight times its exact scale), also within
    the fold's bound of ``x @ exact^T`` element by element: 2 ** -7 of
    ``|x| @ |exact|^T`` (the scale and the product each rounded to BF16,
    2 ** -8 each) plus the output's BF16 rounding."""
    n, k = dequant.shape
    for m in ms:
        x = torch.randn(m, k, generator=generator).to(torch.bfloat16).cuda()
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        prepared.run(x, out)
        torch.cuda.synchronize()
        offset = bias.double() if bias is not None else 0
        ref = x.double() @ dequant.t() + offset
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert not out.isnan().any() and err < 1e-2, (m, bias is not None, err)
        if exact is not None:
            ref = x.double() @ exact.t() + offset
            bound = (2 ** -7 + k * 2 ** -24) * (x.double().abs() @ exact.abs().t()) \
                + 2 ** -8 * ref.abs()
            worst = ((out.double() - ref).abs() / bound).max().item()
            assert worst <= 1.0, (m, bias is not None, worst)


@pytest.mark.parametrize("tactic,n,k", CASES, ids=[f"{t.short()}-{n}x{k}" for t, n, k in CASES])
@pytest.mark.parametrize("scales", ["tensor", "channel", "block128"])
def test_fp8_weights_against_float64(tactic, n, k, scales):
    g = torch.Generator().manual_seed(n + k)
    w8 = _special_codes(n, k, g).cuda()
    scale, factor = _scales(scales, n, k, g)
    bias = torch.randn(n, generator=g).to(torch.bfloat16).cuda()
    exact = w8.double() * factor
    dequant = _dequantized(w8, factor, scales)
    for with_bias in (None, bias):
        _runs_match_float64(_prepared(w8, tactic, MS, with_bias, scale), dequant, MS, g,
                            with_bias, exact if scales == "block128" else None)


@pytest.mark.parametrize("blocks", [False, True], ids=["channel", "block128"])
def test_fp8_matches_the_emulator(blocks):
    tactic, n, k, m = T(32, 8, 128, 3, 1), 160, 1024, 5
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 256, size=(n, k)).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x00
    x = rng.standard_normal((m, k)).astype(np.float32)
    scale = (2.0 ** rng.integers(-3, 3, size=(2, 8) if blocks else n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    expected = emulator.emulate_fp8(x, codes, scale, tactic, bias)
    prepared = _prepared(torch.from_numpy(codes).cuda().view(torch.float8_e4m3fn), tactic, [m],
                         torch.from_numpy(bias).to(torch.bfloat16).cuda(),
                         torch.from_numpy(scale).cuda())
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    prepared.run(torch.from_numpy(x).to(torch.bfloat16).cuda(), out)
    torch.cuda.synchronize()
    got = out.float().cpu().numpy()
    # the mma's FP32 accumulation order is the hardware's: equal up to BF16 rounding of the sums
    np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("n,k", [(2112, 7168), (3216, 1536), (576, 7168)],
                         ids=["2112x7168", "3216x1536", "576x7168"])
def test_block_scales_on_the_fp8_default(n, k):
    """DeepSeek-style ``weight_scale_inv`` (``[ceil(N / 128), ceil(K / 128)]``,
    partial blocks at the edges) through ``prepare``, M 1..32."""
    from warpsplitk import prepare
    g = torch.Generator().manual_seed(n + 3 * k)
    w8 = _special_codes(n, k, g).cuda()
    scale, factor = _scales("block128", n, k, g)
    prepared = prepare(w8, ms=range(1, 33), weight_scale=scale)
    assert prepared.fp8_scales == "block128"
    _runs_match_float64(prepared, _dequantized(w8, factor, "block128"),
                        (1, 2, 4, 8, 13, 16, 32), g, exact=w8.double() * factor)


DEFAULT_SHAPES = [(28672, 4096), (1024, 4096), (6144, 4096), (4096, 14336), (768, 128),
                  (3072, 8192), (2112, 7168)]


@pytest.mark.parametrize("n,k", DEFAULT_SHAPES, ids=[f"{n}x{k}" for n, k in DEFAULT_SHAPES])
def test_prepare_runs_the_fp8_default_at_every_m(n, k):
    """``prepare`` with per-channel scales given as ``[N, 1]`` (as checkpoints
    store them): every M in 1..32 on the FP8 default, against float64."""
    from warpsplitk import prepare
    g = torch.Generator().manual_seed(n * 7 + k)
    w8 = _special_codes(n, k, g).cuda()
    scale = (torch.rand(n, 1, generator=g) * 0.02 + 0.001).cuda()
    prepared = prepare(w8, ms=range(1, 33), weight_scale=scale)
    assert prepared.fp8_scales == "channel"
    _runs_match_float64(prepared, w8.double() * scale.double(), range(1, 33), g)


def test_refusals_leave_out_untouched_and_nan_weights_are_refused():
    from warpsplitk import PreparedWarpSplitK
    n, k = 256, 1024
    tactic = T(16, 8, 128, 4, 1)
    w8 = _special_codes(n, k, torch.Generator().manual_seed(1)).cuda()
    scale = torch.full((1,), 0.5, device="cuda")
    prepared = PreparedWarpSplitK(w8, {8: tactic}, weight_scale=scale)
    out = torch.full((8, n), 7.0, dtype=torch.bfloat16, device="cuda")
    for bad_x in (torch.randn(8, k, device="cuda"),                       # float32
                  torch.randn(8, k + 128, device="cuda").bfloat16(),      # wrong K
                  torch.randn(k, 8, device="cuda").bfloat16().t()):       # not packed
        with pytest.raises(ValueError):
            prepared.run(bad_x, out)
    with pytest.raises(KeyError):
        prepared.run(torch.randn(4, k, device="cuda").bfloat16(), out[:4])
    torch.cuda.synchronize()
    assert bool((out == 7.0).all())
    poisoned = w8.clone()
    poisoned.view(torch.uint8)[5, 9] = 0x7F
    with pytest.raises(ValueError, match="NaN code"):
        PreparedWarpSplitK(poisoned, {8: tactic}, weight_scale=scale)
    with pytest.raises(ValueError, match="finite"):
        PreparedWarpSplitK(w8, {8: tactic}, weight_scale=torch.full((1,), float("nan"),
                                                                    device="cuda"))


def test_fp8_replays_in_a_cuda_graph():
    from warpsplitk import prepare
    n, k, m = 4096, 4096, 8
    g = torch.Generator().manual_seed(5)
    w8 = _special_codes(n, k, g).cuda()
    scale = (torch.rand(n, generator=g) + 0.5).cuda()
    prepared = prepare(w8, ms=(m,), weight_scale=scale)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    prepared.run(x, out)
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prepared.run(x, out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)  # deterministic: the same bits


SWIGLU_SHAPES = [(2 * 14336, 4096, "block128"), (2 * 8192, 3072, "channel"),
                 (2 * 1408, 2048, "block128"), (2 * 1024, 4096, "tensor")]  # I = 1408: mid-block


@pytest.mark.parametrize("n,k,scales", SWIGLU_SHAPES, ids=[f"{n}x{k}-{s}" for n, k, s in
                                                            SWIGLU_SHAPES])
def test_fp8_gate_up_with_the_swiglu_epilogue(n, k, scales):
    """An e4m3 ``[gate; up]`` weight through ``prepare(swiglu=True)`` on the
    FP8 default for the epilogue: ``silu(gate) * up`` of the dequantized
    halves, each with its own rows' scales (and bias), against float64 at
    every M, NaN-poisoned, and the emulator on one M."""
    from warpsplitk import prepare
    g = torch.Generator().manual_seed(n + k)
    w8 = _special_codes(n, k, g).cuda()
    scale, factor = _scales(scales, n, k, g)
    bias = torch.randn(n, generator=g).to(torch.bfloat16).cuda()
    prepared = prepare(w8, ms=range(1, 33), bias=bias, weight_scale=scale, swiglu=True)
    assert prepared.swiglu and prepared.fp8_scales == scales
    dequant, half = _dequantized(w8, factor, scales), n // 2
    for m in (1, 3, 8, 16, 17, 32):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
        out = torch.full((m, half), float("nan"), dtype=torch.bfloat16, device="cuda")
        prepared.run(x, out)
        torch.cuda.synchronize()
        pre = x.double() @ dequant.t() + bias.double()
        ref = torch.nn.functional.silu(pre[:, :half]) * pre[:, half:]
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert not out.isnan().any() and err < 1e-2, (m, err)


@pytest.mark.parametrize("scales", ["channel", "block128"])
def test_fp8_swiglu_matches_the_emulator(scales):
    """gate and up in different 128-row blocks, each its own scales."""
    from warpsplitk import PreparedWarpSplitK
    tactic, n, k, m = T(32, 8, 128, 3, 1), 256, 1024, 5
    rng = np.random.default_rng(4)
    codes = rng.integers(0, 256, size=(n, k)).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x00
    x = rng.standard_normal((m, k)).astype(np.float32) * 0.01
    scale = (2.0 ** rng.integers(-3, 3, size=(2, 8) if scales == "block128" else n)
             ).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    expected = emulator.emulate_fp8(x, codes, scale, tactic, bias, swiglu=True)
    prepared = PreparedWarpSplitK(torch.from_numpy(codes).cuda().view(torch.float8_e4m3fn),
                                  {m: tactic}, bias=torch.from_numpy(bias).to(torch.bfloat16).cuda(),
                                  weight_scale=torch.from_numpy(scale).cuda(), swiglu=True)
    out = torch.full((m, n // 2), float("nan"), dtype=torch.bfloat16, device="cuda")
    prepared.run(torch.from_numpy(x).to(torch.bfloat16).cuda(), out)
    torch.cuda.synchronize()
    np.testing.assert_allclose(out.float().cpu().numpy(), expected, rtol=2e-2, atol=2e-2)
