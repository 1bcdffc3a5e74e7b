"""Reliability on a real GPU: bad input refused before any launch, numerics at
the edges of BF16 and FP32, determinism, concurrency and the compile cache.

Compiles are the slow part (about a second per distinct N, K, tactic and
bias), so every weight here but two is N = 256 with one tactic per K,
``default_tactic(32, 256, K)``, used for every M. The file compiles the six
Ks of the error sweep, one biased (256, 256) kernel, one kernel that only
the thread test uses and four for a weight past 4 GiB: 12 in all.
"""

import math
import threading
import time

import pytest

torch = pytest.importorskip("torch")

import warpsplitk.runtime.compile as compile_module  # noqa: E402
import warpsplitk.runtime.prepared as prepared_module  # noqa: E402
from warpsplitk import PreparedWarpSplitK, WarpSplitKTactic, default_tactic  # noqa: E402
from warpsplitk.runtime.compile import compile_warp_splitk  # noqa: E402

pytestmark = pytest.mark.gpu

N = 256
KS = (128, 256, 1024, 4096, 7168, 16384)
BF16 = torch.bfloat16
NAN = float("nan")
INF = float("inf")
BF16_MAX = torch.finfo(torch.bfloat16).max


def tactic_for(k):
    """The one tactic used for an [N, k] weight, whatever M (token tile 32 covers all)."""
    return default_tactic(32, N, k)


def prepare(weight, ms, bias=None):
    return PreparedWarpSplitK(weight, {m: tactic_for(weight.shape[1]) for m in ms}, bias=bias)


def randn(*shape, device="cuda"):
    return torch.randn(*shape, device=device, dtype=BF16)


def nans(*shape, dtype=BF16, device="cuda"):
    return torch.full(shape, NAN, dtype=dtype, device=device)


def shifted(shape, elements, random=False):
    """A packed BF16 tensor of ``shape`` starting ``elements`` elements past a
    32-byte boundary, cut from a larger buffer; NaN-filled unless ``random``."""
    numel = math.prod(shape)
    buffer = randn(numel + 64) if random else nans(numel + 64)
    t = buffer[elements:elements + numel].view(shape)
    assert tuple(t.shape) == tuple(shape) and t.is_contiguous()
    assert t.data_ptr() % 32 == 2 * elements
    return t


def ref64(x, w, bias=None):
    ref = x.double() @ w.double().t()
    if bias is not None:
        ref = ref + bias.double()
    return ref


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def snapshot(tensors):
    return [(t, t.clone()) for t in tensors if isinstance(t, torch.Tensor)]


def assert_unchanged(pairs):
    """Each tensor equals its copy, NaNs included (same NaN mask, same other values)."""
    for i, (now, before) in enumerate(pairs):
        nan_now, nan_before = now.isnan(), before.isnan()
        assert torch.equal(nan_now, nan_before), f"tensor {i}: NaN pattern changed"
        assert torch.equal(now[~nan_now], before[~nan_before]), f"tensor {i}: values changed"


def check_runs(prepared, m):
    """A good call after whatever came before: written in full and accurate."""
    x = randn(m, prepared.k)
    out = nans(m, prepared.n)
    prepared.run(x, out)
    torch.cuda.synchronize()
    assert not out.isnan().any()
    assert rel_err(out, ref64(x, prepared.weight, prepared.bias)) < 1e-2


# ---------------------------------------------------- bad input to run()

# N == K, so that out may alias x; Ms 1 and 8 prepared; the cases use M = 8.
KB = N


@pytest.fixture(scope="module")
def bad_run():
    torch.manual_seed(0)
    return prepare(randn(N, KB), (1, 8))


def _x(m=8):
    return randn(m, KB)


def _out(m=8):
    return nans(m, N)


def _out_is_x(p):
    x = _x()
    return x, x


def _out_over_half_of_x(p):
    buffer = randn(16 * KB)
    return buffer[:8 * KB].view(8, KB), buffer[4 * KB:12 * KB].view(8, N)


RUN_CASES = [
    # (id, build(prepared) -> (x, out), exception, substrings of its message)
    ("x float16", lambda p: (_x().half(), _out()), ValueError, ["x must be bfloat16", "float16"]),
    ("x float32", lambda p: (_x().float(), _out()), ValueError, ["x must be bfloat16", "float32"]),
    ("x 1-D", lambda p: (randn(8 * KB), _out()), ValueError, ["x must be a 2-D"]),
    ("x 3-D", lambda p: (randn(1, 8, KB), _out()), ValueError, ["x must be a 2-D"]),
    ("x None", lambda p: (None, _out()), ValueError, ["x must be a 2-D", "NoneType"]),
    ("x with K 128", lambda p: (randn(8, 128), _out()), ValueError,
     ["x must have shape (8, 256), got (8, 128)"]),
    ("x with K 512", lambda p: (randn(8, 512), _out()), ValueError,
     ["x must have shape (8, 256), got (8, 512)"]),
    ("x transposed", lambda p: (randn(KB, 8).t(), _out()), ValueError,
     ["x must be packed row-major"]),
    ("x sliced columns", lambda p: (randn(8, 2 * KB)[:, :KB], _out()), ValueError,
     ["x must be packed row-major"]),
    ("x rows repeated", lambda p: (randn(1, KB).expand(8, KB), _out()), ValueError,
     ["x must be packed row-major"]),
    ("x misaligned 2 B", lambda p: (shifted((8, KB), 1, random=True), _out()), ValueError,
     ["x must be 32-byte aligned, its address is 2 bytes past"]),
    ("x misaligned 16 B", lambda p: (shifted((8, KB), 8, random=True), _out()), ValueError,
     ["x must be 32-byte aligned, its address is 16 bytes past"]),
    ("x misaligned 30 B", lambda p: (shifted((8, KB), 15, random=True), _out()), ValueError,
     ["x must be 32-byte aligned, its address is 30 bytes past"]),
    ("x on the CPU", lambda p: (randn(8, KB, device="cpu"), _out()), ValueError,
     ["x must be on cuda:0, got cpu"]),
    ("out float16", lambda p: (_x(), nans(8, N, dtype=torch.float16)), ValueError,
     ["out must be bfloat16", "float16"]),
    ("out float32", lambda p: (_x(), nans(8, N, dtype=torch.float32)), ValueError,
     ["out must be bfloat16", "float32"]),
    ("out 1-D", lambda p: (_x(), nans(8 * N)), ValueError,
     ["out must have shape (8, 256), got (2048,)"]),
    ("out 3-D", lambda p: (_x(), nans(1, 8, N)), ValueError,
     ["out must have shape (8, 256), got (1, 8, 256)"]),
    ("out None", lambda p: (_x(), None), ValueError, ["out must be a torch.Tensor"]),
    ("out with N 128", lambda p: (_x(), nans(8, 128)), ValueError,
     ["out must have shape (8, 256), got (8, 128)"]),
    ("out with N 512", lambda p: (_x(), nans(8, 512)), ValueError,
     ["out must have shape (8, 256), got (8, 512)"]),
    ("out fewer rows than x", lambda p: (_x(), nans(1, N)), ValueError,
     ["out must have shape (8, 256), got (1, 256)"]),
    ("out more rows than x", lambda p: (_x(1), nans(8, N)), ValueError,
     ["out must have shape (1, 256), got (8, 256)"]),
    ("out transposed", lambda p: (_x(), nans(N, 8).t()), ValueError,
     ["out must be packed row-major"]),
    ("out sliced columns", lambda p: (_x(), nans(8, 2 * N)[:, :N]), ValueError,
     ["out must be packed row-major"]),
    ("out rows repeated", lambda p: (_x(), nans(1, N).expand(8, N)), ValueError,
     ["out must be packed row-major"]),
    ("out misaligned 2 B", lambda p: (_x(), shifted((8, N), 1)), ValueError,
     ["out must be 32-byte aligned, its address is 2 bytes past"]),
    ("out misaligned 16 B", lambda p: (_x(), shifted((8, N), 8)), ValueError,
     ["out must be 32-byte aligned, its address is 16 bytes past"]),
    ("out misaligned 30 B", lambda p: (_x(), shifted((8, N), 15)), ValueError,
     ["out must be 32-byte aligned, its address is 30 bytes past"]),
    ("out on the CPU", lambda p: (_x(), nans(8, N, device="cpu")), ValueError,
     ["out must be on cuda:0, got cpu"]),
    ("M 0", lambda p: (randn(0, KB), nans(0, N)), ValueError, ["x must have 1..32 rows", "(0, "]),
    ("M 33", lambda p: (randn(33, KB), nans(33, N)), ValueError,
     ["x must have 1..32 rows", "(33, "]),
    ("M 4 unprepared", lambda p: (_x(4), _out(4)), KeyError, ["M=4", "prepared Ms: [1, 8]"]),
    ("M 32 unprepared", lambda p: (_x(32), _out(32)), KeyError, ["M=32", "prepared Ms: [1, 8]"]),
    ("out is x", _out_is_x, ValueError, ["out must not overlap x"]),
    ("out over half of x", _out_over_half_of_x, ValueError, ["out must not overlap x"]),
    ("out is weight rows 0-7", lambda p: (_x(), p.weight[:8]), ValueError,
     ["out must not overlap the weight"]),
    ("out is the last weight rows", lambda p: (_x(), p.weight[-8:]), ValueError,
     ["out must not overlap the weight"]),
    ("single-row out in the weight", lambda p: (_x(1), p.weight[100:101]), ValueError,
     ["out must not overlap the weight"]),
]


@pytest.mark.parametrize("build,error,words", [c[1:] for c in RUN_CASES],
                         ids=[c[0] for c in RUN_CASES])
def test_run_refuses_bad_input_before_launch(bad_run, build, error, words):
    p = bad_run
    x, out = build(p)
    watched = snapshot([x, out, p.weight])  # out: a NaN canary unless the case builds it
    torch.cuda.synchronize()  # the inputs are ready: whatever follows is the call's
    with pytest.raises(error) as info:
        p.run(x, out)
    message = info.value.args[0]  # (str() of a KeyError is the repr of its message)
    for word in words:
        assert word in message, message
    torch.cuda.synchronize()  # raises if a stray launch faulted
    assert_unchanged(watched)
    check_runs(p, 8)  # and the prepared code still works


@pytest.mark.parametrize("strided", ["x", "out"])
def test_run_single_row_with_a_row_stride(bad_run, strided):
    """What the checks let through for M = 1: one row of a wider buffer."""
    p = bad_run
    xs = randn(3, 2 * KB)
    outs = nans(3, 2 * N)
    x = xs[1:2, KB:] if strided == "x" else _x(1)
    out = outs[1:2, N:] if strided == "out" else _out(1)
    assert x.shape == (1, KB) and out.shape == (1, N)
    assert x.data_ptr() % 32 == 0 and out.data_ptr() % 32 == 0
    assert x.stride()[0] == (2 * KB if strided == "x" else KB)
    assert out.stride()[0] == (2 * N if strided == "out" else N)
    before = outs.clone()
    p.run(x, out)
    torch.cuda.synchronize()
    assert not out.isnan().any()
    assert rel_err(out, ref64(x, p.weight)) < 1e-2
    if strided == "out":
        outs[1:2, N:] = NAN
    assert_unchanged([(outs, before)])  # nothing but that row was written


def test_run_refuses_out_overlapping_the_bias():
    torch.manual_seed(1)
    bias = randn(N)
    p = PreparedWarpSplitK(randn(N, KB), {1: tactic_for(KB)}, bias=bias)
    before = bias.clone()
    with pytest.raises(ValueError, match="out must not overlap the bias"):
        p.run(_x(1), bias.view(1, N))
    torch.cuda.synchronize()
    assert_unchanged([(bias, before)])


# ---------------------------------------------- bad input at prepare time

T128 = WarpSplitKTactic(16, 8, 128, 4, 1)  # legal for [256, 1024]
T256 = WarpSplitKTactic(16, 8, 256, 4, 1)
KP = 1024


def _w():
    return randn(N, KP)


def _bias():
    return randn(N)


PREPARE_CASES = [
    # (id, build() -> (weight, tactics, bias), substrings of the ValueError's message)
    ("weight float32", lambda: (_w().float(), {1: T128}, None), ["weight must be bfloat16"]),
    ("weight float16", lambda: (_w().half(), {1: T128}, None), ["weight must be bfloat16"]),
    ("weight 1-D", lambda: (randn(N * KP), {1: T128}, None), ["weight must be a 2-D torch.Tensor [N, K]"]),
    ("weight 3-D", lambda: (randn(2, N // 2, KP), {1: T128}, None), ["weight must be a 2-D torch.Tensor [N, K]"]),
    ("weight transposed", lambda: (randn(KP, N).t(), {1: T128}, None),
     ["weight must be packed row-major"]),
    ("weight row stride 2K", lambda: (randn(N, 2 * KP)[:, :KP], {1: T128}, None),
     ["weight must be packed row-major"]),
    ("weight every other row", lambda: (randn(2 * N, KP)[::2], {1: T128}, None),
     ["weight must be packed row-major"]),
    ("weight rows repeated", lambda: (randn(1, KP).expand(N, KP), {1: T128}, None),
     ["weight must be packed row-major"]),
    ("weight misaligned 2 B", lambda: (shifted((N, KP), 1, random=True), {1: T128}, None),
     ["weight must be 32-byte aligned", "2 bytes past"]),
    ("weight misaligned 16 B", lambda: (shifted((N, KP), 8, random=True), {1: T128}, None),
     ["weight must be 32-byte aligned", "16 bytes past"]),
    ("weight misaligned 30 B", lambda: (shifted((N, KP), 15, random=True), {1: T128}, None),
     ["weight must be 32-byte aligned", "30 bytes past"]),
    ("weight on the CPU", lambda: (randn(N, KP, device="cpu"), {1: T128}, None),
     ["weight must be on a CUDA device, got cpu"]),
    ("N 40", lambda: (randn(40, KP), {1: T128}, None),
     ["tactic for M=1", "N must be a positive multiple of output_tile 16, got N=40"]),
    ("K 1000", lambda: (randn(N, 1000), {1: T128}, None),
     ["tactic for M=1", "K must be a positive multiple of k_tile 128, got K=1000"]),
    ("K 65x256, k_tile 256", lambda: (randn(16, 65 * 256), {1: T256}, None),
     ["K=16640 is 65 tiles of 256", "at most 64"]),
    ("K 65x256, k_tile 128", lambda: (randn(16, 65 * 256), {1: T128}, None),
     ["K=16640 is 130 tiles of 128", "at most 64"]),
    ("tactics empty", lambda: (_w(), {}, None), ["tactics must be a non-empty mapping"]),
    ("tactics None", lambda: (_w(), None, None), ["tactics must be a non-empty mapping"]),
    ("tactics a list", lambda: (_w(), [(1, T128)], None), ["tactics must be a non-empty mapping"]),
    ("key 0", lambda: (_w(), {0: T128}, None), ["tactics are keyed by M in 1..32", "key 0"]),
    ("key 33", lambda: (_w(), {1: T128, 33: T128}, None), ["keyed by M in 1..32", "key 33"]),
    ("key -1", lambda: (_w(), {-1: T128}, None), ["keyed by M in 1..32", "key -1"]),
    ("key '1'", lambda: (_w(), {"1": T128}, None), ["keyed by M in 1..32", "key '1'"]),
    ("key True", lambda: (_w(), {True: T128}, None), ["keyed by M in 1..32", "key True"]),
    ("key 1.0", lambda: (_w(), {1.0: T128}, None), ["keyed by M in 1..32", "key 1.0"]),
    ("tactic stages > K tiles", lambda: (_w(), {1: T128, 8: WarpSplitKTactic(16, 8, 128, 16, 1)},
                                         None),
     ["tactic for M=8", "stages=16 exceeds the 8 K tiles"]),
    ("tactic wide tile k_tile 256", lambda: (_w(), {1: WarpSplitKTactic(64, 8, 256, 2, 1)}, None),
     ["tactic for M=1", "output_tile 64 needs k_tile 128"]),
    ("tactic b_loader_warps 3", lambda: (_w(), {1: WarpSplitKTactic(16, 8, 128, 4, 3)}, None),
     ["tactic for M=1", "b_loader_warps must be one of"]),
    ("tactic a string", lambda: (_w(), {1: "16,8,128,4,1"}, None),
     ["tactic for M=1", "expected a WarpSplitKTactic, got str"]),
    ("bias float32", lambda: (_w(), {1: T128}, _bias().float()), ["bias must be bfloat16"]),
    ("bias float16", lambda: (_w(), {1: T128}, _bias().half()), ["bias must be bfloat16"]),
    ("bias N+16", lambda: (_w(), {1: T128}, randn(N + 16)),
     ["bias must have shape (256,), got (272,)"]),
    ("bias [1, N]", lambda: (_w(), {1: T128}, randn(1, N)),
     ["bias must have shape (256,), got (1, 256)"]),
    ("bias on the CPU", lambda: (_w(), {1: T128}, randn(N, device="cpu")),
     ["bias must be on cuda:0, got cpu"]),
    ("bias strided", lambda: (_w(), {1: T128}, randn(2 * N)[::2]), ["bias must be packed"]),
    ("bias misaligned", lambda: (_w(), {1: T128}, shifted((N,), 1, random=True)),
     ["bias must be 32-byte aligned"]),
    ("bias a list", lambda: (_w(), {1: T128}, [0.0] * N), ["bias must be a torch.Tensor"]),
]


@pytest.fixture
def compile_calls(monkeypatch):
    """Stand in for the compiler: prepare-time checks must all come before it."""
    calls = []

    def fake_compile(*args, **kwargs):
        calls.append((args, kwargs))
        return lambda *launch: None

    monkeypatch.setattr(prepared_module, "compile_warp_splitk", fake_compile)
    return calls


def test_prepare_control_case_is_valid(compile_calls):
    """The table's weight, tactics and bias are good: each case breaks one thing."""
    p = PreparedWarpSplitK(_w(), {1: T128, 8: T128}, bias=_bias())
    assert compile_calls == [((0, N, KP, T128), {"has_bias": True, "swiglu": False,
                                                         "fp8_scales": None})]
    assert p.ms == (1, 8)


@pytest.mark.parametrize("build,words", [c[1:] for c in PREPARE_CASES],
                         ids=[c[0] for c in PREPARE_CASES])
def test_prepare_refuses(compile_calls, build, words):
    weight, tactics, bias = build()
    with pytest.raises(ValueError) as info:
        PreparedWarpSplitK(weight, tactics, bias=bias)
    for word in words:
        assert word in str(info.value), str(info.value)
    assert compile_calls == []


# ------------------------------------------------------------- numerics


@pytest.mark.parametrize("m,row,col", [(1, 0, 0), (8, 3, 517), (32, 31, 1023)])
def test_nan_in_x_poisons_its_row_only(m, row, col):
    torch.manual_seed(2)
    k = 1024
    w = randn(N, k)
    p = prepare(w, (m,))
    x = randn(m, k)
    x[row, col] = NAN
    out = torch.full((m, N), 7.0, dtype=BF16, device="cuda")  # finite: NaN must be written
    p.run(x, out)
    torch.cuda.synchronize()
    assert out[row].isnan().all()
    others = [i for i in range(m) if i != row]
    if others:
        assert torch.isfinite(out[others]).all()
        assert rel_err(out[others], ref64(x[others], w)) < 1e-2


def test_inf_and_nan_in_weight_rows_match_an_fp32_reference():
    torch.manual_seed(3)
    k, m = 1024, 8
    x = randn(m, k)
    x[x == 0] = 1.0  # 0 * inf is NaN: keep every product of an infinity infinite
    w = randn(N, k)
    w[5, 100] = INF                       # column 5: +-inf by the sign of x[:, 100]
    w[17, 200] = -INF                     # column 17: the opposite
    w[40, 300], w[40, 301] = INF, -INF    # column 40: NaN where x[:, 300:302] agree in sign
    w[63] = INF                           # column 63: every product infinite, both signs
    w[100, 7] = NAN                       # column 100: NaN
    p = prepare(w, (m,))
    out = torch.full((m, N), 7.0, dtype=BF16, device="cuda")
    p.run(x, out)
    torch.cuda.synchronize()
    ref32 = x.float() @ w.float().t()
    bad_cols = sorted(set(torch.nonzero(~torch.isfinite(ref32))[:, 1].tolist()))
    assert bad_cols == [5, 17, 40, 63, 100]  # the reference is what the test means
    assert torch.equal(out.isnan(), ref32.isnan())
    assert torch.equal(out.isinf(), ref32.isinf())
    inf = ref32.isinf()
    assert torch.equal(out.float()[inf], ref32[inf])  # the infinities' signs
    good = [j for j in range(N) if j not in bad_cols]
    assert rel_err(out[:, good], ref64(x, w[good])) < 1e-2


def _huge(shape, gen):
    """Random signs, magnitudes from 1e37 up to BF16's largest finite value."""
    u = torch.rand(shape, generator=gen, device="cuda")
    sign = torch.where(torch.rand(shape, generator=gen, device="cuda") < 0.5, -1.0, 1.0)
    t = (sign * (1e37 + u * (3.3e38 - 1e37))).to(BF16)
    t.view(-1)[:4] = BF16_MAX
    return t


def _small(shape, k, gen):
    """Magnitudes up to 0.5 / k: k products of a huge and a small value stay
    under half the FP32 (and BF16) maximum in any order of summation."""
    return ((torch.rand(shape, generator=gen, device="cuda") * 2 - 1) * (0.5 / k)).to(BF16)


@pytest.mark.parametrize("huge", ["x", "weight"])
def test_near_bf16_max_no_spurious_overflow(huge):
    gen = torch.Generator(device="cuda").manual_seed(4)
    k, m = 1024, 8
    if huge == "x":
        x, w = _huge((m, k), gen), _small((N, k), k, gen)
    else:
        x, w = _small((m, k), k, gen), _huge((N, k), gen)
    assert torch.isfinite(x).all() and torch.isfinite(w).all()
    # no partial sum of k products can overflow, whatever the order
    bound = k * x.abs().max().double().item() * w.abs().max().double().item()
    assert bound < 0.6 * BF16_MAX
    ref32 = x.float() @ w.float().t()
    assert torch.isfinite(ref32).all()
    p = prepare(w, (m,))
    out = torch.full((m, N), 7.0, dtype=BF16, device="cuda")
    p.run(x, out)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "inf/NaN where the FP32 reference is finite"
    ref = ref64(x, w)
    assert ref.abs().max().item() > 1e35  # the outputs are large, not cancelled away
    assert rel_err(out, ref) < 1e-2


def test_relative_error_across_k():
    torch.manual_seed(5)
    errors = {}
    for k in KS:
        w = randn(N, k)
        p = prepare(w, (1, 32))
        for m in (1, 32):
            x = randn(m, k)
            out = nans(m, N)
            p.run(x, out)
            torch.cuda.synchronize()
            assert not out.isnan().any(), f"K={k} M={m}: outputs left unwritten"
            errors[k, m] = rel_err(out, ref64(x, w))
    print("\nrelative error vs fp64 (N=256):")
    for (k, m), err in errors.items():
        print(f"  K={k:6d} M={m:2d} tactic=({tactic_for(k).short()}) rel_err={err:.3e}")
    too_big = {key: err for key, err in errors.items() if not err < 1e-2}
    assert not too_big, too_big


# ------------------------------------------------- weights past 4 GiB

#: [gate; up] of an MLP with I = 69632 at K = 16384: 4.56 GB, its last 8192
#: rows past 2**32 bytes (every address offset must be 64-bit)
BIG = (2 * 69632, 16384)


@pytest.mark.parametrize("text", ["32,8,256,6,2", "32,8,256,6,2+prefetch2"])
@pytest.mark.parametrize("swiglu", [False, True], ids=["plain", "swiglu"])
def test_a_weight_past_4_gib(text, swiglu):
    n, k = BIG
    half = n // 2
    torch.manual_seed(7)
    w = randn(n, k)
    x = randn(8, k)
    tactic = WarpSplitKTactic.parse(text)
    p = PreparedWarpSplitK(w, {8: tactic}, swiglu=swiglu)
    out = nans(8, half if swiglu else n)
    p.run(x, out)
    torch.cuda.synchronize()
    assert not out.isnan().any()
    # the first rows, rows around 2 GiB and 4 GiB, and the last
    rows = torch.cat([torch.arange(0, 64), torch.arange(65536 - 32, 65536 + 32),
                      torch.arange(half - 32, half + 32), torch.arange(131072 - 32, 131072 + 32),
                      torch.arange(n - 64, n)]).cuda()
    if swiglu:
        rows = rows[rows < half]
        up = rows + half  # the last gate rows' up rows lie past 4 GiB
        ref = torch.nn.functional.silu(x.double() @ w[rows].double().t()) * (
            x.double() @ w[up].double().t())
    else:
        ref = ref64(x, w[rows])
    assert rel_err(out[:, rows], ref) < 1e-2


# ----------------------------------------------------------- determinism

KD = 7168
MD = (1, 8, 32)


@pytest.fixture(scope="module")
def det():
    torch.manual_seed(6)
    w = randn(N, KD)
    return prepare(w, MD)


@pytest.mark.parametrize("m", MD)
def test_repeated_runs_are_bitwise_identical(det, m):
    x = randn(m, KD)
    outs = [nans(m, N) for _ in range(20)]
    for out in outs:
        det.run(x, out)
    torch.cuda.synchronize()
    assert not outs[0].isnan().any()
    assert rel_err(outs[0], ref64(x, det.weight)) < 1e-2
    for i, out in enumerate(outs[1:], 1):
        assert torch.equal(out, outs[0]), f"run {i} differs from run 0"


@pytest.mark.parametrize("m", MD)
def test_runs_on_two_streams_are_bitwise_identical(det, m):
    x = randn(m, KD)
    expected = nans(m, N)
    det.run(x, expected)
    outs = [nans(m, N), nans(m, N)]
    current = torch.cuda.current_stream()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for stream, out in zip(streams, outs):
        stream.wait_stream(current)  # x and the NaN outputs are ready
        with torch.cuda.stream(stream):
            det.run(x, out)
    for stream in streams:
        current.wait_stream(stream)
    torch.cuda.synchronize()
    assert not expected.isnan().any()
    for out in outs:
        assert torch.equal(out, expected)


@pytest.mark.parametrize("m", MD)
def test_graph_replays_are_bitwise_identical(det, m):
    x = randn(m, KD)
    out = nans(m, N)
    det.run(x, out)  # eager, outside capture
    torch.cuda.synchronize()
    expected = out.clone()
    assert not expected.isnan().any()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        det.run(x, out)
    for replay in range(5):
        out.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected), f"replay {replay} differs from the eager run"


# ----------------------------------------------------------- concurrency


def test_two_prepared_interleaved_on_two_streams():
    torch.manual_seed(7)
    weights = [randn(N, 1024), randn(N, 7168)]
    prepared = [prepare(w, (1, 8, 32)) for w in weights]
    jobs = []  # (which, x, out, eager result)
    for i in range(24):
        m = (1, 8, 32)[i % 3]
        for which, (p, w) in enumerate(zip(prepared, weights)):
            x = randn(m, w.shape[1])
            eager = nans(m, N)
            p.run(x, eager)  # the same call on the default stream, alone
            jobs.append((which, x, nans(m, N), eager))
    current = torch.cuda.current_stream()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    sleep = getattr(torch.cuda, "_sleep", None)
    for stream in streams:
        stream.wait_stream(current)
        if sleep is not None:
            with torch.cuda.stream(stream):
                sleep(20_000_000)  # hold both streams so that the launches pile up
    for which, x, out, _ in jobs:  # alternate: A on stream 0, B on stream 1
        with torch.cuda.stream(streams[which]):
            prepared[which].run(x, out)
    for stream in streams:
        current.wait_stream(stream)
    torch.cuda.synchronize()
    for i, (which, x, out, eager) in enumerate(jobs):
        assert not out.isnan().any(), f"job {i}: unwritten outputs"
        assert torch.equal(out, eager), f"job {i}: differs from the same call run alone"
        assert rel_err(out, ref64(x, weights[which])) < 1e-2, f"job {i}"


def test_two_threads_preparing_one_new_shape_compile_once(monkeypatch):
    # a key no other test compiles: N 176, K 384, this tactic, with a bias
    n, k = 176, 384
    tactic = WarpSplitKTactic(16, 16, 128, 3, 2)
    torch.manual_seed(8)
    w, bias = randn(n, k), randn(n)
    builds = []
    real_build = compile_module.build

    def counting_build(*args, **kwargs):
        builds.append(args[:5])
        time.sleep(0.5)  # hold the compile open while the other thread arrives
        return real_build(*args, **kwargs)

    monkeypatch.setattr(compile_module, "build", counting_build)
    before = compile_module._compile_cached.cache_info()
    launchers_before = compile_module._launcher_cached.cache_info()
    barrier = threading.Barrier(2)
    results, errors = [None, None], []

    def worker(i):
        try:
            barrier.wait(timeout=60)
            results[i] = PreparedWarpSplitK(w, {8: tactic, 16: tactic}, bias=bias)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors
    after = compile_module._compile_cached.cache_info()
    assert builds == [(n, k, tactic, True, True)], builds
    assert after.misses - before.misses == 1  # the second thread got the first's code
    # one launcher for the shape, made once, shared by both objects and both Ms
    assert compile_module._launcher_cached.cache_info().misses - launchers_before.misses == 1
    assert results[0].codes[8] is results[1].codes[8] is results[1].codes[16]
    assert results[0]._launchers[8] is results[1]._launchers[8] is results[1]._launchers[16]
    for p in results:
        for m in (8, 16):
            x = randn(m, k)
            out = nans(m, n)
            p.run(x, out)
            torch.cuda.synchronize()
            assert not out.isnan().any()
            assert rel_err(out, ref64(x, w, bias)) < 1e-2


def test_weight_on_explicit_cuda0_keys_its_code_to_device_0():
    k = 1024
    tactic = tactic_for(k)
    with torch.cuda.device(0):
        assert torch.cuda.current_device() == 0
        w0 = randn(N, k, device="cuda:0")
        p0 = PreparedWarpSplitK(w0, {8: tactic})
        assert p0.device == torch.device("cuda", 0)
        assert p0.codes[8] is compile_warp_splitk(0, N, k, tactic)
        # a weight on plain "cuda" (the current device) shares that code
        p = PreparedWarpSplitK(randn(N, k, device="cuda"), {8: tactic})
        assert p.device == torch.device("cuda", 0)
        assert p.codes[8] is p0.codes[8]
        x = randn(8, k, device="cuda:0")
        out = nans(8, N, device="cuda:0")
        assert p0.run(x, out) is out
        torch.cuda.synchronize()
        assert not out.isnan().any()
        assert rel_err(out, ref64(x, w0)) < 1e-2


_DISK_PROBE = """
import hashlib, json, sys, torch
import warpsplitk.runtime.compile as c
from warpsplitk import PreparedWarpSplitK, WarpSplitKTactic
from warpsplitk.runtime import disk_cache
builds = []
real = c.build
c.build = lambda *a, **k: builds.append(a[:3]) or real(*a, **k)
torch.manual_seed(31)
h = hashlib.sha256()
for n, k, tactic in ((192, 640, WarpSplitKTactic(16, 8, 128, 3, 1)),
                     (320, 1280, WarpSplitKTactic(32, 16, 256, 2, 2))):
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    p = PreparedWarpSplitK(w, {m: tactic for m in (1, 5, 16)})
    for m in (1, 5, 16):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        p.run(x, out)
        torch.cuda.synchronize()
        ref = (x.double() @ w.double().t())
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-2 and not out.isnan().any(), (n, k, m, err)
        h.update(out.view(torch.int16).cpu().numpy().tobytes())
print(json.dumps({"digest": h.hexdigest(), "builds": len(builds),
                  "files": len(disk_cache.entries())}))
"""


def test_code_from_the_disk_cache_in_a_new_process_is_bitwise_the_same(tmp_path):
    """A process compiles and stores two kernels; a second one loads them
    without compiling, and its outputs are bitwise those of the first."""
    import json
    import os
    import subprocess
    import sys
    env = {**os.environ, "WARPSPLITK_CACHE_DIR": str(tmp_path)}
    env.pop("WARPSPLITK_DISK_CACHE", None)
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _DISK_PROBE], env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["builds"] == 2 and first["files"] == 2, first
    assert second["builds"] == 0 and second["files"] == 2, second
    assert second["digest"] == first["digest"]
